"""Decode steps replayed as CUDA graphs.

A decode step runs hundreds of small kernels (norms, RoPE, attention, the dense products,
routing, one MoE launch per layer); launched one by one from Python they cost far more than
their work. :class:`GraphDecoder` captures the whole step (``Transformer.run``) once per set of
sequences (their KV caches) and cache-length buckets, and replays it: the tokens and their
positions are copied into static input tensors, attention reads a fixed number of cached
positions per sequence (the bucket) and masks the ones past the token. A step of several
sequences, one token each (the server's continuous batching), is one graph too, once the same
set has come :data:`SETTLE_STEPS` steps in a row. So is a verify step of speculative decoding
(a few tokens of one sequence, alone or beside others' decode tokens): a graph per verify
length, with every row's logits and, for a multi-token-prediction head, every row's final
hidden state.
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

__all__ = ["MAX_BATCH", "MAX_SPAN", "Decoder", "GraphDecoder"]

#: Cached positions per bucket: a step attends over the next multiple of this.
BUCKET = 256
#: Most sequences a captured step takes (larger batches run eagerly).
MAX_BATCH = 16
#: Most tokens of one sequence a captured step takes (a verify step: the sampled token and
#: its draft; llama.cpp's largest default draft is 16).
MAX_SPAN = 17
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


#: (caches' ids, keys read per sequence, tokens per sequence, verify flags, hidden states).
_Key = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[bool, ...], bool]


class _Entry:
    """A captured step: its graph, its logits (and hidden states) output, what a verify
    step left in each cache for its rewind (the graph's tensors, which every replay
    rewrites), and the caches it was captured on (weakly: a graph must never replay on a
    cache that is gone, and goes with it)."""

    def __init__(
        self,
        graph: torch.cuda.CUDAGraph,
        logits: torch.Tensor,
        hidden: torch.Tensor | None,
        caches: Sequence[KVCache],
        drop: Callable[[object], None],
    ) -> None:
        self.graph, self.logits, self.hidden = graph, logits, hidden
        self.kept = [c.kept_steps() for c in caches]
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
    """Decode and verify steps of ``model`` (on a CUDA device), up to :data:`MAX_SPAN`
    tokens per sequence for up to :data:`MAX_BATCH` sequences, as CUDA graphs per set of
    caches, buckets and tokens per sequence."""

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

    def _forward(
        self,
        caches: Sequence[KVCache],
        n_keys: Sequence[int],
        lengths: Sequence[int],
        keep_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens, pos = self._static(sum(lengths))
        spans, at = [], 0
        for c, nk, n in zip(caches, n_keys, lengths, strict=True):
            spans.append(Span(pos[at : at + n], n, c, nk))
            at += n
        step = Step(pos, spans, keep_hidden=keep_hidden)
        return self.model.run(tokens, step, None), step.hidden

    def _capture(
        self,
        key: _Key,
        caches: Sequence[KVCache],
        n_keys: Sequence[int],
        lengths: Sequence[int],
        keep_hidden: bool,
    ) -> _Entry:
        # The warm-up passes run the step: recurrent states it advances are put back after.
        restores = [c.checkpoint() for c in caches]
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                self._forward(caches, n_keys, lengths, keep_hidden)
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
                logits, hidden = self._forward(caches, n_keys, lengths, keep_hidden)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream().wait_stream(self.stream)
        decoder = weakref.ref(self)

        def drop(_: object) -> None:
            live = decoder()
            if live is not None:
                live.graphs.pop(key, None)

        return _Entry(graph, logits, hidden, caches, drop)

    @torch.inference_mode()
    def step(
        self, seqs: Sequence[tuple[Sequence[int], KVCache]], keep_hidden: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Runs each sequence's tokens (at most :data:`MAX_SPAN`) at the next positions of
        its cache (distinct caches, at most :data:`MAX_BATCH`); returns the float32 logits of
        every row ``[T, vocab]`` and, with ``keep_hidden``, every row's final hidden state
        (both on the device, valid until the next step), or None, having run nothing, while
        a new set of several sequences settles (:data:`SETTLE_STEPS`): the caller runs that
        step eagerly. A cache's ``keep_steps`` (a verify step) is part of what is captured.
        The caller has checked the token ids."""
        caches = [c for _, c in seqs]
        lengths = tuple(len(t) for t, _ in seqs)
        starts = [c.reserve(n) for c, n in zip(caches, lengths, strict=True)]
        n_keys = tuple(
            min(c.n_ctx, ((s + n - 1) // BUCKET + 1) * BUCKET)
            for c, s, n in zip(caches, starts, lengths, strict=True)
        )
        verify = tuple(c.keep_steps for c in caches)
        key = (tuple(id(c) for c in caches), n_keys, lengths, verify, keep_hidden)
        entry = self.graphs.get(key)
        settled = self.settling.settled(key) or len(caches) == 1
        if (entry is None or not entry.serves(caches)) and not settled:
            return None
        tok, pos = self._static(sum(lengths))
        tok.copy_(torch.tensor([t for toks, _ in seqs for t in toks], dtype=torch.int64))
        at = [s + i for s, n in zip(starts, lengths, strict=True) for i in range(n)]
        pos.copy_(torch.tensor(at, dtype=torch.int64))
        if entry is None or not entry.serves(caches):
            # The warm-up passes write these positions' keys too: the replay rewrites them.
            entry = self.graphs[key] = self._capture(key, caches, n_keys, lengths, keep_hidden)
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        entry.graph.replay()
        for c, n, kept in zip(caches, lengths, entry.kept, strict=True):
            c.restore_kept_steps(kept)
            c.commit(n)
        return entry.logits, entry.hidden
