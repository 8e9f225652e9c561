"""The Gated DeltaNet hybrid decoder shared by ``qwen35``, ``qwen35moe`` and ``qwen3next``.

Every layer: ``x += mix(rms_norm(x, attn_norm))``, then ``x += ffn(rms_norm(x,
post_attention_norm))``, where ``mix`` is Gated DeltaNet linear attention
(:mod:`~freetoken.models.delta_net`) on the recurrent layers and gated full attention on the
others (llama.cpp: layer ``i`` is recurrent unless ``(i + 1) % full_attention_interval == 0``,
or per layer from ``attention.recurrent_layers``). Gated full attention: ``attn_q`` gives per
head the query and an output gate; q and k are RMS-normed per head, rotated over the first
``rope.dimension_count`` dims (NEOX pairs; qwen35's interleaved multi-section RoPE on text
positions rotates the pairs of the first three sections and leaves the fourth's, whose
position is 0), attention is causal and the result is scaled by ``sigmoid(gate)`` before
``attn_output``.

Each sequence's cache is a :class:`~freetoken.runtime.recurrent_cache.HybridCache`: keys and
values of the full-attention layers, the conv and delta-rule states of the others, on the
model's device. Everything here runs as plain torch ops on either device, but for a GPU decode
step's recurrent layers, two fused kernels (:func:`~freetoken.runtime.gpu.gdn_decode`); a
decode step (one token per sequence: the recurrent step, no chunks) reads nothing back to the
host, so the GPU placements capture it as a CUDA graph like any other model's.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from freetoken.errors import GGUFError
from freetoken.gguf import GGUFFile
from freetoken.models.config import ModelConfig
from freetoken.models.delta_net import DeltaNetLayer, DeltaNetShape
from freetoken.models.layers import (
    Linear,
    RopeScaling,
    default_attn_scale,
    linear_group,
    load_vector,
    rms_norm,
)
from freetoken.models.transformer import (
    Block,
    Features,
    FFNFactory,
    Transformer,
    dense_ffn,
    past_trunk,
)
from freetoken.runtime.recurrent_cache import HybridCache
from freetoken.runtime.step import Step

__all__ = ["HybridTransformer", "recurrent_layers", "rope_pairs"]


def recurrent_layers(meta: dict, arch: str, n_layers: int) -> tuple[bool, ...]:
    """Which layers are linear attention: ``attention.recurrent_layers`` if the file has it,
    else all but every ``full_attention_interval``-th (default 4). GGUFError naming the key
    when it does not fit the layer count."""
    per_layer = meta.get(f"{arch}.attention.recurrent_layers")
    if per_layer is not None:
        if not isinstance(per_layer, list) or len(per_layer) < n_layers:
            raise GGUFError(
                f"metadata `{arch}.attention.recurrent_layers` does not give each of the "
                f"{n_layers} layers"
            )
        return tuple(bool(v) for v in per_layer[:n_layers])
    key = f"{arch}.full_attention_interval"
    n = meta.get(key, 4)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= n_layers:
        raise GGUFError(
            f"metadata `{key}` is {n!r}: it must be in 1..{n_layers} (the layer count), so "
            "that some layer has full attention"
        )
    return tuple((i + 1) % n != 0 for i in range(n_layers))


def rope_pairs(meta: dict, arch: str, n_rot: int, head_dim: int) -> torch.Tensor | None:
    """qwen35's interleaved multi-section RoPE on text (positions ``p, p, p, 0``): a mask of
    the ``n_rot / 2`` pairs that rotate (None: the file has no sections, NEOX rotates all)."""
    key = f"{arch}.rope.dimension_sections"
    sections = meta.get(key)
    if sections is None:
        return None
    if not isinstance(sections, list) or not 1 <= len(sections) <= 4:
        raise GGUFError(f"metadata `{key}` is {sections!r}, expected up to 4 section sizes")
    s = [int(v) for v in sections] + [0] * (4 - len(sections))
    total = sum(s)
    if total <= 0 or total > head_dim or min(s) < 0:
        raise GGUFError(f"metadata `{key}` {s} must sum to 1..{head_dim} (the head size)")
    sector = torch.arange(n_rot // 2) % total
    kind = sector % 3
    return (
        ((kind == 0) & (sector < 3 * s[0]))
        | ((kind == 1) & (sector < 3 * s[1]))
        | ((kind == 2) & (sector < 3 * s[2]))
    )


class GatedAttention:
    """One full-attention layer's weights: q with its output gate, k, v, the per-head q/k
    norms and the output projection."""

    def __init__(self, gguf: GGUFFile, cfg: ModelConfig, i: int) -> None:
        p, h, hd = f"blk.{i}.", cfg.hidden, cfg.head_dim
        self.wq = Linear(gguf, p + "attn_q", (2 * cfg.n_heads * hd, h))
        self.wk = Linear(gguf, p + "attn_k", (cfg.n_kv_heads * hd, h))
        self.wv = Linear(gguf, p + "attn_v", (cfg.n_kv_heads * hd, h))
        self.q_norm = load_vector(gguf, p + "attn_q_norm.weight", hd)
        self.k_norm = load_vector(gguf, p + "attn_k_norm.weight", hd)
        self.wo = Linear(gguf, p + "attn_output", (h, cfg.n_heads * hd))


class HybridBlock(Block):
    """One hybrid layer: its input norm, full or linear attention, FFN norm and FFN. The
    attention-side attributes of :class:`Block` (RoPE base and scale) are the ones the
    Transformer's RoPE helpers read; ``index`` is its layer among the cache's attention or
    recurrent layers."""

    #: The RoPE pairs that rotate, None when all do (set by the Transformer: each layer holds
    #: its own, which placement moves to the layer's GPU).
    rope_mask: torch.Tensor | None = None

    def __init__(
        self,
        gguf: GGUFFile,
        cfg: ModelConfig,
        i: int,
        make_ffn: FFNFactory,
        shape: DeltaNetShape | None,
        fused_ba: bool,
        index: int,
    ) -> None:
        p = f"blk.{i}."
        self.attn_norm = load_vector(gguf, p + "attn_norm.weight", cfg.hidden)
        self.ffn_norm = load_vector(gguf, p + "post_attention_norm.weight", cfg.hidden)
        self.delta = DeltaNetLayer(gguf, i, cfg.hidden, shape, fused_ba) if shape else None
        self.attn = None if shape else GatedAttention(gguf, cfg, i)
        self.index = index
        self.ffn = make_ffn(gguf, cfg, i)
        self.swa = False
        self.rope_base = cfg.rope_base
        self.rope_scale = 1.0


class HybridTransformer(Transformer):
    """A Gated DeltaNet hybrid decoder over a mapped GGUF file (module docstring). The
    family sets ``grouped`` (value heads grouped by key head) and ``fused_ba``."""

    def __init__(
        self,
        gguf: GGUFFile,
        cfg: ModelConfig,
        feat: Features,
        attn_scale: float | None = None,
        progress: Callable[[int, int], None] | None = None,
        make_ffn: FFNFactory | None = None,
        *,
        grouped: bool = False,
        fused_ba: bool = False,
    ) -> None:
        meta = gguf.metadata
        arch = cfg.arch
        cfg = self._trunk(meta, cfg)
        self.feat = feat
        self.moe = None
        self.mla = None
        self.rope = RopeScaling.from_metadata(meta, arch, False)
        self.attn_scale = attn_scale or default_attn_scale(cfg.head_dim)
        if cfg.rope_dim % 2 or not 2 <= cfg.rope_dim <= cfg.head_dim:
            raise GGUFError(
                f"metadata `{arch}.rope.dimension_count` is {cfg.rope_dim}: it must be even and "
                f"at most the head size {cfg.head_dim}"
            )
        mask = rope_pairs(meta, arch, cfg.rope_dim, cfg.head_dim)
        #: The pairs that rotate, None when all do (each block holds it too).
        self.rope_mask = None if mask is None or bool(mask.all()) else mask
        self.recurrent = recurrent_layers(meta, arch, cfg.n_layers)
        shape = DeltaNetShape.from_metadata(meta, arch, grouped) if any(self.recurrent) else None
        make_ffn = make_ffn or dense_ffn(feat)
        self.make_ffn = make_ffn
        self.blocks = []
        n_rec = n_attn = 0
        for i in range(cfg.n_layers):
            rec = self.recurrent[i]
            index = n_rec if rec else n_attn
            blk = HybridBlock(gguf, cfg, i, make_ffn, shape if rec else None, fused_ba, index)
            blk.rope_mask = self.rope_mask
            self.blocks.append(blk)
            n_rec, n_attn = n_rec + rec, n_attn + (not rec)
            if progress:
                progress(i + 1, cfg.n_layers)
        self.n_attn_layers = n_attn
        self._load_ends(gguf, cfg)
        self.rope_factors = None
        #: The multi-token-prediction blocks' tensors (``blk.N.*`` from the trunk's layer
        #: count on), kept in the mapped file for speculative decoding; the trunk does not
        #: run them.
        self.mtp_tensors = [
            name
            for name in gguf.tensors
            if name.startswith("blk.") and int(name.split(".")[1]) >= cfg.n_layers
        ]

    def mtp_block(self, gguf: GGUFFile, i: int) -> Block:
        """Layer ``i`` past the trunk (a multi-token-prediction layer): a gated
        full-attention block with the family's feed-forward, its keys and values in layer 0
        of its own cache."""
        blk = HybridBlock(gguf, past_trunk(self.cfg, i), i, self.make_ffn, None, False, 0)
        blk.rope_mask = self.rope_mask
        return blk

    def mtp_kv_shape(self) -> tuple[int, int, int]:
        """(heads, key dims, value dims) per position of a multi-token-prediction layer's
        cache: a full-attention layer's."""
        return self._kv_shape()

    def _kv_shape(self) -> tuple[int, int, int]:
        c = self.cfg
        return c.n_kv_heads, c.head_dim, c.head_dim

    def _state_shapes(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        deltas = [blk.delta for blk in self.blocks if isinstance(blk, HybridBlock)]
        return [d.state_shapes() for d in deltas if d is not None]

    def kv_bytes(self, n_ctx: int) -> int:
        """Bytes of one sequence's cache of ``n_ctx`` positions (float32): the full-attention
        layers' keys and values and the recurrent states."""
        heads, dk, dv = self._kv_shape()
        states = sum(
            4 * (torch.Size(c).numel() + torch.Size(s).numel()) for c, s in self._state_shapes()
        )
        return 4 * self.n_attn_layers * n_ctx * heads * (dk + dv) + states

    def new_cache(self, n_ctx: int, max_step: int = 0) -> HybridCache:
        """An empty cache for one sequence of up to ``n_ctx`` tokens (``max_step`` does not
        apply: these models have no sliding-window layers)."""
        # With the layers split over several GPUs, each cache layer goes beside its layer.
        per_layer = list(zip(self.layer_devices or (), self.recurrent, strict=False))
        return HybridCache(
            self.n_attn_layers,
            n_ctx,
            *self._kv_shape(),
            state_shapes=self._state_shapes(),
            device=self.device,
            v_transposed=self.device.type == "cuda",
            kv_devices=[d for d, rec in per_layer if not rec],
            state_devices=[d for d, rec in per_layer if rec],
            dtypes=self.kv_dtypes,
        )

    def _rope_tables(
        self, x: torch.Tensor, step: Step, blk: Block, n_rot: int, whole: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = super()._rope_tables(x, step, blk, n_rot, False)
        mask = blk.rope_mask if isinstance(blk, HybridBlock) else None
        if mask is not None:
            cos = torch.where(mask, cos, torch.ones_like(cos))
            sin = torch.where(mask, sin, torch.zeros_like(sin))
        if whole:
            cos, sin = torch.cat([cos, cos], -1), torch.cat([-sin, sin], -1)
        return cos, sin

    def _layer(self, i: int, blk: Block, x: torch.Tensor, step: Step) -> torch.Tensor:
        assert isinstance(blk, HybridBlock)
        eps = self.cfg.norm_eps
        h = rms_norm(x, blk.attn_norm, eps)
        if blk.delta is not None:
            spans, keep = [], []
            for sp in step.spans:
                cache = sp.cache
                assert isinstance(cache, HybridCache)
                spans.append((sp.n, cache.conv[blk.index], cache.ssm[blk.index]))
                keep.append(cache.keep_steps)
            a, states = blk.delta(h, spans, eps, keep)
            for sp, (conv, ssm) in zip(step.spans, states, strict=True):
                assert isinstance(sp.cache, HybridCache)
                sp.cache.set_state(blk.index, conv, ssm)
        else:
            a = self._gated_attention(blk, h, step)
        x = x + a
        return x + blk.ffn(rms_norm(x, blk.ffn_norm, eps))

    def _gated_attention(self, blk: HybridBlock, h: torch.Tensor, step: Step) -> torch.Tensor:
        cfg, w = self.cfg, blk.attn
        assert w is not None
        t, hd = h.shape[0], cfg.head_dim
        qg, k, v = linear_group((w.wq, w.wk, w.wv), h)
        qg = qg.view(t, cfg.n_heads, 2 * hd)
        q, gate = qg[..., :hd], qg[..., hd:].reshape(t, cfg.n_heads * hd)
        q = rms_norm(q, w.q_norm, cfg.norm_eps)
        k = rms_norm(k.view(t, cfg.n_kv_heads, hd), w.k_norm, cfg.norm_eps)
        v = v.view(t, cfg.n_kv_heads, hd)
        q = self._rope(q, step, blk, cfg.rope_dim)
        k = self._rope(k, step, blk, cfg.rope_dim)
        o = self._attend(blk.index, q, k, v, step)
        return w.wo(o * torch.sigmoid(gate))
