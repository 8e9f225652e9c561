"""NVFP4 tensors with their ``<name>.scale`` companions (the converter keeps NVFP4's
``weight_scale_2`` there), which llama.cpp's loader reads for every architecture and
multiplies into each product (``build_lora_mm``: the output times the one value; stacked
experts: times the routed expert's own value):

- teacher-forced against llama.cpp (built from the same pinned source) on synthetic models
  with NVFP4 matrices and a scale on each (other than 1, per expert for the experts): a
  dense-attention MoE (qwen3moe: q/k/v/output, experts) and a Gated DeltaNet hybrid
  (qwen35moe: qkv, gate, alpha/beta, ssm_out, the shared expert, the LM head); argmax equal
  except near-ties, mean KL at most 0.005 over the positions not routed at a near-tie
  (``teacher_forced.routing_near_ties``), and the scales matter (the same file without them
  moves the distribution far beyond that);
- a ``.scale`` that does not fit its tensor (two values on a matrix, too few on experts) and
  a per-expert gate scale other than 1 (inside the activation) are refused, naming the
  tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from freetoken.errors import FreeTokenError, UnsupportedError
from freetoken.gguf import GGUFFile
from freetoken.models import load_model
from freetoken.runtime.scales import SCALED_MATRICES
from gguf import GGMLQuantizationType, GGUFReader
from synthetic import build_models
from teacher_forced import compare, routing_near_ties
from test_moe_families_b import rewrite

N_GEN = 16
MAX_KL = 0.005
PROMPT = "The capital of France is"
_F32 = GGMLQuantizationType.F32
_NVFP4 = GGMLQuantizationType.NVFP4

_BASE: dict[str, Any] = dict(
    layers=4, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, seed=7,
    experts=8, top_k=2, expert_ffn=256,
)  # fmt: skip
MODELS = {
    "qwen3moe": dict(arch="qwen3moe", quant="q8_0,attn=nvfp4,exps=nvfp4,output=nvfp4"),
    "qwen35moe": dict(
        arch="qwen35moe", quant="q8_0,attn=nvfp4,ssm=nvfp4,exps=nvfp4,shexp=nvfp4,output=nvfp4"
    ),
}


def _base_name(tensor: str) -> str:
    return tensor.removesuffix(".weight").rsplit(".", 1)[-1]


def add_scales(src: Path, dst: Path, gate_scale: float = 1.0, bad: str | None = None) -> Path:
    """``src`` with a seeded ``.scale`` beside every NVFP4 matrix llama.cpp scales: one value
    in [0.5, 2] per matrix, one per expert for stacked experts (the gate's all
    ``gate_scale``); ``bad`` names a matrix whose scale gets one value too many."""
    rng = np.random.default_rng(1)
    r = GGUFReader(src)
    items = [(t.name, t.data, t.tensor_type) for t in r.tensors]
    for t in r.tensors:
        base = _base_name(t.name)
        if t.tensor_type != _NVFP4 or base not in SCALED_MATRICES:
            continue
        n = int(t.shape[-1]) if base.endswith("_exps") else 1  # gguf-py: ne order
        n += t.name.removesuffix(".weight") == bad
        values = rng.uniform(0.5, 2.0, n).astype(np.float32)
        if base == "ffn_gate_exps":
            values[:] = gate_scale
        items.append((t.name.removesuffix(".weight") + ".scale", values, _F32))
    return rewrite(src, dst, tensors=lambda _: items)


@pytest.fixture(scope="module")
def plain_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The models with NVFP4 matrices, no scales."""
    return build_models(MODELS, _BASE, tmp_path_factory.mktemp("weight-scales"))


@pytest.fixture(scope="module")
def model_files(plain_files: dict[str, Path]) -> dict[str, Path]:
    """The same with a scale beside each NVFP4 matrix."""
    return {n: add_scales(p, p.with_name(f"{n}-scaled.gguf")) for n, p in plain_files.items()}


def _ours(model: Any, seq: list[int]) -> np.ndarray:
    cache = model.new_cache(256)
    return model.forward(seq, cache, all_logits=True)[:-1].numpy()


@pytest.mark.parametrize("name", list(MODELS))
def test_scaled_nvfp4_matches_llamacpp(
    name: str,
    plain_files: dict[str, Path],
    model_files: dict[str, Path],
    llama_ref_root: Path,
) -> None:
    import llama_ref

    path = model_files[name]
    with llama_ref.LlamaRef.load(path, n_ctx=256, n_threads=2, root=llama_ref_root) as ref:
        prompt = ref.tokenize(PROMPT)
        seq = prompt + ref.greedy(prompt, N_GEN)
        want = ref.logits(seq)[: len(seq) - 1]
    model = load_model(GGUFFile(path))
    skip = routing_near_ties(model, seq, 0)
    assert len(skip) <= len(want) // 2, f"test data: {len(skip)} routing near-ties"
    c = compare(want, _ours(model, seq), skip)
    assert not c.mismatches, f"{name}: {c.describe()}"
    assert c.mean_kl <= MAX_KL, f"{name}: {c.describe()}"
    # Without the scales the same weights give another distribution: the scales were read.
    assert sum(t.name.endswith(".scale") for t in GGUFReader(path).tensors) > 8
    off = compare(want, _ours(load_model(GGUFFile(plain_files[name])), seq))
    assert off.mean_kl > 0.05, off.describe()


@pytest.mark.parametrize("bad", ["blk.0.attn_qkv", "blk.1.ffn_down_exps", "output"])
def test_scale_that_does_not_fit_is_refused(
    bad: str, plain_files: dict[str, Path], tmp_path: Path
) -> None:
    path = add_scales(plain_files["qwen35moe"], tmp_path / "bad.gguf", bad=bad)
    with pytest.raises(FreeTokenError, match=rf"`{bad}\.scale`"):
        load_model(GGUFFile(path))


def test_gate_scale_inside_the_activation_is_refused(
    plain_files: dict[str, Path], tmp_path: Path
) -> None:
    path = add_scales(plain_files["qwen3moe"], tmp_path / "gate.gguf", gate_scale=1.5)
    with pytest.raises(UnsupportedError, match=r"blk\.0\.ffn_gate_exps\.scale"):
        load_model(GGUFFile(path))
