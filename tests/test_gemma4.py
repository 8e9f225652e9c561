"""Gemma 4 (``gemma4``) on synthetic models with the pinned tree's gemma-4 vocabulary: the
dense layout, the E-series and the MoE, each teacher-forced against llama.cpp built from the
pinned source on its greedy continuation (argmax equal except at its near-ties, mean KL at
most 0.005), several quant mixes each; bad input raising a ``freetoken.errors`` exception
that names it; the released chat template rendered as its Jinja source gives it.

The models are six layers with a sliding window of 16 (prompts run past it, and 64 decoded
tokens after them), sliding layers of 2 KV heads of 64 and full ones of 1 KV head of 128
(the full layers' proportional RoPE turns a quarter of their pairs). Without per-layer
inputs the full layers have no ``attn_v`` (keys as values); the E-series has per-layer
inputs 64 wide and two shared-KV layers (a sliding one reading layer 2, a full one reading
layer 3, both twice as wide in the FFN); the MoE has 8 experts top-4 beside the dense FFN.
Each ablation edits one Gemma 4 feature out of a case's file (the sliding layers' RoPE base,
the per-layer inputs' projection, the router's input scale): llama.cpp on the edited file
must be at least ABLATION_RATIO times farther from llama.cpp on the case's file than we
are, so the agreement resolves the feature."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from freetoken.errors import FreeTokenError
from freetoken.llm import LLM
from freetoken.testmodel import make_test_model
from freetoken.testmodel.vocab import llama_tree
from gguf import GGUFValueType
from teacher_forced import Comparison, compare
from test_moe_families_b import _stronger, rewrite
from test_more_families import _cut_tensor, _drop_tensor

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who "
    "went out every morning before the sun rose,",
]
N_GEN = 64
MAX_KL = 0.005
WINDOW = 16

T, F = True, False
_BASE = dict(layers=6, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, head_dim_full=128,
             kv_heads_full=1, ctx=512, sliding_window=WINDOW, swa_pattern=3)  # fmt: skip
_E = dict(_BASE, per_layer_width=64, shared_kv_layers=2, swa_pattern=(T, T, T, F, T, F))
_MOE = dict(_BASE, ffn=256, experts=8, top_k=4, expert_ffn=128)

#: (case, make-test-model options): several quant mixes per variant.
CASES: list[tuple[str, dict[str, Any]]] = [
    ("dense-q8", dict(_BASE, quant="q8_0", seed=3)),
    ("dense-k", dict(_BASE, quant="q4_k,ffn_down=q6_k,attn_output=q5_0,embd=q8_0", seed=4)),
    ("e-q8", dict(_E, quant="q8_0", seed=3)),
    ("e-mix", dict(_E, quant="q5_0,per_layer_token_embd=q4_0,attn=q8_0,embd=q6_k", seed=5)),
    ("moe-q8", dict(_MOE, quant="q8_0", seed=3)),
    ("moe-fused-k", dict(_MOE, expert_layout="fused", seed=2,
                         quant="q8_0,exps=q4_k,ffn_down_exps=q6_k,ffn=q5_k")),
]  # fmt: skip

F32 = GGUFValueType.FLOAT32

#: (case, the edit that removes a feature from its file).
ABLATIONS: list[tuple[str, dict[str, Any]]] = [
    ("dense-q8", dict(meta={"gemma4.rope.freq_base_swa": (1000000.0, F32)})),
    ("e-q8", dict(tensors=_stronger("per_layer_proj_norm.weight", mul=0.0))),
    ("moe-q8", dict(tensors=_stronger("ffn_gate_inp.scale", mul=0.25))),
]
ABLATION_RATIO = 4.0


def _vocab(name: str = "gemma-4") -> Path:
    try:
        return llama_tree() / "models" / f"ggml-vocab-{name}.gguf"
    except FreeTokenError as e:
        pytest.skip(str(e))


def _build(case: str, out: Path) -> Path:
    opts = next(c[1] for c in CASES if c[0] == case)
    path = out / f"{case}.gguf"
    return make_test_model("gemma4", vocab=_vocab(), out=path, log=lambda _: None, **opts)


def _compare(path: Path, root: Path, others: list[Path]) -> list[tuple[Comparison, ...]]:
    """Per prompt, on llama.cpp's greedy continuation of it on ``path``: our logits and
    those of llama.cpp on each of ``others`` against llama.cpp's on ``path``."""
    import llama_ref

    ours = LLM(path, n_ctx=512)
    load = dict(n_ctx=512, n_threads=2, root=root)
    refs = [llama_ref.LlamaRef.load(p, **load) for p in [path, *others]]
    try:
        out = []
        for prompt in PROMPTS:
            tokens = refs[0].tokenize(prompt)
            seq = tokens + refs[0].greedy(tokens, N_GEN)
            assert len(seq) > len(tokens) > WINDOW or prompt == PROMPTS[0]
            rows = slice(len(tokens) - 1, len(seq) - 1)
            want = refs[0].logits(seq)[rows]
            got = ours.logits(seq)[rows].numpy()
            assert np.isfinite(got).all()
            others_c = [compare(want, r.logits(seq)[rows]) for r in refs[1:]]
            out.append((compare(want, got), *others_c))
        return out
    finally:
        for r in refs:
            r.close()


@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_matches_llamacpp(case: str, tmp_path: Path, llama_ref_root: Path) -> None:
    path = _build(case, tmp_path)
    for prompt, (c,) in zip(PROMPTS, _compare(path, llama_ref_root, []), strict=True):
        print(f"gemma4 {case} {prompt[:24]!r}: {c.describe()}")
        assert not c.mismatches, f"{case} {prompt!r}: {c.describe()}"
        assert c.mean_kl <= MAX_KL, f"{case} {prompt!r}: {c.describe()}"


@pytest.mark.slow
@pytest.mark.parametrize(("case", "edit"), ABLATIONS, ids=[a[0] for a in ABLATIONS])
def test_agreement_resolves_the_feature(
    case: str, edit: dict[str, Any], tmp_path: Path, llama_ref_root: Path
) -> None:
    path = _build(case, tmp_path)
    other = rewrite(path, tmp_path / "ablated.gguf", **edit)
    for prompt, (ours, ablated) in zip(
        PROMPTS, _compare(path, llama_ref_root, [other]), strict=True
    ):
        print(
            f"gemma4 {case} {prompt[:24]!r}: ours {ours.mean_kl:.5f}, ablated {ablated.mean_kl:.5f}"
        )
        assert ablated.mean_kl >= ABLATION_RATIO * ours.mean_kl, (
            f"{case} {prompt!r}: ours {ours.describe()}; without the feature {ablated.describe()}"
        )


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------

U32, ARRAY = GGUFValueType.UINT32, GGUFValueType.ARRAY

_SMALL = dict(layers=4, hidden=64, ffn=128, heads=2, kv_heads=1, head_dim=32, head_dim_full=64,
              ctx=512, sliding_window=8, swa_pattern=2, quant="q8_0")  # fmt: skip
_SMALL_FILES = {
    "dense": _SMALL,
    "e": dict(_SMALL, per_layer_width=32, shared_kv_layers=2, swa_pattern=(T, F, T, F)),
    "moe": dict(_SMALL, experts=4, top_k=2, expert_ffn=64),
}


@pytest.fixture(scope="module")
def small_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    # A small vocabulary: these files are rewritten and loaded once per case.
    out = tmp_path_factory.mktemp("gemma4-bad")
    return {
        name: make_test_model("gemma4", vocab=_vocab("llama-spm"), out=out / f"{name}.gguf",
                              log=lambda _: None, **opts)
        for name, opts in _SMALL_FILES.items()
    }  # fmt: skip


BAD: list[tuple[str, str, dict[str, Any], str]] = [
    ("dense", "missing", dict(tensors=_drop_tensor("blk.1.attn_k.weight")), "blk.1.attn_k"),
    ("dense", "misshapen", dict(tensors=_cut_tensor("blk.0.ffn_up.weight")), "blk.0.ffn_up"),
    ("dense", "full head size", dict(meta={"gemma4.attention.key_length": (128, U32)}),
     "blk.1.attn_q"),
    ("dense", "pattern length", dict(meta={"gemma4.attention.sliding_window_pattern":
                                           ([True, False, True], ARRAY)}),
     "sliding_window_pattern"),
    ("dense", "no pattern", dict(drop=lambda k: k.endswith("sliding_window_pattern")),
     "sliding_window_pattern"),
    ("dense", "KV heads length", dict(meta={"gemma4.attention.head_count_kv": ([1, 1], ARRAY)}),
     "head_count_kv"),
    ("dense", "no swa head size", dict(drop=lambda k: k.endswith("key_length_swa")),
     "key_length_swa"),
    ("e", "missing rows", dict(tensors=_drop_tensor("per_layer_token_embd.weight")),
     "per_layer_token_embd"),
    ("e", "misshapen gate", dict(tensors=_cut_tensor("blk.2.inp_gate.weight")), "blk.2.inp_gate"),
    ("e", "shared layers of the wrong kind",
     dict(meta={"gemma4.attention.shared_kv_layers": (1, U32)}), "shared_kv_layers"),
    ("moe", "expert count", dict(meta={"gemma4.expert_count": (8, U32)}), "ffn_gate_inp"),
    ("moe", "no expert count", dict(drop=lambda k: k.endswith(".expert_count")), "expert_count"),
    ("moe", "missing router scale", dict(tensors=_drop_tensor("blk.1.ffn_gate_inp.scale")),
     "blk.1.ffn_gate_inp.scale"),
    ("moe", "misshapen experts", dict(tensors=_cut_tensor("blk.0.ffn_down_exps.weight")),
     "ffn_down_exps"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "what", "edit", "named"), BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD]
)
def test_bad_input_names_it(
    name: str, what: str, edit: dict[str, Any], named: str, small_files: dict[str, Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    path = rewrite(small_files[name], tmp_path / "bad.gguf", **edit)
    with pytest.raises(FreeTokenError, match=named):
        LLM(path, n_ctx=64)


@pytest.mark.parametrize("name", list(_SMALL_FILES))
def test_good_small_files_load(name: str, small_files: dict[str, Path]) -> None:
    """The unedited files of the bad-input cases load and run (the edits make them fail)."""
    logits = LLM(small_files[name], n_ctx=64).logits([2, 3, 4])
    assert logits.shape[0] == 3 and np.isfinite(logits.numpy()).all()


def test_shared_layers_have_no_cache_of_their_own(small_files: dict[str, Path]) -> None:
    """The E-series' shared-KV layers hold no keys (they read layers 0 and 1's), and the
    sliding and full layers' caches have their own head sizes."""
    cache = LLM(small_files["e"], n_ctx=64).model.new_cache(16)
    assert [tuple(k.shape[1:]) for k in cache.k] == [(1, 32), (1, 64), (0, 32), (0, 64)]


# ----------------------------------------------------------------------------------------
# The chat template (the released one the pinned tree ships)
# ----------------------------------------------------------------------------------------

TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "How are you?"},
]
#: What the template's Jinja source gives for TURNS with a generation prompt (read off it):
#: the system turn, turns as ``<|turn>ROLE\n...<turn|>\n`` with ``model`` for the assistant,
#: and without thinking an empty thought channel after the prompt.
WANT = (
    "<bos><|turn>system\nBe brief.<turn|>\n<|turn>user\nHello<turn|>\n"
    "<|turn>model\nHi there<turn|>\n<|turn>user\nHow are you?<turn|>\n"
    "<|turn>model\n<|channel>thought\n<channel|>"
)


def test_chat_template_renders() -> None:
    from freetoken.tokenizer.chat import render_chat_template

    try:
        template = llama_tree() / "models" / "templates" / "google-gemma-4-31B-it.jinja"
        text = template.read_text()
    except FreeTokenError as e:
        pytest.skip(str(e))
    out = render_chat_template(text, TURNS, True, bos_token="<bos>", eos_token="<eos>")
    assert out == WANT


def test_preset_context_is_the_released_models() -> None:
    """``--preset gemma-4-26b-a4b`` writes the context length the pinned tree's gemma-4
    vocabulary file records (read by gguf-py): a server sized for long prompts caps each slot
    at the file's ``context_length``."""
    import argparse

    from freetoken.testmodel import cli
    from gguf import GGUFReader

    field = GGUFReader(_vocab()).fields["gemma4.context_length"]
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--preset", "gemma-4-26b-a4b", "-o", "x.gguf"])
    cli._apply_preset(args)
    assert args.ctx == int(field.contents())
