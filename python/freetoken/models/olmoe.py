"""OLMoE (GGUF architecture ``olmoe``): NEOX RoPE, RMSNorm over the whole q and k projections
(weights of ``hidden`` entries, before the split into heads; llama.cpp's olmoe graph norms
``Qcur``/``Kcur`` before reshaping them), and on every layer a mixture of
``feed_forward_length``-wide experts: softmax over all experts, the top-k probabilities used as
they are (llama.cpp's graph does not renormalize them; ``expert_weights_norm`` in the file
asks for it)."""

from __future__ import annotations

from typing import Any

import torch

from freetoken.engine.kv_cache import KVCache
from freetoken.engine.moe import MoeContext, MoeFFN, expert_layer
from freetoken.engine.routing import Routing
from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import Linear, attention, linear_group, load_vector, rms_norm
from freetoken.models.transformer import FFN, Block, Features, FFNFactory, Transformer

# Not the per-head q/k norm of Features: OlmoeTransformer norms the whole projections.
FEATURES = Features(rope_neox=True)


class OlmoeTransformer(Transformer):
    """The decoder with each layer's ``attn_q_norm`` / ``attn_k_norm`` applied over the whole
    q and k projections, before the split into heads."""

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, feat: Features, **kwargs: Any) -> None:
        super().__init__(gguf, cfg, feat, **kwargs)
        c = self.cfg
        self.qk_norms = [
            (
                load_vector(gguf, f"blk.{i}.attn_q_norm.weight", c.n_heads * c.head_dim),
                load_vector(gguf, f"blk.{i}.attn_k_norm.weight", c.n_kv_heads * c.head_dim),
            )
            for i in range(c.n_layers)
        ]

    def _attention(
        self,
        i: int,
        blk: Block,
        h: torch.Tensor,
        pos: torch.Tensor,
        spans: list[tuple[int, int, KVCache]],
    ) -> torch.Tensor:
        # As Transformer._attention, with the norms before the reshape into heads.
        cfg = self.cfg
        t = h.shape[0]
        q_norm, k_norm = self.qk_norms[i]
        q, k, v = linear_group((blk.wq, blk.wk, blk.wv), h)
        q = rms_norm(q, q_norm, cfg.norm_eps).view(t, cfg.n_heads, cfg.head_dim)
        k = rms_norm(k, k_norm, cfg.norm_eps).view(t, cfg.n_kv_heads, cfg.head_dim)
        v = v.view(t, cfg.n_kv_heads, cfg.head_dim_v)
        q = self._rope(q, pos, blk, cfg.rope_dim)
        k = self._rope(k, pos, blk, cfg.rope_dim)
        outs, row = [], 0
        for start, n, cache in spans:
            k_all, v_all = cache.store(i, start, k[row : row + n], v[row : row + n])
            outs.append(attention(q[row : row + n], k_all, v_all, start, self.attn_scale))
            row += n
        return outs[0] if len(outs) == 1 else torch.cat(outs)


#: The model class ``load_model`` builds for this family.
MODEL = OlmoeTransformer


def ffn_factory(ctx: MoeContext) -> FFNFactory:
    """Routed experts on every layer."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        routing = Routing(
            top_k=cfg.n_experts_used, func="softmax", normalize=cfg.expert_weights_norm
        )
        router = Linear(gguf, f"blk.{i}.ffn_gate_inp", (cfg.n_experts, cfg.hidden))
        return MoeFFN(expert_layer(gguf, ctx, i), router, routing, ctx.executor)

    return make
