"""The measurements of ``freetoken bench-bw`` (:mod:`freetoken.engine.bandwidth_profile` saves
and reads them, :mod:`freetoken.cli.bench_bw` is the command): per layer kind of a MoE model,
the bandwidths that decide where a missed expert is served.

A layer kind is the (gate, up, down) types and the expert shape; all layers of a kind are
measured together, the GPU on the first of them:

1. ``cpu_t1`` / ``cpu_t8``: expert bytes read per second by the CPU expert executor on
   decode-shaped calls (1 and 8 tokens, top-k routes each), the routes walking through every
   expert of every layer of the kind so that no call finds its experts in the CPU's caches.
   Bytes are the executor's own counters (``MoeCounters.snapshot``).
2. ``pcie_expert`` / ``pcie_bulk``: page-locked host-to-GPU copies (the page-locked mapping, as
   the ``offload`` strategy uses it, else a pinned buffer) into a device tensor, one expert per
   copy (the fetch of a missed expert) and the whole layer per copy; CUDA-event timed.
3. ``gpu_t1``: ``gpu.moe_layer`` at T=1 on a resident pool of one layer's experts, a pass over
   all of them captured as one CUDA graph and replayed; the k experts read per call.
4. ``cpu_t1_with_gpu`` / ``gpu_t1_with_cpu``: (1) at T=1 in a background thread while (3)
   runs, each one's bandwidth while the other runs.
5. ``cpu_t1_with_pcie`` / ``pcie_expert_with_cpu``: the same with (2)'s one-expert copies,
   both links busy at once (host memory serves both).
6. ``pcie_gather`` / ``cpu_t1_with_gather`` / ``pcie_gather_with_cpu``: hybrid's fetch kernel
   (``gpu.fetch_gather``: the GPU's own threads read the page-locked mapping, no copy engine)
   gathering :data:`GATHER_EXPERTS` experts a call, alone and beside (1): what a step that
   uploads part of its misses while the CPU computes the rest gets from each
   (engine/fetch.py prices the fetch with these when measured, else with (5)).

From them, the fetch rule: fetch a missed expert over PCIe instead of computing it on the
CPU when ``expected_reuse * B_pcie > B_cpu``, so the break-even reuse is ``B_cpu / B_pcie``
(``B_cpu``: the CPU's bandwidth while the GPU runs when measured, else alone; ``B_pcie``: one
expert per copy). GB/s are 10^9 bytes per second. Without a GPU only (1) runs.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from freetoken import _core
from freetoken.engine.gpu_moe import ExpertLayer, gpu_servable, layer_pools, pin_host_memory
from freetoken.errors import FreeTokenError, InvalidInputError, UnsupportedError
from freetoken.quant import type_info
from freetoken.runtime import gpu
from freetoken.runtime.moe import MoeContext, MoeFFN, run_experts

if TYPE_CHECKING:
    from freetoken.models.transformer import Transformer

__all__ = [
    "CpuLoop",
    "GatherLoop",
    "GpuLoop",
    "LayerKind",
    "PcieLoop",
    "Rate",
    "gpu_device",
    "group_layers",
    "measure_kind",
    "measure_model",
    "route_table",
    "run_together",
]

#: Tokens of the batched CPU measurement (MMVQ's largest batch on the GPU side).
BATCH_TOKENS = 8
#: At least this many ``moe_layer`` calls per captured graph (fewer: replay overhead shows).
MIN_GRAPH_CALLS = 64
#: Experts one measured fetch gathers: about what a layer of a 16-stream step fetches at a
#: quarter of the experts cached (fewer experts keep fewer reads in flight).
GATHER_EXPERTS = 32


@dataclass(frozen=True)
class LayerKind:
    """What a layer's expert bandwidth depends on: the three matrix types and the shape."""

    types: tuple[str, str, str]
    hidden: int
    ffn: int

    @classmethod
    def of(cls, ex: ExpertLayer) -> LayerKind:
        """The kind of one MoE layer."""
        names = tuple(type_info(m.qtype).name for m in ex.kinds)
        return cls((names[0], names[1], names[2]), ex.gate.k, ex.gate.rows)

    @property
    def key(self) -> str:
        """``"Q4_0/Q4_0/Q6_K 2048x768"``: gate/up/down types, hidden size x expert FFN size."""
        return f"{'/'.join(self.types)} {self.hidden}x{self.ffn}"


@dataclass(frozen=True)
class Rate:
    """One measurement: ``nbytes`` moved or read in ``seconds`` by ``calls`` calls (kernel
    calls, or copies), ``experts`` experts read or moved in all."""

    nbytes: int
    seconds: float
    calls: int
    experts: int

    @property
    def gbps(self) -> float:
        """10^9 bytes per second."""
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "gbps": self.gbps}


def route_table(n_experts: int, top_k: int, n_tokens: int) -> np.ndarray:
    """Expert ids ``(rounds, n_tokens, top_k)`` int32 for calls that walk through all experts:
    call ``r`` gives token ``t`` route ``j`` expert ``(r*T*k + t*k + j) % E``. A token's ids are
    distinct (k <= E), a call reads ``min(T*k, E)`` distinct experts, and over the ``rounds``
    calls every expert is read equally often."""
    if not 0 < top_k <= n_experts or n_tokens < 1:
        raise InvalidInputError(f"top-{top_k} of {n_experts} experts, {n_tokens} tokens")
    per_call = n_tokens * top_k
    rounds = n_experts // math.gcd(n_experts, per_call)
    ids = np.arange(rounds * per_call, dtype=np.int64) % n_experts
    return ids.reshape(rounds, n_tokens, top_k).astype(np.int32)


# -- (1) the CPU expert executor ------------------------------------------------------------


class CpuLoop:
    """Calls of the CPU expert executor on ``n_tokens`` tokens, alternating over the layers of
    one kind and walking through their experts (:func:`route_table`)."""

    def __init__(
        self,
        executor: _core.MoeExecutor,
        counters: _core.MoeCounters,
        layers: list[ExpertLayer],
        n_tokens: int,
    ) -> None:
        ex = layers[0]
        self.executor, self.counters, self.layers = executor, counters, layers
        self.ids = torch.from_numpy(route_table(ex.n_experts, ex.top_k, n_tokens))
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(n_tokens, ex.gate.k, generator=gen)
        self.weights = torch.full((n_tokens, ex.top_k), 1.0 / ex.top_k)
        self.out = torch.empty_like(self.x)

    @property
    def cycle(self) -> int:
        """Calls that read every expert of every layer of the kind."""
        return len(self.layers) * self.ids.shape[0]

    def call(self, i: int) -> None:
        """The ``i``-th call of the walk."""
        n = len(self.layers)
        ids = self.ids[(i // n) % self.ids.shape[0]]
        run_experts(self.executor, self.layers[i % n].layer, self.x, ids, self.weights, self.out)

    def warm_up(self) -> None:
        """One pass over every expert: pages the mapping in before anything is timed."""
        for i in range(self.cycle):
            self.call(i)

    def _counted(self) -> tuple[int, int]:
        snap = self.counters.snapshot()
        rows = [snap[ex.index] for ex in self.layers]
        return sum(r.bytes for r in rows), sum(r.experts for r in rows)

    def measure(self, seconds: float, stop: threading.Event | None = None) -> Rate:
        """Calls for ``seconds`` (or until ``stop`` is set); the bytes and experts the
        executor counted meanwhile."""
        bytes0, experts0 = self._counted()
        t0 = time.perf_counter()
        calls = 0
        while calls == 0 or not (
            time.perf_counter() - t0 >= seconds or (stop is not None and stop.is_set())
        ):
            self.call(calls)
            calls += 1
        elapsed = time.perf_counter() - t0
        bytes1, experts1 = self._counted()
        return Rate(bytes1 - bytes0, elapsed, calls, experts1 - experts0)


# -- (2), (3) the GPU -------------------------------------------------------------------------


def _event_timed(
    step: Callable[[], tuple[int, int, int]], seconds: float, stop: threading.Event | None = None
) -> Rate:
    """Repeats ``step`` (queues work on the current stream, returns its (bytes, calls,
    experts)) for ``seconds`` of wall time or until ``stop``, at most two steps in flight;
    the time is the sum of the steps' CUDA-event spans."""
    spans: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    nbytes = calls = experts = 0
    t0 = time.perf_counter()
    while not spans or not (
        time.perf_counter() - t0 >= seconds or (stop is not None and stop.is_set())
    ):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b, c, e = step()
        end.record()
        spans.append((start, end))
        nbytes, calls, experts = nbytes + b, calls + c, experts + e
        if len(spans) > 2:
            spans[-3][1].synchronize()
    spans[-1][1].synchronize()
    elapsed = sum(s.elapsed_time(e) for s, e in spans) / 1e3
    return Rate(nbytes, elapsed, calls, experts)


def _host_sources(ex: ExpertLayer, owner: object) -> tuple[list[torch.Tensor], str]:
    """Each kind's bytes of all experts as page-locked CPU tensors: the mapping itself,
    registered for as long as ``owner`` lives (``"mapping"``), else pinned copies
    (``"pinned-buffer"``: per-expert tensors, or a host that refuses to register)."""
    stacked = all(
        all(a == m.ranges[0][0] + i * m.nbytes for i, (a, _) in enumerate(m.ranges))
        for m in ex.kinds
    )
    sources = [ex.host(kind, 0, ex.n_experts) for kind in range(3)]
    if stacked and pin_host_memory([ex], owner):
        return sources, "mapping"
    pinned = [torch.empty(s.numel(), dtype=torch.uint8, pin_memory=True) for s in sources]
    for dst, src in zip(pinned, sources, strict=True):
        dst.copy_(src)
    return pinned, "pinned-buffer"


class PcieLoop:
    """Host-to-GPU copies of ``ex``'s experts into a device tensor: one expert per copy
    (three copies, gate, up and down, per expert, through all experts) or the whole layer per
    copy. The sources are page-locked for as long as the loop lives (:func:`_host_sources`;
    ``where`` says which kind)."""

    def __init__(self, ex: ExpertLayer, device: torch.device) -> None:
        self.ex = ex
        self.sources, self.where = _host_sources(ex, self)
        self.dests = [torch.empty_like(s, device=device) for s in self.sources]
        self._bulk()

    def _per_expert(self) -> tuple[int, int, int]:
        ex, e = self.ex, self.ex.n_experts
        for i in range(e):
            for src, dst, m in zip(self.sources, self.dests, ex.kinds, strict=True):
                n = m.nbytes
                dst[i * n : (i + 1) * n].copy_(src[i * n : (i + 1) * n], non_blocking=True)
        return e * ex.expert_nbytes, 3 * e, e

    def _bulk(self) -> tuple[int, int, int]:
        for src, dst in zip(self.sources, self.dests, strict=True):
            dst.copy_(src, non_blocking=True)
        return self.ex.n_experts * self.ex.expert_nbytes, 3, self.ex.n_experts

    def measure(self, seconds: float, stop: threading.Event | None = None) -> Rate:
        """One expert per copy for ``seconds`` (or until ``stop``)."""
        return _event_timed(self._per_expert, seconds, stop)

    def measure_bulk(self, seconds: float) -> Rate:
        """One layer per copy for ``seconds``."""
        return _event_timed(self._bulk, seconds)


class GatherLoop:
    """Hybrid's fetch kernel on ``ex``'s experts: ``gpu.fetch_gather`` copying
    :data:`GATHER_EXPERTS` of them a call from the registered mapping into staging slots,
    the calls walking through all experts. The mapping stays registered for as long as the
    loop lives; UnsupportedError where the fetch cannot read the layer (experts not evenly
    spaced, or a host that refuses to register them)."""

    def __init__(self, ex: ExpertLayer, device: torch.device) -> None:
        sources = ex.fetch_sources()
        if sources is None:
            raise UnsupportedError("the experts are not evenly spaced in host memory")
        if not pin_host_memory([ex], self):
            raise UnsupportedError("the host refused to register the experts' mapping")
        e, k = ex.n_experts, ex.top_k
        self.ex, self.sources, self.n = ex, sources, min(GATHER_EXPERTS, e)
        self.pools = layer_pools(ex, self.n + k, device)
        rounds = math.ceil(e / self.n)
        lists = np.full((rounds, e), -1, dtype=np.int32)
        lists[:, : self.n] = (np.arange(rounds * self.n) % e).reshape(rounds, self.n)
        self.lists = torch.from_numpy(lists).to(device)
        self.stats = torch.zeros((rounds, gpu.FETCH_STATS), dtype=torch.int64, device=device)
        self.stats[:, gpu.FETCH_N] = self.n

    def _calls(self) -> tuple[int, int, int]:
        for listed, stats in zip(self.lists, self.stats, strict=True):
            gpu.fetch_gather(
                self.pools,
                self.sources,
                listed,
                stats,
                top_k=self.ex.top_k,
                max_fetch=self.n,
                dummy_base=self.n,
            )
        calls = len(self.lists)
        return calls * self.n * self.ex.expert_nbytes, calls, calls * self.n

    def measure(self, seconds: float, stop: threading.Event | None = None) -> Rate:
        """Gathers for ``seconds`` (or until ``stop``)."""
        return _event_timed(self._calls, seconds, stop)


def _capture(fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """``fn`` captured as a graph, after two warm-up runs on the capture stream (kernel
    setup, ggml's per-stream scratch pool)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph


class GpuLoop:
    """``gpu.moe_layer`` at T=1 on a resident pool of one layer's experts, the calls of a walk
    through all experts (at least :data:`MIN_GRAPH_CALLS`) captured as one CUDA graph."""

    def __init__(self, ex: ExpertLayer, device: torch.device) -> None:
        self.ex = ex
        self.pools = [
            gpu.ExpertPool(m.qtype, m.k, m.rows, ex.n_experts, device=device) for m in ex.kinds
        ]
        for kind, pool in enumerate(self.pools):
            pool.load(0, ex.host(kind, 0, ex.n_experts))
        table = route_table(ex.n_experts, ex.top_k, 1)
        table = np.tile(table, (math.ceil(MIN_GRAPH_CALLS / len(table)), 1, 1))
        self.ids = torch.from_numpy(table).to(device)
        gen = torch.Generator().manual_seed(0)
        self.x = torch.randn(1, ex.gate.k, generator=gen).to(device)
        self.weights = torch.full((1, ex.top_k), 1.0 / ex.top_k, device=device)
        self.out = torch.empty_like(self.x)
        self.graph = _capture(self._calls)
        self.graph.replay()

    def _calls(self) -> None:
        gate, up, down = self.pools
        for ids in self.ids:
            gpu.moe_layer(
                gate,
                up,
                down,
                self.x,
                ids,
                self.weights,
                act=self.ex.layer.act,
                out=self.out,
                check_ids=False,
            )

    def measure(self, seconds: float, stop: threading.Event | None = None) -> Rate:
        """Replays for ``seconds`` (or until ``stop``); the bytes of the k experts each call
        reads."""
        calls = self.ids.shape[0]
        k = self.ex.top_k

        def replay() -> tuple[int, int, int]:
            self.graph.replay()
            return calls * k * self.ex.expert_nbytes, calls, calls * k

        return _event_timed(replay, seconds, stop)


def run_together(
    cpu: CpuLoop, other: GpuLoop | PcieLoop | GatherLoop, seconds: float
) -> tuple[Rate, Rate]:
    """(4) to (6): the CPU loop in a background thread while the other loop (the GPU
    kernels, one-expert copies over PCIe, or the fetch kernel) runs for ``seconds``; each
    one's rate over the same span."""
    stop = threading.Event()
    result: dict[str, Any] = {}

    def background() -> None:
        try:
            result["rate"] = cpu.measure(math.inf, stop)
        except BaseException as e:  # re-raised in the calling thread
            result["error"] = e

    thread = threading.Thread(target=background, name="ft-bench-bw-cpu")
    thread.start()
    try:
        other_rate = other.measure(seconds)
    finally:
        stop.set()
        thread.join()
    if "error" in result:
        raise result["error"]
    return result["rate"], other_rate


# -- the whole model --------------------------------------------------------------------------


def gpu_device() -> tuple[torch.device | None, str]:
    """The GPU to measure and its name, or None and why there is none."""
    st = gpu.status()
    if not st.available:
        return None, st.detail
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    dev = torch.device("cuda", torch.cuda.current_device())
    return dev, torch.cuda.get_device_name(dev)


def group_layers(model: Transformer, name: str = "the model") -> dict[LayerKind, list[ExpertLayer]]:
    """The model's MoE layers by kind, in layer order; UnsupportedError (naming the model
    ``name``) if it has none."""
    kinds: dict[LayerKind, list[ExpertLayer]] = {}
    for blk in model.blocks:
        if isinstance(blk.ffn, MoeFFN):
            ex = ExpertLayer.of(blk.ffn)
            kinds.setdefault(LayerKind.of(ex), []).append(ex)
    if model.moe is None or not kinds:
        raise UnsupportedError(
            f"{name} ({model.cfg.arch}) is not a mixture-of-experts model: no expert layers"
        )
    return kinds


def _break_even(b_cpu: float, b_pcie: float | None) -> float | None:
    """The fetch rule: fetch when ``reuse * B_pcie > B_cpu``, so break-even at the ratio."""
    return b_cpu / b_pcie if b_pcie else None


def _gpu_part(
    cpu: CpuLoop, ex: ExpertLayer, device: torch.device, seconds: float
) -> dict[str, Any]:
    """(2) to (6) for one kind; ``gpu_detail`` says why the kernels were skipped,
    ``gather_detail`` why the fetch kernel was."""
    pcie = PcieLoop(ex, device)
    out: dict[str, Any] = {
        "pcie_expert": pcie.measure(seconds).to_json(),
        "pcie_bulk": pcie.measure_bulk(seconds).to_json(),
        "pcie_source": pcie.where,
    }
    cpu_rate, pcie_rate = run_together(cpu, pcie, seconds)
    out["cpu_t1_with_pcie"] = cpu_rate.to_json()
    out["pcie_expert_with_cpu"] = pcie_rate.to_json()
    del pcie  # unregisters the mapping
    try:
        gather = GatherLoop(ex, device)
    except UnsupportedError as e:
        out["gather_detail"] = str(e)
    else:
        out["pcie_gather"] = gather.measure(seconds).to_json()
        cpu_rate, gather_rate = run_together(cpu, gather, seconds)
        out["cpu_t1_with_gather"] = cpu_rate.to_json()
        out["pcie_gather_with_cpu"] = gather_rate.to_json()
        del gather
    if not gpu_servable(ex):
        out["gpu_detail"] = "no GPU kernel for this layer (types, activation or biases)"
        return out
    loop = GpuLoop(ex, device)
    out["gpu_t1"] = loop.measure(seconds).to_json()
    cpu_rate, gpu_rate = run_together(cpu, loop, seconds)
    out["cpu_t1_with_gpu"] = cpu_rate.to_json()
    out["gpu_t1_with_cpu"] = gpu_rate.to_json()
    return out


def measure_kind(
    kind: LayerKind,
    layers: list[ExpertLayer],
    moe: MoeContext,
    device: torch.device | None,
    seconds: float,
) -> dict[str, Any]:
    """Every measurement of one layer kind, and the fetch rule's break-even reuse."""
    ex = layers[0]
    executor, counters = moe.executor, moe.counters
    cpu = CpuLoop(executor, counters, layers, 1)
    cpu.warm_up()
    entry: dict[str, Any] = {
        "types": list(kind.types),
        "hidden": kind.hidden,
        "ffn": kind.ffn,
        "n_experts": ex.n_experts,
        "top_k": ex.top_k,
        "layers": [x.index for x in layers],
        "expert_bytes": ex.expert_nbytes,
        "threads": executor.n_threads,
        "cpu_t1": cpu.measure(seconds).to_json(),
        "cpu_t8": CpuLoop(executor, counters, layers, BATCH_TOKENS).measure(seconds).to_json(),
    }
    entry |= dict.fromkeys(
        (
            "pcie_expert",
            "pcie_bulk",
            "pcie_source",
            "cpu_t1_with_pcie",
            "pcie_expert_with_cpu",
            "pcie_gather",
            "cpu_t1_with_gather",
            "pcie_gather_with_cpu",
            "gpu_t1",
            "cpu_t1_with_gpu",
            "gpu_t1_with_cpu",
        )
    )
    entry["gpu_detail"] = entry["gather_detail"] = None
    if device is not None:
        try:
            entry |= _gpu_part(cpu, ex, device, seconds)
        except (RuntimeError, FreeTokenError) as e:
            entry["gpu_detail"] = f"failed: {e}"
    with_gpu = entry["cpu_t1_with_gpu"]
    b_cpu = (with_gpu or entry["cpu_t1"])["gbps"]
    b_pcie = entry["pcie_expert"]["gbps"] if entry["pcie_expert"] else None
    entry["b_cpu_gbps"], entry["b_pcie_gbps"] = b_cpu, b_pcie
    entry["b_gpu_gbps"] = entry["gpu_t1"]["gbps"] if entry["gpu_t1"] else None
    for name, rate in (
        ("b_cpu_with_pcie_gbps", "cpu_t1_with_pcie"),
        ("b_pcie_with_cpu_gbps", "pcie_expert_with_cpu"),
        ("b_gather_gbps", "pcie_gather"),
        ("b_cpu_with_gather_gbps", "cpu_t1_with_gather"),
        ("b_gather_with_cpu_gbps", "pcie_gather_with_cpu"),
    ):
        entry[name] = entry[rate]["gbps"] if entry[rate] else None
    entry["break_even_reuse"] = _break_even(b_cpu, b_pcie)
    return entry


def measure_model(
    path: str | os.PathLike[str], threads: int | None, seconds: float, mmap: bool = True
) -> dict[str, Any]:
    """Loads the model (experts on the CPU executor, ``threads`` threads, default: as many as
    hybrid uses beside the GPU; mapped or read into memory, ``mmap``) and measures each layer
    kind for ``seconds`` per measurement: ``{"host_threads", "gpu": {available, name,
    detail}, "kinds": {kind key: entry}}``."""
    from freetoken.gguf import GGUFFile
    from freetoken.models import load_model
    from freetoken.runtime.moe import default_threads

    if not seconds > 0:
        raise InvalidInputError(f"--seconds must be positive, got {seconds}")
    if threads is not None and threads < 1:
        raise InvalidInputError(f"-t must be at least 1, got {threads}")
    gguf = GGUFFile(path, mmap=mmap)  # a bad file fails before the GPU probe says anything
    device, about = gpu_device()
    model = load_model(gguf, None, threads or default_threads(with_gpu=device is not None))
    kinds = group_layers(model, os.fspath(path))
    moe = model.moe
    assert moe is not None  # group_layers checked
    return {
        "host_threads": moe.executor.n_threads,
        "gpu": {
            "available": device is not None,
            "name": about if device is not None else None,
            "detail": None if device is not None else about,
        },
        "kinds": {
            kind.key: measure_kind(kind, layers, moe, device, seconds)
            for kind, layers in kinds.items()
        },
    }
