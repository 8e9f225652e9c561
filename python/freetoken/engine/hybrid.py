"""``--moe-strategy hybrid``: per MoE layer and step, the routes whose expert sits in a GPU
slot run on the GPU while the CPU expert executor computes the others from host memory at the
same time; the CPU's rows are added into the GPU's output. Nothing is uploaded on the
critical path (docs/hybrid.md).

The hand-off costs no host round trip per layer. One kernel (``gpu.handoff_routes``) copies
the layer's activations and routes into mapped page-locked host memory, maps each route to its
slot (a device table expert -> slot; misses point at zeroed slots with weight 0) and raises a
sequence number in the mapped block; the GPU goes on with the hits, and a kernel spins until
the CPU thread (``MoeExecutor.serve_handoffs``, polling the same word) has written the missed
routes' sum and its answer, then adds the rows (``gpu.handoff_wait_add``). So a whole decode step is
still one CUDA graph, and eager steps never block Python.

While a step computes, the host does the slot policy's bookkeeping on the previous step's
routes (LRU or adaptive route counts) and starts the copies chosen before, on the copy
stream, off the critical path: misses into free slots (any policy), and with
``--moe-cache-adaptive`` also over cold residents. An upload's slot is taken off the device
table a step before its copy starts and its new expert put in only once the copy has
finished, so no step reads a slot being written. Steps of many tokens (prefill chunks)
split the same way unless the bandwidth profile (``freetoken bench-bw``) says that streaming
the whole layer over PCIe is cheaper than computing the misses on the CPU.

In a split step of several tokens (concurrent decode, verify steps, prompt chunks) each layer
also uploads a share of its missed experts into a staging buffer outside the pools and
computes them on the GPU while the CPU computes the rest, both links busy. The choice runs on
the device (``gpu.fetch_plan``, the rule of :mod:`freetoken.engine.fetch` over the layer
kind's bench-bw figures, or ``--moe-fetch-share``) before the layer's request: it marks the
fetched experts in the host's table (the CPU skips them as residents; the device table still
sends them to the pool's zeroed slots) until the step ends, and a kernel on the fetch stream
copies them from the mapped expert memory (``gpu.fetch_gather``). Nothing reads back, so a
fetching step is still one CUDA graph.

With the layers split over several GPUs one hand-off still serves every layer (one CPU
thread, one block, one sequence of requests): each device has its pools, tables and
sequence counter, and a device's first request after another device's continues that
device's count (a copy of the counter, stream-ordered after the other device's wait), so
the CPU thread sees one sequence.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from freetoken import _core
from freetoken.engine.bandwidth_profile import KindBandwidth
from freetoken.engine.fetch import FETCH_OVERHEAD_S, Links, expect_step, step_bucket
from freetoken.engine.gpu_moe import (
    MAX_SLOT_TOKENS,
    ExpertLayer,
    OffloadExperts,
    PinnedExperts,
    Pools,
    PoolShare,
    clear_last_cuda_error,
    layer_pools,
    unregister_host_memory,
)
from freetoken.errors import DeviceError, FreeTokenError, ShapeError
from freetoken.runtime import gpu
from freetoken.runtime.moe import run_experts
from freetoken.runtime.slots import SlotCache, Upload

__all__ = ["FETCH_FIELDS", "HybridExperts", "HybridStats", "MappedHost"]

log = logging.getLogger("freetoken")

# The hand-off block's words (cuda/include/freetoken_cuda.h, FT_CUDA_HANDOFF_*).
WORDS = _core.HANDOFF_WORDS
TIMEOUT, STOP = _core.HANDOFF_TIMEOUT, _core.HANDOFF_STOP
ANSWERED, BUSY_NS = _core.HANDOFF_ANSWERED, _core.HANDOFF_BUSY_NS
#: Most tokens a step splits between the GPU and the CPU (rows of the hand-off buffers): a
#: server step of a 256-token prompt chunk and the decode tokens of its running streams.
MAX_TOKENS = 512
#: How long the GPU waits for one answer before giving up (the step then fails).
TIMEOUT_S = 60.0
#: Experts uploaded per step into free slots, and over residents once a pool is full
#: (``--moe-cache-adaptive``): uploads read host memory the CPU executor needs too.
FILLS_PER_STEP = 32
SWAPS_PER_STEP = 16
SEEDED, FILLED = 1, 2  # origin of a resident expert
#: The host table's entry of an expert fetched into staging for the current step: the CPU
#: skips it as it skips a resident (any slot >= 0), the counts tell it from one.
FETCHED = _core.CUDA_FETCHED
#: The fetch counters kept per step size (:func:`freetoken.engine.fetch.step_bucket`): split
#: steps, routes uploaded and computed on the GPU vs computed on the CPU, the experts' bytes
#: each side read, the seconds the uploads took (the GPU's timer) and the CPU spent answering.
FETCH_FIELDS = (
    "steps",
    "uploaded_routes",
    "cpu_routes",
    "uploaded_bytes",
    "cpu_bytes",
    "upload_s",
    "cpu_s",
)
_REGISTER_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped
_PAGE = 4096


class MappedHost:
    """Page-locked host memory that the GPU addresses directly (``cudaHostRegister``,
    mapped), carved into named numpy arrays; unregistered when collected."""

    def __init__(self, layout: dict[str, tuple[Any, tuple[int, ...]]]) -> None:
        offsets, total = {}, 0
        for name, (dtype, shape) in layout.items():
            total = -(-total // 64) * 64
            offsets[name] = total
            total += np.dtype(dtype).itemsize * int(np.prod(shape))
        raw = np.zeros(total + _PAGE, dtype=np.uint8)
        start = -raw.ctypes.data % _PAGE
        self.bytes = raw[start : start + total]
        addr = self.bytes.ctypes.data
        if int(torch.cuda.cudart().cudaHostRegister(addr, total, _REGISTER_MAPPED)) != 0:
            clear_last_cuda_error()
            raise DeviceError(f"cannot page-lock {total} bytes for the CPU/GPU hand-off")
        weakref.finalize(self, unregister_host_memory, [addr], [raw])
        self.arrays = {
            name: self.bytes[off : off + np.dtype(dt).itemsize * int(np.prod(shape))]
            .view(dt)
            .reshape(shape)
            for (name, (dt, shape)), off in zip(layout.items(), offsets.values(), strict=True)
        }


@dataclass
class HybridStats:
    """Counters since load: per MoE layer (model order) the routes, how many hit a slot, and
    of those how many hit an expert the pools were seeded with (a profile's) or one filled in
    since, and the routes computed on the GPU on experts uploaded for their step only (not
    hits); hand-off requests the CPU answered and the seconds it spent answering; experts
    uploaded into slots (fills of free slots, swaps over residents) and bytes uploaded
    (seeding, streaming and fetches included); each layer's resident expert ids; the
    seconds the host spent between steps on the slot bookkeeping and starting uploads (the
    GPU idles meanwhile; the policy's own work overlaps the next step and is not counted);
    the fetch counters per step size."""

    layers: list[int]
    routes: np.ndarray
    hits: np.ndarray
    seeded_hits: np.ndarray
    filled_hits: np.ndarray
    fetched: np.ndarray
    answered: int
    cpu_busy_s: float
    fills: int
    swaps: int
    uploaded_bytes: int
    resident: list[list[int]]
    bookkeeping_s: float
    fetch: dict[str, dict[str, float]]
    """Per step size, the :data:`FETCH_FIELDS` counters."""

    @property
    def hit_rate(self) -> float:
        """Routes served by the GPU over all routes."""
        total = int(self.routes.sum())
        return float(self.hits.sum()) / total if total else 0.0

    def since(self, earlier: HybridStats) -> HybridStats:
        """The counts between ``earlier`` (a snapshot of the same experts) and these; the
        resident ids are these."""
        return HybridStats(
            layers=self.layers,
            routes=self.routes - earlier.routes,
            hits=self.hits - earlier.hits,
            seeded_hits=self.seeded_hits - earlier.seeded_hits,
            filled_hits=self.filled_hits - earlier.filled_hits,
            fetched=self.fetched - earlier.fetched,
            answered=self.answered - earlier.answered,
            cpu_busy_s=self.cpu_busy_s - earlier.cpu_busy_s,
            fills=self.fills - earlier.fills,
            swaps=self.swaps - earlier.swaps,
            uploaded_bytes=self.uploaded_bytes - earlier.uploaded_bytes,
            resident=self.resident,
            bookkeeping_s=self.bookkeeping_s - earlier.bookkeeping_s,
            fetch={
                size: {f: v - earlier.fetch.get(size, {}).get(f, 0) for f, v in c.items()}
                for size, c in self.fetch.items()
            },
        )


class HybridExperts(OffloadExperts):
    """The ``hybrid`` strategy over the pools of each share (each pool with ``top_k``
    zeroed slots after its own, where misses point), the CPU half on ``executor``. A
    share's ``cpu_only`` layers have no slots: every route of theirs goes through the
    hand-off to the CPU (``--moe-cpu-layers``, and experts the GPU kernels cannot serve), so
    steps stay graphs. ``policy`` is the slots' (``lru`` fills free slots only; ``adaptive``
    also swaps); ``bandwidth`` each pooled layer's
    :class:`~freetoken.engine.bandwidth_profile.KindBandwidth` by layer index (the prefill and
    fetch decisions), or None; ``fetch_share`` forces the share of a step's missed experts
    that steps of several tokens upload (None: the fetch rule's); ``pinned`` the layers'
    page-locked bytes when the caller pinned them."""

    def __init__(
        self,
        shares: Sequence[PoolShare],
        executor: _core.MoeExecutor,
        policy: str = "lru",
        bandwidth: dict[int, KindBandwidth] | None = None,
        pinned: PinnedExperts | None = None,
        fetch_share: float | None = None,
    ) -> None:
        layers = [ex for sh in shares for ex in sh.layers]
        cpu_only = [ex for sh in shares for ex in sh.cpu_only]
        served = sorted([*layers, *cpu_only], key=lambda ex: ex.index)
        first = served[0]
        shape = (first.gate.k, first.n_experts, first.top_k)
        for ex in served:
            if (ex.gate.k, ex.n_experts, ex.top_k) != shape:
                raise ShapeError("hybrid needs MoE layers of one width, expert count and top-k")
        hidden, n_experts, top_k = shape
        super().__init__(shares, policy, extra_slots=top_k, pinned=pinned)
        self.device_of |= {ex.index: sh.device for sh in shares for ex in sh.cpu_only}
        self.executor, self.top_k, self.policy = executor, top_k, policy
        self.links = {ex.index: Links.of((bandwidth or {}).get(ex.index)) for ex in layers}
        self.fetch_share = fetch_share
        self.fetch_streams = {dev: torch.cuda.Stream(dev) for dev in self.devices}
        self.cpu_only = {ex.index: ex for ex in cpu_only}
        # The hand-off serves every layer, in model order (its own positions).
        self.served = [ex.index for ex in served]
        self.handoff_pos = {li: i for i, li in enumerate(self.served)}
        self.all_layers = {ex.index: ex for ex in served}
        n = len(self.served)
        self.host = MappedHost(
            {
                "block": (np.int64, (WORDS,)),
                "x": (np.float32, (MAX_TOKENS, hidden)),
                "out": (np.float32, (MAX_TOKENS, hidden)),
                "ids": (np.int32, (n, MAX_TOKENS, top_k)),
                "weights": (np.float32, (n, MAX_TOKENS, top_k)),
                "resident": (np.int32, (n, n_experts)),
            }
        )
        a = self.host.arrays
        self.block = a["block"]
        self.views = {k: torch.from_numpy(a[k]) for k in ("x", "out", "ids", "weights")}
        # expert -> slot per layer (-1: computed on the CPU), on the host for the CPU thread
        # and on the device for the hits; both change only between steps (but for the
        # FETCHED marks the device writes into the host's for a step's fetched experts).
        self.resident = a["resident"]
        self.resident[:] = -1
        self.free: dict[int, int] = {}
        for cache, _ in self.of_layer.values():
            if id(cache) in self.free:
                continue
            held = [r for r in cache.residents() if r is not None]
            self.free[id(cache)] = cache.n_slots - len(held)
            for layer, expert in held:
                slot = cache.slot_of(layer, expert)
                assert slot is not None  # a resident has a slot
                self.resident[self.handoff_pos[layer], expert] = slot
        # Where each resident came from: the plan's seed (a profile's hottest) or a fill.
        self.origin = np.where(self.resident >= 0, SEEDED, 0).astype(np.int8)
        # Per device: the table (every layer's rows; each device reads its layers') and the
        # sequence counter of its requests, the last one to raise a request in `last_counter`.
        self.resident_dev = {d: torch.from_numpy(self.resident).to(d) for d in self.devices}
        self.counters = {d: torch.zeros(1, dtype=torch.int64, device=d) for d in self.devices}
        self.last_counter: torch.Tensor | None = None
        # The fetch: each pooled layer's experts as the device reads them (the kinds' host
        # addresses and strides, for layers whose experts lie evenly spaced in pinned
        # memory), its two staging pools (the buffers alternate by layer), the plan's list
        # and statistics per layer.
        fits = n_experts <= _core.CUDA_FETCH_MAX_EXPERTS
        self.sources = {
            ex.index: src
            for ex in layers
            if fits and self.pins.holds(ex) and (src := ex.fetch_sources()) is not None
        }
        self.staged: dict[tuple[int, int], Pools] = {}
        for li in self.sources:
            dev = self.device_of[li]
            for b, buf in enumerate(self.staging[dev]):
                self.staged[(li, b)] = layer_pools(self.layers[li], n_experts, dev, buf.memory)
        self.fetched_dev = {
            d: torch.zeros((n, n_experts), dtype=torch.int32, device=d) for d in self.devices
        }
        self.fetch_stats = {
            d: torch.zeros((n, gpu.FETCH_STATS), dtype=torch.int64, device=d) for d in self.devices
        }
        self.pending: list[tuple[torch.cuda.Event, list[tuple[SlotCache, Upload]]]] = []
        # A plan's uploads, evicted from the tables, until the next step starts their copies.
        self.queued: list[tuple[SlotCache, Pools, list[Upload]]] = []
        self.ticket: Any = None
        self.serving = self.split = self.fetching = False
        self.n_tokens = 0
        self.busy_ns = 0
        self.fetch: dict[str, dict[str, float]] = {}
        self.expert_nbytes = np.array([ex.expert_nbytes for ex in served], dtype=np.int64)
        self.steps = 0
        self.routes = np.zeros(n, dtype=np.int64)
        self.hits = np.zeros(n, dtype=np.int64)
        self.seeded_hits = np.zeros(n, dtype=np.int64)
        self.filled_hits = np.zeros(n, dtype=np.int64)
        self.fetched_routes = np.zeros(n, dtype=np.int64)
        self.fills = self.swaps = 0
        self.bookkeeping_s = 0.0
        # The last step's routes (ids, hits [layers, tokens, top_k], active layers) until
        # the policy has seen them.
        self.last: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    # -- the step -------------------------------------------------------------------------

    def begin(self, n_tokens: int, graph: bool = False) -> None:
        """Before a step of ``n_tokens``: publishes finished uploads, decides split or stream
        and whether layers fetch part of their misses, and starts the CPU thread when
        splitting. ``graph``: the step replays a captured graph (it then always splits)."""
        t0 = time.perf_counter()
        self._publish_uploads()
        self.bookkeeping_s += time.perf_counter() - t0
        self.n_tokens = n_tokens
        self.split, self.fetching = self._plan_step(n_tokens, graph)
        self.serving = n_tokens <= MAX_TOKENS and (self.split or bool(self.cpu_only))
        if not self.serving:
            return
        if self.fetching:
            # Fetches overwrite the staging buffers: they hold no streamed layer after this.
            for buf in (b for pair in self.staging.values() for b in pair):
                buf.layer, buf.pools = -1, None
            for stats in self.fetch_stats.values():
                stats.zero_()
        a = self.host.arrays
        self.block[STOP] = 0
        self.busy_ns = int(self.block[BUSY_NS])
        self.ticket = self.executor.serve_handoffs(
            [self.all_layers[li].layer for li in self.served],
            self.block,
            a["x"],
            a["out"],
            a["ids"],
            a["weights"],
            self.resident,
            MAX_TOKENS,
            self.top_k,
        )

    def end(self) -> None:
        """After a step (also one that raised): waits for the GPU and the CPU thread, raises
        what went wrong, else counts the step's routes. While this step computes (the host
        would only wait) the slot policy works on the previous step's routes and the copies
        its previous plan chose start; once this step is done, the new plan's evictions go
        into the tables before the next step: fills and swaps lag two steps, and the host
        between steps only updates the tables."""
        if self.ticket is None:
            return
        ticket, self.ticket = self.ticket, None
        plan = self._plan()
        self._start_uploads()
        try:
            self._finish(ticket)
        finally:
            t0 = time.perf_counter()
            if self.fetching:  # the CPU thread is done with the table
                self.resident[self.resident == FETCHED] = -1
            for cache, pools, ups in plan:  # the pools are idle now, even after a failure
                self._evict(cache, pools, ups)
            self.bookkeeping_s += time.perf_counter() - t0

    def _finish(self, ticket: Any) -> None:
        try:
            for dev in self.devices:
                torch.cuda.current_stream(dev).synchronize()
        finally:
            self.block[STOP] = 1
            try:
                ticket.wait()
            except FreeTokenError:
                self._reset()
                raise
        if self.block[TIMEOUT]:
            self._reset()
            raise DeviceError(
                f"the GPU waited over {TIMEOUT_S:.0f} s for the CPU expert thread; step abandoned"
            )
        t0 = time.perf_counter()
        self._account(self.n_tokens)
        self.bookkeeping_s += time.perf_counter() - t0

    def launch(
        self, ex: ExpertLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        pooled = ex.index in self.of_layer
        if pooled and not self.split:
            return self._launch_streamed(ex, x, ids, weights)
        if not self.serving:
            return self._cpu_direct(ex, x, ids, weights)
        t, pos = ids.shape[0], self.handoff_pos[ex.index]
        dev = self.device_of[ex.index]
        fetch = self.fetching and ex.index in self.sources
        staged = self._start_fetch(ex, pos, ids, weights) if fetch else None
        v = self.views
        host = (v["x"][:t], v["ids"][pos, :t], v["weights"][pos, :t])
        cache = self.of_layer[ex.index][0] if pooled else None
        dummy = cache.n_slots if cache is not None else 0
        counter = self._counter(dev)
        slots, w = gpu.handoff_routes(
            counter,
            self.block,
            (t << 32) | pos,
            x,
            ids,
            weights,
            self.resident_dev[dev][pos],
            dummy,
            host,
        )
        if pooled:
            pools = self.of_layer[ex.index][1]
            out = gpu.moe_layer(*pools, x, slots, w, act=ex.layer.act, check_ids=False)
        else:
            out = torch.zeros_like(x)
        if staged is not None:
            staging, f_slots, f_weights = staged
            torch.cuda.current_stream(dev).wait_stream(self.fetch_streams[dev])
            gpu.moe_layer(
                *staging,
                x,
                f_slots,
                f_weights,
                act=ex.layer.act,
                out=out,
                accumulate=True,
                check_ids=False,
            )
        gpu.handoff_wait_add(counter, self.block, v["out"][:t], out, TIMEOUT_S)
        return out

    def enter(self, device: torch.device) -> None:
        """Before a captured stage on ``device`` (its capture or replay): the device's
        counter takes the latest count now, so the stage's graph holds no copy of it. A
        device without hand-off layers makes no request: nothing to follow."""
        if device in self.counters:
            self._counter(device)

    def _counter(self, dev: torch.device) -> torch.Tensor:
        """The sequence counter for a request from ``dev``: after another device's request
        it first takes that device's count (on both current streams, which torch orders
        after the other device's wait for its answer), so that the requests of all devices
        form the one sequence the CPU thread answers. A captured graph holds no copy: a graph
        of a whole step is on one device, and each stage of a step over several devices is
        entered (:meth:`enter`) before it is captured or replayed."""
        counter = self.counters[dev]
        last = self.last_counter
        if last is not None and last is not counter:
            counter.copy_(last)
        self.last_counter = counter
        return counter

    def _start_fetch(
        self, ex: ExpertLayer, pos: int, ids: torch.Tensor, weights: torch.Tensor
    ) -> tuple[Pools, torch.Tensor, torch.Tensor]:
        """The layer's fetch, before its request: the device's choice (marking the fetched
        experts in the host's table, so the CPU skips them), then their copies into a
        staging buffer on the fetch stream while the slot pool's kernels run. Returns the
        staging pools and each route's slot and weight there: the fetched experts' slots
        from 0, the ``top_k`` zeroed slots at the end for every other route (weight 0), so
        a token's slots stay distinct. The stream forks after the plan, so the copies also
        follow every earlier layer's use of the same buffer."""
        n_exp, k = ex.n_experts, self.top_k
        base = n_exp - k
        links = self.links[ex.index]
        dev = self.device_of[ex.index]
        slots, f_weights = gpu.fetch_plan(
            ids,
            weights,
            self.resident_dev[dev][pos],
            self.resident[pos],
            self.fetched_dev[dev][pos],
            self.fetch_stats[dev][pos],
            max_fetch=base,
            dummy_base=base,
            expert_bytes=ex.expert_nbytes,
            links=(links.cpu, links.pcie, links.gpu, links.cpu_with_pcie, links.pcie_with_cpu),
            overhead_s=FETCH_OVERHEAD_S,
            share=self.fetch_share,
            price_routes=ids.shape[0] > MAX_SLOT_TOKENS,
        )
        pools = self.staged[(ex.index, self.position[ex.index] % len(self.staging[dev]))]
        fetch_stream = self.fetch_streams[dev]
        fetch_stream.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(fetch_stream):
            gpu.fetch_gather(
                pools,
                self.sources[ex.index],
                self.fetched_dev[dev][pos],
                self.fetch_stats[dev][pos],
                top_k=k,
                max_fetch=base,
                dummy_base=base,
            )
        return pools, slots, f_weights

    def _cpu_direct(
        self, ex: ExpertLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """A slotless layer in a step too long for the hand-off buffers: through the host."""
        out = run_experts(self.executor, ex.layer, x.cpu(), ids.cpu(), weights.cpu())
        return out.to(x.device)

    def _hit_rate(self) -> float:
        total = int(self.routes.sum())
        return float(self.hits.sum()) / total if total else 0.0

    def _plan_step(self, n_tokens: int, graph: bool = False) -> tuple[bool, bool]:
        """Whether a step of ``n_tokens`` splits (else the layers stream over PCIe) and
        whether its layers that can fetch run the device's fetch choice. Up to
        MAX_SLOT_TOKENS tokens, and any step that would replay a ``graph`` (decode and
        verify steps: a captured step must find the same split each replay), a step splits;
        above, when the fetch rule on each layer's expected misses (uniform routing at the
        hit rate so far, each CPU route priced as one expert read, which over-prices the
        CPU on long prompts) expects the split to take less than streaming the layers.
        One-token steps never fetch; split steps of several tokens do unless the forced
        share is 0 (each layer's choice, nothing among them, is the device's)."""
        if not self.order or n_tokens > MAX_TOKENS:
            return False, False  # no slots to split over, or too long for the hand-off
        if n_tokens == 1:
            return True, False
        fetch = bool(self.sources) and (self.fetch_share is None or self.fetch_share > 0)
        small = n_tokens <= MAX_SLOT_TOKENS
        if small or graph:
            return True, fetch
        kinds: dict[tuple[Links, int], int] = {}
        for li in self.order:
            key = (self.links[li], self.layers[li].expert_nbytes)
            kinds[key] = kinds.get(key, 0) + 1
        split_s, stream_s, _ = expect_step(
            n_tokens,
            self._hit_rate(),
            self.resident.shape[1],
            self.top_k,
            kinds,
            share=self.fetch_share,
            price_routes=True,
        )
        split = split_s < stream_s
        return split, split and fetch

    def _reset(self) -> None:
        """After a failed step: both sides back to sequence 0."""
        self.last = None
        for dev in self.devices:
            torch.cuda.synchronize(dev)
        for counter in self.counters.values():
            counter.zero_()
        self.last_counter = None
        self.block[:] = 0

    # -- between steps ----------------------------------------------------------------------

    def _account(self, t: int) -> None:
        """The step's routes: hit counters and the fetch counters of its size; the routes
        are kept for the policy's next plan."""
        n, k = len(self.served), self.top_k
        # The layers that went through the hand-off this step (a streamed step: the
        # slotless ones only); the others' rows of `ids` are an older step's.
        active = np.array([self.split or li in self.cpu_only for li in self.served])
        ids = self.host.arrays["ids"][:, :t].reshape(n, t * k)
        slot = np.take_along_axis(self.resident, ids, axis=1)
        fetched = slot == FETCHED
        hit = (slot >= 0) & ~fetched & active[:, None]
        origin = np.take_along_axis(self.origin, ids, axis=1)
        self.routes += t * k * active
        self.hits += hit.sum(axis=1)
        self.seeded_hits += (hit & (origin == SEEDED)).sum(axis=1)
        self.filled_hits += (hit & (origin == FILLED)).sum(axis=1)
        self.fetched_routes += fetched.sum(axis=1)
        self.last = (ids.reshape(n, t, k).copy(), hit.reshape(n, t, k), active)
        if self.split:
            self._count_fetch(t, ids, fetched, (slot < 0) & active[:, None])

    def _count_fetch(
        self, t: int, ids: np.ndarray, fetched: np.ndarray, on_cpu: np.ndarray
    ) -> None:
        """Adds a split step's routes and bytes on each side, and both sides' times (the
        uploads' on the GPU's timer, from each layer's first copy to its last), to the
        counters of its size (and logs them with ``-v``)."""
        n, e = ids.shape[0], self.resident.shape[1]
        flat = ids + np.arange(n)[:, None] * e

        def bytes_of(mask: np.ndarray) -> int:
            distinct = (np.bincount(flat[mask], minlength=n * e).reshape(n, e) > 0).sum(axis=1)
            return int(distinct @ self.expert_nbytes)

        upload_s = 0.0
        if self.fetching:
            # Each layer's row is written on its own device only (the others' stay zero).
            stats = np.sum([s.cpu().numpy() for s in self.fetch_stats.values()], axis=0)
            ran = stats[:, gpu.FETCH_END_NS] > 0
            spans = stats[ran, gpu.FETCH_END_NS] - stats[ran, gpu.FETCH_START_NS]
            upload_s = float(spans.sum()) / 1e9
        uploaded = bytes_of(fetched)
        self.uploaded_bytes += uploaded
        step = {
            "steps": 1,
            "uploaded_routes": int(fetched.sum()),
            "cpu_routes": int(on_cpu.sum()),
            "uploaded_bytes": uploaded,
            "cpu_bytes": bytes_of(on_cpu),
            "upload_s": upload_s,
            "cpu_s": (int(self.block[BUSY_NS]) - self.busy_ns) / 1e9,
        }
        c = self.fetch.setdefault(step_bucket(t), dict.fromkeys(FETCH_FIELDS, 0))
        for f, v in step.items():
            c[f] += v
        if self.fetching and log.isEnabledFor(logging.DEBUG):
            n_fetched, missed = (int(x) for x in stats[:, [gpu.FETCH_N, gpu.FETCH_MISSED]].sum(0))
            want_up, want_cpu = stats[:, [gpu.FETCH_UPLOAD_NS, gpu.FETCH_CPU_NS]].sum(0) / 1e9
            log.debug(
                "hybrid step of %d tokens: fetched %d of %d missed experts (share %.2f, %s); "
                "%d routes uploaded (%.1f MiB, %.2f ms, expected %.2f), %d on the CPU "
                "(%.1f MiB, %.2f ms, expected %.2f)",
                t,
                n_fetched,
                missed,
                n_fetched / missed if missed else 0.0,
                "forced" if self.fetch_share is not None else "the fetch rule's",
                step["uploaded_routes"],
                step["uploaded_bytes"] / (1 << 20),
                upload_s * 1e3,
                want_up * 1e3,
                step["cpu_routes"],
                step["cpu_bytes"] / (1 << 20),
                step["cpu_s"] * 1e3,
                want_cpu * 1e3,
            )

    def _plan(self) -> list[tuple[SlotCache, Pools, list[Upload]]]:
        """The policy's bookkeeping of the last counted step's routes, and which misses to
        upload where (up to FILLS_PER_STEP, of them SWAPS_PER_STEP over residents)."""
        if self.last is None:
            return []
        ids, hit, active = self.last
        self.last = None
        n = len(self.served)
        fills, swaps = FILLS_PER_STEP, SWAPS_PER_STEP
        batches: dict[int, tuple[SlotCache, Pools, list[Upload]]] = {}
        self.steps += 1
        for i in range(n):
            pos = (i + self.steps) % n  # a different layer first each step
            li = self.served[pos]
            if not active[pos] or li in self.cpu_only:
                continue
            cache, pools = self.of_layer[li]
            cache.lookup(li, ids[pos])
            missed = np.unique(ids[pos][~hit[pos]])
            free = self.free[id(cache)]
            cap = min(fills, free) if free else (swaps if self.policy == "adaptive" else 0)
            if not missed.size or cap <= 0:
                continue
            ups = cache.admit(li, missed, max_uploads=cap)
            for u in ups:
                if u.evicted is None:
                    self.free[id(cache)] -= 1
                else:
                    swaps -= 1
                fills -= 1
            if ups:
                batches.setdefault(id(cache), (cache, pools, []))[2].extend(ups)
            if fills <= 0:
                break
        return list(batches.values())

    def _set_resident(self, entries: list[tuple[int, int, int]]) -> None:
        """(position, expert, slot or -1) into both tables; on the current stream, so before
        the next step's kernels."""
        if not entries:
            return
        table = np.ascontiguousarray(np.array(entries, dtype=np.int64).T)  # [3, n]: one copy
        pos, expert, slot = table
        self.resident[pos, expert] = slot
        self.origin[pos, expert] = np.where(slot >= 0, FILLED, 0)
        for device, resident in self.resident_dev.items():
            dev = torch.from_numpy(table).to(device)
            resident[dev[0], dev[1]] = dev[2].to(torch.int32)

    def _evict(self, cache: SlotCache, pools: Pools, ups: list[Upload]) -> None:
        """Takes the experts a plan replaces out of the tables (before the next step, on the
        current stream) and queues the plan's copies for :meth:`_start_uploads`."""
        gone = [(self.handoff_pos[u.evicted[0]], u.evicted[1], -1) for u in ups if u.evicted]
        self.swaps += len(gone)
        self.fills += len(ups) - len(gone)
        self._set_resident(gone)
        self.queued.append((cache, pools, ups))

    def _start_uploads(self) -> None:
        """Queues the copies of the evicted and free slots on the copy stream. A step in
        flight does not read them (the tables name none of them since before it started),
        and the steps that did are done, so the copies need not wait for the current
        stream."""
        for cache, pools, ups in self.queued:
            ready = torch.cuda.Event()
            copy_stream = self.copy_streams[pools[0].device]
            with torch.cuda.stream(copy_stream):
                self._upload(pools, sorted(ups, key=lambda u: (u.layer, u.expert)), self.pinned)
                ready.record(copy_stream)
            self.pending.append((ready, [(cache, u) for u in ups]))
        self.queued = []

    def _publish_uploads(self) -> None:
        """Puts finished uploads into the tables (an expert evicted again meanwhile stays
        out)."""
        done = [p for p in self.pending if p[0].query()]
        if not done:
            return
        self.pending = [p for p in self.pending if p not in done]
        self._set_resident(
            [
                (self.handoff_pos[u.layer], u.expert, u.slot)
                for _, ups in done
                for cache, u in ups
                if cache.slot_of(u.layer, u.expert) == u.slot
            ]
        )

    def stats(self) -> HybridStats:
        """The counters since load."""
        return HybridStats(
            layers=list(self.served),
            routes=self.routes.copy(),
            hits=self.hits.copy(),
            seeded_hits=self.seeded_hits.copy(),
            filled_hits=self.filled_hits.copy(),
            fetched=self.fetched_routes.copy(),
            answered=int(self.block[ANSWERED]),
            cpu_busy_s=int(self.block[BUSY_NS]) / 1e9,
            fills=self.fills,
            swaps=self.swaps,
            uploaded_bytes=self.uploaded_bytes,
            resident=[np.flatnonzero(row >= 0).tolist() for row in self.resident],
            bookkeeping_s=self.bookkeeping_s,
            fetch={size: dict(c) for size, c in self.fetch.items()},
        )
