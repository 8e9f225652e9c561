"""The ``gemma4`` synthetic test models: the dense layout, the E-series and the 26B-A4B MoE,
as llama.cpp's loader reads them (``src/models/gemma4.cpp``) and its converter writes them
(``conversion/gemma.py``, ``Gemma4Model``).

- Sliding-window and full layers (``swa_pattern``, default every sixth full), written as one
  flag per layer; the full layers have their own head size (``head_dim_full``) and KV heads
  (``kv_heads_full``, as the per-layer ``attention.head_count_kv``), RoPE base (``rope_theta``;
  the sliding ones ``rope_theta_swa``, default 10000) and proportional RoPE: ``rope_freqs``
  turns the first quarter of the pairs (``partial_rotary_factor`` 0.25), the rest never.
- Per-head q/k norms, sandwich norms, GELU-tanh gating, embeddings times sqrt(hidden),
  unscaled attention (the q norm weights carry 1/sqrt(head size)), logits soft-capped at
  :data:`SOFTCAP`, a per-layer output scale.
- Without the per-layer inputs (the 31B and 26B-A4B layout) the full layers have no
  ``attn_v`` (their keys serve as values).
- The E-series (``per_layer_width`` > 0): ``per_layer_token_embd`` and its projection and
  per-layer gates; ``shared_kv_layers`` trailing layers without key/value projections (the
  last two layers before them must be sliding then full), twice ``ffn`` wide (the
  converter's double-wide MLP).
- The MoE (``experts`` > 0, 26B-A4B): on every layer the dense FFN as a shared expert beside
  ``experts`` routed ones (``expert_ffn`` wide, gate and up stacked, or fused with
  ``expert_layout="fused"`` as the converter writes them), the router's input scale and
  per-expert output scales.
"""

from __future__ import annotations

from dataclasses import replace

from gguf import GGUFValueType

from freetoken.errors import InvalidInputError
from freetoken.testmodel.archs import GemmaLayout, MetaItem, ModelConfig, TensorDef, _blk
from freetoken.testmodel.archs_moe import _MOE_OPTIONS, MoeArch

__all__ = ["GEMMA4_ARCHS", "SHAPE_PRESETS", "SOFTCAP", "Gemma4"]

_U32, _F32, _ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.ARRAY
#: ``final_logit_softcapping`` of the released models.
SOFTCAP = 30.0

#: Gemma 4 26B-A4B's shape (its config as the pinned tree's gemma-4 vocabulary file carries
#: it): 30 layers, every sixth full; sliding layers 8 KV heads of 256, full ones 2 of 512.
SHAPE_PRESETS: dict[str, dict[str, object]] = {
    "gemma-4-26b-a4b": dict(
        arch="gemma4", layers=30, hidden=2816, heads=16, kv_heads=8, head_dim=256,
        head_dim_full=512, kv_heads_full=2, ffn=2112, experts=128, top_k=8, expert_ffn=704,
        sliding_window=1024, swa_pattern="6", expert_layout="fused", ctx=262144,
    ),
}  # fmt: skip


class Gemma4(GemmaLayout, MoeArch):
    """Gemma 4 (module docstring, :class:`GemmaLayout`); dense unless ``experts`` > 0."""

    name = "gemma4"
    attn_unscaled = True
    default_experts = 0
    options = _MOE_OPTIONS | {
        "expert_layout", "head_dim_full", "kv_heads_full", "per_layer_width", "shared_kv_layers"
    }  # fmt: skip

    def defaults(self, cfg: ModelConfig) -> ModelConfig:
        """As :meth:`MoeArch.defaults`; full layers as the sliding ones unless given."""
        cfg = super().defaults(cfg)
        return replace(
            cfg,
            head_dim_full=cfg.head_dim_full or cfg.head_dim,
            kv_heads_full=cfg.kv_heads_full or cfg.kv_heads,
            rope_theta_swa=10000.0 if cfg.rope_theta_swa is None else cfg.rope_theta_swa,
        )

    def validate(self, cfg: ModelConfig) -> None:
        """As :meth:`MoeArch.validate` (with the fused expert layout), plus what llama.cpp's
        gemma4 loader requires."""
        super().validate(replace(cfg, expert_layout="stacked"))
        if cfg.expert_layout not in ("stacked", "fused"):
            raise InvalidInputError(f"gemma4 experts are stacked or fused, not {cfg.expert_layout}")
        if not cfg.sliding_window:
            raise InvalidInputError("gemma4 needs a sliding window (llama.cpp requires the key)")
        full, kv = cfg.head_dim_full or 0, cfg.kv_heads_full or 0
        if full < 2 or full % 2 or kv < 1 or cfg.heads % kv:
            raise InvalidInputError(
                f"full layers: head-dim-full {full} must be even, kv-heads-full {kv} divide "
                f"the {cfg.heads} heads"
            )
        if cfg.per_layer_width < 0:
            raise InvalidInputError(f"per-layer-width must be >= 0, got {cfg.per_layer_width}")
        s = cfg.shared_kv_layers
        if s:
            n = cfg.layers - s
            if n < 2 or not self.is_swa_layer(cfg, n - 2) or self.is_swa_layer(cfg, n - 1):
                raise InvalidInputError(
                    f"shared-kv-layers {s}: the two layers before them must be a sliding and "
                    "then a full one (llama.cpp's reuse)"
                )

    def _swa(self, cfg: ModelConfig, i: int) -> bool:
        return self.is_swa_layer(cfg, i)

    def _head(self, cfg: ModelConfig, i: int) -> tuple[int, int]:
        """Layer ``i``'s head size and KV heads."""
        if self._swa(cfg, i):
            return cfg.head_dim, cfg.kv_heads
        assert cfg.head_dim_full is not None and cfg.kv_heads_full is not None
        return cfg.head_dim_full, cfg.kv_heads_full

    def _own_kv(self, cfg: ModelConfig, i: int) -> bool:
        return i < cfg.layers - cfg.shared_kv_layers

    def _ffn(self, cfg: ModelConfig, i: int) -> int:
        return cfg.ffn * (1 if self._own_kv(cfg, i) else 2)

    # ---- tensors ------------------------------------------------------------------------

    def tensors(self, cfg: ModelConfig) -> list[TensorDef]:
        """As :meth:`ArchSpec.tensors`, plus the proportional RoPE factors and the E-series'
        per-layer input tables."""
        out = super().tensors(cfg)
        assert cfg.head_dim_full is not None
        extra = [
            TensorDef("rope_freqs.weight", "rope_freqs", None, (cfg.head_dim_full // 2,),
                      "proportional_rope", False),
        ]  # fmt: skip
        w = cfg.per_layer_width
        if w:
            n, h = cfg.layers * w, cfg.hidden
            extra += [
                TensorDef("per_layer_token_embd.weight", "per_layer_token_embd", None,
                          (cfg.vocab_size, n), "proj_in", True),
                TensorDef("per_layer_model_proj.weight", "per_layer_model_proj", None, (n, h),
                          "proj_in", True),
                TensorDef("per_layer_proj_norm.weight", "per_layer_proj_norm", None, (w,),
                          "norm", False),
            ]  # fmt: skip
        return [out[0], *extra, *out[1:]]

    def attn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """Layer ``i``'s attention at its kind's sizes; no k/v in shared-KV layers, no v in
        the full layers of models without per-layer inputs."""
        h, (d, nkv) = cfg.hidden, self._head(cfg, i)
        nq = cfg.heads * d
        t = [
            TensorDef(_blk(i, "attn_norm"), "attn_norm", i, (h,), "norm", False),
            TensorDef(_blk(i, "attn_q"), "attn_q", i, (nq, h), "proj_in", True),
            TensorDef(_blk(i, "attn_q_norm"), "attn_q_norm", i, (d,), "norm", False),
        ]
        if self._own_kv(cfg, i):
            t.append(TensorDef(_blk(i, "attn_k"), "attn_k", i, (nkv * d, h), "proj_in", True))
            if cfg.per_layer_width or self._swa(cfg, i):
                t.append(TensorDef(_blk(i, "attn_v"), "attn_v", i, (nkv * d, h), "proj_in", True))
            t.append(TensorDef(_blk(i, "attn_k_norm"), "attn_k_norm", i, (d,), "norm", False))
        return [
            *t,
            TensorDef(_blk(i, "attn_output"), "attn_output", i, (h, nq), "attn_out", True),
            TensorDef(_blk(i, "post_attention_norm"), "post_attention_norm", i, (h,),
                      "post_norm", False),
        ]  # fmt: skip

    def ffn_tensors(self, cfg: ModelConfig, i: int) -> list[TensorDef]:
        """The dense FFN (the shared expert of a MoE layer) with its norms, the routed
        experts, the per-layer input gate and the layer's output scale."""
        h, f = cfg.hidden, self._ffn(cfg, i)
        t = [
            TensorDef(_blk(i, "ffn_norm"), "ffn_norm", i, (h,), "norm", False),
            TensorDef(_blk(i, "ffn_gate"), "ffn_gate", i, (f, h), "proj_in", True),
            TensorDef(_blk(i, "ffn_up"), "ffn_up", i, (f, h), "proj_in", True),
            TensorDef(_blk(i, "ffn_down"), "ffn_down", i, (h, f), "ffn_out", True),
            TensorDef(_blk(i, "post_ffw_norm"), "post_ffw_norm", i, (h,), "post_norm", False),
        ]
        if self.is_moe(cfg):
            e, n = cfg.experts, cfg.expert_ffn
            t += [
                TensorDef(_blk(i, "ffn_gate_inp"), "ffn_gate_inp", i, (e, h), "router", False),
                TensorDef(_blk(i, "ffn_gate_inp", "scale"), "ffn_gate_inp.scale", i, (h,),
                          "input_scale", False),
                TensorDef(_blk(i, "post_ffw_norm_1"), "post_ffw_norm_1", i, (h,), "norm", False),
                TensorDef(_blk(i, "pre_ffw_norm_2"), "pre_ffw_norm_2", i, (h,), "norm", False),
                TensorDef(_blk(i, "post_ffw_norm_2"), "post_ffw_norm_2", i, (h,), "norm", False),
            ]  # fmt: skip
            if cfg.expert_layout == "fused":
                t.append(TensorDef(_blk(i, "ffn_gate_up_exps"), "ffn_gate_up_exps", i,
                                   (e, 2 * n, h), "proj_in", True))  # fmt: skip
            else:
                t += [
                    TensorDef(_blk(i, "ffn_gate_exps"), "ffn_gate_exps", i, (e, n, h), "proj_in",
                              True),
                    TensorDef(_blk(i, "ffn_up_exps"), "ffn_up_exps", i, (e, n, h), "proj_in",
                              True),
                ]  # fmt: skip
            t += [
                TensorDef(_blk(i, "ffn_down_exps"), "ffn_down_exps", i, (e, h, n), "exp_out", True),
                TensorDef(_blk(i, "ffn_down_exps", "scale"), "ffn_down_exps.scale", i, (e,),
                          "norm", False),
            ]  # fmt: skip
        w = cfg.per_layer_width
        if w:
            t += [
                TensorDef(_blk(i, "inp_gate"), "per_layer_inp_gate", i, (w, h), "proj_in", True),
                TensorDef(_blk(i, "proj"), "per_layer_proj", i, (h, w), "proj_in", True),
                TensorDef(_blk(i, "post_norm"), "post_norm", i, (h,), "post_norm", False),
            ]
        t.append(TensorDef(_blk(i, "layer_output_scale"), "layer_output_scale", i, (1,), "norm",
                           False))  # fmt: skip
        return t

    # ---- metadata -----------------------------------------------------------------------

    def metadata(self, cfg: ModelConfig) -> list[MetaItem]:
        """The converter's keys: per-layer KV heads and sliding flags, both kinds' head and
        rotated sizes, the per-layer input width and shared layers, the soft-cap."""
        a = self.name
        assert cfg.head_dim_full is not None and cfg.rope_theta_swa is not None
        replaced = {f"{a}.{k}" for k in (
            "feed_forward_length", "attention.head_count_kv", "attention.key_length",
            "attention.value_length", "attention.sliding_window_pattern", "rope.freq_base_swa",
        )}  # fmt: skip
        m = [item for item in super().metadata(cfg) if item.key not in replaced]
        n = cfg.layers
        ffn = [self._ffn(cfg, i) for i in range(n)]
        m += [
            MetaItem(f"{a}.feed_forward_length", ffn if len(set(ffn)) > 1 else cfg.ffn,
                     _ARR if len(set(ffn)) > 1 else _U32, _U32 if len(set(ffn)) > 1 else None),
            MetaItem(f"{a}.attention.head_count_kv", [self._head(cfg, i)[1] for i in range(n)],
                     _ARR, _U32),
            MetaItem(f"{a}.attention.sliding_window_pattern",
                     [self._swa(cfg, i) for i in range(n)], _ARR, GGUFValueType.BOOL),
            MetaItem(f"{a}.attention.key_length", cfg.head_dim_full, _U32),
            MetaItem(f"{a}.attention.value_length", cfg.head_dim_full, _U32),
            MetaItem(f"{a}.attention.key_length_swa", cfg.head_dim, _U32),
            MetaItem(f"{a}.attention.value_length_swa", cfg.head_dim, _U32),
            MetaItem(f"{a}.rope.dimension_count", cfg.head_dim_full, _U32),
            MetaItem(f"{a}.rope.dimension_count_swa", cfg.head_dim, _U32),
            MetaItem(f"{a}.rope.freq_base_swa", float(cfg.rope_theta_swa), _F32),
            MetaItem(f"{a}.attention.shared_kv_layers", cfg.shared_kv_layers, _U32),
            MetaItem(f"{a}.embedding_length_per_layer_input", cfg.per_layer_width, _U32),
            MetaItem(f"{a}.final_logit_softcapping", SOFTCAP, _F32),
        ]  # fmt: skip
        return m


#: The architectures of this module.
GEMMA4_ARCHS: tuple[MoeArch, ...] = (Gemma4(),)
