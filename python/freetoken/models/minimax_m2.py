"""MiniMax-M2 (GGUF architecture ``minimax-m2``): RMSNorm over the whole q and k
projections (before the split into heads), NEOX RoPE on the first ``rope.dimension_count``
dims of each head, and a mixture of experts on every layer routed by
``expert_gating_func`` (sigmoid in the released files) with the selection-only bias
``exp_probs_b``, the top-k weights renormalized and scaled by ``expert_weights_scale``."""

from __future__ import annotations

from freetoken.errors import GGUFError, UnsupportedError
from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear, load_vector
from freetoken.models.transformer import FFN, Features, FFNFactory
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import GATING_FUNCS, Routing
from freetoken.runtime.scales import expert_scales

__all__ = ["FEATURES", "ffn_factory"]

FEATURES = Features(rope_neox=True, qk_norm_full=True)


def _routing(cfg: ModelConfig) -> Routing:
    code = cfg.expert_gating_func
    # llama.cpp's graph has no gating for a file without the key (it aborts).
    if code == 0:
        raise GGUFError(f"{cfg.arch}: missing metadata key `{cfg.arch}.expert_gating_func`")
    if code not in GATING_FUNCS:
        raise UnsupportedError(f"{cfg.arch}: expert_gating_func {code} is not supported")
    return Routing(
        top_k=cfg.n_experts_used,
        func=GATING_FUNCS[code],
        normalize=True,
        scale=cfg.expert_weights_scale or 1.0,
    )


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Routed experts with the selection bias on every layer."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        p = f"blk.{i}."
        router = Linear(gguf, p + "ffn_gate_inp", (cfg.n_experts, cfg.hidden))
        bias = load_vector(gguf, p + "exp_probs_b.bias", cfg.n_experts)
        layer = expert_layer(gguf, ctx, i)
        scale = expert_scales(gguf, i, cfg.n_experts)
        return MoeFFN(layer, router, _routing(cfg), ctx.executor, bias, expert_scale=scale)

    return make
