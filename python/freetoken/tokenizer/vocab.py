"""The vocabulary of a GGUF file: tokens, their attributes, special ids and tokenizer flags.

Everything here follows how llama.cpp loads a vocabulary (``llama_vocab::impl::load``), since
the attributes decide how text is split around special tokens, how tokens render, and which
tokens end generation: the defaults per tokenizer model and pre-tokenizer type, the overrides
from metadata, the tokens recognised by their text (end-of-turn, fill-in-the-middle, unused),
and the per-model attribute fixes.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from freetoken.errors import GGUFError, UnsupportedError
from freetoken.tokenizer.pretok import PreTokenizer, pre_tokenizer

__all__ = ["Attr", "Vocab"]

NULL = -1  # LLAMA_TOKEN_NULL


class Attr:
    """Token attribute bits (llama.cpp's ``llama_token_attr``); plain ints, for speed."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# GGUF ``tokenizer.ggml.token_type`` values -> attributes.
_TYPE_TO_ATTR = {
    0: Attr.UNDEFINED,
    1: Attr.NORMAL,
    2: Attr.UNKNOWN,
    3: Attr.CONTROL,
    4: Attr.USER_DEFINED,
    5: Attr.UNUSED,
    6: Attr.BYTE,
}

# Token texts llama.cpp recognises, in its auto-detection, as special roles.
_EOT_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "<\uff5cend▁of▁sentence\uff5c>",
        "<end_of_utterance>",
    ]
)
_EOM_TEXTS = frozenset(["<|eom_id|>"])
_FIM_TEXTS = {
    "fim_pre": frozenset(
        [
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<\uff5cfim▁begin\uff5c>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ]
    ),
    "fim_suf": frozenset(
        [
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<\uff5cfim▁hole\uff5c>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ]
    ),
    "fim_mid": frozenset(
        [
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<\uff5cfim▁end\uff5c>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ]
    ),
    "fim_pad": frozenset(["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"]),
    "fim_rep": frozenset(["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"]),
    "fim_sep": frozenset(["<|file_sep|>"]),
}
# Token texts that end generation (llama.cpp keeps this list by text).
_EOG_TEXTS = frozenset(
    [
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<\uff5cend▁of▁sentence\uff5c>",
        "[e~[",
    ]
)

# Metadata keys of special token ids, in the order llama.cpp reads them (the deprecated
# prefix/suffix/middle keys come last and win over fim_*).
_SPECIAL_KEYS = (
    ("bos", "bos_token_id"),
    ("eos", "eos_token_id"),
    ("eot", "eot_token_id"),
    ("eom", "eom_token_id"),
    ("unk", "unknown_token_id"),
    ("sep", "seperator_token_id"),
    ("pad", "padding_token_id"),
    ("mask", "mask_token_id"),
    ("fim_pre", "fim_pre_token_id"),
    ("fim_suf", "fim_suf_token_id"),
    ("fim_mid", "fim_mid_token_id"),
    ("fim_pad", "fim_pad_token_id"),
    ("fim_rep", "fim_rep_token_id"),
    ("fim_sep", "fim_sep_token_id"),
    ("fim_pre", "prefix_token_id"),
    ("fim_suf", "suffix_token_id"),
    ("fim_mid", "middle_token_id"),
)

# Pre-tokenizer types whose flags differ from the BPE defaults (clean_spaces on, add_bos and
# ignore_merges off): name -> (clean_spaces, add_bos, ignore_merges).
_BPE_FLAGS: dict[str, tuple[bool, bool, bool]] = {
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
        ],
        (True, True, True),
    ),
    **dict.fromkeys(
        [
            "deepseek-llm",
            "deepseek-coder",
            "deepseek-v3",
            "qwen2",
            "deepseek-r1-qwen",
            "kormo",
            "f2llmv2",
            "qwen35",
            "command-r",
            "smollm",
            "gpt-4o",
            "llama4",
            "kanana2",
            "talkie",
            "minimax-m2",
            "trillion",
            "granite-docling",
            "hunyuan",
            "hunyuan-dense",
            "hy_v4",
            "joyai-llm",
            "grok-2",
            "solar-open",
        ],
        (False, False, False),
    ),
    "tekken": (False, True, True),
    "glm4": (True, False, True),
    "glm5": (True, False, True),
}


def _get(meta: Mapping[str, Any], key: str, default: Any = None) -> Any:
    return meta.get(key, default)


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    if getattr(getattr(value, "dtype", None), "kind", None) == "b":
        return bool(value)  # a numpy bool
    try:
        number = operator.index(value)
    except TypeError:
        number = None
    if number in (0, 1):
        return bool(number)
    raise GGUFError(f"{key} must be a bool, got {value!r}")


def _as_int(value: Any, key: str) -> int:
    if isinstance(value, bool):
        raise GGUFError(f"{key} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise GGUFError(f"{key} must be an integer, got {value!r}") from None


@dataclass
class Vocab:
    """A loaded vocabulary: token texts, scores, attributes, special ids and flags."""

    model: str  # "llama" (SPM) or "bpe" (gpt2 / gemma4)
    pre: str
    tokens: list[str]
    scores: list[float]
    attrs: list[int]
    token_to_id: dict[str, int]
    merges: dict[tuple[str, str], int]
    special: dict[str, int]
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    escape_whitespaces: bool
    clean_spaces: bool
    ignore_merges: bool
    pretok: PreTokenizer | None
    eog_ids: frozenset[int]
    special_tokens: list[int]  # tried in this order when splitting text around them
    chat_template: str | None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.tokens)

    @classmethod
    def from_metadata(cls, meta: Mapping[str, Any]) -> Vocab:
        """Loads the vocabulary from GGUF metadata, the way llama.cpp does."""
        model_name = _get(meta, "tokenizer.ggml.model")
        if model_name is None:
            raise GGUFError("tokenizer.ggml.model is missing: the file has no tokenizer")
        if not isinstance(model_name, str):
            raise GGUFError(f"tokenizer.ggml.model must be a string, got {model_name!r}")
        pre = _get(meta, "tokenizer.ggml.pre", "") or ""
        if not isinstance(pre, str):
            raise GGUFError(f"tokenizer.ggml.pre must be a string, got {pre!r}")

        tokens = _get(meta, "tokenizer.ggml.tokens")
        if not isinstance(tokens, Sequence) or isinstance(tokens, str | bytes) or not tokens:
            raise GGUFError("tokenizer.ggml.tokens is missing or not a list of strings")
        tokens = list(tokens)
        n = len(tokens)
        for i, t in enumerate(tokens):
            if not isinstance(t, str):
                raise GGUFError(f"tokenizer.ggml.tokens[{i}] is not a string: {t!r}")
            if not t:
                tokens[i] = f"[EMPTY_{i}]"  # as llama.cpp names empty tokens

        roles = ["bos", "eos", "eot", "eom", "unk", "sep", "pad", "mask"]
        roles += ["fim_pre", "fim_suf", "fim_mid", "fim_pad", "fim_rep", "fim_sep"]
        special = dict.fromkeys(roles, NULL)
        merges: dict[tuple[str, str], int] = {}
        add_space_prefix = False
        escape_whitespaces = True
        clean_spaces = False
        ignore_merges = False
        add_bos = False
        add_eos = False
        pretok: PreTokenizer | None = None

        if model_name == "llama":
            kind = "llama"
            special.update(bos=1, eos=2, unk=0)
            add_space_prefix = True
            add_bos = True
            pre = "default"
        elif model_name in ("gpt2", "gemma4"):
            kind = "bpe"
            merges = _parse_merges(meta)
            if model_name == "gemma4":
                pre = "gemma4"
            else:
                special.update(bos=11, eos=11)
            escape_whitespaces = False
            clean_spaces = True
            if not pre:
                pre = "default"  # llama.cpp warns and uses the default pre-tokenizer
            if pre in _BPE_FLAGS:
                clean_spaces, add_bos, ignore_merges = _BPE_FLAGS[pre]
            if pre in ("gemma4", "granite-embed-multi-311m"):
                escape_whitespaces = True
            if pre in ("chatglm-bpe", "glm4", "glm5"):
                special["bos"] = NULL
            pretok = pre_tokenizer(pre)
        else:
            raise UnsupportedError(f"unsupported tokenizer model {model_name!r}")

        if "tokenizer.ggml.add_space_prefix" in meta:
            key = "tokenizer.ggml.add_space_prefix"
            add_space_prefix = _as_bool(meta[key], key)

        scores = _number_list(meta, "tokenizer.ggml.scores", n, float, 0.0)
        types = _number_list(meta, "tokenizer.ggml.token_type", n, int, 1)
        attrs = [_TYPE_TO_ATTR.get(t, Attr.UNDEFINED) for t in types]

        token_to_id: dict[str, int] = {}
        for i, t in enumerate(tokens):
            token_to_id[t] = i
        if len(token_to_id) != n:
            raise GGUFError("tokenizer.ggml.tokens has duplicate entries")

        # Special ids: out-of-range defaults are disabled, out-of-range metadata is ignored.
        for role in special:
            if special[role] >= n:
                special[role] = NULL
        for role, key in _SPECIAL_KEYS:
            value = meta.get("tokenizer.ggml." + key)
            if value is None:
                continue
            value = _as_int(value, "tokenizer.ggml." + key)
            if 0 <= value < n:
                special[role] = value

        for key, name in (("add_bos_token", "bos"), ("add_eos_token", "eos")):
            full = "tokenizer.ggml." + key
            if full in meta:
                if name == "bos":
                    add_bos = _as_bool(meta[full], full)
                else:
                    add_eos = _as_bool(meta[full], full)
        if pre in ("gemma4", "granite-embed-multi-311m"):
            add_bos = True  # llama.cpp forces it for Gemma 4

        # Roles recognised by token text, for files that do not name them.
        for text, i in token_to_id.items():
            if special["eot"] == NULL and text in _EOT_TEXTS:
                special["eot"] = i
                attrs[i] |= Attr.CONTROL
            if special["eom"] == NULL and text in _EOM_TEXTS:
                special["eom"] = i
                attrs[i] |= Attr.CONTROL
            for role, texts in _FIM_TEXTS.items():
                if special[role] == NULL and text in texts:
                    special[role] = i
                    attrs[i] |= Attr.CONTROL

        # Control tokens named "unused" are unused.
        for text, i in token_to_id.items():
            if attrs[i] & Attr.CONTROL and "unused" in text:
                attrs[i] |= Attr.UNUSED

        eog: set[int] = {special[r] for r in ("fim_pad", "fim_rep", "fim_sep")} - {NULL}
        for text, i in token_to_id.items():
            if text in _EOG_TEXTS:
                eog.add(i)
                attrs[i] |= Attr.CONTROL
        # gpt-oss renders these markers, so llama.cpp makes them user-defined.
        for text in ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"):
            if text in token_to_id:
                attrs[token_to_id[text]] = Attr.USER_DEFINED
        eog |= {special[r] for r in ("eos", "eot", "eom")} - {NULL}
        eog_texts = {tokens[i] for i in eog}
        if "<|end|>" in eog_texts and (
            ("<|return|>" in eog_texts and "<|call|>" in eog_texts)
            or (("<|call|>" in eog_texts or "<|calls|>" in eog_texts) and "<|flush|>" in eog_texts)
        ):
            # harmony / solar-open chat formats: "<|end|>" ends a message, not the generation
            end_id = token_to_id["<|end|>"]
            eog.discard(end_id)
            attrs[end_id] = Attr.USER_DEFINED
        normal_s = "<|tool_response>" in eog_texts or "<|plamo:eos|>" in eog_texts
        if normal_s and "</s>" in eog_texts:
            # Gemma 4 and PLaMo have an ordinary "</s>"
            s_id = token_to_id["</s>"]
            eog.discard(s_id)
            attrs[s_id] = Attr.NORMAL

        # Tokens split out of text before tokenizing, longest first (llama.cpp's order among
        # equal lengths is unspecified; we take the lower id first).
        special_tokens = [
            i for i in range(n) if attrs[i] & (Attr.CONTROL | Attr.USER_DEFINED | Attr.UNKNOWN)
        ]
        special_tokens.sort(key=lambda i: (-len(tokens[i].encode()), i))

        # Per-model attribute fixes, chosen by model name and architecture as llama.cpp does.
        name = str(meta.get("general.name", "") or "").lower()
        arch = str(meta.get("general.architecture", "") or "")
        if any(s in pre for s in ("jina-v2-de", "jina-v2-es", "jina-v2-code")) or any(
            s in arch for s in ("nomic-bert-moe", "jina-bert-v3")
        ):
            if "<mask>" in token_to_id:
                attrs[token_to_id["<mask>"]] |= Attr.LSTRIP
        elif "phi-3" in name or "phi3" in name:
            for i in special_tokens:
                attrs[i] |= Attr.RSTRIP
            if "</s>" in token_to_id:
                attrs[token_to_id["</s>"]] |= Attr.RSTRIP
            for text in ("<unk>", "<s>", "<|endoftext|>"):
                if text in token_to_id:
                    attrs[token_to_id[text]] &= ~Attr.RSTRIP

        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise GGUFError("tokenizer.chat_template must be a string")

        return cls(
            model=kind,
            pre=pre,
            tokens=tokens,
            scores=scores,
            attrs=attrs,
            token_to_id=token_to_id,
            merges=merges,
            special=special,
            add_bos=add_bos,
            add_eos=add_eos,
            add_space_prefix=add_space_prefix,
            escape_whitespaces=escape_whitespaces,
            clean_spaces=clean_spaces,
            ignore_merges=ignore_merges,
            pretok=pretok,
            eog_ids=frozenset(eog),
            special_tokens=special_tokens,
            chat_template=template,
            extra={"architecture": arch, "name": name},
        )


def _number_list(
    meta: Mapping[str, Any], key: str, n: int, kind: type, default: float | int
) -> list[Any]:
    values = meta.get(key)
    if values is None:
        return [kind(default)] * n
    if isinstance(values, str | bytes) or not hasattr(values, "__len__"):
        raise GGUFError(f"{key} must be a list of numbers")
    if len(values) < n:
        raise GGUFError(f"{key} has {len(values)} entries for {n} tokens")
    try:
        return [kind(v) for v in list(values)[:n]]
    except (TypeError, ValueError) as e:
        raise GGUFError(f"{key} must be a list of numbers: {e}") from None


def _parse_merges(meta: Mapping[str, Any]) -> dict[tuple[str, str], int]:
    merges = meta.get("tokenizer.ggml.merges")
    if merges is None:
        raise GGUFError("tokenizer.ggml.merges is missing (a BPE tokenizer needs its merges)")
    if isinstance(merges, str | bytes):
        raise GGUFError("tokenizer.ggml.merges must be a list of strings")
    ranks: dict[tuple[str, str], int] = {}
    for rank, merge in enumerate(merges):
        if not isinstance(merge, str):
            raise GGUFError(f"tokenizer.ggml.merges[{rank}] is not a string: {merge!r}")
        # split at the first space after the first character (a pair may start with a space)
        pos = merge.find(" ", 1)
        pair = (merge[:pos], merge[pos + 1 :]) if pos >= 0 else ("", "")
        ranks.setdefault(pair, rank)  # the first rank of a repeated pair wins
    return ranks
