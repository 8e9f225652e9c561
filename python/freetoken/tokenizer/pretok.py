"""Pre-tokenization for BPE vocabularies: the word splitting that ``tokenizer.ggml.pre`` names.

llama.cpp splits text with a list of regular expressions per pre-tokenizer type, applied one
after another: each expression splits every piece left by the previous one into its matches and
the gaps between them. It matches on Unicode general categories from its own tables (Unicode
15.1) and a fixed whitespace set (the Unicode ``White_Space`` property), and runs some
expressions through ``std::wregex``, where non-ASCII whitespace is first replaced by a vertical
tab. We express each of its expressions as a Python ``re`` pattern over explicit character
classes built from the same facts, so the splits are the same.
"""

from __future__ import annotations

import functools
import re
import unicodedata
from dataclasses import dataclass, field

from freetoken.errors import UnsupportedError

__all__ = ["BYTE_DECODER", "BYTE_ENCODER", "PreTokenizer", "byte_encode", "pre_tokenizer"]

# The Unicode White_Space property: what llama.cpp's ``\s`` means.
_WHITESPACE = [
    *range(0x09, 0x0E),
    *(0x20, 0x85, 0xA0, 0x1680),
    *range(0x2000, 0x200B),
    *(0x2028, 0x2029, 0x202F, 0x205F, 0x3000),
]

# Characters assigned in Unicode 15.0 and 15.1 (llama.cpp's tables) that an older Python
# unicodedata (3.11 has Unicode 14.0) reports as unassigned: (first, last, major category).
_UNICODE_15_ADDITIONS: tuple[tuple[int, int, str], ...] = (
    (0x0CF3, 0x0CF3, "M"),
    (0x0ECE, 0x0ECE, "M"),
    (0x2FFC, 0x2FFF, "S"),
    (0x31EF, 0x31EF, "S"),
    (0x10EFD, 0x10EFF, "M"),
    (0x1123F, 0x11240, "L"),
    (0x11241, 0x11241, "M"),
    (0x11B00, 0x11B09, "P"),
    (0x11F00, 0x11F01, "M"),
    (0x11F02, 0x11F02, "L"),
    (0x11F03, 0x11F03, "M"),
    (0x11F04, 0x11F10, "L"),
    (0x11F12, 0x11F33, "L"),
    (0x11F34, 0x11F3A, "M"),
    (0x11F3E, 0x11F42, "M"),
    (0x11F43, 0x11F4F, "P"),
    (0x11F50, 0x11F59, "N"),
    (0x1342F, 0x1342F, "L"),
    (0x13439, 0x1343F, "C"),
    (0x13440, 0x13440, "M"),
    (0x13441, 0x13446, "L"),
    (0x13447, 0x13455, "M"),
    (0x1B132, 0x1B132, "L"),
    (0x1B155, 0x1B155, "L"),
    (0x1D2C0, 0x1D2D3, "N"),
    (0x1DF25, 0x1DF2A, "L"),
    (0x1E030, 0x1E06D, "L"),
    (0x1E08F, 0x1E08F, "M"),
    (0x1E4D0, 0x1E4EB, "L"),
    (0x1E4EC, 0x1E4EF, "M"),
    (0x1E4F0, 0x1E4F9, "N"),
    (0x1F6DC, 0x1F6DC, "S"),
    (0x1F774, 0x1F776, "S"),
    (0x1F77B, 0x1F77F, "S"),
    (0x1F7D9, 0x1F7D9, "S"),
    (0x1FA75, 0x1FA77, "S"),
    (0x1FA87, 0x1FA88, "S"),
    (0x1FAAD, 0x1FAAF, "S"),
    (0x1FABB, 0x1FABD, "S"),
    (0x1FABF, 0x1FABF, "S"),
    (0x1FACE, 0x1FACF, "S"),
    (0x1FADA, 0x1FADB, "S"),
    (0x1FAE8, 0x1FAE8, "S"),
    (0x1FAF7, 0x1FAF8, "S"),
    (0x2B739, 0x2B739, "L"),
    (0x2EBF0, 0x2EE5D, "L"),
    (0x31350, 0x323AF, "L"),
)


def _ranges_to_class(cps: list[int]) -> str:
    """The body of a regex character class (no brackets) matching exactly the sorted ``cps``."""
    out: list[str] = []
    i = 0
    while i < len(cps):
        j = i
        while j + 1 < len(cps) and cps[j + 1] == cps[j] + 1:
            j += 1
        out.append(f"\\U{cps[i]:08x}" if i == j else f"\\U{cps[i]:08x}-\\U{cps[j]:08x}")
        i = j + 1
    return "".join(out)


@functools.cache
def _classes() -> dict[str, str]:
    """Character-class bodies: L, N, P, S, M (general categories) and WS (whitespace)."""
    by_cat: dict[str, list[int]] = {"L": [], "N": [], "P": [], "S": [], "M": []}
    extra = {}
    for first, last, cat in _UNICODE_15_ADDITIONS:
        for cp in range(first, last + 1):
            extra[cp] = cat
    category = unicodedata.category
    for cp in range(0x110000):
        cat = category(chr(cp))
        major = extra.get(cp, cat[0]) if cat == "Cn" else cat[0]
        lst = by_cat.get(major)
        if lst is not None:
            lst.append(cp)
    classes = {k: _ranges_to_class(v) for k, v in by_cat.items()}
    classes["WS"] = _ranges_to_class(sorted(_WHITESPACE))
    return classes


# What ``\s`` means inside std::wregex after llama.cpp has replaced non-ASCII whitespace by a
# vertical tab: the ASCII whitespace of the C locale.
_ASCII_WS = "\\t\\n\\x0b\\x0c\\r "
_WREGEX_TRANSLATE = {cp: "\x0b" for cp in _WHITESPACE if cp > 0x7F}


@dataclass(frozen=True)
class _Rule:
    """One splitting expression. ``wide``: matched as llama.cpp's std::wregex path does (the
    expression has literal non-ASCII characters): non-ASCII whitespace becomes ``\\x0b`` first
    and ``\\s`` is ASCII whitespace."""

    pattern: str
    wide: bool = False


def _compile(rule: _Rule) -> re.Pattern[str]:
    c = _classes()
    ws = _ASCII_WS if rule.wide else c["WS"]
    # ``{L}`` etc. are class bodies for use inside brackets; ``{s}`` / ``{S}`` stand alone.
    subst = {
        "L": c["L"],
        "N": c["N"],
        "P": c["P"],
        "S_": c["S"],
        "M": c["M"],
        "WS": ws,
        "s": f"[{ws}]",
        "S": f"[^{ws}]",
    }
    return re.compile(rule.pattern.format(**subst))


# Expressions, by llama.cpp pre-tokenizer family. ``{L}`` ``{N}`` ``{P}`` ``{S_}`` ``{M}`` ``{WS}``
# are class bodies, ``{s}`` ``{S}`` whitespace / non-whitespace; ``\Z`` is ECMAScript's ``$``.
_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = "'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{WS}{L}{N}]+|{s}+(?!{S})"
_LLAMA3 = (
    _CONTRACTIONS + "|[^\\r\\n{L}{N}]?[{L}]+|[{N}]{{1,3}}| ?[^{WS}{L}{N}]+[\\r\\n]*"
    "|{s}*[\\r\\n]+|{s}+(?!{S})|{s}+"
)
_QWEN2 = (
    _CONTRACTIONS + "|[^\\r\\n{L}{N}]?[{L}]+|[{N}]| ?[^{WS}{L}{N}]+[\\r\\n]*"
    "|{s}*[\\r\\n]+|{s}+(?!{S})|{s}+"
)
_QWEN35 = (
    _CONTRACTIONS + "|[^\\r\\n{L}{N}]?[{L}{M}]+|[{N}]| ?[^{WS}{L}{M}{N}]+[\\r\\n]*"
    "|{s}*[\\r\\n]+|{s}+(?!{S})|{s}+"
)
# ECMAScript's ``(?=[\p{L}])([^a-z])``: a letter that is not a-z (and the mirror for A-Z).
_NOT_LOWER = "(?:(?=[{L}])[^a-z])"
_NOT_UPPER = "(?:(?=[{L}])[^A-Z])"
_TEKKEN = (
    "[^\\r\\n{L}{N}]?" + _NOT_LOWER + "*" + _NOT_UPPER + "+"
    "|[^\\r\\n{L}{N}]?" + _NOT_LOWER + "+" + _NOT_UPPER + "*"
    "|[{N}]| ?[^{WS}{L}{N}]+[\\r\\n/]*|{s}*[\\r\\n]+|{s}+(?!{S})|{s}+"
)
_GPT4O = (
    "[^\\r\\n{L}{N}]?" + _NOT_LOWER + "*" + _NOT_UPPER + "+" + _CONTRACTIONS + "?"
    "|[^\\r\\n{L}{N}]?" + _NOT_LOWER + "+" + _NOT_UPPER + "*" + _CONTRACTIONS + "?"
    "|[{N}]{{1,3}}| ?[^{WS}{L}{N}]+[\\r\\n/]*|{s}*[\\r\\n]+|{s}+(?!{S})|{s}+"
)
_DEEPSEEK3 = (
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{{|}}~][A-Za-z]+|[^\\r\\n{L}{P}{S_}]?[{L}{M}]+"
    "| ?[{P}{S_}]+[\\r\\n]*|{s}*[\\r\\n]+|{s}+(?!{S})|{s}+"
)
_DEEPSEEK_LLM_LETTERS = (
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1"
    "\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5"
    "\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a"
    "\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d"
    "\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3"
    "\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115"
    "\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f"
    "\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf"
    "\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f"
    "\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2"
    "\U000118a0-\U000118df\U0001e900-\U0001e943"
)
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"

_RULES: dict[str, tuple[_Rule, ...]] = {
    "default": (
        _Rule("[{P}\\$\\+<=>\\^~\\|]+"),
        _Rule(_GPT2),
        _Rule("[{N}]+"),
        _Rule("[0-9][0-9][0-9]"),
    ),
    "llama3": (_Rule(_LLAMA3),),
    "qwen2": (_Rule(_QWEN2),),
    "qwen35": (_Rule(_QWEN35),),
    "gpt2": (_Rule(_GPT2),),
    "starcoder": (_Rule("[{N}]"), _Rule(_GPT2)),
    "falcon": (
        _Rule("[{P}\\$\\+<=>\\^~\\|`]+"),
        _Rule("'s|'t|'re|'ve|'m|'ll|'d| ?[{L}]+| ?[{N}]+| ?[^{WS}{L}{N}]+|{s}+(?!{S})"),
        _Rule("[0-9][0-9][0-9]"),
    ),
    "deepseek-llm": (
        _Rule("[\\r\\n]", wide=True),
        _Rule("{s}?[" + _DEEPSEEK_LLM_LETTERS + "]+", wide=True),
        _Rule("{s}?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", wide=True),
        _Rule("{s}+\\Z", wide=True),
        _Rule(_CJK, wide=True),
        _Rule("[{N}]+"),
    ),
    "deepseek-coder": (
        _Rule("[\\r\\n]", wide=True),
        _Rule("{s}?[{L}]+"),
        _Rule("{s}?[{P}]+"),
        _Rule(_CJK, wide=True),
        _Rule("[{N}]"),
    ),
    "deepseek3": (
        _Rule("[{N}]{{1,3}}"),
        _Rule("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", wide=True),
        _Rule(_DEEPSEEK3),
    ),
    "tekken": (_Rule(_TEKKEN),),
    "gpt4o": (_Rule(_GPT4O),),
    "newlines": (_Rule("[^\\n]+|\\n+"),),
}


@dataclass(frozen=True)
class PreTokenizer:
    """How one pre-tokenizer type splits text into words, and how words are then spelled."""

    family: str
    byte_encode: bool = True  # GPT-2 byte-to-unicode spelling; False: raw UTF-8 (gemma4)
    _compiled: list[tuple[re.Pattern[str], bool]] = field(default_factory=list, compare=False)

    def split(self, text: str) -> list[str]:
        """Splits ``text`` into words (not yet byte-encoded)."""
        if not self._compiled:
            self._compiled.extend((_compile(r), r.wide) for r in _RULES[self.family])
        pieces = [(0, len(text))] if text else []
        wide_text: str | None = None
        for pattern, wide in self._compiled:
            if wide and wide_text is None:
                wide_text = text.translate(_WREGEX_TRANSLATE)
            subject = wide_text if wide and wide_text is not None else text
            out: list[tuple[int, int]] = []
            for start, end in pieces:
                prev = start
                for m in pattern.finditer(subject, start, end):
                    a, b = m.span()
                    if a > prev:
                        out.append((prev, a))  # the gap before a match is a piece too
                    if b > a:
                        out.append((a, b))
                    prev = b
                if prev < end:
                    out.append((prev, end))
            pieces = out
        return [text[a:b] for a, b in pieces]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's printable spelling of bytes: printable Latin-1 bytes stand for themselves, the
    # others take code points from 256 up, in byte order.
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return table


BYTE_ENCODER: dict[int, str] = _bytes_to_unicode()
BYTE_DECODER: dict[str, int] = {v: k for k, v in BYTE_ENCODER.items()}
_BYTE_TRANSLATE = [BYTE_ENCODER[b] for b in range(256)]


def byte_encode(word: str) -> str:
    """GPT-2 byte-level spelling of ``word``: one printable character per UTF-8 byte."""
    if word.isascii() and word.isprintable() and " " not in word:
        return word  # printable ASCII other than space maps to itself
    return "".join([_BYTE_TRANSLATE[b] for b in word.encode("utf-8")])


# llama.cpp's names for pre-tokenizer types (``tokenizer.ggml.pre``), grouped by the splitting
# family they use. Flags that differ from the BPE defaults ride along (see vocab.py).
_PRE_FAMILIES: dict[str, str] = {
    "default": "default",
    **dict.fromkeys(
        [
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
            "chatglm-bpe",
            "glm4",
            "glm5",
        ],
        "llama3",
    ),
    **dict.fromkeys(
        [
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "stablelm2",
            "hunyuan",
            "solar-open",
            "megrez",
            "grok-2",
        ],
        "qwen2",
    ),
    "qwen35": "qwen35",
    **dict.fromkeys(
        [
            "gpt-2",
            "phi-2",
            "jina-es",
            "jina-de",
            "gigachat",
            "jina-v2-es",
            "jina-v2-de",
            "a.x-4.0",
            "mellum",
            "modern-bert",
            "jina-v1-en",
            "jina-v2-code",
            "roberta-bpe",
            "mpt",
            "olmo",
            "jais",
            "trillion",
            "granite-docling",
            "exaone4",
        ],
        "gpt2",
    ),
    **dict.fromkeys(
        [
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ],
        "starcoder",
    ),
    "falcon": "falcon",
    "deepseek-llm": "deepseek-llm",
    "deepseek-coder": "deepseek-coder",
    **dict.fromkeys(["deepseek-v3", "hunyuan-dense", "joyai-llm", "hy_v4"], "deepseek3"),
    "tekken": "tekken",
    **dict.fromkeys(["gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"], "gpt4o"),
    **dict.fromkeys(["gemma4", "granite-embed-multi-311m"], "newlines"),
}


def pre_tokenizer(name: str) -> PreTokenizer:
    """The pre-tokenizer llama.cpp uses for ``tokenizer.ggml.pre`` = ``name``; an
    :class:`~freetoken.errors.UnsupportedError` naming it for a type we do not implement."""
    family = _PRE_FAMILIES.get(name)
    if family is None:
        raise UnsupportedError(f"unsupported tokenizer pre-tokenizer type {name!r}")
    return PreTokenizer(family=family, byte_encode=family != "newlines")
