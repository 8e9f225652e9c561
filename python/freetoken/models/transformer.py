"""The decoder shared by the dense families: each family file says which features it uses
(biases, q/k norms, sandwich norms, embedding scale, activation, RoPE layout, sliding
window) and this module runs them."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from freetoken.engine.kv_cache import KVCache
from freetoken.engine.moe import MoeContext
from freetoken.errors import InvalidInputError
from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.layers import (
    Embedding,
    Linear,
    apply_rope,
    attention,
    default_attn_scale,
    load_vector,
    rms_norm,
)

__all__ = ["Features", "Transformer"]

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


@dataclass(frozen=True)
class Features:
    """What a family adds to the plain pre-norm decoder."""

    rope_neox: bool = True
    qk_norm: bool = False
    sandwich_norm: bool = False
    embed_scale: bool = False
    activation: str = "silu"
    swa_pattern: int = 0


FFN = Callable[[torch.Tensor], torch.Tensor]
#: Builds layer i's feed-forward; MoE families give their own.
FFNFactory = Callable[[GGUFFile, ModelConfig, int], FFN]


class DenseFFN:
    """``down(act(gate(x)) * up(x))``."""

    def __init__(self, gguf: GGUFFile, prefix: str, hidden: int, ffn: int, act: str) -> None:
        self.gate = Linear(gguf, prefix + "ffn_gate", (ffn, hidden))
        self.up = Linear(gguf, prefix + "ffn_up", (ffn, hidden))
        self.down = Linear(gguf, prefix + "ffn_down", (hidden, ffn))
        self.act = _ACTIVATIONS[act]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x)) * self.up(x))


def dense_ffn(feat: Features) -> FFNFactory:
    """The factory of plain gated feed-forwards with the family's activation."""

    def make(gguf: GGUFFile, cfg: ModelConfig, i: int) -> FFN:
        return DenseFFN(gguf, f"blk.{i}.", cfg.hidden, cfg.ffn, feat.activation)

    return make


class Block:
    """One decoder layer's weights."""

    def __init__(
        self, gguf: GGUFFile, cfg: ModelConfig, feat: Features, i: int, make_ffn: FFNFactory
    ) -> None:
        p = f"blk.{i}."
        h, hd, hdv = cfg.hidden, cfg.head_dim, cfg.head_dim_v
        self.attn_norm = load_vector(gguf, p + "attn_norm.weight", h)
        self.wq = Linear(gguf, p + "attn_q", (cfg.n_heads * hd, h))
        self.wk = Linear(gguf, p + "attn_k", (cfg.n_kv_heads * hd, h))
        self.wv = Linear(gguf, p + "attn_v", (cfg.n_kv_heads * hdv, h))
        self.wo = Linear(gguf, p + "attn_output", (h, cfg.n_heads * hdv))
        self.ffn_norm = load_vector(gguf, p + "ffn_norm.weight", h)
        self.ffn = make_ffn(gguf, cfg, i)
        self.q_norm = self.k_norm = self.post_attn_norm = self.post_ffn_norm = None
        if feat.qk_norm:
            self.q_norm = load_vector(gguf, p + "attn_q_norm.weight", hd)
            self.k_norm = load_vector(gguf, p + "attn_k_norm.weight", hd)
        if feat.sandwich_norm:
            self.post_attn_norm = load_vector(gguf, p + "post_attention_norm.weight", h)
            self.post_ffn_norm = load_vector(gguf, p + "post_ffw_norm.weight", h)
        self.swa = cfg.swa_layers[i]


class Transformer:
    """A dense decoder-only model over a mapped GGUF file."""

    def __init__(
        self,
        gguf: GGUFFile,
        cfg: ModelConfig,
        feat: Features,
        attn_scale: float | None = None,
        progress: Callable[[int, int], None] | None = None,
        make_ffn: FFNFactory | None = None,
    ) -> None:
        self.cfg = cfg
        self.feat = feat
        #: The MoE executor and counters of MoE families (set by ``load_model``).
        self.moe: MoeContext | None = None
        self.attn_scale = attn_scale or default_attn_scale(cfg.head_dim)
        make_ffn = make_ffn or dense_ffn(feat)
        self.embed = Embedding(gguf, "token_embd.weight", cfg.vocab_size, cfg.hidden)
        self.blocks = []
        for i in range(cfg.n_layers):
            self.blocks.append(Block(gguf, cfg, feat, i, make_ffn))
            if progress:
                progress(i + 1, cfg.n_layers)
        self.output_norm = load_vector(gguf, "output_norm.weight", cfg.hidden)
        out_name = "output" if "output.weight" in gguf else "token_embd"
        self.output = Linear(gguf, out_name, (cfg.vocab_size, cfg.hidden))
        self.rope_factors = (
            load_vector(gguf, "rope_freqs.weight", cfg.rope_dim // 2)
            if "rope_freqs.weight" in gguf
            else None
        )

    def new_cache(self, n_ctx: int) -> KVCache:
        """An empty KV cache for one sequence of up to ``n_ctx`` tokens."""
        c = self.cfg
        return KVCache(c.n_layers, n_ctx, c.n_kv_heads, c.head_dim, c.head_dim_v)

    def forward(self, tokens: list[int], cache: KVCache, all_logits: bool = False) -> torch.Tensor:
        """Runs ``tokens`` after the cache's positions; returns float32 logits for the last
        token ``[vocab]``, or for every token ``[T, vocab]`` with ``all_logits``."""
        return self.forward_batch([(tokens, cache)], all_logits)[0]

    @torch.inference_mode()
    def forward_batch(
        self, seqs: list[tuple[list[int], KVCache]], all_logits: bool = False
    ) -> list[torch.Tensor]:
        """Runs several sequences in one pass (continuous batching): the weight products see
        all their rows together, attention runs per sequence on its own cache. Returns each
        sequence's logits as :meth:`forward` does."""
        cfg = self.cfg
        spans = []
        for tokens, cache in seqs:
            if not tokens:
                raise InvalidInputError("a sequence in the batch has no tokens")
            spans.append((cache.reserve(len(tokens)), len(tokens), cache))
        flat = [t for tokens, _ in seqs for t in tokens]
        pos = torch.cat([torch.arange(start, start + n) for start, n, _ in spans])
        x = self.embed(flat)
        if self.feat.embed_scale:
            x = x * math.sqrt(cfg.hidden)
        for i, blk in enumerate(self.blocks):
            x = self._layer(i, blk, x, pos, spans)
        for _, n, cache in spans:
            cache.commit(n)
        if not all_logits:
            ends = torch.tensor([0] + [n for _, n, _ in spans]).cumsum(0)[1:] - 1
            x = x[ends]
        logits = self.output(rms_norm(x, self.output_norm, cfg.norm_eps))
        if cfg.final_logit_softcap:
            cap = cfg.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        if not all_logits:
            return list(logits.unbind(0))
        return list(logits.split([n for _, n, _ in spans]))

    def _layer(
        self,
        i: int,
        blk: Block,
        x: torch.Tensor,
        pos: torch.Tensor,
        spans: list[tuple[int, int, KVCache]],
    ) -> torch.Tensor:
        cfg, feat = self.cfg, self.feat
        t = x.shape[0]
        h = rms_norm(x, blk.attn_norm, cfg.norm_eps)
        q = blk.wq(h).view(t, cfg.n_heads, cfg.head_dim)
        k = blk.wk(h).view(t, cfg.n_kv_heads, cfg.head_dim)
        v = blk.wv(h).view(t, cfg.n_kv_heads, cfg.head_dim_v)
        if blk.q_norm is not None and blk.k_norm is not None:
            q = rms_norm(q, blk.q_norm, cfg.norm_eps)
            k = rms_norm(k, blk.k_norm, cfg.norm_eps)
        base = cfg.rope_base_swa if blk.swa else cfg.rope_base
        scale = 1.0 if blk.swa else cfg.rope_scale
        q = apply_rope(q, pos, base, cfg.rope_dim, scale, feat.rope_neox, self.rope_factors)
        k = apply_rope(k, pos, base, cfg.rope_dim, scale, feat.rope_neox, self.rope_factors)
        window = cfg.sliding_window if blk.swa else 0
        outs, row = [], 0
        for start, n, cache in spans:
            k_all, v_all = cache.store(i, start, k[row : row + n], v[row : row + n])
            outs.append(attention(q[row : row + n], k_all, v_all, start, self.attn_scale, window))
            row += n
        a = blk.wo(outs[0] if len(outs) == 1 else torch.cat(outs))
        if blk.post_attn_norm is not None:
            a = rms_norm(a, blk.post_attn_norm, cfg.norm_eps)
        x = x + a
        h = rms_norm(x, blk.ffn_norm, cfg.norm_eps)
        f = blk.ffn(h)
        if blk.post_ffn_norm is not None:
            f = rms_norm(f, blk.post_ffn_norm, cfg.norm_eps)
        return x + f
