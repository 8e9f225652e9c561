"""Per-architecture tensor layouts and metadata of the synthetic test models.

Each architecture is one :class:`ArchSpec` (all of them: ``registry.ARCHS``). The layouts
follow llama.cpp's loaders (``src/models/<arch>.cpp``, ``load_arch_tensors`` and
``load_arch_hparams``) and the metadata its converter writes (``convert_hf_to_gguf.py`` /
``conversion/``). Shapes here are numpy order: a matrix is ``(rows, K)`` where llama.cpp
writes ``{K, rows}`` (``ne[0] = K``); a stack of experts is ``(n_expert, rows, K)``.

The MoE families are :class:`~freetoken.testmodel.archs_moe.MoeArch` subclasses in
``archs_moe.py`` (llama among them: with experts it is Mixtral); their options are the optional
:class:`ModelConfig` fields (:data:`OPTIONAL_FIELDS`), each accepted only by the architectures
that list it in ``ArchSpec.options``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

from gguf import GGUFValueType

from freetoken.errors import InvalidInputError

__all__ = [
    "ArchSpec",
    "Gemma3",
    "MetaItem",
    "ModelConfig",
    "Qwen2",
    "Qwen3",
    "RoutingSpec",
    "TensorDef",
]


@dataclass(frozen=True)
class ModelConfig:
    """The shape and hyperparameters of a synthetic model."""

    arch: str
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab_size: int
    ctx: int = 4096
    rope_theta: float | None = None
    """RoPE base; None: the architecture's default."""
    rms_eps: float | None = None
    """RMSNorm epsilon; None: the architecture's default."""
    tied: bool = False
    """No ``output.weight``: the output projection is ``token_embd`` (llama.cpp duplicates it)."""
    sliding_window: int | None = None
    """Gemma 3: the local layers' attention window; None: the default (512), 0: none."""
    swa_pattern: int | tuple[bool, ...] | None = None
    """Gemma 3: every N-th layer global (an int), or per layer True for sliding-window layers;
    None writes no key and llama.cpp's default (6) applies."""
    rope_theta_swa: float | None = None
    """Gemma 3: RoPE base of the sliding-window layers; None writes no key (llama.cpp: 10000)."""
    # ---- MoE (see archs_moe.py; 0 / None: the architecture's default) ------------------
    experts: int = 0
    """Routed experts per MoE layer (0: a dense model, or the MoE architecture's default)."""
    top_k: int = 0
    """Experts used per token (0: the architecture's default)."""
    expert_ffn: int = 0
    """One expert's FFN width (0: ``ffn``)."""
    shared_experts: int | None = None
    """Shared experts (their FFN is ``shared_experts * expert_ffn`` wide); None: the default."""
    leading_dense: int = 0
    """Leading layers with a dense FFN instead of experts (glm4moe, deepseek2)."""
    expert_layout: str = "stacked"
    """llama (Mixtral): ``stacked`` ``ffn_*_exps`` or the older ``per-expert`` ``ffn_*.E``."""
    expert_gating: str | None = None
    """deepseek2: ``softmax`` or ``sigmoid``; None: the architecture's default."""
    expert_weights_norm: bool | None = None
    """glm4moe, deepseek2: renormalize the top-k weights; None: the default."""
    expert_weights_scale: float | None = None
    """glm4moe, deepseek2: routed scaling factor; None: the default."""
    expert_groups: int = 0
    """glm4moe, deepseek2: expert groups of grouped top-k (0: no key, one group)."""
    expert_groups_used: int = 0
    """glm4moe, deepseek2: groups kept per token."""
    # ---- attention variants ------------------------------------------------------------
    rope_dim: int | None = None
    """Rotated dims per head (glm4moe's partial RoPE, deepseek2's qk_rope_head_dim)."""
    qk_norm: bool | None = None
    """glm4moe: per-head q/k RMSNorm (GLM-4.5 has it, GLM-4.5-Air not); None: off."""
    q_lora_rank: int | None = None
    """deepseek2: rank of the q compression (0: a plain ``attn_q``); None: hidden / 2."""
    kv_lora_rank: int | None = None
    """deepseek2: rank of the kv compression; None: hidden / 4."""
    v_head_dim: int | None = None
    """deepseek2: value head size; None: head_dim - rope_dim."""
    # ---- Gated DeltaNet linear attention (qwen35, qwen35moe, qwen3next; archs_hybrid.py) ----
    linear_k_heads: int | None = None
    """Key (and query) heads of the linear-attention layers; None: hidden / linear_head_dim."""
    linear_v_heads: int | None = None
    """Value heads of the linear-attention layers; None: twice the key heads."""
    linear_head_dim: int | None = None
    """The linear attention's key and value head size; None: min(128, hidden / 2)."""
    conv_kernel: int | None = None
    """Width of the causal depthwise conv1d; None: 4."""
    full_attention_interval: int | None = None
    """Every N-th layer is full attention, the others linear; None: 4."""
    # ---- Gemma 4 (archs_gemma4.py) ------------------------------------------------------
    head_dim_full: int | None = None
    """The full-attention layers' head size; None: ``head_dim``."""
    kv_heads_full: int | None = None
    """The full-attention layers' key/value heads; None: ``kv_heads``."""
    per_layer_width: int = 0
    """The E-series' per-layer input width (0: none)."""
    shared_kv_layers: int = 0
    """Trailing layers that reuse an earlier layer's keys and values (the E-series)."""
    # ---- multi-token prediction (qwen35, qwen35moe, qwen3next, glm4moe) ------------------
    nextn_layers: int = 0
    """``nextn`` (MTP) layers after the ``layers`` of the trunk: a full-attention layer with
    the family's FFN plus ``nextn.eh_proj``, ``enorm``, ``hnorm`` and ``shared_head_norm``."""


#: ModelConfig fields only some architectures accept (``ArchSpec.options``), with the value
#: that leaves them unset.
OPTIONAL_FIELDS: dict[str, Any] = {
    f.name: f.default
    for f in fields(ModelConfig)
    if f.name
    in (
        "experts",
        "top_k",
        "expert_ffn",
        "shared_experts",
        "leading_dense",
        "expert_layout",
        "expert_gating",
        "expert_weights_norm",
        "expert_weights_scale",
        "expert_groups",
        "expert_groups_used",
        "rope_dim",
        "qk_norm",
        "q_lora_rank",
        "kv_lora_rank",
        "v_head_dim",
        "linear_k_heads",
        "linear_v_heads",
        "linear_head_dim",
        "conv_kernel",
        "full_attention_interval",
        "head_dim_full",
        "kv_heads_full",
        "per_layer_width",
        "shared_kv_layers",
        "nextn_layers",
    )
}


@dataclass(frozen=True)
class TensorDef:
    """One tensor of the layout."""

    name: str
    """The GGUF name, e.g. ``blk.0.attn_q.weight``."""
    short: str
    """The name the quant spec uses, e.g. ``attn_q`` (``attn_q.bias`` for a bias)."""
    layer: int | None
    shape: tuple[int, ...]
    """numpy order; the last axis is the row (ggml's ``ne[0]``)."""
    role: str
    """How the generator initialises it (see ``writer.WeightGen``)."""
    quantizable: bool
    """Whether the quant spec applies; otherwise it is F32 (norms, biases, routers)."""
    source: tuple[str, int] | None = None
    """(stacked tensor, expert): the values are that expert's slice of the stacked tensor (the
    per-expert Mixtral layout), so both layouts of one seed hold the same weights."""

    @property
    def k(self) -> int:
        """Row length."""
        return self.shape[-1]


@dataclass(frozen=True)
class RoutingSpec:
    """The routing llama.cpp applies to an architecture's router logits (``build_moe_ffn``):
    the weight generator sizes the experts' outputs by it."""

    func: str
    """``softmax``, ``sigmoid`` or ``softmax_weight`` (softmax over the chosen logits)."""
    top_k: int
    normalize: bool
    scale: float = 1.0
    groups: int = 1
    groups_used: int = 1
    selection_bias: bool = False
    """An ``exp_probs_b`` bias added to the scores for selection only."""


@dataclass(frozen=True)
class MetaItem:
    """One metadata key."""

    key: str
    value: Any
    vtype: GGUFValueType
    sub_type: GGUFValueType | None = None


def _blk(i: int, short: str, suffix: str = "weight") -> str:
    return f"blk.{i}.{short}.{suffix}"


class ArchSpec:
    """A dense decoder family; subclass attributes select the family's pieces."""

    name: str = ""
    default_rope_theta: float = 10000.0
    default_rms_eps: float = 1e-5
    #: Gated FFN activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU).
    ffn_act: str = "silu"
    #: q/k/v biases (qwen2).
    qkv_bias: bool = False
    #: Per-head RMSNorm of q and k (qwen3, gemma3).
    qk_norm: bool = False
    #: RMSNorm of each block's output before the residual add (gemma3's post_attention_norm and
    #: post_ffw_norm). With it the norm weights set the blocks' output size; without it the
    #: attn_output and ffn_down weights do.
    sandwich_norm: bool = False
    #: Token embeddings multiplied by sqrt(hidden) on input (gemma).
    embed_scale: bool = False
    #: The attention width heads * head_dim must equal hidden (llama.cpp's qwen2 loader).
    q_width_is_hidden: bool = False
    #: Write ``{arch}.rope.dimension_count`` and ``{arch}.vocab_size`` (llama's converter does).
    write_rope_dims: bool = False
    write_vocab_size: bool = False
    #: Always write key_length / value_length (gemma3's converter does).
    always_key_length: bool = False
    #: Sliding-window attention keys (gemma3), and the default window and pattern (llama.cpp's
    #: default for the architecture: every N-th layer global).
    has_swa: bool = False
    default_sliding_window: int = 0
    default_swa_pattern: int = 6
    #: An architecture with routed experts (archs_moe.MoeArch; llama only with experts > 0).
    moe: bool = False
    #: The optional ModelConfig fields (:data:`OPTIONAL_FIELDS`) the architecture accepts.
    options: frozenset[str] = frozenset()
    #: Attention scores are not divided by sqrt(head_dim) (gemma4): the q norm weights
    #: carry that factor instead.
    attn_unscaled: bool = False

    def defaults(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with the architecture's defaults filled in."""
        from dataclasses import replace

        return replace(
            cfg,
            rope_theta=self.default_rope_theta if cfg.rope_theta is None else cfg.rope_theta,
            rms_eps=self.default_rms_eps if cfg.rms_eps is None else cfg.rms_eps,
            sliding_window=(
                self.default_sliding_window if cfg.sliding_window is None else cfg.sliding_window
            ),
        )

    def validate(self, cfg: ModelConfig) -> None:
        """InvalidInputError for a shape llama.cpp cannot load for this architecture."""
        for field in ("layers", "hidden", "ffn", "heads", "kv_heads", "head_dim", "vocab_size"):
            value = getattr(cfg, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInputError(f"{field} must be a positive integer, got {value!r}")
        if cfg.ctx < 1:
            raise InvalidInputError(f"ctx must be positive, got {cfg.ctx}")
        if cfg.layers > 512:
            raise InvalidInputError(f"llama.cpp allows at most 512 layers, got {cfg.layers}")
        if cfg.heads % cfg.kv_heads:
            raise InvalidInputError(
                f"heads ({cfg.heads}) must be a multiple of kv_heads ({cfg.kv_heads})"
            )
        if cfg.head_dim % 2:
            raise InvalidInputError(f"head_dim must be even for RoPE, got {cfg.head_dim}")
        if self.q_width_is_hidden and cfg.heads * cfg.head_dim != cfg.hidden:
            raise InvalidInputError(
                f"{self.name}: heads * head_dim ({cfg.heads} * {cfg.head_dim}) must equal "
                f"hidden ({cfg.hidden}), as llama.cpp's {self.name} loader requires"
            )
        if not self.has_swa and (cfg.sliding_window or cfg.swa_pattern is not None):
            raise InvalidInputError(f"{self.name} has no sliding-window attention")
        if cfg.sliding_window is not None and cfg.sliding_window < 0:
            raise InvalidInputError(f"sliding_window must be >= 0, got {cfg.sliding_window}")
        if self.has_swa and not cfg.sliding_window and cfg.swa_pattern is not None:
            raise InvalidInputError("a sliding-window pattern needs a sliding window (> 0)")
        if isinstance(cfg.swa_pattern, tuple) and len(cfg.swa_pattern) != cfg.layers:
            raise InvalidInputError(
                f"the sliding-window pattern has {len(cfg.swa_pattern)} entries for "
                f"{cfg.layers} layers"
            )
        if isinstance(cfg.swa_pattern, int) and cfg.swa_pattern < 0:
            raise InvalidInputError(
                f"the sliding-window pattern must be >= 0, not {cfg.swa_pattern}"
            )
        for name, unset in OPTIONAL_FIELDS.items():
            if name not in self.options and getattr(cfg, name) != unset:
                raise InvalidInputError(
                    f"{self.name} has no option {name.replace('_', '-')} "
                    f"(given {getattr(cfg, name)!r})"
                )

    # ---- tensors ------------------------------------------------------------------------

    def tensors(self, cfg: ModelConfig) -> list[TensorDef]:
        """Every tensor of the model, in file order."""
        h, v = cfg.hidden, cfg.vocab_size
        out = [TensorDef("token_embd.weight", "token_embd", None, (v, h), "embd", True)]
        for i in range(cfg.layers):
            out += self.attn_tensors(cfg, i)
            out += self.ffn_tensors(cfg, i)
        for i in range(cfg.layers, cfg.layers + cfg.nextn_layers):
            out += self.nextn_tensors(cfg, i)
        out.append(TensorDef("output_norm.weight", "output_norm", None, (h,), "norm", False))
        if not cfg.tied:
            out.append(TensorDef("output.weight", "output", None, (v, h), "output", True))
        return out

    def nextn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Multi-token-prediction layer ``i`` (past the trunk, as llama.cpp's loaders read
        it): a full-attention decoder layer and the ``nextn.*`` projection and norms."""
        h = cfg.hidden

        def nextn(short: str, shape: tuple[int, ...], role: str, quant: bool) -> TensorDef:
            return TensorDef(_blk(i, f"nextn.{short}"), f"nextn.{short}", i, shape, role, quant)

        return [
            *self.attn_tensors(cfg, i),
            *self.ffn_tensors(cfg, i),
            nextn("eh_proj", (h, 2 * h), "proj_in", True),
            nextn("enorm", (h,), "norm", False),
            nextn("hnorm", (h,), "norm", False),
            nextn("shared_head_norm", (h,), "norm", False),
        ]

    def attn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Layer ``i``'s attention tensors (with its input norm and, if any, post norm)."""
        h, d = cfg.hidden, cfg.head_dim
        nq, nkv = cfg.heads * d, cfg.kv_heads * d
        t = [
            TensorDef(_blk(i, "attn_norm"), "attn_norm", i, (h,), "norm", False),
            TensorDef(_blk(i, "attn_q"), "attn_q", i, (nq, h), "proj_in", True),
            TensorDef(_blk(i, "attn_k"), "attn_k", i, (nkv, h), "proj_in", True),
            TensorDef(_blk(i, "attn_v"), "attn_v", i, (nkv, h), "proj_in", True),
        ]
        if self.qkv_bias:
            t += [
                TensorDef(_blk(i, "attn_q", "bias"), "attn_q.bias", i, (nq,), "bias", False),
                TensorDef(_blk(i, "attn_k", "bias"), "attn_k.bias", i, (nkv,), "bias", False),
                TensorDef(_blk(i, "attn_v", "bias"), "attn_v.bias", i, (nkv,), "bias", False),
            ]
        if self.uses_qk_norm(cfg):
            t += [
                TensorDef(_blk(i, "attn_q_norm"), "attn_q_norm", i, (d,), "norm", False),
                TensorDef(_blk(i, "attn_k_norm"), "attn_k_norm", i, (d,), "norm", False),
            ]
        t.append(TensorDef(_blk(i, "attn_output"), "attn_output", i, (h, nq), "attn_out", True))
        if self.sandwich_norm:
            t.append(
                TensorDef(
                    _blk(i, "post_attention_norm"), "post_attention_norm", i, (h,),
                    "post_norm", False,
                )
            )  # fmt: skip
        return t

    def ffn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Layer ``i``'s feed-forward tensors (with its input norm and, if any, post norm)."""
        h, f = cfg.hidden, cfg.ffn
        t = [
            TensorDef(_blk(i, "ffn_norm"), "ffn_norm", i, (h,), "norm", False),
            TensorDef(_blk(i, "ffn_gate"), "ffn_gate", i, (f, h), "proj_in", True),
            TensorDef(_blk(i, "ffn_up"), "ffn_up", i, (f, h), "proj_in", True),
            TensorDef(_blk(i, "ffn_down"), "ffn_down", i, (h, f), "ffn_out", True),
        ]
        if self.sandwich_norm:
            t.append(
                TensorDef(_blk(i, "post_ffw_norm"), "post_ffw_norm", i, (h,), "post_norm", False)
            )
        return t

    # ---- metadata -----------------------------------------------------------------------

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """The architecture's metadata keys (``general.*`` and ``tokenizer.*`` are added by
        the writer)."""
        a = self.name
        u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
        m = [
            MetaItem(f"{a}.context_length", cfg.ctx, u32),
            MetaItem(f"{a}.embedding_length", cfg.hidden, u32),
            MetaItem(f"{a}.block_count", cfg.layers + cfg.nextn_layers, u32),
            MetaItem(f"{a}.feed_forward_length", cfg.ffn, u32),
            MetaItem(f"{a}.attention.head_count", cfg.heads, u32),
            MetaItem(f"{a}.attention.head_count_kv", cfg.kv_heads, u32),
            MetaItem(f"{a}.rope.freq_base", float(cfg.rope_theta), f32),  # type: ignore[arg-type]
            MetaItem(f"{a}.attention.layer_norm_rms_epsilon", float(cfg.rms_eps), f32),  # type: ignore[arg-type]
        ]
        # llama.cpp derives the head size as hidden / heads unless these keys say otherwise.
        if self.always_key_length or cfg.head_dim * cfg.heads != cfg.hidden:
            m += [
                MetaItem(f"{a}.attention.key_length", cfg.head_dim, u32),
                MetaItem(f"{a}.attention.value_length", cfg.head_dim, u32),
            ]
        if cfg.nextn_layers:
            m.append(MetaItem(f"{a}.nextn_predict_layers", cfg.nextn_layers, u32))
        if self.write_rope_dims:
            m.append(MetaItem(f"{a}.rope.dimension_count", cfg.head_dim, u32))
        if self.write_vocab_size:
            m.append(MetaItem(f"{a}.vocab_size", cfg.vocab_size, u32))
        if self.has_swa and cfg.sliding_window:
            m.append(MetaItem(f"{a}.attention.sliding_window", cfg.sliding_window, u32))
            if isinstance(cfg.swa_pattern, tuple):
                m.append(
                    MetaItem(
                        f"{a}.attention.sliding_window_pattern",
                        [bool(x) for x in cfg.swa_pattern],
                        GGUFValueType.ARRAY,
                        GGUFValueType.BOOL,
                    )
                )
            elif cfg.swa_pattern is not None:
                m.append(MetaItem(f"{a}.attention.sliding_window_pattern", cfg.swa_pattern, u32))
            if cfg.rope_theta_swa is not None:
                m.append(MetaItem(f"{a}.rope.freq_base_swa", float(cfg.rope_theta_swa), f32))
        return m

    def is_swa_layer(self, cfg: ModelConfig, i: int) -> bool:
        """Whether layer ``i`` uses the sliding window, as llama.cpp reads the metadata."""
        if not (self.has_swa and cfg.sliding_window):
            return False
        if isinstance(cfg.swa_pattern, tuple):
            return bool(cfg.swa_pattern[i])
        n = self.default_swa_pattern if cfg.swa_pattern is None else cfg.swa_pattern
        return n == 0 or i % n < n - 1

    def is_moe(self, cfg: ModelConfig) -> bool:
        """Whether ``cfg`` has routed experts."""
        return False

    def uses_qk_norm(self, cfg: ModelConfig) -> bool:
        """Whether q and k are RMS-normed (then q is sharpened through its norm weight)."""
        return self.qk_norm

    def routing(self, cfg: ModelConfig) -> RoutingSpec | None:
        """How the router's weights combine the experts (None: a dense model)."""
        return None


class Llama(ArchSpec):
    """Llama (and Mistral): SwiGLU, RMSNorm, RoPE (normal), optional GQA."""

    name = "llama"
    default_rope_theta = 10000.0
    default_rms_eps = 1e-5
    write_rope_dims = True
    write_vocab_size = True


class Qwen2(ArchSpec):
    """Qwen2: llama with q/k/v biases."""

    name = "qwen2"
    default_rope_theta = 1000000.0
    default_rms_eps = 1e-6
    qkv_bias = True
    q_width_is_hidden = True


class Qwen3(ArchSpec):
    """Qwen3: llama with per-head q/k RMSNorm, no biases."""

    name = "qwen3"
    default_rope_theta = 1000000.0
    default_rms_eps = 1e-6
    qk_norm = True


class GemmaLayout:
    """What Gemma 3 and 4 share: GeGLU (tanh), q/k norms, sandwich norms, embedding scale,
    interleaved sliding-window and global layers (a window of 512: Gemma 3 270M and 1B)."""

    default_rope_theta = 1000000.0
    default_rms_eps = 1e-6
    ffn_act = "gelu_tanh"
    qk_norm = True
    sandwich_norm = True
    embed_scale = True
    always_key_length = True
    has_swa = True
    default_sliding_window = 512


class Gemma3(GemmaLayout, ArchSpec):
    """Gemma 3 (:class:`GemmaLayout`). Norm weights are stored as the effective multiplier,
    as the converter writes them (Gemma's ``1 + w``)."""

    name = "gemma3"

    def validate(self, cfg: ModelConfig) -> None:
        """As :meth:`ArchSpec.validate`, plus llama.cpp's layer counts with special meaning."""
        super().validate(cfg)
        # llama.cpp takes 62 layers for Gemma 3 27B and then scales attention by
        # 1/sqrt(hidden/heads) instead of 1/sqrt(head_dim): refuse the ambiguity.
        if cfg.layers == 62 and cfg.hidden // cfg.heads != cfg.head_dim:
            raise InvalidInputError(
                "gemma3 with 62 layers is read by llama.cpp as the 27B model (another "
                "attention scale); use another layer count"
            )


def gated_act_rms(act: str) -> float:
    """RMS of ``act(g) * u`` for independent standard normal g and u (Gauss-Hermite).

    ``swiglu_oai`` is gpt-oss's ``min(g, 7) * sigmoid(1.702 * min(g, 7)) * (clamp(u, -7, 7) + 1)``.
    """
    import numpy as np

    x, w = np.polynomial.hermite_e.hermegauss(96)
    w = w / w.sum()
    up_ms = 1.0  # E[u^2]
    if act == "silu":
        y = x / (1.0 + np.exp(-x))
    elif act == "gelu_tanh":
        y = 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))
    elif act == "swiglu_oai":
        g = np.minimum(x, 7.0)
        y = g / (1.0 + np.exp(-1.702 * g))
        up_ms = float((w * (np.clip(x, -7.0, 7.0) + 1.0) ** 2).sum())
    else:
        raise ValueError(act)
    return float(math.sqrt(float((w * y * y).sum()) * up_ms))


def swa_pattern_from_text(text: str, layers: int | None = None) -> int | tuple[bool, ...]:
    """Parses ``--swa-pattern``: ``N`` (every N-th layer global) or 0/1 per layer (1: sliding
    window), e.g. ``1,1,0``."""
    text = text.strip()
    if text.isdigit():
        return int(text)
    items: Sequence[str] = [s.strip() for s in text.split(",")]
    if not items or any(s not in ("0", "1") for s in items):
        raise InvalidInputError(
            f"bad sliding-window pattern `{text}`: give N, or 0/1 per layer such as 1,1,0"
        )
    if layers is not None and len(items) != layers:
        raise InvalidInputError(
            f"the sliding-window pattern has {len(items)} entries for {layers} layers"
        )
    return tuple(s == "1" for s in items)
