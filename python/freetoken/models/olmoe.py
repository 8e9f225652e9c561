"""OLMoE (GGUF architecture ``olmoe``): NEOX RoPE, RMSNorm over the whole q and k projections
(weights of ``hidden`` entries, before the split into heads; llama.cpp's olmoe graph norms
``Qcur``/``Kcur`` before reshaping them), and on every layer a mixture of
``feed_forward_length``-wide experts: softmax over all experts, the top-k probabilities used as
they are (llama.cpp's graph does not renormalize them; ``expert_weights_norm`` in the file
asks for it)."""

from __future__ import annotations

from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear
from freetoken.models.transformer import FFN, Features, FFNFactory
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import Routing
from freetoken.runtime.scales import expert_scales

FEATURES = Features(rope_neox=True, qk_norm_full=True)


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Routed experts on every layer."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        routing = Routing(
            top_k=cfg.n_experts_used, func="softmax", normalize=cfg.expert_weights_norm
        )
        router = Linear(gguf, f"blk.{i}.ffn_gate_inp", (cfg.n_experts, cfg.hidden))
        scale = expert_scales(gguf, i, cfg.n_experts)
        layer = expert_layer(gguf, ctx, i)
        return MoeFFN(layer, router, routing, ctx.executor, expert_scale=scale)

    return make
