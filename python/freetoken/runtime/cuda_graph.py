"""Decode steps replayed as CUDA graphs.

A decode step runs hundreds of small kernels (norms, RoPE, attention, the dense products,
routing, one MoE launch per layer); launched one by one from Python they cost far more than
their work. :class:`GraphDecoder` captures the whole step (``Transformer.run``) once per set of
sequences (their KV caches) and cache-length buckets, and replays it: the tokens and their
positions are copied into static input tensors, attention reads a fixed number of cached
positions per sequence (the bucket) and masks the ones past the token. A step of several
sequences, one token each (the server's continuous batching), is one graph too, once the same
set has come :data:`SETTLE_STEPS` steps in a row.
"""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.step import Span, Step

__all__ = ["MAX_BATCH", "Decoder", "GraphDecoder"]

#: Cached positions per bucket: a step attends over the next multiple of this.
BUCKET = 256
#: Most sequences a captured step takes (larger batches run eagerly).
MAX_BATCH = 16
#: Graphs kept, least recently used dropped first: each holds its batch's caches' addresses
#: and a share of the graph memory pool.
MAX_GRAPHS = 32
#: Steps a set of several sequences runs eagerly, unchanged, before it is captured: a capture
#: costs about three eager steps, and in a server whose requests come and go a set may last
#: only a few steps. One sequence alone is captured at once.
SETTLE_STEPS = 4


class Settling:
    """Counts how many steps in a row the same key came: :meth:`settled` is true once a key
    has come ``steps`` times in a row (at once for ``steps`` <= 1)."""

    def __init__(self, steps: int) -> None:
        self.steps = steps
        self.key: object = None
        self.count = 0

    def settled(self, key: object) -> bool:
        self.count = self.count + 1 if key == self.key else 1
        self.key = key
        return self.count >= self.steps


_Key = tuple[tuple[int, ...], tuple[int, ...]]


class _Entry:
    """A captured step: its graph, its logits output, and the caches it was captured on
    (weakly: a graph must never replay on a cache that is gone, and goes with it)."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        logits: torch.Tensor,
        caches: Sequence[KVCache],
        drop: Callable[[object], None],
    ) -> None:
        self.graph, self.logits = graph, logits
        self.refs = [weakref.ref(c, drop) for c in caches]

    def serves(self, caches: Sequence[KVCache]) -> bool:
        return all(r() is c for r, c in zip(self.refs, caches, strict=True))


class Decoder(Protocol):
    """What a model offers to be captured: its device and its forward pass on tensors
    (``Transformer.run``)."""

    @property
    def device(self) -> torch.device: ...

    def run(self, tokens: torch.Tensor, step: Step, rows: torch.Tensor | None) -> torch.Tensor: ...


class GraphDecoder:
    """Decode steps of ``model`` (on a CUDA device), one token per sequence for up to
    :data:`MAX_BATCH` sequences, as CUDA graphs per set of caches and buckets."""

    def __init__(self, model: Decoder) -> None:
        self.model = model
        # Our MoE launches run on torch's current stream; warm-up and capture share one side
        # stream, so ggml-cuda's per-stream scratch is allocated before capture starts.
        self.stream = torch.cuda.Stream(model.device)
        self.mempool = torch.cuda.graph_pool_handle()
        # Static inputs per batch size: token ids and positions.
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: OrderedDict[_Key, _Entry] = OrderedDict()
        self.settling = Settling(SETTLE_STEPS)

    def _static(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n not in self.inputs:
            dev = self.model.device
            zeros = torch.zeros(n, dtype=torch.int64, device=dev)
            self.inputs[n] = (zeros, zeros.clone())
        return self.inputs[n]

    def _forward(self, caches: Sequence[KVCache], n_keys: Sequence[int]) -> torch.Tensor:
        tokens, pos = self._static(len(caches))
        spans = [
            Span(pos[i : i + 1], 1, c, nk)
            for i, (c, nk) in enumerate(zip(caches, n_keys, strict=True))
        ]
        return self.model.run(tokens, Step(pos, spans), None)

    def _capture(self, key: _Key, caches: Sequence[KVCache], n_keys: Sequence[int]) -> _Entry:
        # The warm-up passes run the step: recurrent states it advances are put back after.
        restores = [c.checkpoint() for c in caches]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                self._forward(caches, n_keys)
            for restore in restores:
                restore()
        graph = torch.cuda.CUDAGraph()
        # No garbage collection during the capture: finalizers of dropped pools unregister
        # page-locked memory (cudaHostUnregister), which invalidates a capture in progress
        # (seen as an abort in the next ggml-cuda call of the GPU test suite).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.mempool, stream=self.stream):
                logits = self._forward(caches, n_keys)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream().wait_stream(self.stream)
        decoder = weakref.ref(self)

        def drop(_: object) -> None:
            live = decoder()
            if live is not None:
                live.graphs.pop(key, None)

        return _Entry(graph, logits, caches, drop)

    @torch.inference_mode()
    def step(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor | None:
        """Runs ``tokens[i]`` at the next position of ``caches[i]`` (distinct caches, at most
        :data:`MAX_BATCH`); returns their float32 logits ``[n, vocab]`` (on the device, valid
        until the next step), or None, having run nothing, while a new set of several
        sequences settles (:data:`SETTLE_STEPS`): the caller runs that step eagerly. The caller
        has checked the token ids."""
        starts = [c.reserve(1) for c in caches]
        n_keys = tuple(
            min(c.n_ctx, (s // BUCKET + 1) * BUCKET) for c, s in zip(caches, starts, strict=True)
        )
        key = (tuple(id(c) for c in caches), n_keys)
        entry = self.graphs.get(key)
        settled = self.settling.settled(key) or len(caches) == 1
        if (entry is None or not entry.serves(caches)) and not settled:
            return None
        tok, pos = self._static(len(caches))
        tok.copy_(torch.tensor(tokens, dtype=torch.int64))
        pos.copy_(torch.tensor(starts, dtype=torch.int64))
        if entry is None or not entry.serves(caches):
            # The warm-up passes write these positions' keys too: the replay rewrites them.
            entry = self.graphs[key] = self._capture(key, caches, n_keys)
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        entry.graph.replay()
        for c in caches:
            c.commit(1)
        return entry.logits
