"""A per-sequence KV cache: one preallocated key and value tensor per layer."""

from __future__ import annotations

import torch

from freetoken.errors import InvalidInputError

__all__ = ["KVCache"]


class KVCache:
    """Keys (after RoPE) and values of one sequence, ``[n_ctx, n_kv_heads, head_dim]`` per
    layer; positions ``0..length-1`` are filled."""

    def __init__(
        self,
        n_layers: int,
        n_ctx: int,
        n_kv_heads: int,
        head_dim_k: int,
        head_dim_v: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.n_ctx = n_ctx
        self.k = [torch.zeros(n_ctx, n_kv_heads, head_dim_k, dtype=dtype, device=device)]
        self.k += [torch.zeros_like(self.k[0]) for _ in range(n_layers - 1)]
        self.v = [
            torch.zeros(n_ctx, n_kv_heads, head_dim_v, dtype=dtype, device=device)
            for _ in range(n_layers)
        ]
        self.length = 0

    def reserve(self, n_new: int) -> int:
        """Checks that ``n_new`` more positions fit; returns the first new position."""
        if self.length + n_new > self.n_ctx:
            raise InvalidInputError(
                f"context full: {self.length} + {n_new} tokens exceed the context size "
                f"{self.n_ctx} (raise -c/--ctx-size)"
            )
        return self.length

    def store(
        self,
        layer: int,
        start: int | torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        n_keys: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes ``k``/``v`` at positions ``start..`` of ``layer``; returns the layer's keys
        and values for positions ``0..start + len(k) - 1``. With ``start`` a tensor of
        positions (a captured step, whose shapes are fixed), returns the first ``n_keys``."""
        if isinstance(start, torch.Tensor):
            self.k[layer].index_copy_(0, start, k.to(self.k[layer].dtype))
            self.v[layer].index_copy_(0, start, v.to(self.v[layer].dtype))
            return self.k[layer][:n_keys], self.v[layer][:n_keys]
        end = start + k.shape[0]
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v
        return self.k[layer][:end], self.v[layer][:end]

    def commit(self, n_new: int) -> None:
        """Marks ``n_new`` positions as filled, after every layer stored them."""
        self.length += n_new

    def truncate(self, length: int) -> None:
        """Forgets positions from ``length`` on (for reusing a shared prefix)."""
        self.length = min(self.length, max(0, length))
