"""The MoE families (qwen3moe, qwen2moe, Mixtral in the llama architecture with both expert
layouts, olmoe, and a model with different types across layers and for gate, up and down) on
small synthetic models from make-test-model:

- teacher-forced against llama.cpp (built from the same pinned source): on llama.cpp's greedy
  continuation of 32 tokens after each of 3 prompts, our argmax equals llama.cpp's except at
  its near-ties, and the mean KL(llama.cpp || ours) is at most 0.005 per prompt;
- against the float64 reference forward of the dequantized weights
  (``tests/moe_reference.py``, gguf-py dequantization): over the same positions, mean KL at
  most 0.01 and top-1 agreement at least 95%.

llama.cpp no longer loads the per-expert Mixtral layout (``ffn_gate.E``); that model is
compared with llama.cpp running its stacked twin (same seed: the same weights, checked here).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from freetoken.engine.options import EngineOptions
from freetoken.errors import FileAccessError
from freetoken.llm import LLM
from freetoken.testmodel import make_test_model
from freetoken.testmodel.vocab import llama_tree
from moe_reference import MoeReference
from synthetic import build_models
from teacher_forced import compare

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea,",
]
N_GEN = 32
MAX_KL_LLAMA = 0.005
MAX_KL_F64 = 0.01
MIN_TOP1_F64 = 0.95

_BASE: dict[str, Any] = dict(layers=2, hidden=256, ffn=512, heads=4, kv_heads=2, seed=11)

#: name: (make_test_model arguments, the model llama.cpp runs instead, if any)
MODELS: dict[str, tuple[dict[str, Any], str | None]] = {
    "qwen3moe": (
        dict(arch="qwen3moe", head_dim=64, experts=16, top_k=4, expert_ffn=256,
             quant="q8_0,exps=q4_k,ffn_down_exps=q6_k"),
        None,
    ),
    "qwen2moe": (
        dict(arch="qwen2moe", experts=16, top_k=4, expert_ffn=128, shared_experts=2,
             quant="q5_k,exps=q4_0,shexp=q8_0"),
        None,
    ),
    "mixtral": (
        dict(arch="llama", experts=8, top_k=2, expert_ffn=256,
             quant="q4_k,attn_v=q6_k,exps=iq4_xs,ffn_down_exps=q5_k"),
        None,
    ),
    "mixtral-per-expert": (
        dict(arch="llama", experts=8, top_k=2, expert_ffn=256, expert_layout="per-expert",
             quant="q4_k,attn_v=q6_k,exps=iq4_xs,ffn_down_exps=q5_k"),
        "mixtral",
    ),
    "olmoe": (
        dict(arch="olmoe", kv_heads=4, experts=16, top_k=4, expert_ffn=256,
             quant="q6_k,exps=q4_1"),
        None,
    ),
    # Different types across layers, and for gate, up and down within a layer.
    "mixed": (
        dict(arch="qwen2moe", layers=3, experts=8, top_k=2, expert_ffn=256, shared_experts=1,
             quant="q8_0,attn=q5_k,blk.1.attn=q4_k,output=q6_k,"
                   "blk.0.ffn_gate_exps=q4_k,blk.0.ffn_up_exps=q5_0,blk.0.ffn_down_exps=q6_k,"
                   "blk.1.ffn_gate_exps=iq4_nl,blk.1.ffn_up_exps=q4_1,blk.1.ffn_down_exps=q5_k,"
                   "blk.2.exps=mxfp4,blk.2.ffn_down_exps=q8_0,"
                   "blk.0.shexp=q5_1,blk.2.ffn_up_shexp=q4_k"),
        None,
    ),
}  # fmt: skip

#: The mixed model's expert types per layer (gate, up, down).
MIXED_EXPERT_TYPES = [
    ("Q4_K", "Q5_0", "Q6_K"),
    ("IQ4_NL", "Q4_1", "Q5_K"),
    ("MXFP4", "MXFP4", "Q8_0"),
]


@pytest.fixture(scope="module")
def model_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every model of :data:`MODELS`, on the llama-spm vocabulary."""
    specs = {name: args for name, (args, _) in MODELS.items()}
    return build_models(specs, _BASE, tmp_path_factory.mktemp("moe"))


@dataclass
class Run:
    """One prompt's llama.cpp run: the full sequence (prompt + greedy continuation), the
    first compared position and llama.cpp's logits from there."""

    tokens: list[int]
    first: int
    ref: np.ndarray


@pytest.fixture(scope="module")
def llama_runs(model_files: dict[str, Path], llama_ref_root: Path) -> dict[str, list[Run]]:
    """llama.cpp's runs of each model (of its stacked twin for the per-expert layout)."""
    import llama_ref

    runs: dict[str, list[Run]] = {}
    for name, (_, twin) in MODELS.items():
        if twin is not None:
            continue
        with llama_ref.LlamaRef.load(
            model_files[name], n_ctx=512, n_threads=2, root=llama_ref_root
        ) as ref:
            runs[name] = []
            for prompt in PROMPTS:
                tokens = ref.tokenize(prompt)
                seq = tokens + ref.greedy(tokens, N_GEN)
                first = len(tokens) - 1
                runs[name].append(Run(seq, first, ref.logits(seq)[first : len(seq) - 1]))
    for name, (_, twin) in MODELS.items():
        if twin is not None:
            runs[name] = runs[twin]
    return runs


def _ours(path: Path, runs: list[Run], mmap: bool = True) -> list[np.ndarray]:
    llm = LLM(path, n_ctx=512, engine=EngineOptions(mmap=mmap))
    assert llm.model.moe is not None, "an MoE model must run the expert executor"
    out = []
    for r in runs:
        logits = llm.logits(r.tokens)[r.first : len(r.tokens) - 1].numpy()
        assert np.isfinite(logits).all()
        out.append(logits)
    return out


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_llamacpp(
    name: str, model_files: dict[str, Path], llama_runs: dict[str, list[Run]]
) -> None:
    runs = llama_runs[name]
    for prompt, run, ours in zip(PROMPTS, runs, _ours(model_files[name], runs), strict=True):
        c = compare(run.ref, ours)
        assert not c.mismatches, f"{name} {prompt!r}: {c.describe()}"
        assert c.mean_kl <= MAX_KL_LLAMA, f"{name} {prompt!r}: {c.describe()}"


def test_no_mmap_matches_llamacpp(
    model_files: dict[str, Path], llama_runs: dict[str, list[Run]]
) -> None:
    """``--no-mmap``: the experts read from the copy in memory, same agreement."""
    name = next(iter(MODELS))
    runs = llama_runs[name]
    for run, ours in zip(runs, _ours(model_files[name], runs, mmap=False), strict=True):
        c = compare(run.ref, ours)
        assert not c.mismatches and c.mean_kl <= MAX_KL_LLAMA, f"{name}: {c.describe()}"


@pytest.mark.parametrize("name", list(MODELS))
def test_matches_float64_reference(
    name: str, model_files: dict[str, Path], llama_runs: dict[str, list[Run]]
) -> None:
    path = model_files[name]
    runs = llama_runs[name]
    reference = MoeReference(path)
    ref = np.concatenate([reference.logits(r.tokens)[r.first : len(r.tokens) - 1] for r in runs])
    c = compare(ref, np.concatenate(_ours(path, runs)))
    assert c.mean_kl <= MAX_KL_F64, f"{name}: {c.describe()}"
    assert c.top1_agreement >= MIN_TOP1_F64, f"{name}: {c.describe()}"


def test_per_expert_layout_same_weights_same_logits(
    model_files: dict[str, Path], llama_runs: dict[str, list[Run]]
) -> None:
    """The per-expert file holds the stacked file's experts byte for byte, and we compute the
    same logits from either layout."""
    stacked = {t.name: t for t in gguf.GGUFReader(model_files["mixtral"]).tensors}
    split = {t.name: t for t in gguf.GGUFReader(model_files["mixtral-per-expert"]).tensors}
    assert "blk.0.ffn_gate.7.weight" in split and "blk.0.ffn_gate_exps.weight" not in split
    for i in range(2):
        for kind in ("gate", "up", "down"):
            whole = stacked[f"blk.{i}.ffn_{kind}_exps.weight"]
            for e in range(8):
                one = split[f"blk.{i}.ffn_{kind}.{e}.weight"]
                assert one.tensor_type == whole.tensor_type
                assert np.array_equal(np.asarray(one.data), np.asarray(whole.data)[e])
    runs = llama_runs["mixtral"]
    a = _ours(model_files["mixtral"], runs)
    b = _ours(model_files["mixtral-per-expert"], runs)
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x, y)


def test_mixed_model_types(model_files: dict[str, Path]) -> None:
    """The mixed model really mixes: expert types differ across layers and within a layer."""
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(model_files["mixed"]).tensors}
    for i, want in enumerate(MIXED_EXPERT_TYPES):
        got = tuple(types[f"blk.{i}.ffn_{k}_exps.weight"] for k in ("gate", "up", "down"))
        assert got == want, i
    assert types["blk.0.ffn_gate_shexp.weight"] == "Q5_1"
    assert types["blk.2.ffn_up_shexp.weight"] == "Q4_K"
    assert types["blk.1.attn_q.weight"] == "Q4_K" and types["blk.0.attn_q.weight"] == "Q5_K"
    assert types["blk.0.ffn_gate_inp.weight"] == "F32"  # routers stay F32


def test_dense_llama_has_no_experts(tmp_path: Path) -> None:
    """The llama family dispatches on the metadata: without experts it is the dense model."""
    try:
        vocab = llama_tree() / "models" / "ggml-vocab-llama-spm.gguf"
    except FileAccessError as e:
        pytest.skip(str(e))
    path = make_test_model(
        "llama", layers=1, hidden=64, ffn=128, heads=2, vocab=vocab, out=tmp_path / "d.gguf"
    )
    llm = LLM(path, n_ctx=64)
    assert llm.model.moe is None
    assert np.isfinite(llm.logits([1, 2, 3]).numpy()).all()


def test_expert_counters(model_files: dict[str, Path], llama_runs: dict[str, list[Run]]) -> None:
    """Every token of every MoE layer routes top-k times, over most of the experts."""
    run = llama_runs["qwen3moe"][0]
    llm = LLM(model_files["qwen3moe"], n_ctx=512)
    assert llm.model.moe is not None
    llm.logits(run.tokens)
    counts = np.asarray(llm.model.moe.counters.expert_counts())
    assert counts.shape == (2, 16)
    assert (counts.sum(axis=1) == 4 * len(run.tokens)).all()
    assert ((counts > 0).sum(axis=1) >= 12).all()
