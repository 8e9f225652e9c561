"""A per-sequence KV cache: one preallocated key and value tensor per layer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeAlias

import torch

from freetoken.errors import InvalidInputError

__all__ = ["KVCache", "PerLayer"]

#: A size that is the same for every layer, or one per layer.
PerLayer: TypeAlias = int | Sequence[int]


def _of(size: PerLayer, i: int) -> int:
    return size if isinstance(size, int) else size[i]


class KVCache:
    """Keys (after RoPE) and values of one sequence, ``[n_ctx, n_kv_heads, head_dim]`` per
    layer; positions ``0..length-1`` are filled. With ``v_transposed`` the values are kept
    as ``[n_kv_heads, head_dim_v, n_ctx]`` (as llama.cpp keeps them without flash
    attention): a decode step's product of the attention weights with the values then reads
    each head's values as a column-major matrix, which cuBLAS runs several times faster than
    the row-major one on the GPU. Either way :meth:`store` returns them ``[L, heads, dims]``.

    Sliding-window layers (``windows[i] > 0``) keep only what their attention can still see
    when that saves memory (as llama.cpp's SWA cache): a ring of ``window + max_step - 1``
    positions, enough for a step of ``max_step`` tokens (:meth:`reserve` checks it), each
    position written twice, at ``p % ring`` and ``p % ring + ring``, so that the positions a
    step sees are always one slice, in order: :meth:`store` returns them from
    :meth:`first_key` on, and attention computes on the same tensors as with a full cache
    (``layers.attention`` leaves out the keys before a step's first window either way).
    Rings are for caches on the CPU: the GPU's captured decode steps index positions
    directly.

    ``devices`` gives each layer's device where the layers are split over several GPUs
    (each layer's keys and values live beside its weights); else every layer is on
    ``device``. ``dtypes`` are the keys' and the values' element types (float32, or float16:
    llama.cpp's ``--cache-type-k/v``), stored rounded and returned as they are."""

    #: A verify step (speculative decoding) is running: caches with state that cannot be
    #: cut back keep checkpoints for :meth:`rewind` (runtime/recurrent_cache.py).
    keep_steps = False

    def __init__(
        self,
        n_layers: int,
        n_ctx: int,
        n_kv_heads: PerLayer,
        head_dim_k: PerLayer,
        head_dim_v: PerLayer,
        dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
        device: torch.device | str = "cpu",
        v_transposed: bool = False,
        windows: Sequence[int] = (),
        max_step: int = 0,
        devices: Sequence[torch.device] = (),
    ) -> None:
        if devices and len(devices) != n_layers:
            raise InvalidInputError(f"{len(devices)} devices for a cache of {n_layers} layers")
        self.n_ctx = n_ctx
        self.v_transposed = v_transposed
        self.max_step = max_step
        #: Per layer, its ring's size (0: every position is kept).
        self.ring = [0] * n_layers
        for i, w in enumerate(windows):
            r = w + max_step - 1
            if w > 0 and max_step > 0 and 2 * r < n_ctx and not v_transposed:
                self.ring[i] = r
        #: One past the highest position a ring has had written since it was last empty: the
        #: rings hold positions from this minus their size on.
        self._high = 0
        self.k, self.v = [], []
        for i, r in enumerate(self.ring):
            n = 2 * r or n_ctx
            heads, dk, dv = _of(n_kv_heads, i), _of(head_dim_k, i), _of(head_dim_v, i)
            dev = devices[i] if devices else device
            self.k.append(torch.zeros(n, heads, dk, dtype=dtypes[0], device=dev))
            v_shape = (heads, dv, n) if v_transposed else (n, heads, dv)
            self.v.append(torch.zeros(v_shape, dtype=dtypes[1], device=dev))
        self.length = 0

    def reserve(self, n_new: int) -> int:
        """Checks that ``n_new`` more positions fit; returns the first new position."""
        if self.length + n_new > self.n_ctx:
            raise InvalidInputError(
                f"context full: {self.length} + {n_new} tokens exceed the context size "
                f"{self.n_ctx} (raise -c/--ctx-size)"
            )
        if any(self.ring) and n_new > self.max_step:
            raise InvalidInputError(
                f"a step of {n_new} tokens is longer than this cache's sliding-window rings "
                f"allow ({self.max_step})"
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
        and values for positions ``0..start + len(k) - 1`` (a ring layer: from
        :meth:`first_key` on).
        With ``start`` a tensor of positions (a captured step, whose shapes are fixed),
        returns the first ``n_keys``."""
        kc, vc = self.k[layer], self.v[layer]
        k = k.to(kc.dtype)
        v = v.to(vc.dtype).permute(1, 2, 0) if self.v_transposed else v.to(vc.dtype)
        v_axis = 2 if self.v_transposed else 0
        ring = self.ring[layer]
        if ring:
            assert isinstance(start, int), "rings are not captured"
            end = start + k.shape[0]
            slots = torch.arange(start, end, device=kc.device) % ring
            for at in (slots, slots + ring):
                kc.index_copy_(0, at, k)
                vc.index_copy_(0, at, v)
            self._high = max(self._high, end)
            first = self.first_key(layer, start)
            lo, hi = first % ring, first % ring + end - first
            return kc[lo:hi], vc[lo:hi]
        if isinstance(start, torch.Tensor):
            kc.index_copy_(0, start, k)
            vc.index_copy_(v_axis, start, v)
            assert n_keys is not None, "a captured step reads a fixed number of keys"
            end = n_keys
        else:
            end = start + k.shape[0]
            kc[start:end] = k
            vc.narrow(v_axis, start, end - start).copy_(v)
        if self.v_transposed:
            return kc[:end], vc[:, :, :end].permute(2, 0, 1)
        return kc[:end], vc[:end]

    def one_token_rows(self, layer: int, start: int, window: int) -> tuple[list[int], int, int]:
        """For one token at position ``start`` of ``layer`` (a cache kept as
        ``[n, heads, dims]``): the rows its key and value go to, and the rows ``lo..hi`` its
        query attends over, those of :meth:`store` that a ``window`` (0: none) leaves it, as
        ``layers.attention`` cuts them. Marks the position written, as :meth:`store` does."""
        end = start + 1
        ring = self.ring[layer]
        if ring:
            self._high = max(self._high, end)
            first = self.first_key(layer, start)
            write = [start % ring, start % ring + ring]
            lo, hi = first % ring, first % ring + end - first
        else:
            first, write, lo, hi = 0, [start], 0, end
        if window:
            lo += max(0, start - first - window + 1)
        return write, lo, hi

    def first_key(self, layer: int, start: int) -> int:
        """The position of the first key :meth:`store` returns for a step from ``start``:
        0, or for a ring layer the first one the step's first query sees."""
        return self._first(self.ring[layer], start)

    def _first(self, ring: int, start: int) -> int:
        return max(0, start - (ring - self.max_step)) if ring else 0

    def checkpoint(self) -> Callable[[], None]:
        """A function that puts back what running a step changes besides the positions it
        writes (a CUDA graph's capture runs its step for real before recording it). Nothing
        for keys and values: the replay rewrites the same positions."""
        return lambda: None

    def kept_steps(self) -> object:
        """What the step just run left for :meth:`rewind` besides its positions (None: nothing,
        as here); a captured step hands it back after each replay
        (:meth:`restore_kept_steps`)."""
        return None

    def restore_kept_steps(self, kept: object) -> None:
        """Takes back what :meth:`kept_steps` returned after the same step."""

    def commit(self, n_new: int) -> None:
        """Marks ``n_new`` positions as filled, after every layer stored them."""
        self.length += n_new

    def truncate(self, length: int) -> int:
        """Forgets positions from ``length`` on (for reusing a shared prefix); returns the
        length kept: 0 when the rings no longer hold the keys the positions after ``length``
        see (later positions overwrote them)."""
        length = min(self.length, max(0, length))
        ring = max(self.ring)  # every ring layer has the one window
        if ring and length > 0 and self._first(ring, length) < self._high - ring:
            length = 0
        if length == 0:
            self._high = 0
        self.length = length
        return length

    def rewind(self, length: int) -> None:
        """Cuts back to ``length`` positions after a step that wrote past it (the rejected
        tokens of a verify step): InvalidInputError when the cache cannot hold ``length``
        any more (a ring layer overwrote what it needs: the step was longer than
        ``max_step``)."""
        if self.truncate(length) != length:
            raise InvalidInputError(
                f"cannot cut the cache back to {length} positions: a step was longer than its "
                f"sliding-window rings allow ({self.max_step})"
            )
