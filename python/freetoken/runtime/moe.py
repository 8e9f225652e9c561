"""The MoE feed-forward of one layer: the router, then the routed experts on the expert backend
the layer is given (by default the CPU expert executor, Rust; the engine gives GPU placements
theirs), optional shared experts."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from freetoken import _core
from freetoken.gguf import GGUFFile
from freetoken.runtime.routing import Routing, route

__all__ = [
    "CpuExperts",
    "ExpertBackend",
    "MoeContext",
    "MoeFFN",
    "default_executor",
    "default_threads",
    "expert_layer",
    "run_experts",
]

_EXECUTOR: _core.MoeExecutor | None = None


def default_threads(with_gpu: bool) -> int:
    """The expert executor's threads when neither ``--moe-cpu-threads`` nor ``-t`` says: the
    CPUs this process may run on, or with a GPU three quarters of them (at least one). A
    hybrid step's CPU jobs need every worker running at once, and beside them Python's main
    thread (spinning in CUDA synchronizations), the CUDA driver's threads and the OS want
    cores too: on the H200 machine's 16 vCPUs, 12 threads decode 1.2-1.5x faster than 16
    (benches/README.md, "Hybrid decode")."""
    n = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    n = n or 1
    return max(1, n * 3 // 4) if with_gpu else n


def default_executor(
    n_threads: int | None = None,
    precise: bool = False,
    poll_us: int | None = None,
    shared: bool = False,
) -> _core.MoeExecutor:
    """The process's CPU expert executor (``--moe-cpu-threads``, else ``-t``; default: all
    CPUs; LLM passes :func:`default_threads`). ``precise`` (``--moe-cpu-precise``):
    activations quantized in two passes, the row and its rounding residual, so that results
    track float math (about 0.01% per token) instead of ggml's (and llama.cpp's) activation
    rounding (1-3% with K-quants).
    ``poll_us`` (``--poll``): how long idle workers poll for the next job before sleeping.
    ``shared``: on the process pool (``_core.set_num_threads``) instead of a pool of its own,
    for the CPU engine, whose dense products and experts take turns on the same cores."""
    global _EXECUTOR
    if shared:
        # The process pool may have been replaced since: a shared executor is made anew.
        _EXECUTOR = _core.MoeExecutor(n_threads or _core.num_threads(), precise, None, True)
    elif (
        _EXECUTOR is None
        or _EXECUTOR.shared
        or (n_threads is not None and _EXECUTOR.n_threads != n_threads)
        or _EXECUTOR.residual_acts != precise
        or (poll_us is not None and _EXECUTOR.poll_us != poll_us)
    ):
        _EXECUTOR = _core.MoeExecutor(n_threads or default_threads(False), precise, poll_us)
    return _EXECUTOR


def run_experts(
    executor: _core.MoeExecutor,
    layer: _core.MoeLayer,
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The layer's routed experts on contiguous CPU tensors ``x [T, H]``, ``ids`` int32 and
    ``weights`` float32 ``[T, k]``, into ``out`` (a new tensor by default), synchronously."""
    if out is None:
        out = torch.empty_like(x)
    executor.run(layer, x, ids, weights, out)
    return out


class ExpertBackend(Protocol):
    """Where a MoE layer's routed experts run: :meth:`route` turns the router's logits into
    ids and weights ``[T, k]`` (on the device the backend computes on), :meth:`run` sums the
    chosen experts' outputs per token."""

    def route(
        self, logits: torch.Tensor, routing: Routing, selection_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def run(
        self, layer: _core.MoeLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor: ...


class CpuExperts:
    """The CPU expert executor on CPU tensors (routes counted by the executor)."""

    def __init__(self, executor: _core.MoeExecutor) -> None:
        self.executor = executor

    def route(
        self, logits: torch.Tensor, routing: Routing, selection_bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return route(logits, routing, selection_bias)

    def run(
        self, layer: _core.MoeLayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        return run_experts(self.executor, layer, x, ids, weights)


class MoeFFN:
    """``y = sum_j w_j * expert_j(x) (+ shared(x))`` for the experts the router picks (``w_j``
    times the expert's scale where the file has one), run by
    ``backend`` (default: :class:`CpuExperts` on ``executor``). ``layer`` holds the experts'
    weights in host memory whatever the backend."""

    def __init__(
        self,
        layer: _core.MoeLayer,
        router: Callable[[torch.Tensor], torch.Tensor],
        routing: Routing,
        executor: _core.MoeExecutor,
        selection_bias: torch.Tensor | None = None,
        shared: Callable[[torch.Tensor], torch.Tensor] | None = None,
        expert_scale: torch.Tensor | None = None,
    ) -> None:
        self.layer = layer
        self.router = router
        self.routing = routing
        self.selection_bias = selection_bias
        self.shared = shared
        #: Per expert, a factor on its output (``runtime.scales.expert_scales``), carried by
        #: the routing weights.
        self.expert_scale = expert_scale
        self.backend: ExpertBackend = CpuExperts(executor)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        ids, weights = self.backend.route(self.router(x), self.routing, self.selection_bias)
        if self.expert_scale is not None:
            weights = weights * self.expert_scale[ids.long()]
        out = self.backend.run(self.layer, x, ids, weights)
        if self.shared is not None:
            out = out + self.shared(x)
        return out


@dataclass
class MoeContext:
    """What a model's MoE layers share: the executor and the per-layer counters. Layers that
    count elsewhere (the GPU, on the device) register a flush in ``collectors``."""

    executor: _core.MoeExecutor
    counters: _core.MoeCounters
    collectors: list[Callable[[], None]] = field(default_factory=list)

    def collect(self) -> _core.MoeCounters:
        """The counters, with every count made elsewhere added in."""
        for flush in self.collectors:
            flush()
        return self.counters


def expert_layer(
    gguf: GGUFFile,
    ctx: MoeContext,
    i: int,
    act: str = "silu",
    biases: bool = False,
    **names: list[str],
) -> _core.MoeLayer:
    """Layer ``i``'s experts: by default the stacked ``blk.i.ffn_{gate,up,down}_exps``
    tensors; ``names`` overrides them (``gate_up=`` for a fused tensor, per-expert name
    lists for Mixtral's older layout). ``biases`` adds ``.bias`` tensors (gpt-oss)."""
    p = f"blk.{i}."
    tensors: dict[str, Any] = {k: [f"{p}ffn_{k}_exps.weight"] for k in ("gate", "up", "down")}
    if "gate_up" in names:
        del tensors["gate"]
    tensors.update(names)
    if biases:
        tensors |= {f"{k}_bias": f"{p}ffn_{k}_exps.bias" for k in ("gate", "up", "down")}
    return _core.MoeLayer(gguf.handle, i, ctx.counters, act=act, **tensors)
