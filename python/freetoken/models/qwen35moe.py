"""Qwen3.5 / Qwen3.6 MoE (GGUF architecture ``qwen35moe``): Qwen3.5's hybrid decoder
(:mod:`~freetoken.models.qwen35`) with routed experts on every layer (softmax, the top-k
renormalized) plus a shared expert scaled by ``sigmoid(x . ffn_gate_inp_shexp)``."""

from __future__ import annotations

from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear
from freetoken.models.qwen2moe import GatedSharedExpert
from freetoken.models.qwen35 import FEATURES, MODEL
from freetoken.models.transformer import FFN, FFNFactory
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import Routing
from freetoken.runtime.scales import expert_scales

__all__ = ["FEATURES", "MODEL", "ffn_factory"]


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Routed experts and the gated shared expert on every layer (qwen35moe, qwen3next)."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        routing = Routing(top_k=cfg.n_experts_used, func="softmax", normalize=True)
        router = Linear(gguf, f"blk.{i}.ffn_gate_inp", (cfg.n_experts, cfg.hidden))
        # llama.cpp: the shared width from its key, else the dense FFN width.
        shared = GatedSharedExpert(gguf, i, cfg.hidden, cfg.expert_shared_ffn or cfg.ffn)
        scale = expert_scales(gguf, i, cfg.n_experts)
        layer = expert_layer(gguf, ctx, i)
        return MoeFFN(layer, router, routing, ctx.executor, shared=shared, expert_scale=scale)

    return make
