"""What the layers of one forward pass share: each sequence's rows of the batch (:class:`Span`)
and the step's positions, RoPE tables and masks (:class:`Step`), per device when the layers
are split over several GPUs (:meth:`Step.on`)."""

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
    #: The step as the layers on other devices see it (:meth:`on`), by device.
    views: dict[torch.device, Step] = field(default_factory=dict)

    def on(self, device: torch.device) -> Step:
        """The step for layers on ``device``: itself where its positions are, else (once per
        step and device) a step with the positions and the spans' tensor starts copied there,
        RoPE tables and masks of its own (they are made on the layers' device) and the same
        spans' caches and shared keys and values. The output layer's view gets the final
        hidden state; :meth:`take_hidden` brings it back."""
        if device == self.pos.device:
            return self
        view = self.views.get(device)
        if view is None:
            spans = [
                Span(
                    sp.start.to(device) if isinstance(sp.start, torch.Tensor) else sp.start,
                    sp.n,
                    sp.cache,
                    sp.n_keys,
                )
                for sp in self.spans
            ]
            pos = self.pos.to(device, non_blocking=True)
            view = Step(pos, spans, kv=self.kv, keep_hidden=self.keep_hidden)
            self.views[device] = view
        return view

    def take_hidden(self, view: Step) -> None:
        """Keeps the final hidden state that ``view`` (one of :meth:`on`'s) got."""
        if view is not self:
            self.hidden = view.hidden
