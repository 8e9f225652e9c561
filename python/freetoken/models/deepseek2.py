"""DeepSeek-V2 / V3 (GGUF architecture ``deepseek2``): multi-head latent attention (queries
through ``q_a`` / norm / ``q_b`` or a plain ``q``; keys and values from one compressed latent,
RoPE on separate decoupled dims with the llama layout; YaRN with ``mscale_all_dim``),
leading dense layers, then MoE layers: softmax or sigmoid routing per
``expert_gating_func``, an optional selection bias, grouped top-k, renormalization and a
routed scaling factor, plus shared experts. See
:class:`~freetoken.models.transformer.MLAShape` for what the KV cache holds."""

from __future__ import annotations

from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.glm4moe import moe_ffn
from freetoken.models.transformer import FFN, DenseFFN, Features, FFNFactory
from freetoken.runtime.moe import MoeContext

FEATURES = Features(rope_neox=False, mla=True, yarn_log_mul=True)

#: GLM-4.7-Flash files (deepseek2 layout, 47 or 48 layers, this vocabulary) without a gating
#: key route by sigmoid, as llama.cpp special-cases them.
_GLM_LITE_VOCAB = 154880


def _default_gating(cfg: ModelConfig) -> str:
    if cfg.n_layers in (47, 48) and cfg.vocab_size == _GLM_LITE_VOCAB:
        return "sigmoid"
    return "softmax"


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Dense feed-forwards on the first ``leading_dense_block_count`` layers, MoE after."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        if i < cfg.leading_dense:
            return DenseFFN(gguf, f"blk.{i}.", cfg.hidden, cfg.ffn, "silu")
        return moe_ffn(gguf, ctx, cfg, i, default_func=_default_gating(cfg))

    return make
