"""One sequence's cache for hybrid models: the KV cache of the full-attention layers and, beside
it, the recurrent state of the linear-attention layers (conv state and delta-rule state).

A recurrent state holds one position only, the last one: it cannot be cut back as keys and
values can. So the cache keeps snapshots of the states (in host memory) where recent
multi-token steps (prompt chunks) ended, and :meth:`HybridCache.truncate` restores the
latest snapshot at or before the asked length: the positions after it run again (none
saved: from the start). Decode steps (one token each) take no snapshot: the next turn of a
chat continues from the current state, which is always valid at :attr:`length`.

A verify step of speculative decoding sets :attr:`HybridCache.keep_steps`: its layers then
hand over the states after each of the step's tokens (checkpoints, no extra compute: the
token-by-token recurrence makes them anyway), and :meth:`HybridCache.rewind` restores the
one at the last accepted token.

The state tensors are updated in place, never replaced: a captured decode step (a CUDA graph)
reads and writes them at the addresses it was captured on."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from freetoken.errors import InvalidInputError
from freetoken.runtime import gpu
from freetoken.runtime.kv_cache import KVCache

__all__ = ["MAX_SNAPSHOTS", "HybridCache"]

#: Snapshots of the recurrent states a cache keeps (the latest ones).
MAX_SNAPSHOTS = 4


def _snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of a state in host memory: device memory holds the live states only, as
    llama.cpp keeps its context checkpoints in host memory. From a GPU the copy is not
    waited for: it comes before any later write of the state on its stream, and before
    :meth:`HybridCache._load` reads it back."""
    return t.clone() if t.device.type == "cpu" else gpu.to_host(t, wait=False)


class HybridCache(KVCache):
    """A :class:`KVCache` over the full-attention layers plus per linear-attention layer a
    conv state ``conv[i]`` and a delta-rule state ``ssm[i]`` (float32, zeros when empty).
    ``kv_devices`` and ``state_devices`` give each attention and each recurrent layer its
    device where the layers are split over several GPUs (else all are on ``device``)."""

    def __init__(
        self,
        n_attn_layers: int,
        n_ctx: int,
        n_kv_heads: int,
        head_dim_k: int,
        head_dim_v: int,
        state_shapes: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
        device: torch.device | str = "cpu",
        max_snapshots: int = MAX_SNAPSHOTS,
        v_transposed: bool = False,
        kv_devices: Sequence[torch.device] = (),
        state_devices: Sequence[torch.device] = (),
        dtypes: tuple[torch.dtype, torch.dtype] = (torch.float32, torch.float32),
    ) -> None:
        super().__init__(
            n_attn_layers,
            n_ctx,
            n_kv_heads,
            head_dim_k,
            head_dim_v,
            dtypes=dtypes,
            device=device,
            v_transposed=v_transposed,
            devices=kv_devices,
        )
        if state_devices and len(state_devices) != len(state_shapes):
            raise InvalidInputError(
                f"{len(state_devices)} devices for {len(state_shapes)} recurrent layers"
            )
        devs: list[torch.device | str] = list(state_devices) or [device] * len(state_shapes)
        self.conv = [torch.zeros(c, device=d) for (c, _), d in zip(state_shapes, devs, strict=True)]
        self.ssm = [torch.zeros(s, device=d) for (_, s), d in zip(state_shapes, devs, strict=True)]
        self.max_snapshots = max_snapshots
        #: Length -> copies of (conv, ssm) at that length, oldest first.
        self._snapshots: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        #: Steps hand over per-token states (``[T, ...]`` stacks) for :meth:`rewind`.
        self.keep_steps = False
        #: Per recurrent layer, the last step's per-token (conv, ssm) states.
        self._steps: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(self.conv)
        self._step_from = 0

    def set_state(self, layer: int, conv: torch.Tensor, ssm: torch.Tensor) -> None:
        """Writes recurrent layer ``layer``'s new states (after a step ran it) in place; with
        :attr:`keep_steps` they are the stacks of the states after each of the step's tokens,
        kept for :meth:`rewind`, and the last one is written. The cache's own tensors (a step
        that updated them in place) are left as they are."""
        if self.keep_steps:
            self._steps[layer] = (conv, ssm)
            conv, ssm = conv[-1], ssm[-1]
        for mine, new in ((self.conv[layer], conv), (self.ssm[layer], ssm)):
            if new is not mine:
                mine.copy_(new)

    def _load(
        self, conv: Sequence[torch.Tensor] | None, ssm: Sequence[torch.Tensor] | None
    ) -> None:
        """Copies saved states in place (None: zeros, the empty state). In inference mode:
        the states may be inference tensors."""
        with torch.inference_mode():
            for i, (c, s) in enumerate(zip(self.conv, self.ssm, strict=True)):
                if conv is None or ssm is None:
                    c.zero_()
                    s.zero_()
                else:
                    c.copy_(conv[i])
                    s.copy_(ssm[i])

    def checkpoint(self) -> Callable[[], None]:
        """As :meth:`KVCache.checkpoint`: the recurrent states, which a step advances."""
        conv = [c.clone() for c in self.conv]
        ssm = [s.clone() for s in self.ssm]
        return lambda: self._load(conv, ssm)

    def kept_steps(self) -> object:
        """A verify step's per-token states (the tensors it wrote them into), else None."""
        return list(self._steps) if self.keep_steps else None

    def restore_kept_steps(self, kept: object) -> None:
        """After a replay of the captured verify step, its per-token states are where the
        capture wrote them."""
        if kept is not None:
            assert isinstance(kept, list)
            self._steps = list(kept)

    def commit(self, n_new: int) -> None:
        """As :meth:`KVCache.commit`; a step of several tokens also snapshots the states
        (not a verify step's: :meth:`rewind` has its checkpoints)."""
        self._step_from = self.length
        super().commit(n_new)
        if self.keep_steps:
            return
        self._steps = [None] * len(self.conv)
        if n_new > 1 and self.max_snapshots > 0:
            self._snapshots.pop(self.length, None)
            self._snapshots[self.length] = (
                [_snapshot(c) for c in self.conv],
                [_snapshot(s) for s in self.ssm],
            )
            while len(self._snapshots) > self.max_snapshots:
                del self._snapshots[next(iter(self._snapshots))]

    def truncate(self, length: int) -> int:
        """Keeps positions up to ``length`` where the states can be restored there: the
        current length, else the latest snapshot at or before ``length``, else none.
        Returns the length kept."""
        length = min(self.length, max(0, length))
        if length < self.length:
            kept = max((n for n in self._snapshots if n <= length), default=0)
            self._load(*(self._snapshots[kept] if kept else (None, None)))
            for n in [n for n in self._snapshots if n > kept]:
                del self._snapshots[n]
            length = kept
        return super().truncate(length)

    def rewind(self, length: int) -> None:
        """As :meth:`KVCache.rewind`; inside the last step run with :attr:`keep_steps` the
        recurrent states come from its checkpoint at ``length``."""
        i = length - self._step_from - 1
        steps = self._steps
        if length < self.length and 0 <= i and all(st is not None for st in steps):
            self._load(
                [st[0][i] for st in steps if st is not None],
                [st[1][i] for st in steps if st is not None],
            )
            for n in [n for n in self._snapshots if n > length]:
                del self._snapshots[n]
            self._steps = [None] * len(self.conv)
            KVCache.truncate(self, length)
            return
        super().rewind(length)
