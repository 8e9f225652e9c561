"""mistral3, qwen3vl and qwen3vlmoe (text) and minimax-m2 on synthetic models:
teacher-forced agreement with llama.cpp built from the pinned source (argmax equal except at
its near-ties, mean KL at most 0.005) on 64 tokens of its greedy continuation, several quant
mixes each; and bad input (a missing or misshapen tensor, inconsistent metadata) raising a
``freetoken.errors`` exception that names it.

mistral3's models carry Ministral 3's YaRN and attention temperature keys with an original
context of 32 (``ctx`` 512), so that the temperature scales the queries of every position
past 32; qwen3vl's carry the RoPE sections, whose last pair of each head reads the text
tokens' fourth position (0) and does not turn; minimax-m2's selection biases are made ten
times larger than make-test-model draws them, so that they change which experts are chosen."""

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
from teacher_forced import compare
from test_moe_families_b import _stronger, rewrite

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Once upon a time, in a small village by the sea,",
]
N_GEN = 64
MAX_KL = 0.005

_DENSE = dict(layers=3, hidden=256, ffn=512, heads=4, kv_heads=2, head_dim=64, ctx=512)
_MOE = dict(_DENSE, ffn=256, experts=8, top_k=4, expert_ffn=128)

#: (case, arch, vocabulary, make-test-model options): several quant mixes per family.
CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("mistral3-q8", "mistral3", "llama-bpe", dict(_DENSE, quant="q8_0", seed=3)),
    ("mistral3-k", "mistral3", "llama-bpe",
     dict(_DENSE, quant="q4_k,ffn_down=q6_k,output=q8_0", seed=4)),
    ("qwen3vl-q8", "qwen3vl", "qwen2", dict(_DENSE, quant="q8_0", seed=3)),
    ("qwen3vl-mix", "qwen3vl", "qwen2", dict(_DENSE, quant="q5_0,attn_v=q8_0,output=q6_k", seed=5)),
    # Sections whose sum (8) is below the head's 32 pairs: two of every 8 pairs read the
    # fourth position and stay unrotated, high frequencies among them (EDITS).
    ("qwen3vl-sections", "qwen3vl", "qwen2", dict(_DENSE, quant="q8_0", seed=6)),
    # A temperature beta of 1 (EDITS), so that it moves the logits well past what the checks
    # resolve.
    ("mistral3-temp", "mistral3", "llama-bpe", dict(_DENSE, quant="q8_0", seed=5)),
    ("qwen3vlmoe-q8", "qwen3vlmoe", "qwen2", dict(_MOE, quant="q8_0", seed=3)),
    ("qwen3vlmoe-mix", "qwen3vlmoe", "qwen2",
     dict(_MOE, quant="q8_0,exps=q4_0,ffn_down_exps=q5_1", seed=2)),
    ("minimax-m2-q8", "minimax-m2", "qwen2", dict(_MOE, quant="q8_0", seed=3)),
    ("minimax-m2-mix", "minimax-m2", "qwen2",
     dict(_MOE, quant="q8_0,attn=q5_k,exps=q4_k,ffn_down_exps=q6_k", rope_dim=32, seed=2)),
]  # fmt: skip


F32, ARRAY = GGUFValueType.FLOAT32, GGUFValueType.ARRAY

#: Metadata and tensor edits of cases after make-test-model: RoPE sections, a stronger
#: temperature, sharper attention (q norms x3: positions then matter more), ten times larger
#: selection biases (they then change which experts are chosen).
EDITS: dict[str, dict[str, Any]] = {
    "qwen3vl-sections": dict(
        meta={"qwen3vl.rope.dimension_sections": ([2, 2, 2, 2], ARRAY)},
        tensors=_stronger("attn_q_norm.weight", mul=3.0),
    ),
    "mistral3-temp": dict(meta={"mistral3.attention.temperature_scale": (1.0, F32)}),
    "minimax-m2-q8": dict(tensors=_stronger("exp_probs_b.bias", mul=10.0)),
    "minimax-m2-mix": dict(tensors=_stronger("exp_probs_b.bias", mul=10.0)),
}

#: (case, the edit that removes a feature from its file): llama.cpp on the edited file must be
#: at least ABLATION_RATIO times farther (mean KL) from llama.cpp on the case's file than we
#: are, so that the agreement resolves the feature.
ABLATIONS: list[tuple[str, dict[str, Any]]] = [
    ("mistral3-temp", {"mistral3.attention.temperature_scale": (0.0, F32)}),
    # Sections covering every pair: plain NEOX RoPE at text positions.
    ("qwen3vl-sections", {"qwen3vl.rope.dimension_sections": ([16, 16, 16, 0], ARRAY)}),
]
ABLATION_RATIO = 4.0


def _vocab(name: str) -> Path:
    try:
        return llama_tree() / "models" / f"ggml-vocab-{name}.gguf"
    except FreeTokenError as e:
        pytest.skip(str(e))


def build(case: str, out: Path) -> Path:
    """The file of ``case`` (make-test-model, then its EDITS) in ``out``."""
    _, arch, vocab, opts = next(c for c in CASES if c[0] == case)
    path = out / f"{case}.gguf"
    base = out / f"{case}.base.gguf" if case in EDITS else path
    make_test_model(arch, vocab=_vocab(vocab), out=base, log=lambda _: None, **opts)
    return rewrite(base, path, **EDITS[case]) if case in EDITS else path


@pytest.mark.slow
@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_matches_llamacpp(case: str, tmp_path: Path, llama_ref_root: Path) -> None:
    import llama_ref

    path = build(case, tmp_path)
    ours = LLM(path, n_ctx=512)
    with llama_ref.LlamaRef.load(path, n_ctx=512, n_threads=2, root=llama_ref_root) as ref:
        for prompt in PROMPTS:
            tokens = ref.tokenize(prompt)
            seq = tokens + ref.greedy(tokens, N_GEN)
            rows = slice(len(tokens) - 1, len(seq) - 1)
            want = ref.logits(seq)[rows]
            got = ours.logits(seq)[rows].numpy()
            assert np.isfinite(got).all()
            c = compare(want, got)
            assert not c.mismatches, f"{case} {prompt!r}: {c.describe()}"
            assert c.mean_kl <= MAX_KL, f"{case} {prompt!r}: {c.describe()}"


@pytest.mark.slow
@pytest.mark.parametrize(("case", "ablate"), ABLATIONS, ids=[a[0] for a in ABLATIONS])
def test_agreement_resolves_the_feature(
    case: str, ablate: dict[str, Any], tmp_path: Path, llama_ref_root: Path
) -> None:
    import llama_ref

    path = build(case, tmp_path)
    other = rewrite(path, tmp_path / "ablated.gguf", meta=ablate)
    ours = LLM(path, n_ctx=512)
    load = dict(n_ctx=512, n_threads=2, root=llama_ref_root)
    with llama_ref.LlamaRef.load(path, **load) as ref, llama_ref.LlamaRef.load(other, **load) as ab:
        for prompt in PROMPTS:
            tokens = ref.tokenize(prompt)
            seq = tokens + ref.greedy(tokens, N_GEN)
            rows = slice(len(tokens) - 1, len(seq) - 1)
            want = ref.logits(seq)[rows]
            c_ours = compare(want, ours.logits(seq)[rows].numpy())
            c_ablated = compare(want, ab.logits(seq)[rows])
            assert c_ablated.mean_kl >= ABLATION_RATIO * c_ours.mean_kl, (
                f"{case} {prompt!r}: ours {c_ours.describe()}; without the feature "
                f"{c_ablated.describe()}"
            )


# ----------------------------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------------------------

U32 = GGUFValueType.UINT32


def _drop_tensor(name: str):  # type: ignore[no-untyped-def]
    return lambda r: [(t.name, t.data, t.tensor_type) for t in r.tensors if t.name != name]


def _cut_tensor(name: str):  # type: ignore[no-untyped-def]
    """``name`` with its last row left out (a misshapen tensor)."""
    return lambda r: [
        (t.name, t.data[:-1] if t.name == name else t.data, t.tensor_type) for t in r.tensors
    ]


@pytest.fixture(scope="module")
def small_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("bad")
    small = dict(layers=2, hidden=64, ffn=128, heads=2, kv_heads=1, head_dim=32, ctx=512)
    files = {}
    for arch, vocab in (("mistral3", "llama-spm"), ("qwen3vl", "llama-spm"),
                        ("qwen3vlmoe", "llama-spm"), ("minimax-m2", "llama-spm")):  # fmt: skip
        moe = arch in ("qwen3vlmoe", "minimax-m2")
        opts = dict(small, experts=4, top_k=2, expert_ffn=64) if moe else small
        files[arch] = make_test_model(
            arch, vocab=_vocab(vocab), out=out / f"{arch}.gguf", log=lambda _: None,
            quant="q8_0", **opts,
        )  # fmt: skip
    return files


BAD: list[tuple[str, str, dict[str, Any], str]] = [
    ("mistral3", "missing", dict(tensors=_drop_tensor("blk.1.attn_k.weight")), "blk.1.attn_k"),
    ("mistral3", "misshapen", dict(tensors=_cut_tensor("blk.0.ffn_up.weight")), "blk.0.ffn_up"),
    ("mistral3", "temperature without a context",
     dict(meta={"mistral3.rope.scaling.original_context_length": (0, U32),
                "mistral3.context_length": (0, U32)}), "temperature_scale"),
    ("qwen3vl", "missing", dict(tensors=_drop_tensor("blk.0.attn_q_norm.weight")),
     "blk.0.attn_q_norm"),
    ("qwen3vl", "no sections", dict(drop=lambda k: k.endswith("dimension_sections")),
     "dimension_sections"),
    ("qwen3vl", "sections past the head",
     dict(meta={"qwen3vl.rope.dimension_sections": ([12, 12, 12, 0], GGUFValueType.ARRAY)}),
     "sections"),
    ("qwen3vlmoe", "expert count", dict(meta={"qwen3vlmoe.expert_count": (8, U32)}),
     "ffn_gate_inp"),
    ("qwen3vlmoe", "misshapen experts", dict(tensors=_cut_tensor("blk.1.ffn_down_exps.weight")),
     "ffn_down_exps"),
    ("minimax-m2", "missing bias", dict(tensors=_drop_tensor("blk.1.exp_probs_b.bias")),
     "blk.1.exp_probs_b"),
    ("minimax-m2", "per-head k norm", dict(tensors=_cut_tensor("blk.0.attn_k_norm.weight")),
     "blk.0.attn_k_norm"),
    ("minimax-m2", "expert count", dict(meta={"minimax-m2.expert_count": (3, U32)}),
     "ffn_gate_inp"),
    ("minimax-m2", "no gating", dict(drop=lambda k: k.endswith("expert_gating_func")),
     "expert_gating_func"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("arch", "what", "edit", "named"), BAD, ids=[f"{b[0]}-{b[1]}" for b in BAD]
)
def test_bad_input_names_it(
    arch: str, what: str, edit: dict[str, Any], named: str, small_files: dict[str, Path],
    tmp_path: Path,
) -> None:  # fmt: skip
    path = rewrite(small_files[arch], tmp_path / "bad.gguf", **edit)
    with pytest.raises(FreeTokenError, match=named):
        LLM(path, n_ctx=64)


@pytest.mark.parametrize("arch", ["mistral3", "qwen3vl", "qwen3vlmoe", "minimax-m2"])
def test_good_small_files_load(arch: str, small_files: dict[str, Path]) -> None:
    """The unedited files of the bad-input cases load and run (the edits make them fail)."""
    logits = LLM(small_files[arch], n_ctx=64).logits([1, 2, 3])
    assert logits.shape[0] == 3 and np.isfinite(logits.numpy()).all()


# ----------------------------------------------------------------------------------------
# Chat templates (the released ones the pinned tree ships), rendered as transformers does
# ----------------------------------------------------------------------------------------

TURNS = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "How are you?"},
]

#: (template file, messages, the text its Jinja source gives for them, read off the source).
TEMPLATES = [
    (
        "MiniMax-M2.jinja",
        TURNS,
        "]~!b[]~b]system\nYou are a helpful assistant.[e~[\n]~b]user\nHello[e~[\n"
        "]~b]ai\nHi there[e~[\n]~b]user\nHow are you?[e~[\n]~b]ai\n<think>\n",
    ),
    (
        "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
        [{"role": "system", "content": "Be brief."}, *TURNS],
        "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hello[/INST]Hi there</s>"
        "[INST]How are you?[/INST]",
    ),
    (
        "Mistral-Small-3.2-24B-Instruct-2506.jinja",
        [{"role": "system", "content": "Be brief."}, *TURNS],
        "<s>[SYSTEM_PROMPT]Be brief.[/SYSTEM_PROMPT][INST]Hello[/INST]Hi there</s>"
        "[INST]How are you?[/INST]",
    ),
]


@pytest.mark.parametrize(("name", "messages", "want"), TEMPLATES, ids=[t[0] for t in TEMPLATES])
def test_chat_template_renders(name: str, messages: list[dict[str, str]], want: str) -> None:
    from freetoken.tokenizer.chat import render_chat_template

    try:
        template = (llama_tree() / "models" / "templates" / name).read_text()
    except FreeTokenError as e:
        pytest.skip(str(e))
    out = render_chat_template(template, messages, True, bos_token="<s>", eos_token="</s>")
    assert out == want
