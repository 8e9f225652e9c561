"""Qwen1.5-MoE / Qwen2-MoE (GGUF architecture ``qwen2moe``): Qwen2's attention (q/k/v biases,
NEOX RoPE) and on every layer a mixture of experts: softmax over all experts, the top-k
probabilities used as they are (llama.cpp's graph does not renormalize them; a file that sets
``expert_weights_norm`` asks for it, as Hugging Face's ``norm_topk_prob`` does), plus a shared
expert scaled per token by ``sigmoid(x . ffn_gate_inp_shexp)``."""

from __future__ import annotations

import torch

from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear, load_vector
from freetoken.models.transformer import FFN, DenseFFN, Features, FFNFactory
from freetoken.runtime.moe import MoeContext, MoeFFN, expert_layer
from freetoken.runtime.routing import Routing
from freetoken.runtime.scales import expert_scales

FEATURES = Features(rope_neox=True)


class GatedSharedExpert:
    """The shared expert: a SwiGLU FFN over ``ffn_{gate,up,down}_shexp``, its output scaled
    per token by ``sigmoid(x . ffn_gate_inp_shexp)``."""

    def __init__(self, gguf: GGUFFile, i: int, hidden: int, width: int) -> None:
        p = f"blk.{i}."
        self.ffn = DenseFFN(gguf, p, hidden, width, "silu", "_shexp")
        self.gate = load_vector(gguf, p + "ffn_gate_inp_shexp.weight", hidden)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # An elementwise product and a row sum, not `x @ gate`: on the GPU cuBLAS runs a
        # matrix-vector product of one row as a split-K `addmv` (about 30 us against 3).
        return self.ffn(x) * torch.sigmoid((x * self.gate).sum(-1, keepdim=True))


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Routed experts and the gated shared expert on every layer."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        routing = Routing(
            top_k=cfg.n_experts_used, func="softmax", normalize=cfg.expert_weights_norm
        )
        router = Linear(gguf, f"blk.{i}.ffn_gate_inp", (cfg.n_experts, cfg.hidden))
        # llama.cpp: the shared width from its key, else the dense FFN width.
        width = cfg.expert_shared_ffn or cfg.ffn
        shared = GatedSharedExpert(gguf, i, cfg.hidden, width)
        scale = expert_scales(gguf, i, cfg.n_experts)
        layer = expert_layer(gguf, ctx, i)
        return MoeFFN(layer, router, routing, ctx.executor, shared=shared, expert_scale=scale)

    return make
