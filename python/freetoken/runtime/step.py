"""What the layers of one forward pass share: each sequence's rows of the batch (:class:`Span`)
and the step's positions, RoPE tables and masks (:class:`Step`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from freetoken.runtime.kv_cache import KVCache

__all__ = ["Span", "Step"]


@dataclass
class Span:
    """One sequence's rows of a batch: ``n`` tokens from position ``start`` in ``cache``.
    In a captured decode step ``start`` is a tensor of the rows' positions and ``n_keys``
    the fixed number of cached positions attention reads (the rest masked)."""

    start: int | torch.Tensor
    n: int
    cache: KVCache
    n_keys: int | None = None

    def store(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes the rows' keys and values; returns the keys and values attention reads."""
        return self.cache.store(layer, self.start, k, v, self.n_keys)

    def first_key(self, layer: int) -> int:
        """The position of the first key :meth:`store` returned."""
        return (
            0 if isinstance(self.start, torch.Tensor) else self.cache.first_key(layer, self.start)
        )


@dataclass
class Step:
    """What the layers of one forward pass share: the rows' positions (on the model's
    device), the sequences, the RoPE tables and attention masks made so far, and the keys
    and values a layer read that later layers attend over too (``kv``, by span index and
    layer: Gemma 4's shared-KV layers). With ``keep_hidden`` the pass leaves every row's
    final hidden state (after the output norm, what multi-token-prediction heads read) in
    ``hidden``."""

    pos: torch.Tensor
    spans: list[Span]
    rope: dict[tuple[Any, ...], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    masks: dict[tuple[Any, ...], torch.Tensor | None] = field(default_factory=dict)
    kv: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    keep_hidden: bool = False
    hidden: torch.Tensor | None = None
