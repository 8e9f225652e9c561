"""The quant spec of ``freetoken make-test-model``: which ggml type each weight matrix gets.

Grammar (whitespace around items is ignored, type and tensor names are case-insensitive)::

    spec     := item ("," item)*
    item     := TYPE                    the default type: matrices no rule matches
              | pattern "=" TYPE        a rule
    pattern  := NAME                    that tensor in every layer (or the global tensor)
              | "blk." LAYERS "." NAME  only in the given layers
    LAYERS   := N | N "-" M | "*"       one layer, an inclusive range, or every layer
    NAME     := a short tensor name     attn_q attn_k attn_v attn_output ffn_gate ffn_up
                                        ffn_down token_embd output, and the MoE names
                                        ffn_gate_exps ffn_up_exps ffn_down_exps ffn_gate_shexp ...
              | a group                 attn (every attn_* matrix), ffn (every ffn_* matrix,
                                        experts included), exps (routed experts),
                                        shexp (shared experts), ssm (linear attention's
                                        ssm_* matrices), embd (= token_embd), * (all)
              | a glob over short names ffn_*_exps, attn_[qk]

Rules are applied in order and the last rule that matches a tensor wins; the default (at most
one bare TYPE, wherever it stands) applies only where no rule matches, and is F16 when the spec
has none. TYPE is any ggml storage type (F32, F16, BF16, Q4_0, Q8_0, Q4_K, IQ4_XS, MXFP4, ...).

Only matrices are affected: 1-D tensors (norms, biases) are always F32, as llama-quantize
leaves them. Where a matrix's row length (its ``K``, ggml's ``ne[0]``) is not a multiple of the
type's block size, the type falls back the way llama-quantize does (``src/llama-quant.cpp``,
``tensor_type_fallback``): IQ1_S IQ1_M IQ2_XXS IQ2_XS IQ2_S IQ3_XXS IQ3_S IQ4_XS -> IQ4_NL;
Q2_0 Q2_K Q3_K TQ1_0 TQ2_0 -> Q4_0; Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0; and if that type
does not fit either, F16. Other types with blocks over 32 (Q1_0, NVFP4) have no fallback there
and are an error here too.

Examples::

    q4_k                                    every matrix Q4_K
    q8_0,attn=q4_0,ffn_down=q6_k,output=q8_0,embd=f16
    q4_0,blk.0-3.ffn_down=q5_k,blk.7.ffn=q8_0
    q4_k,exps=q4_0,ffn_down_exps=q8_0       (MoE: experts Q4_0 but their down Q8_0)
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable
from dataclasses import dataclass

from freetoken import quant
from freetoken.errors import FreeTokenError, InvalidInputError

__all__ = [
    "GLOBAL_NAMES",
    "GROUPS",
    "KNOWN_NAMES",
    "QuantSpec",
    "Rule",
    "fallback_type",
    "parse_quant_spec",
    "type_name",
]

#: Matrices that exist once per model, not per layer.
GLOBAL_NAMES = frozenset({"token_embd", "output", "per_layer_token_embd", "per_layer_model_proj"})

#: Every matrix short name a spec may name: the dense families' and the MoE and MLA families'
#: (listed ahead of those families so a spec written for them already parses).
KNOWN_NAMES = frozenset(
    {
        "token_embd",
        "output",
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "attn_qkv",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        # MoE
        "ffn_gate_exps",
        "ffn_up_exps",
        "ffn_down_exps",
        "ffn_gate_up_exps",
        "ffn_gate_shexp",
        "ffn_up_shexp",
        "ffn_down_shexp",
        # MLA (deepseek2)
        "attn_q_a",
        "attn_q_b",
        "attn_kv_a_mqa",
        "attn_kv_b",
        "attn_k_b",
        "attn_v_b",
        # Gated DeltaNet linear attention (qwen35, qwen35moe, qwen3next)
        "attn_gate",
        "ssm_beta",
        "ssm_alpha",
        "ssm_ba",
        "ssm_out",
        # Gemma 4's per-layer inputs (the E-series)
        "per_layer_token_embd",
        "per_layer_model_proj",
        "per_layer_inp_gate",
        "per_layer_proj",
    }
)

#: Group names and the short names each covers.
GROUPS = {
    "*": lambda s: True,
    "attn": lambda s: s.startswith("attn_"),
    "ffn": lambda s: s.startswith("ffn_"),
    "exps": lambda s: s.endswith("_exps"),
    "shexp": lambda s: s.endswith("_shexp"),
    "embd": lambda s: s == "token_embd",
    "ssm": lambda s: s.startswith("ssm_"),
}

# llama-quantize's fallback table (src/llama-quant.cpp, tensor_type_fallback).
_FALLBACK = {
    **dict.fromkeys(
        ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"), "IQ4_NL"
    ),
    **dict.fromkeys(("Q2_0", "Q2_K", "Q3_K", "TQ1_0", "TQ2_0"), "Q4_0"),
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
}

# llama-quantize file types (mixtures), which users may type where a tensor type is meant.
_FTYPE_HINT = re.compile(r"^(q[2-6]_k)_(s|m|l|xs)$|^(iq[1-4])_(xs|s|m|xxs)$", re.IGNORECASE)

_LAYERS = re.compile(r"^(\d+)(?:-(\d+))?$")


def type_name(qtype: int) -> str:
    """The ggml name of a type id (``"Q4_K"``)."""
    return quant.type_info(qtype).name


def _parse_type(text: str, item: str) -> int:
    if not text:
        raise InvalidInputError(f"quant spec item `{item}`: missing type")
    try:
        info = quant.type_info(text)
    except FreeTokenError:
        hint = ""
        if _FTYPE_HINT.match(text):
            hint = (
                f" ({text} is a llama-quantize file type, a mixture; name a tensor type such as"
                f" {text.rsplit('_', 1)[0].upper()})"
            )
        raise InvalidInputError(f"quant spec item `{item}`: unknown type `{text}`{hint}") from None
    if not info.is_storage:
        raise InvalidInputError(
            f"quant spec item `{item}`: {info.name} is an activation type, not a storage type"
        )
    return info.id


@dataclass(frozen=True)
class Rule:
    """One ``pattern=TYPE`` rule."""

    name: str
    """A short name, a group or a glob, lower case."""
    layers: tuple[int, int] | None
    """An inclusive layer range, or None for every layer and the global matrices."""
    qtype: int
    text: str
    """The item as written, for messages."""

    def matches(self, short: str, layer: int | None) -> bool:
        """Whether this rule selects the matrix ``short`` of ``layer`` (None: global)."""
        if self.layers is not None:
            if layer is None or not self.layers[0] <= layer <= self.layers[1]:
                return False
        return _name_matches(self.name, short)


def _name_matches(pattern: str, short: str) -> bool:
    group = GROUPS.get(pattern)
    if group is not None:
        return group(short)
    return fnmatch.fnmatchcase(short, pattern)


@dataclass(frozen=True)
class QuantSpec:
    """A parsed quant spec: the default type and the rules, in order."""

    default: int
    rules: tuple[Rule, ...]
    text: str

    def requested_type(self, short: str, layer: int | None) -> int:
        """The type the spec asks for the matrix ``short`` of ``layer``, before any fallback."""
        for rule in reversed(self.rules):
            if rule.matches(short, layer):
                return rule.qtype
        return self.default

    def check_layers(self, n_layers: int) -> None:
        """InvalidInputError if a rule names a layer the model does not have."""
        for rule in self.rules:
            if rule.layers is not None and rule.layers[1] >= n_layers:
                raise InvalidInputError(
                    f"quant spec item `{rule.text}`: the model has {n_layers} layers "
                    f"(0-{n_layers - 1})"
                )


def _parse_layers(text: str, item: str) -> tuple[int, int] | None:
    if text == "*":
        return None
    m = _LAYERS.match(text)
    if not m:
        raise InvalidInputError(
            f"quant spec item `{item}`: bad layer selector `{text}` (use N, N-M or *)"
        )
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) is not None else lo
    if hi < lo:
        raise InvalidInputError(f"quant spec item `{item}`: empty layer range {lo}-{hi}")
    return (lo, hi)


def _parse_name(text: str, item: str, per_layer: bool, known: frozenset[str]) -> str:
    if not text:
        raise InvalidInputError(f"quant spec item `{item}`: missing tensor name")
    name = text.lower()
    if name.endswith(".weight"):
        # Accept full GGUF names too (`blk.0.attn_q.weight`): the suffix adds nothing.
        name = name[: -len(".weight")]
    if name in GROUPS:
        covered = {s for s in known if GROUPS[name](s)}
    else:
        covered = {s for s in known if fnmatch.fnmatchcase(s, name)}
    if not covered:
        raise InvalidInputError(
            f"quant spec item `{item}`: `{text}` names no weight matrix (short names: "
            f"{', '.join(sorted(known))}; groups: {', '.join(sorted(GROUPS))}; 1-D tensors "
            "such as norms and biases are always F32)"
        )
    if per_layer and covered <= GLOBAL_NAMES:
        raise InvalidInputError(
            f"quant spec item `{item}`: `{text}` is not a per-layer tensor; drop the blk. prefix"
        )
    return name


def parse_quant_spec(text: str, known_names: Iterable[str] | None = None) -> QuantSpec:
    """Parses a quant spec (grammar in the module docstring); InvalidInputError if malformed.

    ``known_names`` are the matrix short names a pattern may name (default
    :data:`KNOWN_NAMES`); a pattern that names none of them is an error, so typos are caught.
    """
    if not isinstance(text, str):
        raise InvalidInputError(f"quant spec must be a string, not {type(text).__name__}")
    known = KNOWN_NAMES if known_names is None else frozenset(known_names)
    items = [s.strip() for s in text.split(",")]
    if not text.strip():
        raise InvalidInputError("quant spec is empty (give a type such as q8_0)")
    default: int | None = None
    default_text = ""
    rules: list[Rule] = []
    for item in items:
        if not item:
            raise InvalidInputError(f"quant spec `{text}` has an empty item")
        pattern, eq, type_text = (s.strip() for s in item.partition("="))
        if not eq:
            if default is not None:
                raise InvalidInputError(
                    f"quant spec `{text}` has two default types (`{default_text}` and `{item}`);"
                    " give rules as PATTERN=TYPE"
                )
            default, default_text = _parse_type(item, item), item
            continue
        qtype = _parse_type(type_text, item)
        layers = None
        per_layer = False
        if pattern.lower().startswith("blk."):
            layer_text, dot, name_text = pattern[4:].partition(".")
            if not dot:
                raise InvalidInputError(
                    f"quant spec item `{item}`: expected blk.LAYERS.NAME, e.g. blk.0-3.ffn_down"
                )
            layers = _parse_layers(layer_text.strip(), item)
            per_layer = True
        else:
            name_text = pattern
        name = _parse_name(name_text.strip(), item, per_layer, known)
        rules.append(Rule(name, layers, qtype, item))
    if default is None:
        default = quant.type_info("F16").id
    return QuantSpec(default, tuple(rules), text)


def fallback_type(qtype: int, k: int) -> int:
    """The type a matrix with rows of ``k`` elements gets when ``qtype`` is asked for.

    ``qtype`` itself where ``k`` is whole blocks; else llama-quantize's fallback (module
    docstring), or F16 if that does not fit either. InvalidInputError for a type with blocks
    over 32 that llama-quantize has no fallback for.
    """
    info = quant.type_info(qtype)
    if k % info.block_size == 0:
        return info.id
    target = _FALLBACK.get(info.name)
    if target is None:
        if info.block_size > 32:
            raise InvalidInputError(
                f"rows of {k} elements are not whole {info.name} blocks of {info.block_size}, "
                f"and llama-quantize defines no fallback for {info.name}"
            )
        target = info.name
    fb = quant.type_info(target)
    if k % fb.block_size:
        return quant.type_info("F16").id
    return fb.id
