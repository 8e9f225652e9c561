"""The mixture-of-experts architectures of the synthetic test models.

Each is an :class:`~freetoken.testmodel.archs.ArchSpec` subclass whose layout and metadata
follow llama.cpp's loader (``src/models/<arch>.cpp``: ``load_arch_hparams``,
``load_arch_tensors``) and graph (``build_moe_ffn`` in ``src/llama-graph.cpp``), and the keys
its converter writes (``conversion/<family>.py``). Shapes are numpy order: a stack of experts
is ``(n_expert, rows, K)`` where llama.cpp writes ``{K, rows, n_expert}``.

- ``qwen3moe``: Qwen3 attention, softmax top-k renormalized.
- ``qwen2moe``: Qwen2 attention (q/k/v biases), softmax top-k not renormalized, a shared
  expert scaled by ``sigmoid(x . ffn_gate_inp_shexp)``.
- ``llama`` with experts (Mixtral): softmax top-k renormalized; the expert width is
  ``feed_forward_length``; stacked ``ffn_*_exps`` or the older per-expert ``ffn_*.E`` layout
  (which this llama.cpp no longer loads).
- ``olmoe``: RMSNorm over the whole q and k projections, softmax top-k not renormalized.
- ``gpt-oss``: attention sinks, q/k/v and output biases, alternating sliding-window layers,
  router bias, top-k on the logits then softmax, expert biases, the clamped SwiGLU
  (``swiglu_oai``); ``post_attention_norm`` is the FFN's input norm.
- ``glm4moe``: q/k/v biases, partial NEOX RoPE, optional q/k norms, ``post_attention_norm`` as
  the FFN's input norm, leading dense layers, sigmoid routing with the ``exp_probs_b``
  selection bias, optional groups, renormalization and scaling, shared experts.
- ``deepseek2``: MLA attention (``attn_q_a``/``attn_q_b`` or ``attn_q``, ``attn_kv_a_mqa``,
  ``attn_k_b``, ``attn_v_b``), leading dense layers, shared experts, softmax or sigmoid (with
  ``exp_probs_b``) routing, groups, renormalization and scaling.
"""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFValueType

from freetoken.errors import InvalidInputError
from freetoken.testmodel.archs import (
    ArchSpec,
    Llama,
    MetaItem,
    ModelConfig,
    RoutingSpec,
    TensorDef,
    _blk,
)

__all__ = [
    "MOE_ARCHS",
    "DeepSeek2",
    "Glm4Moe",
    "GptOss",
    "LlamaMoe",
    "MoeArch",
    "Olmoe",
    "Qwen2Moe",
    "Qwen3Moe",
]

_U32, _F32, _BOOL = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.BOOL

#: llama.cpp's ``llama_expert_gating_func_type`` values.
GATING_FUNC_IDS = {"softmax": 1, "sigmoid": 2, "softmax_weight": 3}
#: llama.cpp's LLAMA_MAX_EXPERTS.
MAX_EXPERTS = 1024

_MOE_OPTIONS: frozenset[str] = frozenset({"experts", "top_k", "expert_ffn", "shared_experts"})


def _set(items: list[MetaItem], key: str, value: object, vtype: GGUFValueType) -> None:
    """Replaces ``key``'s value in ``items`` (or appends it)."""
    for n, item in enumerate(items):
        if item.key == key:
            items[n] = MetaItem(key, value, vtype)
            return
    items.append(MetaItem(key, value, vtype))


class MoeArch(ArchSpec):
    """An architecture whose FFNs are routed experts; the class attributes say what llama.cpp's
    graph does for it."""

    moe = True
    options = _MOE_OPTIONS
    default_experts = 8
    default_top_k = 2
    #: The gating llama.cpp's graph uses (deepseek2: from the metadata).
    gating = "softmax"
    #: Whether the graph renormalizes the top-k weights (glm4moe, deepseek2: from metadata).
    normalize = True
    default_shared = 0
    min_shared = 0
    max_shared: int | None = 0
    #: qwen2moe's shared expert is scaled by sigmoid(x . ffn_gate_inp_shexp).
    shared_gate = False
    #: gpt-oss: router bias and per-expert gate/up/down biases.
    router_bias = False
    expert_biases = False
    #: The FFN's input norm (glm4moe and gpt-oss use post_attention_norm).
    ffn_norm_name = "ffn_norm"
    #: llama and olmoe size the experts by feed_forward_length, not expert_feed_forward_length.
    expert_ffn_in_ffn_key = False
    #: qwen2moe writes the shared FFN width; glm4moe and deepseek2 the shared expert count.
    shared_ffn_key = False
    shared_count_key = False
    #: The output projection may be left out (tied to token_embd).
    allow_tied = True

    def is_moe(self, cfg: ModelConfig) -> bool:
        """Whether ``cfg`` has routed experts."""
        return cfg.experts > 0

    def defaults(self, cfg: ModelConfig) -> ModelConfig:
        """As :meth:`ArchSpec.defaults`, plus the expert counts and widths."""
        cfg = super().defaults(cfg)
        experts = cfg.experts or self.default_experts
        if experts == 0:
            return cfg
        shared = self.default_shared if cfg.shared_experts is None else cfg.shared_experts
        cfg = replace(
            cfg,
            experts=experts,
            top_k=cfg.top_k or min(self.default_top_k, experts),
            expert_ffn=cfg.expert_ffn or cfg.ffn,
            shared_experts=shared,
        )
        if "expert_weights_norm" in self.options and cfg.expert_weights_norm is None:
            cfg = replace(cfg, expert_weights_norm=True)
        if "expert_weights_scale" in self.options and cfg.expert_weights_scale is None:
            cfg = replace(cfg, expert_weights_scale=1.0)
        return cfg

    def validate(self, cfg: ModelConfig) -> None:
        """As :meth:`ArchSpec.validate`, plus the expert options llama.cpp accepts."""
        super().validate(cfg)
        if cfg.tied and not self.allow_tied:
            raise InvalidInputError(f"llama.cpp's {self.name} loader requires output.weight")
        if not self.is_moe(cfg):
            for name in ("top_k", "expert_ffn", "leading_dense", "expert_groups"):
                if getattr(cfg, name):
                    raise InvalidInputError(f"{name.replace('_', '-')} needs experts")
            if cfg.shared_experts or cfg.expert_layout != "stacked":
                raise InvalidInputError("shared experts and expert layouts need experts")
            return
        for name in ("experts", "top_k", "expert_ffn", "leading_dense", "expert_groups",
                     "expert_groups_used", "shared_experts"):  # fmt: skip
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidInputError(
                    f"{name.replace('_', '-')} must be an integer, not {value!r}"
                )
        e = cfg.experts
        if not 1 <= e <= MAX_EXPERTS:
            raise InvalidInputError(f"experts must be in 1..{MAX_EXPERTS}, got {e}")
        if not 1 <= cfg.top_k <= e:
            raise InvalidInputError(f"top-k must be in 1..{e} (the experts), got {cfg.top_k}")
        if cfg.expert_ffn < 1:
            raise InvalidInputError(f"expert-ffn must be positive, got {cfg.expert_ffn}")
        s = cfg.shared_experts or 0
        if s < self.min_shared or (self.max_shared is not None and s > self.max_shared):
            most = "+" if self.max_shared is None else f"..{self.max_shared}"
            raise InvalidInputError(
                f"{self.name} takes {self.min_shared}{most} shared experts, got {s}"
                + (" (llama.cpp requires them)" if self.min_shared else "")
            )
        if not 0 <= cfg.leading_dense < cfg.layers:
            raise InvalidInputError(
                f"leading-dense must be in 0..{cfg.layers - 1} (at least one MoE layer), "
                f"got {cfg.leading_dense}"
            )
        if cfg.expert_layout not in ("stacked", "per-expert"):
            raise InvalidInputError(
                f"expert layout must be stacked or per-expert, got {cfg.expert_layout!r}"
            )
        g, used = cfg.expert_groups, cfg.expert_groups_used
        if g > 1:
            if e % g or e // g < 2:
                raise InvalidInputError(f"{e} experts do not split into {g} groups of at least two")
            # llama.cpp asserts 0 < used < groups.
            if not 0 < used < g:
                raise InvalidInputError(f"expert-groups-used must be in 1..{g - 1}, got {used}")
            if cfg.top_k > used * (e // g):
                raise InvalidInputError(
                    f"top-k {cfg.top_k} exceeds the experts of {used} groups of {e // g}"
                )
        elif used not in (0, 1) or g < 0:
            raise InvalidInputError("expert-groups-used needs expert-groups > 1")
        if cfg.expert_weights_scale is not None and cfg.expert_weights_scale <= 0:
            raise InvalidInputError(
                f"expert-weights-scale must be positive, got {cfg.expert_weights_scale}"
            )

    # ---- routing ------------------------------------------------------------------------

    def gating_func(self, cfg: ModelConfig) -> str:
        """The gating function of ``cfg``'s router."""
        return self.gating

    def has_probs_bias(self, cfg: ModelConfig) -> bool:
        """Whether MoE layers carry an ``exp_probs_b`` selection bias."""
        return False

    def routing(self, cfg: ModelConfig) -> RoutingSpec | None:
        """How llama.cpp turns this model's router logits into expert weights."""
        if not self.is_moe(cfg):
            return None
        if "expert_weights_norm" in self.options:
            normalize, scale = bool(cfg.expert_weights_norm), float(cfg.expert_weights_scale or 1)
        else:
            normalize, scale = self.normalize, 1.0
        return RoutingSpec(
            func=self.gating_func(cfg),
            top_k=cfg.top_k,
            normalize=normalize,
            scale=scale,
            groups=max(cfg.expert_groups, 1),
            groups_used=max(cfg.expert_groups_used, 1),
            selection_bias=self.has_probs_bias(cfg),
        )

    # ---- tensors ------------------------------------------------------------------------

    def ffn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Layer ``i``'s input norm and dense FFN (a leading dense layer) or its router,
        experts and shared experts."""
        if not self.is_moe(cfg):
            return super().ffn_tensors(cfg, i)
        h = cfg.hidden
        norm = self.ffn_norm_name
        t = [TensorDef(_blk(i, norm), norm, i, (h,), "norm", False)]
        if i < cfg.leading_dense:
            f = cfg.ffn
            return [
                *t,
                TensorDef(_blk(i, "ffn_gate"), "ffn_gate", i, (f, h), "proj_in", True),
                TensorDef(_blk(i, "ffn_up"), "ffn_up", i, (f, h), "proj_in", True),
                TensorDef(_blk(i, "ffn_down"), "ffn_down", i, (h, f), "ffn_out", True),
            ]
        e = cfg.experts
        t.append(TensorDef(_blk(i, "ffn_gate_inp"), "ffn_gate_inp", i, (e, h), "router", False))
        if self.router_bias:
            t.append(
                TensorDef(_blk(i, "ffn_gate_inp", "bias"), "ffn_gate_inp.bias", i, (e,), "bias",
                          False)
            )  # fmt: skip
        if self.has_probs_bias(cfg):
            t.append(TensorDef(f"blk.{i}.exp_probs_b.bias", "exp_probs_b", i, (e,), "probs_bias",
                               False))  # fmt: skip
        t += self.expert_tensors(cfg, i)
        s = (cfg.shared_experts or 0) * cfg.expert_ffn
        if s:
            t += [
                TensorDef(_blk(i, "ffn_gate_shexp"), "ffn_gate_shexp", i, (s, h), "proj_in", True),
                TensorDef(_blk(i, "ffn_up_shexp"), "ffn_up_shexp", i, (s, h), "proj_in", True),
                TensorDef(_blk(i, "ffn_down_shexp"), "ffn_down_shexp", i, (h, s), "shexp_out",
                          True),
            ]  # fmt: skip
            if self.shared_gate:
                t.append(TensorDef(_blk(i, "ffn_gate_inp_shexp"), "ffn_gate_inp_shexp", i, (h,),
                                   "shexp_gate", False))  # fmt: skip
        return t

    def expert_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Layer ``i``'s routed experts: stacked (``ffn_gate_exps``: ``(E, I, H)``) or one
        matrix per expert (``ffn_gate.E``: ``(I, H)``), and gpt-oss's biases."""
        e, n, h = cfg.experts, cfg.expert_ffn, cfg.hidden
        kinds = [
            ("ffn_gate_exps", (e, n, h), "proj_in"),
            ("ffn_up_exps", (e, n, h), "proj_in"),
            ("ffn_down_exps", (e, h, n), "exp_out"),
        ]
        if cfg.expert_layout == "per-expert":
            out = []
            for short, shape, role in kinds:
                stacked, base = _blk(i, short), short.removesuffix("_exps")
                out += [
                    TensorDef(f"blk.{i}.{base}.{x}.weight", short, i, shape[1:], role, True,
                              source=(stacked, x))
                    for x in range(e)
                ]  # fmt: skip
            return out
        out = [TensorDef(_blk(i, s), s, i, shape, role, True) for s, shape, role in kinds]
        if self.expert_biases:
            out += [
                TensorDef(_blk(i, "ffn_gate_exps", "bias"), "ffn_gate_exps.bias", i, (e, n),
                          "bias", False),
                TensorDef(_blk(i, "ffn_up_exps", "bias"), "ffn_up_exps.bias", i, (e, n), "bias",
                          False),
                TensorDef(_blk(i, "ffn_down_exps", "bias"), "ffn_down_exps.bias", i, (e, h),
                          "out_bias", False),
            ]  # fmt: skip
        return out

    # ---- metadata -----------------------------------------------------------------------

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """As :meth:`ArchSpec.metadata`, plus the expert keys."""
        m = super().metadata(cfg)
        if not self.is_moe(cfg):
            return m
        a = self.name
        m += [
            MetaItem(f"{a}.expert_count", cfg.experts, _U32),
            MetaItem(f"{a}.expert_used_count", cfg.top_k, _U32),
        ]
        if self.expert_ffn_in_ffn_key:
            _set(m, f"{a}.feed_forward_length", cfg.expert_ffn, _U32)
        else:
            m.append(MetaItem(f"{a}.expert_feed_forward_length", cfg.expert_ffn, _U32))
        shared = cfg.shared_experts or 0
        if self.shared_ffn_key:
            m.append(
                MetaItem(f"{a}.expert_shared_feed_forward_length", shared * cfg.expert_ffn, _U32)
            )
        if self.shared_count_key:
            m.append(MetaItem(f"{a}.expert_shared_count", shared, _U32))
        if "leading_dense" in self.options:
            m.append(MetaItem(f"{a}.leading_dense_block_count", cfg.leading_dense, _U32))
        if "expert_weights_norm" in self.options:
            m += [
                MetaItem(f"{a}.expert_weights_scale", float(cfg.expert_weights_scale or 1), _F32),
                MetaItem(f"{a}.expert_weights_norm", bool(cfg.expert_weights_norm), _BOOL),
                MetaItem(f"{a}.expert_gating_func", GATING_FUNC_IDS[self.gating_func(cfg)], _U32),
            ]
        if cfg.expert_groups:
            m += [
                MetaItem(f"{a}.expert_group_count", cfg.expert_groups, _U32),
                MetaItem(f"{a}.expert_group_used_count", max(cfg.expert_groups_used, 1), _U32),
            ]
        return m


class Qwen3Moe(MoeArch):
    """Qwen3-MoE: Qwen3's attention (per-head q/k norms), softmax top-k renormalized."""

    name = "qwen3moe"
    default_rope_theta = 1000000.0
    default_rms_eps = 1e-6
    qk_norm = True


class Qwen2Moe(MoeArch):
    """Qwen1.5/2-MoE: Qwen2's attention (q/k/v biases), softmax top-k without
    renormalization (llama.cpp's graph passes norm_w = false), and a shared expert of width
    ``expert_shared_feed_forward_length`` scaled by ``sigmoid(x . ffn_gate_inp_shexp)``."""

    name = "qwen2moe"
    default_rope_theta = 1000000.0
    default_rms_eps = 1e-6
    qkv_bias = True
    q_width_is_hidden = True
    normalize = False
    default_shared = 1
    min_shared = 1
    max_shared = None
    shared_gate = True
    shared_ffn_key = True
    allow_tied = False


class LlamaMoe(MoeArch, Llama):
    """Llama, and Mixtral when ``experts`` > 0: softmax top-k renormalized, the experts
    ``feed_forward_length`` wide, stacked or (the older layout) one tensor per expert."""

    options = _MOE_OPTIONS | {"expert_layout"}
    default_experts = 0
    expert_ffn_in_ffn_key = True


class Olmoe(MoeArch):
    """OLMoE: RMSNorm over the whole q and k projections (weights of ``hidden`` entries, not
    per head), softmax top-k not renormalized, the experts ``feed_forward_length`` wide."""

    name = "olmoe"
    default_rope_theta = 10000.0
    default_rms_eps = 1e-5
    qk_norm = True
    normalize = False
    expert_ffn_in_ffn_key = True
    allow_tied = False

    def validate(self, cfg: ModelConfig) -> None:
        """As :meth:`MoeArch.validate`; llama.cpp's loader wants q, k, v and the output all
        ``hidden`` wide (the k norm is ``hidden`` entries)."""
        super().validate(cfg)
        if cfg.kv_heads != cfg.heads or cfg.heads * cfg.head_dim != cfg.hidden:
            raise InvalidInputError(
                "olmoe needs kv_heads == heads and heads * head_dim == hidden (llama.cpp's "
                "loader sizes q, k, v, the q/k norms and the output by hidden)"
            )

    def attn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Qwen-style attention with ``hidden``-wide q and k norms."""
        h = cfg.hidden
        t = [
            TensorDef(_blk(i, "attn_norm"), "attn_norm", i, (h,), "norm", False),
            TensorDef(_blk(i, "attn_q"), "attn_q", i, (h, h), "proj_in", True),
            TensorDef(_blk(i, "attn_k"), "attn_k", i, (h, h), "proj_in", True),
            TensorDef(_blk(i, "attn_v"), "attn_v", i, (h, h), "proj_in", True),
            TensorDef(_blk(i, "attn_q_norm"), "attn_q_norm", i, (h,), "norm", False),
            TensorDef(_blk(i, "attn_k_norm"), "attn_k_norm", i, (h,), "norm", False),
            TensorDef(_blk(i, "attn_output"), "attn_output", i, (h, h), "attn_out", True),
        ]
        return t


class GptOss(MoeArch):
    """gpt-oss: q/k/v and output biases, per-head attention sinks, sliding-window layers
    alternating with global ones (llama.cpp's default pattern 2: even layers slide), a router
    with a bias, softmax over the top-k logits, expert biases, the clamped SwiGLU
    (alpha 1.702, limit 7), ``post_attention_norm`` before the experts. The experts are meant
    to be MXFP4 (``--quant ...,exps=mxfp4``) as in the released files."""

    name = "gpt-oss"
    default_rope_theta = 150000.0
    default_rms_eps = 1e-5
    qkv_bias = True
    always_key_length = True
    has_swa = True
    default_sliding_window = 128
    default_swa_pattern = 2
    ffn_act = "swiglu_oai"
    gating = "softmax_weight"
    normalize = False
    router_bias = True
    expert_biases = True
    ffn_norm_name = "post_attention_norm"
    allow_tied = False

    def validate(self, cfg: ModelConfig) -> None:
        """As :meth:`MoeArch.validate`; llama.cpp requires the sliding-window key."""
        super().validate(cfg)
        if not cfg.sliding_window:
            raise InvalidInputError("gpt-oss needs a sliding window (llama.cpp requires it)")

    def attn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """The base attention with q/k/v biases, an output bias and the sinks."""
        t = super().attn_tensors(cfg, i)
        h = cfg.hidden
        return [
            *t,
            TensorDef(_blk(i, "attn_output", "bias"), "attn_output.bias", i, (h,), "out_bias",
                      False),
            TensorDef(_blk(i, "attn_sinks"), "attn_sinks", i, (cfg.heads,), "sinks", False),
        ]  # fmt: skip


class Glm4Moe(MoeArch):
    """GLM-4.5: q/k/v biases, NEOX RoPE over ``rope_dim`` (default half) of each head,
    optional per-head q/k norms, ``post_attention_norm`` before the FFN, leading dense layers,
    sigmoid routing with the ``exp_probs_b`` selection bias, renormalization and a routed
    scaling factor from the metadata, shared experts (``expert_shared_count``)."""

    name = "glm4moe"
    default_rope_theta = 1000000.0
    default_rms_eps = 1e-5
    qkv_bias = True
    options = _MOE_OPTIONS | {
        "leading_dense",
        "expert_weights_norm",
        "expert_weights_scale",
        "expert_groups",
        "expert_groups_used",
        "rope_dim",
        "qk_norm",
        "nextn_layers",
    }
    gating = "sigmoid"
    default_shared = 1
    # llama.cpp's graph always adds the shared expert's build_ffn (without its tensors that
    # is silu(x)), so a file without shared experts does not run as GLM would.
    min_shared = 1
    max_shared = None
    shared_count_key = True
    ffn_norm_name = "post_attention_norm"

    def defaults(self, cfg: ModelConfig) -> ModelConfig:
        """As :meth:`MoeArch.defaults`; RoPE over half of each head."""
        cfg = super().defaults(cfg)
        return replace(cfg, rope_dim=cfg.rope_dim or cfg.head_dim // 2)

    def validate(self, cfg: ModelConfig) -> None:
        """As :meth:`MoeArch.validate`, and an even ``rope_dim`` within the head."""
        super().validate(cfg)
        _check_rope_dim(cfg, cfg.head_dim)

    def uses_qk_norm(self, cfg: ModelConfig) -> bool:
        """The q/k norms are optional (GLM-4.5 has them, GLM-4.5-Air not)."""
        return bool(cfg.qk_norm)

    def has_probs_bias(self, cfg: ModelConfig) -> bool:
        """Every MoE layer has ``exp_probs_b`` (llama.cpp requires it)."""
        return True

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """As :meth:`MoeArch.metadata`, plus the partial RoPE width."""
        m = super().metadata(cfg)
        m.append(MetaItem(f"{self.name}.rope.dimension_count", cfg.rope_dim, _U32))
        return m


class DeepSeek2(MoeArch):
    """DeepSeek V2/V3 (and the models converted to its architecture): MLA attention, leading
    dense layers, shared experts, softmax (V2) or sigmoid with ``exp_probs_b`` (V3, the
    default) routing, optional groups, renormalization and routed scaling.

    The attention is written as the current converter writes it: ``attn_q_a`` (rank
    ``q_lora_rank``), ``attn_q_a_norm``, ``attn_q_b`` (or a plain ``attn_q`` when the rank is
    0), ``attn_kv_a_mqa`` (``kv_lora_rank + rope_dim`` rows), ``attn_kv_a_norm``, and the
    split ``attn_k_b`` ``(heads, kv_lora_rank, head_dim - rope_dim)`` and ``attn_v_b``
    ``(heads, v_head_dim, kv_lora_rank)``. ``head_dim`` is the q/k head size
    (``key_length_mla``); ``head_count_kv`` is 1 and ``key_length`` / ``value_length`` are the
    compressed sizes, as llama.cpp's MLA reads them. ``kv_heads`` does not apply.
    """

    name = "deepseek2"
    default_rope_theta = 10000.0
    default_rms_eps = 1e-6
    write_vocab_size = True
    options = _MOE_OPTIONS | {
        "leading_dense",
        "expert_gating",
        "expert_weights_norm",
        "expert_weights_scale",
        "expert_groups",
        "expert_groups_used",
        "rope_dim",
        "q_lora_rank",
        "kv_lora_rank",
        "v_head_dim",
    }
    default_shared = 1
    min_shared = 1
    max_shared = None
    shared_count_key = True

    def defaults(self, cfg: ModelConfig) -> ModelConfig:
        """As :meth:`MoeArch.defaults`, plus the MLA sizes and sigmoid gating."""
        cfg = super().defaults(cfg)
        rope = cfg.rope_dim or cfg.head_dim // 2
        return replace(
            cfg,
            expert_gating=cfg.expert_gating or "sigmoid",
            rope_dim=rope,
            q_lora_rank=cfg.hidden // 2 if cfg.q_lora_rank is None else cfg.q_lora_rank,
            kv_lora_rank=cfg.kv_lora_rank or cfg.hidden // 4,
            v_head_dim=cfg.v_head_dim or cfg.head_dim - rope,
        )

    def validate(self, cfg: ModelConfig) -> None:
        """As :meth:`MoeArch.validate`, plus the MLA sizes and llama.cpp's "lite" layer
        counts (26 or 27 layers: it then ignores q_lora_rank)."""
        super().validate(cfg)
        if cfg.kv_heads != cfg.heads:
            raise InvalidInputError("deepseek2's MLA attention has no kv_heads (it is 1)")
        _check_rope_dim(cfg, cfg.head_dim - 1)
        if cfg.expert_gating not in ("softmax", "sigmoid"):
            raise InvalidInputError(
                f"expert gating must be softmax or sigmoid, got {cfg.expert_gating!r}"
            )
        for name in ("q_lora_rank", "kv_lora_rank", "v_head_dim"):
            value = getattr(cfg, name)
            if value is None or value < (0 if name == "q_lora_rank" else 1):
                raise InvalidInputError(f"{name.replace('_', '-')} must be positive, got {value}")
        if cfg.q_lora_rank and cfg.layers in (26, 27):
            raise InvalidInputError(
                f"llama.cpp reads a {cfg.layers}-layer deepseek2 as a lite model without "
                "q_lora_rank; use another layer count or q-lora-rank 0"
            )

    def gating_func(self, cfg: ModelConfig) -> str:
        """From the config: softmax (V2) or sigmoid (V3)."""
        return cfg.expert_gating or "sigmoid"

    def has_probs_bias(self, cfg: ModelConfig) -> bool:
        """V3's selection bias comes with its sigmoid gating."""
        return self.gating_func(cfg) == "sigmoid"

    def attn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """MLA: the compressed q and kv projections and the split kv_b."""
        h, nh, hd = cfg.hidden, cfg.heads, cfg.head_dim
        rope, ql = int(cfg.rope_dim or 0), int(cfg.q_lora_rank or 0)
        kvl, vd = int(cfg.kv_lora_rank or 0), int(cfg.v_head_dim or 0)
        t = [TensorDef(_blk(i, "attn_norm"), "attn_norm", i, (h,), "norm", False)]
        if ql:
            t += [
                TensorDef(_blk(i, "attn_q_a"), "attn_q_a", i, (ql, h), "proj_in", True),
                TensorDef(_blk(i, "attn_q_a_norm"), "attn_q_a_norm", i, (ql,), "norm", False),
                TensorDef(_blk(i, "attn_q_b"), "attn_q_b", i, (nh * hd, ql), "proj_in", True),
            ]
        else:
            t.append(TensorDef(_blk(i, "attn_q"), "attn_q", i, (nh * hd, h), "proj_in", True))
        t += [
            TensorDef(_blk(i, "attn_kv_a_mqa"), "attn_kv_a_mqa", i, (kvl + rope, h), "proj_in",
                      True),
            TensorDef(_blk(i, "attn_kv_a_norm"), "attn_kv_a_norm", i, (kvl,), "norm", False),
            TensorDef(_blk(i, "attn_k_b"), "attn_k_b", i, (nh, kvl, hd - rope), "mla_kb", True),
            TensorDef(_blk(i, "attn_v_b"), "attn_v_b", i, (nh, vd, kvl), "proj_in", True),
            TensorDef(_blk(i, "attn_output"), "attn_output", i, (h, nh * vd), "attn_out", True),
        ]  # fmt: skip
        return t

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """As :meth:`MoeArch.metadata`, plus the MLA keys (the converter's)."""
        a = self.name
        m = [
            item
            for item in super().metadata(cfg)
            if item.key not in (f"{a}.attention.key_length", f"{a}.attention.value_length")
        ]
        kvl, rope = int(cfg.kv_lora_rank or 0), int(cfg.rope_dim or 0)
        _set(m, f"{a}.attention.head_count_kv", 1, _U32)
        m += [
            MetaItem(f"{a}.attention.q_lora_rank", int(cfg.q_lora_rank or 0), _U32),
            MetaItem(f"{a}.attention.kv_lora_rank", kvl, _U32),
            MetaItem(f"{a}.attention.key_length", kvl + rope, _U32),
            MetaItem(f"{a}.attention.value_length", kvl, _U32),
            MetaItem(f"{a}.attention.key_length_mla", cfg.head_dim, _U32),
            MetaItem(f"{a}.attention.value_length_mla", int(cfg.v_head_dim or 0), _U32),
            MetaItem(f"{a}.rope.dimension_count", rope, _U32),
        ]
        return m


def _check_rope_dim(cfg: ModelConfig, most: int) -> None:
    rope = cfg.rope_dim
    if rope is None or rope < 2 or rope % 2 or rope > most:
        raise InvalidInputError(f"rope-dim must be even and in 2..{most}, got {rope}")


#: The MoE architectures (llama among them: Mixtral is llama with experts).
MOE_ARCHS: tuple[MoeArch, ...] = (
    LlamaMoe(),
    Qwen3Moe(),
    Qwen2Moe(),
    Olmoe(),
    GptOss(),
    Glm4Moe(),
    DeepSeek2(),
)
