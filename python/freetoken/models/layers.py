"""Building blocks of the decoder families, on torch float32 with quantized weights run by
the Rust quantized product."""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
import torch.nn.functional as F

from freetoken.errors import InvalidInputError
from freetoken.gguf import GGUFFile
from freetoken.quant import QuantMatrix, dequantize

__all__ = [
    "Embedding",
    "Linear",
    "apply_rope",
    "attention",
    "default_attn_scale",
    "load_vector",
    "rms_norm",
]


class Linear:
    """``y = x @ W.T (+ b)`` with ``W`` quantized in the mapped file."""

    def __init__(self, gguf: GGUFFile, name: str, shape: tuple[int, int]) -> None:
        gguf.expect(f"{name}.weight", shape)
        self.weight: QuantMatrix = gguf.matrix(f"{name}.weight")
        bias = f"{name}.bias"
        self.bias = load_vector(gguf, bias, shape[0]) if bias in gguf else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.weight.matmul(x)
        assert isinstance(y, torch.Tensor)
        return y + self.bias if self.bias is not None else y


class Embedding:
    """Token embedding rows, dequantized on lookup (the table stays quantized)."""

    def __init__(self, gguf: GGUFFile, name: str, vocab: int, hidden: int) -> None:
        info = gguf.expect(name, (vocab, hidden))
        self.raw = gguf.raw(name)
        self.qtype = info.qtype
        self.row = info.nbytes // vocab
        self.hidden = hidden
        self.vocab = vocab

    def __call__(self, tokens: list[int]) -> torch.Tensor:
        out = np.empty((len(tokens), self.hidden), dtype=np.float32)
        for i, t in enumerate(tokens):
            if not 0 <= t < self.vocab:
                raise InvalidInputError(
                    f"token id {t} is outside the vocabulary (0..{self.vocab - 1})"
                )
            out[i] = dequantize(
                self.raw[t * self.row : (t + 1) * self.row], self.qtype, (self.hidden,)
            )
        return torch.from_numpy(out)


def load_vector(gguf: GGUFFile, name: str, n: int) -> torch.Tensor:
    """A 1-D tensor (norm weight, bias) as float32."""
    gguf.expect(name, (n,))
    return torch.from_numpy(gguf.array(name).copy())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last axis, scaled by ``weight``."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@functools.lru_cache(maxsize=64)
def _inv_freq(base: float, n_rot: int) -> torch.Tensor:
    return base ** (-torch.arange(0, n_rot, 2, dtype=torch.float64) / n_rot)


def apply_rope(
    x: torch.Tensor,
    pos: torch.Tensor,
    base: float,
    n_rot: int,
    scale: float,
    neox: bool,
    freq_factors: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotates the first ``n_rot`` dims of ``x [T, H, D]`` by position. NEOX pairs dim ``i``
    with ``i + n_rot/2``; the original (llama) layout pairs adjacent dims."""
    inv = _inv_freq(base, n_rot)
    if freq_factors is not None:
        inv = inv / freq_factors.to(torch.float64)
    theta = pos.to(torch.float64)[:, None] * inv[None, :] * scale
    cos = theta.cos().to(x.dtype)[:, None, :]
    sin = theta.sin().to(x.dtype)[:, None, :]
    half = n_rot // 2
    if neox:
        x1, x2 = x[..., :half], x[..., half:n_rot]
    else:
        x1, x2 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
    r1 = x1 * cos - x2 * sin
    r2 = x2 * cos + x1 * sin
    rotated = torch.cat([r1, r2], -1) if neox else torch.stack([r1, r2], -1).flatten(-2)
    return torch.cat([rotated, x[..., n_rot:]], -1) if n_rot < x.shape[-1] else rotated


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: int,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """Causal grouped-query attention of queries at positions ``start..`` over keys
    ``0..len(k)-1``; with ``window``, a query at ``p`` sees keys ``j`` with ``p - j < window``.
    ``q [T, H, D]``, ``k [L, Hkv, D]``, ``v [L, Hkv, Dv]`` -> ``[T, H * Dv]``."""
    t, h, _ = q.shape
    n_keys = k.shape[0]
    first = 0
    if window and t == 1:
        first = max(0, n_keys - window)
    k, v = k[first:], v[first:]
    mask = None
    if t > 1:
        qpos = torch.arange(start, start + t)[:, None]
        kpos = torch.arange(first, n_keys)[None, :]
        allowed = kpos <= qpos
        if window:
            allowed &= qpos - kpos < window
        mask = allowed
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
        enable_gqa=h != k.shape[1],
    )
    return out.transpose(0, 1).reshape(t, -1)


def default_attn_scale(head_dim: int) -> float:
    """The usual ``1/sqrt(head_dim)``."""
    return 1.0 / math.sqrt(head_dim)
