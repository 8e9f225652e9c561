"""Qwen3-MoE: Qwen3's attention (Q/K norms, NEOX RoPE) with every layer's feed-forward a
softmax-routed mixture of experts, weights renormalized over the top-k."""

from __future__ import annotations

from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear
from freetoken.models.transformer import FFN, Features, FFNFactory
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import Routing
from freetoken.runtime.scales import expert_scales

FEATURES = Features(rope_neox=True, qk_norm=True)


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Routed experts on every layer."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        routing = Routing(top_k=cfg.n_experts_used, func="softmax", normalize=True)
        router = Linear(gguf, f"blk.{i}.ffn_gate_inp", (cfg.n_experts, cfg.hidden))
        scale = expert_scales(gguf, i, cfg.n_experts)
        layer = expert_layer(gguf, ctx, i)
        return MoeFFN(layer, router, routing, ctx.executor, expert_scale=scale)

    return make
