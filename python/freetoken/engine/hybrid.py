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

In a split step of several tokens (concurrent decode, prompt chunks) each layer also uploads
a share of its missed experts into a staging buffer outside the pools and computes them on
the GPU while the CPU computes the rest, both links busy (:mod:`freetoken.engine.fetch`
chooses the share from the layer kind's bench-bw figures, or ``--moe-fetch-share`` forces
it). The layer's routes are read back first, so such steps run eagerly; the fetched
experts are marked in the host's table only (the CPU skips them, the device table still
sends them to the pool's zeroed slots) until the step ends.
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
from freetoken.engine.fetch import Links, choose_fetch, expect_step, step_bucket
from freetoken.engine.gpu_moe import (
    MAX_SLOT_TOKENS,
    ExpertLayer,
    OffloadExperts,
    PinnedExperts,
    Pools,
    _pools,
    clear_last_cuda_error,
    unregister_host_memory,
)
from freetoken.errors import DeviceError, FreeTokenError, ShapeError
from freetoken.runtime import gpu
from freetoken.runtime.moe import run_experts
from freetoken.runtime.slots import CachePlan, SlotCache, Upload

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
FETCHED = np.iinfo(np.int32).max
#: The fetch counters kept per step size (:func:`freetoken.engine.fetch.step_bucket`): split
#: steps, routes uploaded and computed on the GPU vs computed on the CPU, the experts' bytes
#: each side read, the seconds the uploads took (CUDA events) and the CPU spent answering.
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
    """The ``hybrid`` strategy over the pools of ``plan`` for ``layers`` (each pool with
    ``top_k`` zeroed slots after its own, where misses point), the CPU half on ``executor``.
    ``cpu_only`` layers have no slots: every route of theirs goes through the hand-off to the
    CPU (``--moe-cpu-layers``, and experts the GPU kernels cannot serve), so steps stay
    graphs. ``policy`` is the slots' (``lru`` fills free slots only; ``adaptive`` also
    swaps); ``bandwidth`` each pooled layer's
    :class:`~freetoken.engine.bandwidth_profile.KindBandwidth` by layer index (the prefill and
    fetch decisions), or None; ``fetch_share`` forces the share of a step's missed experts
    that steps of several tokens upload (None: the fetch rule's); ``pinned`` the layers'
    page-locked bytes when the caller pinned them."""

    def __init__(
        self,
        layers: Sequence[ExpertLayer],
        plan: CachePlan,
        device: torch.device,
        executor: _core.MoeExecutor,
        policy: str = "lru",
        bandwidth: dict[int, KindBandwidth] | None = None,
        cpu_only: Sequence[ExpertLayer] = (),
        pinned: PinnedExperts | None = None,
        fetch_share: float | None = None,
    ) -> None:
        served = sorted([*layers, *cpu_only], key=lambda ex: ex.index)
        first = served[0]
        shape = (first.gate.k, first.n_experts, first.top_k)
        for ex in served:
            if (ex.gate.k, ex.n_experts, ex.top_k) != shape:
                raise ShapeError("hybrid needs MoE layers of one width, expert count and top-k")
        hidden, n_experts, top_k = shape
        super().__init__(layers, plan, device, policy, extra_slots=top_k, pinned=pinned)
        self.executor, self.top_k, self.policy = executor, top_k, policy
        self.links = {ex.index: Links.of((bandwidth or {}).get(ex.index)) for ex in layers}
        self.fetch_share = fetch_share
        self.fetch_stream = torch.cuda.Stream(device)
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
            }
        )
        a = self.host.arrays
        self.block = a["block"]
        self.views = {k: torch.from_numpy(a[k]) for k in ("x", "out", "ids", "weights")}
        # expert -> slot per layer (-1: computed on the CPU), on the host for the CPU thread
        # and on the device for the hits; both change only between steps (but for the
        # host's FETCHED marks of a step's fetched experts).
        self.resident = np.full((n, n_experts), -1, dtype=np.int32)
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
        self.resident_dev = torch.from_numpy(self.resident).to(device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.pending: list[tuple[torch.cuda.Event, list[tuple[SlotCache, Upload]]]] = []
        # A plan's uploads, evicted from the tables, until the next step starts their copies.
        self.queued: list[tuple[SlotCache, Pools, list[Upload]]] = []
        self.ticket: Any = None
        self.serving = self.split = self.fetching = False
        self.n_tokens = 0
        # This step's fetches: (position, experts) and the uploads' CUDA events.
        self.marked: list[tuple[int, np.ndarray]] = []
        self.fetch_spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        # The fetch rule's choices this step, summed over the layers: experts fetched and
        # missed, expected upload and CPU seconds.
        self.expected = np.zeros(4)
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

    def begin(self, n_tokens: int, graph: bool = False) -> bool:
        """Before a step of ``n_tokens``: publishes finished uploads, decides split or stream
        and whether layers fetch part of their misses, and starts the CPU thread when
        splitting. ``graph``: the step replays a captured graph unless it fetches. Returns
        whether the step may replay a graph (not when it fetches)."""
        t0 = time.perf_counter()
        self._publish_uploads()
        self.bookkeeping_s += time.perf_counter() - t0
        self.n_tokens = n_tokens
        self.split, self.fetching = self._plan_step(n_tokens, graph)
        self.serving = n_tokens <= MAX_TOKENS and (self.split or bool(self.cpu_only))
        if not self.serving:
            return True
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
        return not self.fetching

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
            for pos, experts in self.marked:  # the CPU thread is done with the table
                self.resident[pos, experts] = -1
            self.marked, self.fetch_spans = [], []
            self.expected[:] = 0
            for cache, pools, ups in plan:  # the pools are idle now, even after a failure
                self._evict(cache, pools, ups)
            self.bookkeeping_s += time.perf_counter() - t0

    def _finish(self, ticket: Any) -> None:
        try:
            torch.cuda.current_stream(self.device).synchronize()
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
        fetch = self._choose_fetch(ex, pos, ids) if pooled and self.fetching else None
        v = self.views
        host = (v["x"][:t], v["ids"][pos, :t], v["weights"][pos, :t])
        cache = self.of_layer[ex.index][0] if pooled else None
        dummy = cache.n_slots if cache is not None else 0
        slots, w = gpu.handoff_routes(
            self.counter,
            self.block,
            (t << 32) | pos,
            x,
            ids,
            weights,
            self.resident_dev[pos],
            dummy,
            host,
        )
        if pooled:
            pools = self.of_layer[ex.index][1]
            out = gpu.moe_layer(*pools, x, slots, w, act=ex.layer.act, check_ids=False)
        else:
            out = torch.zeros_like(x)
        if fetch is not None:
            self._run_fetched(ex, x, weights, out, *fetch)
        gpu.handoff_wait_add(self.counter, self.block, v["out"][:t], out, TIMEOUT_S)
        return out

    def _choose_fetch(
        self, ex: ExpertLayer, pos: int, ids: torch.Tensor
    ) -> tuple[torch.Tensor, np.ndarray] | None:
        """Which of the layer's missed experts to upload, marked in the host's table before
        the layer's request (the CPU skips them). Reads the routes back: the layers before
        are then done on both sides. Returns each route's staging slot (on the device) and
        the experts (sorted), or None when nothing is fetched."""
        host_ids = ids.cpu().numpy()
        row, n_exp = self.resident[pos], ex.n_experts
        flat = host_ids.ravel()
        counts = np.bincount(flat[row[flat] < 0], minlength=n_exp)
        missed = np.flatnonzero(counts)
        choice = choose_fetch(
            missed,
            counts[missed],
            ex.expert_nbytes,
            self.links[ex.index],
            share=self.fetch_share,
            max_fetch=n_exp - self.top_k,  # staging holds n_experts slots, top_k zeroed
            price_routes=self.n_tokens > MAX_SLOT_TOKENS,
        )
        self.expected += (choice.n_fetch, len(missed), choice.upload_s, choice.cpu_s)
        if not choice.n_fetch:
            return None
        fetched = np.sort(choice.fetched)
        row[fetched] = FETCHED
        self.marked.append((pos, fetched))
        # Each route's staging slot: the fetched experts' in order, then the zeroed ones
        # (copied while the stream is idle: a copy from pageable memory synchronizes).
        n, k = len(fetched), self.top_k
        slot_of = np.full(n_exp, -1, dtype=np.int32)
        slot_of[fetched] = np.arange(n, dtype=np.int32)
        slots = slot_of[host_ids]
        staged = np.where(slots >= 0, slots, n + np.arange(k, dtype=np.int32))
        return torch.from_numpy(staged).to(self.device), fetched

    def _run_fetched(
        self,
        ex: ExpertLayer,
        x: torch.Tensor,
        weights: torch.Tensor,
        out: torch.Tensor,
        slots: torch.Tensor,
        fetched: np.ndarray,
    ) -> None:
        """Copies the fetched experts into a staging buffer on the fetch stream (the slot
        pool's kernels run meanwhile) and adds their routes into ``out`` once they are in;
        the buffer's ``top_k`` slots after them are zeroed and take every other route at
        weight 0, so a token's slots stay distinct and the launch shape is the pool's."""
        n, k = len(fetched), self.top_k
        buf = self.staging[self.position[ex.index] % 2]
        start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.fetch_stream.wait_event(buf.free)
        with torch.cuda.stream(self.fetch_stream):
            staged = _pools(ex, n + k, self.device, buf.memory)
            for p in staged:
                p.tensor[n * p.matrix_nbytes : (n + k) * p.matrix_nbytes].zero_()
            start.record()
            ups = [Upload(ex.index, int(e), i, None) for i, e in enumerate(fetched)]
            self._upload(staged, ups, non_blocking=self.pinned)
            done.record()
            buf.ready.record(self.fetch_stream)
        buf.layer, buf.pools = -1, None  # not a streamed layer any more
        self.fetch_spans.append((start, done))
        f_weights = torch.where(slots < n, weights, torch.zeros_like(weights))
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(buf.ready)
        gpu.moe_layer(
            *staged,
            x,
            slots,
            f_weights,
            act=ex.layer.act,
            out=out,
            accumulate=True,
            check_ids=False,
        )
        buf.free.record(stream)

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
        whether its layers fetch part of their misses. Up to MAX_SLOT_TOKENS tokens a step
        splits; above, when the fetch rule on each layer's expected misses (uniform routing
        at the hit rate so far, each CPU route priced as one expert read, which over-prices
        the CPU on long prompts) expects the split to take less than streaming the layers.
        One-token steps never fetch; up to MAX_SLOT_TOKENS a forced share above 0 always
        does, and a step that would replay a ``graph`` does not otherwise (a fetching step
        runs eagerly: on the H200 a 4-token verify step of the Qwen3.5-35B-A3B preset took
        96 ms eagerly against 14 ms for a replayed one-token step, while its misses cost the
        CPU about 25 ms); else :func:`freetoken.engine.fetch.expect_step` decides."""
        if not self.order or n_tokens > MAX_TOKENS:
            return False, False  # no slots to split over, or too long for the hand-off
        if n_tokens == 1:
            return True, False
        small = n_tokens <= MAX_SLOT_TOKENS
        if small and self.fetch_share is not None:
            return True, self.fetch_share > 0
        if small and graph:
            return True, False
        kinds: dict[tuple[Links, int], int] = {}
        for li in self.order:
            key = (self.links[li], self.layers[li].expert_nbytes)
            kinds[key] = kinds.get(key, 0) + 1
        split_s, stream_s, fetch = expect_step(
            n_tokens,
            self._hit_rate(),
            self.resident.shape[1],
            self.top_k,
            kinds,
            share=self.fetch_share,
            price_routes=not small,
        )
        split = small or split_s < stream_s
        return split, split and fetch

    def _reset(self) -> None:
        """After a failed step: both sides back to sequence 0."""
        self.last = None
        torch.cuda.synchronize(self.device)
        self.counter.zero_()
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
        """Adds a split step's routes and bytes on each side, and both sides' times, to the
        counters of its size (and logs them with ``-v``)."""
        n, e = ids.shape[0], self.resident.shape[1]
        flat = ids + np.arange(n)[:, None] * e

        def bytes_of(mask: np.ndarray) -> int:
            distinct = (np.bincount(flat[mask], minlength=n * e).reshape(n, e) > 0).sum(axis=1)
            return int(distinct @ self.expert_nbytes)

        upload_s = sum(a.elapsed_time(b) for a, b in self.fetch_spans) / 1e3
        step = {
            "steps": 1,
            "uploaded_routes": int(fetched.sum()),
            "cpu_routes": int(on_cpu.sum()),
            "uploaded_bytes": bytes_of(fetched),
            "cpu_bytes": bytes_of(on_cpu),
            "upload_s": upload_s,
            "cpu_s": (int(self.block[BUSY_NS]) - self.busy_ns) / 1e9,
        }
        c = self.fetch.setdefault(step_bucket(t), dict.fromkeys(FETCH_FIELDS, 0))
        for f, v in step.items():
            c[f] += v
        if self.fetching and log.isEnabledFor(logging.DEBUG):
            n_fetched, missed, want_up, want_cpu = self.expected.tolist()
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
        dev = torch.from_numpy(table).to(self.device)
        self.resident_dev[dev[0], dev[1]] = dev[2].to(torch.int32)

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
            with torch.cuda.stream(self.copy_stream):
                self._upload(pools, sorted(ups, key=lambda u: (u.layer, u.expert)), self.pinned)
                ready.record(self.copy_stream)
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
