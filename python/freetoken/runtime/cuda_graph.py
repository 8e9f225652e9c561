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

With the layers split over several GPUs a graph is captured per stage (the layers of one GPU
in a row, :func:`stages`), each on its GPU, and a step replays them in order with the
activations copied between them (:class:`StagedGraphDecoder`).
"""

from __future__ import annotations

import gc
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from freetoken.runtime.kv_cache import KVCache
from freetoken.runtime.step import Span, Step

__all__ = [
    "MAX_BATCH",
    "MAX_SPAN",
    "Decoder",
    "GraphDecoder",
    "Stage",
    "StagedDecoder",
    "StagedGraphDecoder",
    "stages",
]

#: Cached positions per bucket: a step attends over the next multiple of this.
BUCKET = 256
#: Most sequences a captured step takes (larger batches run eagerly).
MAX_BATCH = 32
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


def _step(
    pos: torch.Tensor,
    caches: Sequence[KVCache],
    n_keys: Sequence[int],
    lengths: Sequence[int],
    keep_hidden: bool,
) -> Step:
    """A captured step over static positions ``pos``: each cache's span of ``lengths`` rows
    in order, attending over its ``n_keys`` bucket."""
    spans, at = [], 0
    for c, nk, n in zip(caches, n_keys, lengths, strict=True):
        spans.append(Span(pos[at : at + n], n, c, nk))
        at += n
    return Step(pos, spans, keep_hidden=keep_hidden)


class Decoder(Protocol):
    """What a model offers to be captured: its device and its forward pass on tensors
    (``Transformer.run``)."""

    @property
    def device(self) -> torch.device: ...

    def run(self, tokens: torch.Tensor, step: Step, rows: torch.Tensor | None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Stage:
    """Layers in a row on one device, and whether the output layer ends them."""

    device: torch.device
    layers: range
    head: bool


def stages(layer_devices: Sequence[torch.device], output: torch.device) -> list[Stage]:
    """A step's stages over the layers' devices: each run of consecutive layers on one
    device, the output layer with the last when it is on the same device, else a stage of
    its own (no layers)."""
    out: list[Stage] = []
    start = 0
    for i in range(1, len(layer_devices) + 1):
        if i == len(layer_devices) or layer_devices[i] != layer_devices[start]:
            out.append(Stage(layer_devices[start], range(start, i), False))
            start = i
    last = out[-1]
    if last.device == output:
        out[-1] = Stage(last.device, last.layers, True)
    else:
        n = len(layer_devices)
        out.append(Stage(output, range(n, n), True))
    return out


class StagedDecoder(Decoder, Protocol):
    """A decoder whose layers are split over several devices: what
    :class:`StagedGraphDecoder` captures stage by stage (``Transformer``)."""

    @property
    def layer_devices(self) -> tuple[torch.device, ...] | None: ...

    @property
    def output_device(self) -> torch.device: ...

    def run_part(
        self,
        x: torch.Tensor,
        step: Step,
        layers: range,
        rows: torch.Tensor | None = None,
        head: bool = True,
    ) -> torch.Tensor: ...

    def enter(self, device: torch.device) -> None: ...


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
        # Per logits shape and device: the output every graph of that shape writes last.
        self.outputs: dict[tuple[torch.Size, torch.device], torch.Tensor] = {}
        self.graphs: OrderedDict[_Key, _Entry] = OrderedDict()
        self.settling = Settling(SETTLE_STEPS)

    def _static(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if n not in self.inputs:
            dev = self.model.device
            zeros = torch.zeros(n, dtype=torch.int64, device=dev)
            self.inputs[n] = (zeros, zeros.clone())
        return self.inputs[n]

    def _output(self, like: torch.Tensor) -> torch.Tensor:
        """The logits output of every graph whose logits are shaped as ``like``, allocated
        outside any capture: a graph's own output would stay allocated as long as the graph
        (32 MB a graph at 32 rows of a 248k vocabulary), where a step only reads the last
        one's."""
        key = (like.shape, like.device)
        out = self.outputs.get(key)
        if out is None:
            out = self.outputs[key] = torch.empty_like(like)
        return out

    def _forward(
        self,
        caches: Sequence[KVCache],
        n_keys: Sequence[int],
        lengths: Sequence[int],
        keep_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        tokens, pos = self._static(sum(lengths))
        step = _step(pos, caches, n_keys, lengths, keep_hidden)
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
                warm, _ = self._forward(caches, n_keys, lengths, keep_hidden)
            for restore in restores:
                restore()
        out = self._output(warm)
        graph = torch.cuda.CUDAGraph()
        # No garbage collection during the capture: finalizers of dropped pools unregister
        # page-locked memory (cudaHostUnregister), which invalidates a capture in progress
        # (seen as an abort in the next ggml-cuda call of the GPU test suite).
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.graph(graph, pool=self.mempool, stream=self.stream):
                logits, hidden = self._forward(caches, n_keys, lengths, keep_hidden)
                out.copy_(logits)
        finally:
            if collecting:
                gc.enable()
        torch.cuda.current_stream().wait_stream(self.stream)
        return _Entry(graph, out, hidden, caches, self._dropper(key))

    def _dropper(self, key: _Key) -> Callable[[object], None]:
        """What drops the graph of ``key`` when one of its caches goes (this decoder held
        weakly: the graphs must not keep it alive)."""
        decoder = weakref.ref(self)

        def drop(_: object) -> None:
            live = decoder()
            if live is not None:
                live.graphs.pop(key, None)

        return drop

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
        at = [s + i for s, n in zip(starts, lengths, strict=True) for i in range(n)]
        self._fill([t for toks, _ in seqs for t in toks], at)
        if entry is None or not entry.serves(caches):
            # The warm-up passes write these positions' keys too: the replay rewrites them.
            entry = self.graphs[key] = self._capture(key, caches, n_keys, lengths, keep_hidden)
            while len(self.graphs) > MAX_GRAPHS:
                self.graphs.popitem(last=False)
        self.graphs.move_to_end(key)
        self._replay(entry)
        for c, n, kept in zip(caches, lengths, entry.kept, strict=True):
            c.restore_kept_steps(kept)
            c.commit(n)
        return entry.logits, entry.hidden

    def _fill(self, tokens: list[int], positions: list[int]) -> None:
        """The step's token ids and positions into the static inputs."""
        tok, pos = self._static(len(tokens))
        tok.copy_(torch.tensor(tokens, dtype=torch.int64))
        pos.copy_(torch.tensor(positions, dtype=torch.int64))

    def _replay(self, entry: _Entry) -> None:
        entry.graph.replay()


class _StagedEntry(_Entry):
    """A captured step over several devices: its stages' graphs in order and each stage's
    output (the next stage's input is copied from it; the last one's are the logits)."""

    def __init__(
        self,
        graphs: list[torch.cuda.CUDAGraph],
        outs: list[torch.Tensor],
        hidden: torch.Tensor | None,
        caches: Sequence[KVCache],
        drop: Callable[[object], None],
    ) -> None:
        super().__init__(graphs[0], outs[-1], hidden, caches, drop)
        self.stage_graphs, self.outs = graphs, outs


class StagedGraphDecoder(GraphDecoder):
    """:class:`GraphDecoder` for a model whose layers are split over several devices: each
    stage (:func:`stages`) captured on its device's side stream, with static positions and
    (past the first) a static input activation there; a step replays the stages in order,
    copying each stage's output into the next one's input and entering each device first
    (``model.enter``: the hybrid hand-off's sequence counter follows). ``parts`` are the
    stages where not :func:`stages` of the model's devices (any cut of the layers in order,
    the last with the output layer: several stages on one device run the same way but for
    the copies between devices)."""

    def __init__(self, model: StagedDecoder, parts: Sequence[Stage] | None = None) -> None:
        super().__init__(model)
        self.staged = model
        devs = model.layer_devices
        assert devs is not None, "a staged decoder needs the layers' devices"
        self.stages = list(parts) if parts is not None else stages(devs, model.output_device)
        self.streams = [self.stream] + [torch.cuda.Stream(st.device) for st in self.stages[1:]]
        # Per stage past the first and token count: its positions and input activation.
        self.stage_pos: dict[tuple[int, int], torch.Tensor] = {}
        self.carries: dict[tuple[int, int], torch.Tensor] = {}

    def _stage_static(self, k: int, n: int) -> torch.Tensor:
        """Stage ``k``'s positions for ``n`` tokens (the first stage's are the inputs')."""
        if k == 0:
            return self._static(n)[1]
        if (k, n) not in self.stage_pos:
            dev = self.stages[k].device
            self.stage_pos[(k, n)] = torch.zeros(n, dtype=torch.int64, device=dev)
        return self.stage_pos[(k, n)]

    def _carry(self, k: int, x: torch.Tensor) -> torch.Tensor:
        """Stage ``k``'s static input: ``x`` (the stage before's output) copied there."""
        buf = self.carries.get((k, x.shape[0]))
        if buf is None:
            buf = torch.empty(x.shape, dtype=x.dtype, device=self.stages[k].device)
            self.carries[(k, x.shape[0])] = buf
        buf.copy_(x)
        return buf

    def _fill(self, tokens: list[int], positions: list[int]) -> None:
        super()._fill(tokens, positions)
        at = torch.tensor(positions, dtype=torch.int64)
        for k in range(1, len(self.stages)):
            self._stage_static(k, len(tokens)).copy_(at)

    def _stage_forward(
        self,
        k: int,
        x: torch.Tensor,
        caches: Sequence[KVCache],
        n_keys: Sequence[int],
        lengths: Sequence[int],
        keep_hidden: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Stage ``k`` of the step from ``x`` (token ids, or its input activation), on the
        current stream, with its device's positions."""
        step = _step(self._stage_static(k, sum(lengths)), caches, n_keys, lengths, keep_hidden)
        st = self.stages[k]
        return self.staged.run_part(x, step, st.layers, None, st.head), step.hidden

    def _capture(
        self,
        key: _Key,
        caches: Sequence[KVCache],
        n_keys: Sequence[int],
        lengths: Sequence[int],
        keep_hidden: bool,
    ) -> _Entry:
        # As GraphDecoder's: two warm-up passes, stage by stage on the stages' side streams
        # (ggml-cuda's per-stream scratch exists before capture), the recurrent states they
        # advanced put back, then each stage captured on its side stream.
        restores = [c.checkpoint() for c in caches]
        tokens = self._static(sum(lengths))[0]
        for _ in range(2):
            x = tokens
            for k, (st, stream) in enumerate(zip(self.stages, self.streams, strict=True)):
                x = self._carry(k, x) if k else x
                self.staged.enter(st.device)
                stream.wait_stream(torch.cuda.current_stream(st.device))
                with torch.cuda.stream(stream):
                    x, _ = self._stage_forward(k, x, caches, n_keys, lengths, keep_hidden)
                torch.cuda.current_stream(st.device).wait_stream(stream)
        for restore in restores:
            restore()
        logits = self._output(x)
        last = len(self.stages) - 1
        graphs, outs, hidden = [], [], None
        collecting = gc.isenabled()
        gc.disable()  # as GraphDecoder's capture: no finalizer may unpin memory meanwhile
        try:
            for k, (st, stream) in enumerate(zip(self.stages, self.streams, strict=True)):
                x = self.carries[(k, tokens.shape[0])] if k else tokens
                self.staged.enter(st.device)
                stream.wait_stream(torch.cuda.current_stream(st.device))
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.mempool, stream=stream):
                    out, hidden = self._stage_forward(k, x, caches, n_keys, lengths, keep_hidden)
                    if k == last:
                        out = logits.copy_(out)
                torch.cuda.current_stream(st.device).wait_stream(stream)
                graphs.append(graph)
                outs.append(out)
        finally:
            if collecting:
                gc.enable()
        return _StagedEntry(graphs, outs, hidden, caches, self._dropper(key))

    def _replay(self, entry: _Entry) -> None:
        assert isinstance(entry, _StagedEntry)
        for k, (st, graph) in enumerate(zip(self.stages, entry.stage_graphs, strict=True)):
            if k:
                self._carry(k, entry.outs[k - 1])
            self.staged.enter(st.device)
            graph.replay()
