"""A per-sequence KV cache: one preallocated key and value tensor per layer."""

from __future__ import annotations

import torch

from freetoken.errors import InvalidInputError

__all__ = ["KVCache"]


class KVCache:
    """Keys (after RoPE) and values of one sequence, ``[n_ctx, n_kv_heads, head_dim]`` per
    layer; positions ``0..length-1`` are filled. With ``v_transposed`` the values are kept
    as ``[n_kv_heads, head_dim_v, n_ctx]`` (as llama.cpp keeps them without flash
    attention): a decode step's product of the attention weights with the values then reads
    each head's values as a column-major matrix, which cuBLAS runs several times faster than
    the row-major one on the GPU. Either way :meth:`store` returns them ``[L, heads, dims]``."""

    def __init__(
        self,
        n_layers: int,
        n_ctx: int,
        n_kv_heads: int,
        head_dim_k: int,
        head_dim_v: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        v_transposed: bool = False,
    ) -> None:
        self.n_ctx = n_ctx
        self.v_transposed = v_transposed
        self.k = [torch.zeros(n_ctx, n_kv_heads, head_dim_k, dtype=dtype, device=device)]
        self.k += [torch.zeros_like(self.k[0]) for _ in range(n_layers - 1)]
        v_shape = (
            (n_kv_heads, head_dim_v, n_ctx) if v_transposed else (n_ctx, n_kv_heads, head_dim_v)
        )
        self.v = [torch.zeros(v_shape, dtype=dtype, device=device) for _ in range(n_layers)]
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
        kc, vc = self.k[layer], self.v[layer]
        k = k.to(kc.dtype)
        v = v.to(vc.dtype).permute(1, 2, 0) if self.v_transposed else v.to(vc.dtype)
        v_axis = 2 if self.v_transposed else 0
        if isinstance(start, torch.Tensor):
            kc.index_copy_(0, start, k)
            vc.index_copy_(v_axis, start, v)
            end = n_keys
        else:
            end = start + k.shape[0]
            kc[start:end] = k
            vc.narrow(v_axis, start, end - start).copy_(v)
        if self.v_transposed:
            return kc[:end], vc[:, :, :end].permute(2, 0, 1)
        return kc[:end], vc[:end]

    def commit(self, n_new: int) -> None:
        """Marks ``n_new`` positions as filled, after every layer stored them."""
        self.length += n_new

    def truncate(self, length: int) -> None:
        """Forgets positions from ``length`` on (for reusing a shared prefix)."""
        self.length = min(self.length, max(0, length))
