"""gpt-oss (GGUF architecture ``gpt-oss``): alternating sliding-window and full attention
layers (the first of each pair slides), per-head attention sinks, biases on q/k/v/o, YaRN
RoPE on every layer, and a mixture of experts on every layer: the router's top-k logits
(with the router bias) softmaxed, experts with biases and the clamped SwiGLU
(``LLM_FFN_SWIGLU_OAI_MOE``, alpha 1.702 and limit 7, fixed in llama.cpp), usually MXFP4."""

from __future__ import annotations

import math

from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear
from freetoken.models.transformer import FFN, Features, FFNFactory
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import Routing
from freetoken.runtime.scales import expert_scales

FEATURES = Features(
    rope_neox=True,
    attn_sinks=True,
    ffn_norm="post_attention_norm",
    swa_pattern=2,
    swa_rope_as_full=True,
)


def attn_scale(cfg: ModelConfig) -> float:
    """llama.cpp scales scores by ``1/sqrt(n_rot)``."""
    return 1.0 / math.sqrt(cfg.rope_dim)


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Routed experts with biases on every layer."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        # llama.cpp's gpt-oss graph fixes the gating to softmax over the chosen logits; a
        # weights scale of 0 (its default) means none.
        scale = cfg.expert_weights_scale or 1.0
        routing = Routing(top_k=cfg.n_experts_used, func="softmax_weight", scale=scale)
        router = Linear(gguf, f"blk.{i}.ffn_gate_inp", (cfg.n_experts, cfg.hidden))
        layer = expert_layer(gguf, ctx, i, act="swiglu_oai", biases=True)
        expert_scales(gguf, i, cfg.n_experts, biases=True)  # refuses any
        return MoeFFN(layer, router, routing, ctx.executor)

    return make
