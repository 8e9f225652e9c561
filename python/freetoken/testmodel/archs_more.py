"""More architectures of the synthetic test models: ``mistral3``, and the text side of
``qwen3vl`` and ``qwen3vlmoe``. Layouts and keys follow llama.cpp's loaders
(``src/models/<arch>.cpp``) and its converter (``conversion/mistral3.py``,
``conversion/qwen3vl.py``).

- ``mistral3``: Llama's layout, with the keys Ministral 3 files carry: YaRN (factor 16 over
  an original context of a sixteenth of ``ctx``, betas 32 / 1, mscale_all_dim 1) and the
  attention temperature ``attention.temperature_scale`` 0.1.
- ``minimax-m2``: RMSNorm over the whole q and k projections, NEOX RoPE on ``rope_dim``
  (default half) of each head, experts on every layer routed by sigmoid with the
  ``exp_probs_b`` selection bias, renormalized; the experts are ``feed_forward_length`` wide
  (llama.cpp sizes them so) and ``expert_feed_forward_length`` says the same.
- ``qwen3vl`` / ``qwen3vlmoe``: Qwen3 / Qwen3-MoE with ``rope.dimension_sections`` (the
  interleaved multi-section RoPE; sized like Qwen3-VL's 24/20/20 of 64 pairs) and
  ``n_deepstack_layers`` 3 (fewer than the layers: llama.cpp's graph cannot add them to its
  last layer), the count of image feature layers a text model ignores.
"""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFValueType

from freetoken.testmodel.archs import (
    ArchSpec,
    Llama,
    MetaItem,
    ModelConfig,
    Qwen3,
    TensorDef,
    _blk,
)
from freetoken.testmodel.archs_moe import (
    _MOE_OPTIONS,
    GATING_FUNC_IDS,
    MoeArch,
    Qwen3Moe,
    _check_rope_dim,
)

__all__ = ["MORE_ARCHS", "MinimaxM2", "Mistral3", "Qwen3VL", "Qwen3VLMoe", "vl_sections"]

_U32, _F32, _STR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING
#: Ministral 3's YaRN factor and attention temperature beta.
MISTRAL3_YARN_FACTOR = 16.0
MISTRAL3_TEMPERATURE = 0.1
#: Qwen3-VL's deepstack feature layers.
DEEPSTACK_LAYERS = 3


class Mistral3(Llama):
    """Mistral 3 (text): Llama with YaRN and the attention temperature keys."""

    name = "mistral3"
    default_rope_theta = 1000000.0

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """Llama's keys plus Ministral 3's RoPE scaling and temperature."""
        a = self.name
        return [
            *super().metadata(cfg),
            MetaItem(f"{a}.rope.scaling.type", "yarn", _STR),
            MetaItem(f"{a}.rope.scaling.factor", MISTRAL3_YARN_FACTOR, _F32),
            MetaItem(
                f"{a}.rope.scaling.original_context_length",
                max(1, int(cfg.ctx / MISTRAL3_YARN_FACTOR)),
                _U32,
            ),
            MetaItem(f"{a}.rope.scaling.yarn_beta_fast", 32.0, _F32),
            MetaItem(f"{a}.rope.scaling.yarn_beta_slow", 1.0, _F32),
            MetaItem(f"{a}.rope.scaling.yarn_log_multiplier", 1.0, _F32),
            MetaItem(f"{a}.attention.temperature_scale", MISTRAL3_TEMPERATURE, _F32),
        ]


def vl_sections(head_dim: int) -> list[int]:
    """Qwen3-VL's RoPE sections (24, 20, 20 of 64 pairs) scaled to ``head_dim / 2`` pairs."""
    pairs = head_dim // 2
    hw = pairs * 20 // 64
    return [pairs - 2 * hw, hw, hw, 0]


def _vl_metadata(arch: ArchSpec, cfg: ModelConfig, items: list[MetaItem]) -> list[MetaItem]:
    a = arch.name
    return [
        *items,
        MetaItem(
            f"{a}.rope.dimension_sections",
            vl_sections(cfg.head_dim),
            GGUFValueType.ARRAY,
            GGUFValueType.INT32,
        ),
        MetaItem(f"{a}.n_deepstack_layers", min(DEEPSTACK_LAYERS, cfg.layers - 1), _U32),
    ]


class Qwen3VL(Qwen3):
    """Qwen3-VL's text model: Qwen3 with the multi-section RoPE keys."""

    name = "qwen3vl"

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """Qwen3's keys plus the RoPE sections and deepstack count."""
        return _vl_metadata(self, cfg, super().metadata(cfg))


class Qwen3VLMoe(Qwen3Moe):
    """Qwen3-VL-MoE's text model: Qwen3-MoE with the multi-section RoPE keys."""

    name = "qwen3vlmoe"

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """Qwen3-MoE's keys plus the RoPE sections and deepstack count."""
        return _vl_metadata(self, cfg, super().metadata(cfg))


class MinimaxM2(MoeArch):
    """MiniMax-M2: whole-projection q/k norms, partial NEOX RoPE, sigmoid routing with the
    selection bias, renormalized (llama.cpp's graph fixes that), no shared experts."""

    name = "minimax-m2"
    default_rope_theta = 5000000.0
    default_rms_eps = 1e-6
    qk_norm = True
    always_key_length = True
    options = _MOE_OPTIONS | {"rope_dim"}
    gating = "sigmoid"
    expert_ffn_in_ffn_key = True
    allow_tied = False

    def defaults(self, cfg: ModelConfig) -> ModelConfig:
        """As :meth:`MoeArch.defaults`; RoPE over half of each head."""
        cfg = super().defaults(cfg)
        return replace(cfg, rope_dim=cfg.rope_dim or cfg.head_dim // 2)

    def validate(self, cfg: ModelConfig) -> None:
        """As :meth:`MoeArch.validate`, and an even ``rope_dim`` within the head."""
        super().validate(cfg)
        _check_rope_dim(cfg, cfg.head_dim)

    def has_probs_bias(self, cfg: ModelConfig) -> bool:
        """Every layer has ``exp_probs_b`` (llama.cpp requires it)."""
        return True

    def attn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Attention with q and k norms as wide as the projections."""
        h, d = cfg.hidden, cfg.head_dim
        nq, nkv = cfg.heads * d, cfg.kv_heads * d
        return [
            TensorDef(_blk(i, "attn_norm"), "attn_norm", i, (h,), "norm", False),
            TensorDef(_blk(i, "attn_q"), "attn_q", i, (nq, h), "proj_in", True),
            TensorDef(_blk(i, "attn_k"), "attn_k", i, (nkv, h), "proj_in", True),
            TensorDef(_blk(i, "attn_v"), "attn_v", i, (nkv, h), "proj_in", True),
            TensorDef(_blk(i, "attn_q_norm"), "attn_q_norm", i, (nq,), "norm", False),
            TensorDef(_blk(i, "attn_k_norm"), "attn_k_norm", i, (nkv,), "norm", False),
            TensorDef(_blk(i, "attn_output"), "attn_output", i, (h, nq), "attn_out", True),
        ]

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """As :meth:`MoeArch.metadata`, plus the expert width, gating and RoPE width."""
        a = self.name
        return [
            *super().metadata(cfg),
            MetaItem(f"{a}.expert_feed_forward_length", cfg.expert_ffn, _U32),
            MetaItem(f"{a}.expert_gating_func", GATING_FUNC_IDS["sigmoid"], _U32),
            MetaItem(f"{a}.rope.dimension_count", cfg.rope_dim, _U32),
        ]


#: The architectures of this module.
MORE_ARCHS: tuple[ArchSpec, ...] = (Mistral3(), Qwen3VL(), Qwen3VLMoe(), MinimaxM2())
