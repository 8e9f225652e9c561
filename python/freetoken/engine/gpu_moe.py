"""MoE layers on the GPU: routing in torch, the routed experts by ggml-cuda (one
``gpu.moe_layer`` launch per layer) on slot pools.

Strategies (``--moe-strategy``):

- ``gpu``: every expert resident. One pool per (gate, up, down) type triple holds the experts
  of all its layers back to back, so a layer's slots are its expert ids plus a base, computed
  on the device: nothing reads back to the host and decode steps can be captured as a graph.
- ``offload``: pools smaller than the experts, filled on demand. A decode step (up to 8
  tokens) reads the layer's routes back, places them with the pool's LRU
  (:class:`freetoken.runtime.slots.SlotCache`), uploads the missed experts from host memory and
  launches on the slots. A prefill chunk (more tokens) streams whole expert layers into two
  staging buffers outside the pools instead, double-buffered on a copy stream: the upload of
  the next MoE layer overlaps the compute of this one.

Layers the GPU kernels cannot serve (gpt-oss's clamped SwiGLU and expert biases, or types
without MMVQ/MMQ) stay on the CPU expert executor.

With the layers split over several GPUs each GPU's range has a :class:`PoolShare`: its own
pools, planned within its share of the cache, beside the range's other weights; one expert
object serves the shares of all ranges, each layer on its own device.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Container, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from freetoken import _core
from freetoken.errors import InvalidInputError
from freetoken.runtime import gpu
from freetoken.runtime.moe import CpuExperts, MoeFFN
from freetoken.runtime.routing import Routing, route
from freetoken.runtime.slots import CachePlan, LayerSpec, SlotCache, Upload

__all__ = [
    "ExpertLayer",
    "GpuExperts",
    "HostExperts",
    "OffloadExperts",
    "PinnedExperts",
    "PoolShare",
    "ResidentExperts",
    "gpu_servable",
    "layer_pools",
    "pin_host_memory",
]

KINDS = ("gate", "up", "down")
#: Above this many tokens a layer call streams the whole layer (MMQ's regime: most experts
#: are hit anyway) instead of placing routes in slots.
MAX_SLOT_TOKENS = 8
#: A layer's (gate, up, down) slot pools.
Pools = tuple[gpu.ExpertPool, gpu.ExpertPool, gpu.ExpertPool]
#: cudaHostRegisterPortable | cudaHostRegisterMapped | cudaHostRegisterReadOnly: the mapping
#: is read-only, and mapped so that a kernel can read experts in place (hybrid's fetches).
_REGISTER_FLAGS = 1 | 2 | 8


@dataclass(frozen=True)
class Matrices:
    """One kind of expert matrix of one layer: type, shape and each expert's host bytes."""

    qtype: int
    rows: int
    k: int
    ranges: list[tuple[int, int]]

    @classmethod
    def of(cls, m: _core.ExpertMatrices) -> Matrices:
        """The matrices a MoE layer reports (``MoeLayer.matrices``)."""
        return cls(m.qtype, m.rows, m.k, m.ranges)

    @property
    def nbytes(self) -> int:
        return self.ranges[0][1]


@dataclass(frozen=True)
class ExpertLayer:
    """One MoE layer's experts as the GPU path sees them."""

    layer: _core.MoeLayer
    top_k: int
    gate: Matrices
    up: Matrices
    down: Matrices

    @classmethod
    def of(cls, ffn: MoeFFN) -> ExpertLayer:
        """The experts of a CPU MoE feed-forward."""
        layer = ffn.layer
        return cls(layer, ffn.routing.top_k, *(Matrices.of(layer.matrices(k)) for k in KINDS))

    def spec(self) -> LayerSpec:
        """What the pool planner needs to know of this layer."""
        return LayerSpec.from_shapes(
            self.index,
            [m.qtype for m in self.kinds],
            [(m.rows, m.k) for m in self.kinds],
            self.n_experts,
            self.top_k,
        )

    @property
    def index(self) -> int:
        return int(self.layer.index)

    @property
    def n_experts(self) -> int:
        return int(self.layer.n_experts)

    @property
    def kinds(self) -> tuple[Matrices, Matrices, Matrices]:
        return (self.gate, self.up, self.down)

    @property
    def expert_nbytes(self) -> int:
        return sum(m.nbytes for m in self.kinds)

    def host(self, kind: int, first: int, count: int) -> torch.Tensor:
        """The bytes of experts ``first..first+count-1`` of one kind, as a CPU tensor over the
        mapping (contiguous in the stacked layout; per-expert tensors are copied)."""
        m = self.kinds[kind]
        parts = m.ranges[first : first + count]
        if self._spacing(kind, first, count) == m.nbytes:
            return gpu.host_tensor(parts[0][0], m.nbytes * count, self.layer)
        return torch.cat([gpu.host_tensor(a, n, self.layer) for a, n in parts])

    def host_spans(self) -> list[tuple[int, int]]:
        """The host ranges ``(start, end)`` of the kinds whose experts lie evenly spaced in
        one range (stacked tensors), kinds that tile one range (a fused
        ``ffn_gate_up_exps``) merged into one; per-expert tensors have none."""
        spans = sorted(
            (m.ranges[0][0], m.ranges[-1][0] + m.nbytes)
            for kind, m in enumerate(self.kinds)
            if self._spacing(kind, 0, self.n_experts) is not None
        )
        merged: list[tuple[int, int]] = []
        for a, b in spans:
            if merged and a < merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        return merged

    def fetch_sources(self) -> list[tuple[int, int]] | None:
        """Each kind's host address of expert 0 and the distance to the next expert, when
        every kind's experts lie evenly spaced (what the device's fetch reads); else None."""
        out = []
        for kind, m in enumerate(self.kinds):
            step = self._spacing(kind, 0, self.n_experts)
            if step is None:
                return None
            out.append((m.ranges[0][0], step))
        return out

    def _spacing(self, kind: int, first: int, count: int) -> int | None:
        """The host distance between consecutive experts ``first..first+count-1`` of one kind
        when it is the same for all (one expert: its size), else None."""
        m = self.kinds[kind]
        parts = m.ranges[first : first + count]
        step = parts[1][0] - parts[0][0] if count > 1 else m.nbytes
        if all(a == parts[0][0] + i * step for i, (a, _) in enumerate(parts)):
            return step
        return None

    def load(
        self, pools: Pools, first: int, count: int, slot: int, non_blocking: bool = False
    ) -> None:
        """Experts ``first..first+count-1`` of every kind into slots ``slot..`` of ``pools``.
        A kind whose experts are one host range is one copy. Kinds whose experts lie evenly
        spaced in one host range they tile together (a fused ``ffn_gate_up_exps``: each
        expert's gate rows, then its up rows) are one upload of that range and a strided
        copy per kind on the device: gathering them on the host (:meth:`host`) copies every
        piece into pageable memory, whose upload cannot overlap compute."""
        spread = [
            k for k in range(len(pools)) if self._spacing(k, first, count) != self.kinds[k].nbytes
        ]
        region = self._tiled_region(spread, first, count) if spread else None
        for kind, pool in enumerate(pools):
            if region is None or kind not in spread:
                pool.load(slot, self.host(kind, first, count), non_blocking)
        if region is None:
            return
        lo, hi = region
        dev = gpu.host_tensor(lo, hi - lo, self.layer).to(
            pools[spread[0]].device, non_blocking=non_blocking
        )
        for kind in spread:
            # Two or more experts (one is always one range), evenly spaced (`_tiled_region`).
            (a0, _), (a1, _) = self.kinds[kind].ranges[first : first + 2]
            view = dev.as_strided((count, self.kinds[kind].nbytes), (a1 - a0, 1), a0 - lo)
            pools[kind].load(slot, view, non_blocking)

    def _tiled_region(self, kinds: list[int], first: int, count: int) -> tuple[int, int] | None:
        """The host range ``(lo, hi)`` that experts ``first..first+count-1`` of ``kinds`` tile
        with no gap and no overlap, each kind's experts evenly spaced in it; else None."""
        if any(self._spacing(kind, first, count) is None for kind in kinds):
            return None
        pieces = sorted(
            (a, a + self.kinds[kind].nbytes)
            for kind in kinds
            for a, _ in self.kinds[kind].ranges[first : first + count]
        )
        if any(b != c for (_, b), (c, _) in pairwise(pieces)):
            return None
        return pieces[0][0], pieces[-1][1]


def gpu_servable(ex: ExpertLayer) -> bool:
    """Whether ggml-cuda's kernels serve this layer (act, biases, types) at every batch size:
    MMVQ for decode and MMQ above (IQ1_M has MMVQ only, so its layers stay on the CPU)."""
    if ex.layer.act not in ("silu", "gelu") or ex.layer.has_biases:
        return False
    return all(gpu.kernel_for(m.qtype, t) for m in ex.kinds for t in (1, MAX_SLOT_TOKENS + 1))


class PinnedExperts:
    """Page-locked expert bytes (cudaHostRegister, read-only, mapped), so uploads run
    asynchronously at full PCIe speed and kernels read them in place. The registrations are
    undone when this object is collected, while the mapping is still held (a stale
    registration would make later copies from a new mapping at the same addresses fail)."""

    def __init__(self) -> None:
        self.addresses: list[int] = []
        #: The registered host ranges ``(start, end)``.
        self.spans: list[tuple[int, int]] = []
        self.layers: list[int] = []
        self._mappings: list[Any] = []  # the mapping outlives the registration
        self.release = weakref.finalize(
            self, unregister_host_memory, self.addresses, self._mappings
        )
        """Undoes the registrations now (once; also when collected)."""

    def pin(self, ex: ExpertLayer) -> bool:
        """Pins one layer's experts (:meth:`ExpertLayer.host_spans`; per-expert tensors are
        left pageable); False (nothing of it left pinned) if the host refuses, e.g. over
        RLIMIT_MEMLOCK."""
        cudart = torch.cuda.cudart()
        done: list[tuple[int, int]] = []
        for start, end in ex.host_spans():
            if int(cudart.cudaHostRegister(start, end - start, _REGISTER_FLAGS)) != 0:
                clear_last_cuda_error()
                unregister_host_memory([a for a, _ in done], [])
                return False
            done.append((start, end))
        self.addresses.extend(a for a, _ in done)
        self.spans.extend(done)
        self._mappings.append(ex.layer)
        self.layers.append(ex.index)
        return True

    def holds(self, ex: ExpertLayer) -> bool:
        """Whether every kind of ``ex``'s experts lies in a registered range."""
        sources = ex.fetch_sources()
        if sources is None:
            return False
        ends = [
            (addr, addr + (ex.n_experts - 1) * step + m.nbytes)
            for (addr, step), m in zip(sources, ex.kinds, strict=True)
        ]
        return all(any(a <= lo and hi <= b for a, b in self.spans) for lo, hi in ends)


def pin_host_memory(layers: Sequence[ExpertLayer], owner: object) -> bool:
    """Pins ``layers`` (:class:`PinnedExperts`) for as long as ``owner`` lives; False at the
    first layer the host refuses (uploads still work, synchronously)."""
    pinned = PinnedExperts()
    # The finalizer holds the pins themselves, not only their release: the pins undo their
    # registrations when collected, which would otherwise be as soon as this returns.
    weakref.finalize(owner, _release, pinned)
    return all(pinned.pin(ex) for ex in layers)


def _release(pinned: PinnedExperts) -> None:
    pinned.release()


def clear_last_cuda_error() -> None:
    """A failed runtime call leaves its error for the next cudaGetLastError, which torch's
    next kernel-launch check would report as its own: read it off, in the libcudart torch
    loaded (the one cudaHostRegister ran in)."""
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    for path in paths:
        ctypes.CDLL(path).cudaGetLastError()


def unregister_host_memory(addresses: list[int], _mapping_owners: list[Any]) -> None:
    """Undoes cudaHostRegister of ``addresses`` (the owners keep the memory mapped until
    then)."""
    cudart = torch.cuda.cudart()
    for addr in addresses:
        cudart.cudaHostUnregister(addr)


def layer_pools(
    ex: ExpertLayer, n_slots: int, device: torch.device, memory: Sequence[torch.Tensor] = ()
) -> Pools:
    """Empty (gate, up, down) pools of ``n_slots`` of ``ex``'s experts on ``device``, each
    in its own new tensor or at the start of the ``memory`` given per kind."""
    mems: list[torch.Tensor | None] = [*memory] if memory else [None, None, None]
    gate, up, down = (
        gpu.ExpertPool(m.qtype, m.k, m.rows, n_slots, device=device, memory=mem)
        for m, mem in zip(ex.kinds, mems, strict=True)
    )
    return gate, up, down


@dataclass(frozen=True)
class PoolShare:
    """One GPU's part of the expert pools: the layers it serves from slots and their
    :class:`~freetoken.runtime.slots.CachePlan` (within that GPU's budget) on ``device``;
    ``cpu_only`` its MoE layers without slots that hybrid's hand-off sends to the CPU."""

    layers: Sequence[ExpertLayer]
    plan: CachePlan
    device: torch.device
    cpu_only: Sequence[ExpertLayer] = ()


class _PlannedPools:
    """The slot pools of each share's :class:`~freetoken.runtime.slots.CachePlan` on its
    device, each with its LRU bookkeeping, seeded with the plan's residents; ``extra_slots``
    zeroed slots follow each pool's own (the bookkeeping never gives them out). ``device``
    is the first share's; ``device_of`` each layer's."""

    def __init__(
        self, shares: Sequence[PoolShare], policy: str = "lru", extra_slots: int = 0
    ) -> None:
        self.device = shares[0].device
        #: The shares' devices, each once, in layer order.
        self.devices = list(dict.fromkeys(sh.device for sh in shares))
        self.layers = {ex.index: ex for sh in shares for ex in sh.layers}
        self.device_of = {ex.index: sh.device for sh in shares for ex in sh.layers}
        self.of_layer: dict[int, tuple[SlotCache, Pools]] = {}
        self.uploaded_bytes = 0
        for sh in shares:
            for pp in sh.plan.pools:
                cache = SlotCache(pp.n_slots, pp.n_experts, policy=policy)
                pools = layer_pools(self.layers[pp.layers[0]], pp.n_slots + extra_slots, sh.device)
                for li in pp.layers:
                    self.of_layer[li] = (cache, pools)
                self._upload(pools, cache.seed(list(pp.residents)), non_blocking=False)

    @property
    def nbytes(self) -> int:
        """Device bytes of the pools."""
        return self.nbytes_of(self.of_layer)

    def nbytes_of(self, layers: Container[int]) -> int:
        """Device bytes of the pools that serve ``layers`` (a pool serves the layers of one
        share only)."""
        seen = {id(p): p for li, (_, ps) in self.of_layer.items() if li in layers for p in ps}
        return sum(p.tensor.numel() for p in seen.values())

    def _upload(self, pools: Pools, uploads: Sequence[Upload], non_blocking: bool) -> None:
        """Copies each upload's expert into its slot, coalescing runs of consecutive experts
        into consecutive slots (a whole layer at once when seeding)."""
        i = 0
        while i < len(uploads):
            first, j = uploads[i], i + 1
            while (
                j < len(uploads)
                and uploads[j].layer == first.layer
                and uploads[j].expert == first.expert + (j - i)
                and uploads[j].slot == first.slot + (j - i)
            ):
                j += 1
            ex = self.layers[first.layer]
            ex.load(pools, first.expert, j - i, first.slot, non_blocking)
            self.uploaded_bytes += ex.expert_nbytes * (j - i)
            i = j


class ResidentExperts(_PlannedPools):
    """The ``gpu`` strategy: every expert of every layer resident (plans that hold them
    all), layer after layer in each pool."""

    def __init__(self, shares: Sequence[PoolShare]) -> None:
        if not all(sh.plan.all_resident for sh in shares):
            raise InvalidInputError("the gpu strategy needs a cache that holds every expert")
        super().__init__(shares)
        # Each layer launches on a window of its own experts: a kernel's grid spans the
        # pool's slots (MMQ's z dimension), and the expert ids are the slots.
        self.windows: dict[int, Pools] = {}
        for pp in (pp for sh in shares for pp in sh.plan.pools):
            for j, li in enumerate(pp.layers):
                _, pools = self.of_layer[li]
                gate, up, down = (p.window(j * pp.n_experts, pp.n_experts) for p in pools)
                self.windows[li] = (gate, up, down)

    def launch(
        self, ex: ExpertLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        pools = self.windows[ex.index]
        return gpu.moe_layer(*pools, x, ids, weights, act=ex.layer.act, check_ids=False)


@dataclass
class _Staging:
    """One of the two whole-layer buffers of the prefill stream."""

    memory: list[torch.Tensor]
    ready: torch.cuda.Event
    free: torch.cuda.Event
    layer: int = -1
    pools: Pools | None = None


class OffloadExperts(_PlannedPools):
    """The ``offload`` strategy: experts uploaded into slot pools on demand (decode; evicting
    by ``policy``, ``lru`` or ``adaptive``), whole layers streamed double-buffered (prefill),
    through a copy stream and two staging buffers per device. The experts' host bytes are
    page-locked here unless ``pinned`` already holds them."""

    def __init__(
        self,
        shares: Sequence[PoolShare],
        policy: str = "lru",
        extra_slots: int = 0,
        pinned: PinnedExperts | None = None,
    ) -> None:
        super().__init__(shares, policy, extra_slots)
        layers = list(self.layers.values())
        self.order = [ex.index for ex in layers]
        self.position = {li: i for i, li in enumerate(self.order)}
        if pinned is None:
            pinned = PinnedExperts()
            self.pinned = all(pinned.pin(ex) for ex in layers)
        else:  # pinned by the caller (--moe-cpu-layers auto)
            self.pinned = set(pinned.layers) >= set(self.order)
        #: The registrations, kept as long as these pools.
        self.pins = pinned
        self.copy_streams = {dev: torch.cuda.Stream(dev) for dev in self.devices}
        #: Per device, the two buffers of the layers streamed there (none without layers:
        #: a hand-off with no slots streams nothing).
        self.staging: dict[torch.device, list[_Staging]] = {}
        for dev in self.devices:
            on_dev = [ex for ex in layers if self.device_of[ex.index] == dev]
            if on_dev:
                self.staging[dev] = _staging_pair(on_dev, dev)

    @property
    def nbytes(self) -> int:
        """Device bytes of the pools and the staging buffers."""
        bufs = [b for pair in self.staging.values() for b in pair]
        return super().nbytes + sum(m.numel() for b in bufs for m in b.memory)

    def launch(
        self, ex: ExpertLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        if ids.shape[0] > MAX_SLOT_TOKENS:
            return self._launch_streamed(ex, x, ids, weights)
        cache, pools = self.of_layer[ex.index]
        host_ids = ids.cpu().numpy()
        out = torch.empty_like(x)
        # Token ranges whose distinct experts fit the pool: a batch is never capped by it.
        for lo, hi in cache.split_tokens(host_ids):
            slots, uploads = cache.place(ex.index, host_ids[lo:hi])
            self._upload(pools, uploads, non_blocking=self.pinned)
            dev_slots = torch.from_numpy(slots).to(x.device)
            gpu.moe_layer(
                *pools,
                x[lo:hi],
                dev_slots,
                weights[lo:hi],
                act=ex.layer.act,
                out=out[lo:hi],
                check_ids=False,
            )
        return out

    def _stage(self, ex: ExpertLayer) -> _Staging:
        """Starts (or finds) the upload of ``ex``'s whole layer into its staging buffer."""
        dev = self.device_of[ex.index]
        buf = self.staging[dev][self.position[ex.index] % 2]
        if buf.layer == ex.index:
            return buf
        copy_stream = self.copy_streams[dev]
        copy_stream.wait_event(buf.free)
        with torch.cuda.stream(copy_stream):
            buf.pools = pools = layer_pools(ex, ex.n_experts, dev, buf.memory)
            ex.load(pools, 0, ex.n_experts, 0, non_blocking=self.pinned)
            buf.ready.record(copy_stream)
        buf.layer = ex.index
        self.uploaded_bytes += ex.expert_nbytes * ex.n_experts
        return buf

    def _launch_streamed(
        self, ex: ExpertLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        buf = self._stage(ex)
        nxt = self.position[ex.index] + 1
        if nxt < len(self.order):
            self._stage(self.layers[self.order[nxt]])  # overlaps this layer's compute
        stream = torch.cuda.current_stream(self.device_of[ex.index])
        stream.wait_event(buf.ready)
        assert buf.pools is not None  # staged above
        out = gpu.moe_layer(*buf.pools, x, ids, weights, act=ex.layer.act, check_ids=False)
        buf.free.record(stream)
        return out


def _staging_pair(layers: Sequence[ExpertLayer], device: torch.device) -> list[_Staging]:
    """Two whole-layer buffers on ``device``, each kind's as large as ``layers``' largest."""
    sizes = [
        max(
            gpu.pool_nbytes(ex.kinds[k].qtype, ex.kinds[k].k, ex.kinds[k].rows, ex.n_experts)
            for ex in layers
        )
        for k in range(3)
    ]
    return [
        _Staging(
            [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes],
            torch.cuda.Event(),
            torch.cuda.Event(),
        )
        for _ in range(2)
    ]


class GpuExperts:
    """The expert backend of a MoE layer on the GPU: routing in torch (one fused kernel where
    it applies) and the routed experts on ``experts`` (resident, offloaded or hybrid pools).
    Routes per expert are counted on the device (capturable) and flushed into the engine's
    counters when read (``MoeContext.collect``)."""

    def __init__(
        self,
        ex: ExpertLayer,
        routing: Routing,
        experts: ResidentExperts | OffloadExperts,
        selection_bias: torch.Tensor | None,
    ) -> None:
        self.ex = ex
        self.experts = experts
        device = experts.device_of[ex.index]
        self.counts = torch.zeros(self.ex.n_experts, dtype=torch.int64, device=device)
        self.fused_routing = (
            routing.softmax_top_k
            and selection_bias is None
            and ex.n_experts <= gpu.TOPK_MAX_EXPERTS
            and routing.top_k <= gpu.TOPK_MAX_K
        )

    def flush_counts(self, counters: _core.MoeCounters) -> None:
        """Adds the routes counted since the last flush to ``counters``."""
        counts = self.counts.tolist()
        self.counts.zero_()
        counters.add_expert_counts(self.ex.index, counts)

    def route(
        self, logits: torch.Tensor, routing: Routing, selection_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fused_routing and logits.dtype == torch.float32:
            # Top-k, weights and route counts in one kernel.
            return gpu.topk_softmax(logits, routing.top_k, routing.weight_scale, self.counts)
        ids, weights = route(logits, routing, selection_bias)
        flat = ids.view(-1)
        ones = gpu.constant(flat.numel(), 1, torch.int64, flat.device)
        self.counts.index_add_(0, flat, ones)
        return ids, weights

    def run(
        self, layer: _core.MoeLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return self.experts.launch(self.ex, x, ids, weights)


class HostExperts(CpuExperts):
    """The expert backend of a MoE layer that the GPU does not serve, in a model on the GPU:
    routing on the device, the routed experts on the CPU executor, activations to the host
    and back (no graph capture for such models)."""

    def run(
        self, layer: _core.MoeLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return super().run(layer, x.cpu(), ids.cpu(), weights.cpu()).to(x.device)
