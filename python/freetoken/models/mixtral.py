"""Mixtral: the ``llama`` architecture with ``llama.expert_count`` > 0 (the llama family
module dispatches here). Every layer's FFN is a mixture of ``feed_forward_length``-wide
experts: softmax over all experts, the top-k probabilities renormalized. The experts are
stacked (``ffn_{gate,up,down}_exps``) or, in older files, one tensor per expert
(``ffn_gate.E``, ``ffn_up.E``, ``ffn_down.E``)."""

from __future__ import annotations

from freetoken.errors import GGUFError
from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear
from freetoken.models.transformer import FFN, FFNFactory
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import Routing
from freetoken.runtime.scales import expert_scales


def expert_names(gguf: GGUFFile, cfg: ModelConfig, i: int) -> dict[str, list[str]]:
    """Layer ``i``'s expert tensor names for :func:`expert_layer`: none for the stacked layout
    (its default), else one list per matrix of the per-expert layout."""
    p = f"blk.{i}."
    if f"{p}ffn_up_exps.weight" in gguf:
        return {}
    names = {
        k: [f"{p}ffn_{k}.{e}.weight" for e in range(cfg.n_experts)] for k in ("gate", "up", "down")
    }
    missing = [n for kind in names.values() for n in kind if n not in gguf]
    if missing:
        raise GGUFError(
            f"layer {i} has neither `{p}ffn_up_exps.weight` nor the per-expert tensors "
            f"(missing `{missing[0]}`)"
        )
    return names


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Routed experts on every layer, either tensor layout."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        routing = Routing(top_k=cfg.n_experts_used, func="softmax", normalize=True)
        router = Linear(gguf, f"blk.{i}.ffn_gate_inp", (cfg.n_experts, cfg.hidden))
        layer = expert_layer(gguf, ctx, i, "silu", False, **expert_names(gguf, cfg, i))
        scale = expert_scales(gguf, i, cfg.n_experts)
        return MoeFFN(layer, router, routing, ctx.executor, expert_scale=scale)

    return make
