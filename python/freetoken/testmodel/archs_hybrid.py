"""The Gated DeltaNet hybrid architectures of the synthetic test models: ``qwen35`` (dense
Qwen3.5), ``qwen35moe`` (Qwen3.5/3.6-MoE) and ``qwen3next`` (Qwen3-Next).

The layout follows llama.cpp's loaders (``src/models/qwen35.cpp``, ``qwen35moe.cpp``,
``qwen3next.cpp``) and the keys its converter writes (``conversion/qwen.py``). Every
``full_attention_interval``-th layer (``(i + 1) % N == 0``) is gated full attention, the
others Gated DeltaNet linear attention:

- full attention: ``attn_q`` holds per head the query and its output gate (``2 * head_dim``
  rows per head), ``attn_k``, ``attn_v``, per-head ``attn_q_norm``/``attn_k_norm``,
  ``attn_output``; partial RoPE over ``rope_dim`` dims (default a quarter of the head, the
  converter's ``partial_rotary_factor``), NEOX (qwen3next) or interleaved multi-section
  (qwen35, with ``rope.dimension_sections`` [11, 11, 10, 0] as the converter writes by
  default).
- linear attention: ``attn_qkv`` (q, k, v of the conv channels), ``attn_gate`` (z),
  ``ssm_conv1d`` (``(channels, conv_kernel)``, F32 as llama-quantize leaves it),
  ``ssm_dt.bias``, ``ssm_a`` (``-exp(A_log)``), ``ssm_beta`` and ``ssm_alpha`` (qwen35:
  one row per value head) or the fused ``ssm_ba`` (qwen3next: per key head its value heads'
  beta rows, then their alpha rows), ``ssm_norm`` (per value head) and ``ssm_out``.
- every layer: ``attn_norm``, ``post_attention_norm`` (the FFN's input norm), then a dense
  FFN (qwen35) or routed experts (softmax, top-k renormalized) plus a shared expert scaled by
  ``sigmoid(x . ffn_gate_inp_shexp)`` (qwen35moe, qwen3next).

The linear-attention sizes default from the hidden size: head size ``min(128, hidden / 2)``,
``hidden / head`` key heads and twice as many value heads (Qwen3.5-35B-A3B: 128, 16, 32).
"""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFValueType

from freetoken.errors import InvalidInputError
from freetoken.testmodel.archs import ArchSpec, MetaItem, ModelConfig, TensorDef, _blk
from freetoken.testmodel.archs_moe import MoeArch

__all__ = ["HYBRID_ARCHS", "SHAPE_PRESETS", "Qwen3Next", "Qwen35", "Qwen35Moe"]

_U32, _I32 = GGUFValueType.UINT32, GGUFValueType.INT32

_LINEAR_OPTIONS = frozenset(
    {"rope_dim", "linear_k_heads", "linear_v_heads", "linear_head_dim", "conv_kernel",
     "full_attention_interval", "nextn_layers"}
)  # fmt: skip
#: The converter's default ``rope.dimension_sections`` of Qwen3.5.
ROPE_SECTIONS = (11, 11, 10, 0)

#: Shapes of the benchmark models (make-test-model ``--preset``); the flags given override.
SHAPE_PRESETS: dict[str, dict[str, object]] = {
    "qwen3.5-35b-a3b": dict(
        arch="qwen35moe", layers=40, hidden=2048, heads=16, kv_heads=2, head_dim=256,
        experts=256, top_k=8, expert_ffn=512, ffn=512, shared_experts=1, linear_k_heads=16,
        linear_v_heads=32, linear_head_dim=128, conv_kernel=4, full_attention_interval=4,
        rope_dim=64, ctx=262144,
    ),
    "qwen3-next-80b-a3b": dict(
        arch="qwen3next", layers=48, hidden=2048, heads=16, kv_heads=2, head_dim=256,
        experts=512, top_k=10, expert_ffn=512, ffn=512, shared_experts=1, linear_k_heads=16,
        linear_v_heads=32, linear_head_dim=128, conv_kernel=4, full_attention_interval=4,
        rope_dim=64, ctx=262144,
    ),
}  # fmt: skip


class _GatedDeltaNet(ArchSpec):
    """What the three hybrid families share (see the module docstring)."""

    default_rope_theta = 10000000.0
    default_rms_eps = 1e-6
    qk_norm = True
    always_key_length = True
    allow_tied = True
    #: qwen3next: fused ``ssm_ba`` and value heads grouped by key head.
    fused_ba = False
    #: qwen35: interleaved multi-section RoPE (``rope.dimension_sections``).
    mrope = False
    #: The full-attention output is gated by sigmoid(gate) (the writer sizes it for that).
    gated_attention = True

    def defaults(self, cfg: ModelConfig) -> ModelConfig:
        """The architecture's defaults, plus the linear-attention sizes from the hidden size."""
        cfg = super().defaults(cfg)
        head = cfg.linear_head_dim or min(128, max(cfg.hidden // 2, 1))
        k_heads = cfg.linear_k_heads or max(cfg.hidden // head, 1)
        return replace(
            cfg,
            rope_dim=cfg.rope_dim or max(2, cfg.head_dim // 4 // 2 * 2),
            linear_head_dim=head,
            linear_k_heads=k_heads,
            linear_v_heads=cfg.linear_v_heads or 2 * k_heads,
            conv_kernel=cfg.conv_kernel or 4,
            full_attention_interval=cfg.full_attention_interval or 4,
        )

    def validate(self, cfg: ModelConfig) -> None:
        """As the base class, plus the linear-attention sizes llama.cpp can run."""
        super().validate(cfg)
        for name in ("linear_k_heads", "linear_v_heads", "linear_head_dim", "conv_kernel",
                     "full_attention_interval"):  # fmt: skip
            value = getattr(cfg, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidInputError(
                    f"{name.replace('_', '-')} must be a positive integer, got {value!r}"
                )
        kh, vh = int(cfg.linear_k_heads or 0), int(cfg.linear_v_heads or 0)
        if vh % kh:
            raise InvalidInputError(
                f"linear-v-heads ({vh}) must be a multiple of linear-k-heads ({kh})"
            )
        if int(cfg.conv_kernel or 0) < 2:
            raise InvalidInputError(f"conv-kernel must be at least 2, got {cfg.conv_kernel}")
        n = int(cfg.full_attention_interval or 0)
        if n > cfg.layers:
            raise InvalidInputError(
                f"full-attention-interval {n} exceeds the {cfg.layers} layers (no layer would "
                "have full attention)"
            )
        rope = cfg.rope_dim
        if rope is None or rope < 2 or rope % 2 or rope > cfg.head_dim:
            raise InvalidInputError(f"rope-dim must be even and in 2..{cfg.head_dim}, got {rope}")
        if self.mrope and sum(ROPE_SECTIONS) > cfg.head_dim:
            raise InvalidInputError(
                f"{self.name}'s RoPE sections cover {sum(ROPE_SECTIONS)} pairs; head-dim must "
                f"be at least that, got {cfg.head_dim}"
            )

    def is_recurrent(self, cfg: ModelConfig, i: int) -> bool:
        """Whether layer ``i`` is linear attention (llama.cpp's ``is_recr``: never the
        multi-token-prediction layers after the trunk)."""
        return i < cfg.layers and (i + 1) % int(cfg.full_attention_interval or 4) != 0

    def uses_qk_norm(self, cfg: ModelConfig) -> bool:
        """The full-attention layers norm q and k per head."""
        return True

    def attn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Layer ``i``'s input norm and its full or linear attention."""
        h = cfg.hidden
        t = [TensorDef(_blk(i, "attn_norm"), "attn_norm", i, (h,), "norm", False)]
        if not self.is_recurrent(cfg, i):
            d = cfg.head_dim
            nq, nkv = cfg.heads * d, cfg.kv_heads * d
            return [
                *t,
                TensorDef(_blk(i, "attn_q"), "attn_q", i, (2 * nq, h), "proj_in", True),
                TensorDef(_blk(i, "attn_k"), "attn_k", i, (nkv, h), "proj_in", True),
                TensorDef(_blk(i, "attn_v"), "attn_v", i, (nkv, h), "proj_in", True),
                TensorDef(_blk(i, "attn_q_norm"), "attn_q_norm", i, (d,), "norm", False),
                TensorDef(_blk(i, "attn_k_norm"), "attn_k_norm", i, (d,), "norm", False),
                TensorDef(_blk(i, "attn_output"), "attn_output", i, (h, nq), "attn_out", True),
            ]
        d, kh, vh = (
            int(cfg.linear_head_dim or 0),
            int(cfg.linear_k_heads or 0),
            int(cfg.linear_v_heads or 0),
        )
        channels, value = 2 * kh * d + vh * d, vh * d
        t += [
            TensorDef(_blk(i, "attn_qkv"), "attn_qkv", i, (channels, h), "proj_in", True),
            TensorDef(_blk(i, "attn_gate"), "attn_gate", i, (value, h), "proj_in", True),
            TensorDef(_blk(i, "ssm_conv1d"), "ssm_conv1d", i, (channels, int(cfg.conv_kernel or 0)),
                      "conv", False),
            TensorDef(_blk(i, "ssm_dt", "bias"), "ssm_dt.bias", i, (vh,), "bias", False),
            TensorDef(f"blk.{i}.ssm_a", "ssm_a", i, (vh,), "ssm_a", False),
        ]  # fmt: skip
        if self.fused_ba:
            t.append(TensorDef(_blk(i, "ssm_ba"), "ssm_ba", i, (2 * vh, h), "proj_in", True))
        else:
            t += [
                TensorDef(_blk(i, "ssm_beta"), "ssm_beta", i, (vh, h), "proj_in", True),
                TensorDef(_blk(i, "ssm_alpha"), "ssm_alpha", i, (vh, h), "proj_in", True),
            ]
        t += [
            TensorDef(_blk(i, "ssm_norm"), "ssm_norm", i, (d,), "norm", False),
            TensorDef(_blk(i, "ssm_out"), "ssm_out", i, (h, value), "ffn_out", True),
        ]
        return t

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """As the base class, plus the partial RoPE, the ``ssm.*`` keys and the interval."""
        a = self.name
        d, vh = int(cfg.linear_head_dim or 0), int(cfg.linear_v_heads or 0)
        m = super().metadata(cfg)
        m += [
            MetaItem(f"{a}.rope.dimension_count", int(cfg.rope_dim or 0), _U32),
            MetaItem(f"{a}.ssm.conv_kernel", int(cfg.conv_kernel or 0), _U32),
            MetaItem(f"{a}.ssm.state_size", d, _U32),
            MetaItem(f"{a}.ssm.group_count", int(cfg.linear_k_heads or 0), _U32),
            MetaItem(f"{a}.ssm.time_step_rank", vh, _U32),
            MetaItem(f"{a}.ssm.inner_size", d * vh, _U32),
            MetaItem(f"{a}.full_attention_interval", int(cfg.full_attention_interval or 0), _U32),
        ]
        if self.mrope:
            m.append(
                MetaItem(f"{a}.rope.dimension_sections", list(ROPE_SECTIONS), GGUFValueType.ARRAY,
                         _I32)
            )  # fmt: skip
        return m


class Qwen35(_GatedDeltaNet):
    """Qwen3.5 (dense): a SwiGLU FFN on every layer, interleaved multi-section RoPE."""

    name = "qwen35"
    options = _LINEAR_OPTIONS
    mrope = True

    def ffn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """``post_attention_norm`` (the FFN's input norm) and the dense FFN."""
        h, f = cfg.hidden, cfg.ffn
        return [
            TensorDef(_blk(i, "post_attention_norm"), "post_attention_norm", i, (h,), "norm",
                      False),
            TensorDef(_blk(i, "ffn_gate"), "ffn_gate", i, (f, h), "proj_in", True),
            TensorDef(_blk(i, "ffn_up"), "ffn_up", i, (f, h), "proj_in", True),
            TensorDef(_blk(i, "ffn_down"), "ffn_down", i, (h, f), "ffn_out", True),
        ]  # fmt: skip


class _HybridMoe(MoeArch, _GatedDeltaNet):
    """Routed experts (softmax, renormalized) with one gated shared expert on every layer."""

    options = frozenset({"experts", "top_k", "expert_ffn", "shared_experts"}) | _LINEAR_OPTIONS
    ffn_norm_name = "post_attention_norm"
    default_shared = 1
    min_shared = 1
    max_shared = 1
    shared_gate = True
    shared_ffn_key = True


class Qwen35Moe(_HybridMoe):
    """Qwen3.5 / 3.6 MoE: interleaved multi-section RoPE, separate ``ssm_beta``/``ssm_alpha``,
    value heads tiled over the key heads."""

    name = "qwen35moe"
    mrope = True


class Qwen3Next(_HybridMoe):
    """Qwen3-Next: NEOX partial RoPE, fused ``ssm_ba``, value heads grouped by key head."""

    name = "qwen3next"
    fused_ba = True


#: The hybrid architectures.
HYBRID_ARCHS: tuple[ArchSpec, ...] = (Qwen35(), Qwen35Moe(), Qwen3Next())
