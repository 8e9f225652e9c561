"""GLM-4.5 / 4.6 (GGUF architecture ``glm4moe``): q/k/v biases, optional Q/K norms, partial
NEOX RoPE (``rope.dimension_count`` of the head), the feed-forward norm named
``post_attention_norm``, leading dense layers, then MoE layers: sigmoid routing with a
selection-only bias (``exp_probs_b``), optional grouped top-k, renormalized weights and a
routed scaling factor, plus a shared expert. Trailing next-token-prediction layers
(``nextn_predict_layers``) are skipped by the Transformer."""

from __future__ import annotations

from freetoken.errors import UnsupportedError
from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear, load_vector
from freetoken.models.transformer import FFN, DenseFFN, Features, FFNFactory
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import GATING_FUNCS, Routing
from freetoken.runtime.scales import expert_scales

FEATURES = Features(rope_neox=True, ffn_norm="post_attention_norm", optional_qk_norm=True)


def routing(cfg: ModelConfig, default_func: str) -> Routing:
    """The routing of ``cfg``'s keys (``expert_gating_func`` 0: ``default_func``); shared
    with deepseek2, whose llama.cpp graph is the same."""
    code = cfg.expert_gating_func
    if code not in GATING_FUNCS:
        raise UnsupportedError(f"{cfg.arch}: expert_gating_func {code} is not supported")
    func = default_func if code == 0 else GATING_FUNCS[code]
    return Routing(
        top_k=cfg.n_experts_used,
        func=func,
        normalize=cfg.expert_weights_norm,
        scale=cfg.expert_weights_scale or 1.0,
        n_groups=max(cfg.expert_groups, 1),
        groups_used=max(cfg.expert_groups_used, 1),
    )


def moe_ffn(gguf: GGUFFile, ctx: MoeContext, cfg: ModelConfig, i: int, default_func: str) -> MoeFFN:
    """Layer ``i``'s routed experts (stacked or fused gate/up), their optional selection bias
    and the shared experts (``expert_shared_count`` of the expert size)."""
    p = f"blk.{i}."
    e, h = cfg.n_experts, cfg.hidden
    router = Linear(gguf, p + "ffn_gate_inp", (e, h))
    bias_name = p + "exp_probs_b.bias"
    bias = load_vector(gguf, bias_name, e) if bias_name in gguf else None
    fused = p + "ffn_gate_up_exps.weight"
    layer = (
        expert_layer(gguf, ctx, i, gate_up=[fused]) if fused in gguf else expert_layer(gguf, ctx, i)
    )
    n_shared = gguf.metadata.get(f"{cfg.arch}.expert_shared_count", 0)
    shared = None
    if n_shared:
        # llama.cpp: the expert size times the count, when the file gives no expert size
        # the dense size over the experts used.
        expert_ffn = cfg.expert_ffn or cfg.ffn // cfg.n_experts_used
        shared = DenseFFN(gguf, p, h, expert_ffn * int(n_shared), "silu", "_shexp")
    scale = expert_scales(gguf, i, cfg.n_experts)
    return MoeFFN(layer, router, routing(cfg, default_func), ctx.executor, bias, shared, scale)


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Dense feed-forwards on the first ``leading_dense_block_count`` layers, MoE after."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        if i < cfg.leading_dense:
            return DenseFFN(gguf, f"blk.{i}.", cfg.hidden, cfg.ffn, "silu")
        return moe_ffn(gguf, ctx, cfg, i, default_func="sigmoid")

    return make
