"""How a model's layers are divided over the host's GPUs: llama.cpp's ``--split-mode``,
``--tensor-split`` and ``--main-gpu``, planned into contiguous layer ranges, one per GPU,
each with its share of the expert cache.

The layer rule is llama.cpp's (``src/llama-model.cpp``): the proportions (or, when none are
given, each GPU's free memory) are normalized into cumulative split points, and repeating
layer ``i`` of ``n`` goes to the first GPU whose split point exceeds ``i / (n + 1)``; the output
layer counts as layer ``n``. The expert cache (``--moe-cache-mib``, the total over the GPUs) is
divided in proportion to the expert bytes of each range's MoE layers."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from freetoken.errors import InvalidInputError, UnsupportedError

__all__ = ["SPLIT_MODES", "SplitPlan", "parse_tensor_split", "plan_split"]

#: ``none``: one GPU (``--main-gpu``) holds every layer; ``layer``: contiguous ranges of layers
#: per GPU; ``row`` (llama.cpp's weights split by rows) is refused.
SPLIT_MODES = ("none", "layer", "row")


def parse_tensor_split(text: str) -> tuple[float, ...]:
    """``--tensor-split`` proportions, one per GPU, separated by ``,`` or ``/`` as llama.cpp
    takes them: each a finite number >= 0, not all zero."""
    parts = [p.strip() for p in re.split(r"[,/]+", text.strip())]
    values = []
    for p in parts:
        try:
            v = float(p)
        except ValueError:
            raise InvalidInputError(f"--tensor-split {text!r}: {p!r} is not a number") from None
        if not math.isfinite(v) or v < 0:
            raise InvalidInputError(f"--tensor-split {text!r}: {p} is not a proportion >= 0")
        values.append(v)
    if not any(values):
        raise InvalidInputError(f"--tensor-split {text!r}: every proportion is zero")
    return tuple(values)


@dataclass(frozen=True)
class SplitPlan:
    """Contiguous layer ranges in layer order, each with its GPU and its share of the expert
    cache in MiB (None: what fits there), and the GPU of the output layer (the final norm and
    projection; the embedding is on the first range's GPU).

    :func:`plan_split` makes one from the flags; a plan given to placement as it is
    (``EngineOptions.split_plan``, ``place_on_gpu(split_plan=...)``) may also name one GPU
    for several ranges: each range then still has pools of its own, and everything runs
    as over several GPUs but for the copies between them."""

    devices: tuple[int, ...]
    ranges: tuple[range, ...]
    cache_mib: tuple[int | None, ...]
    output_device: int

    def check(self, n_layers: int, n_gpus: int) -> None:
        """InvalidInputError unless the ranges cover layers ``0..n_layers-1`` in order, none
        empty, and every GPU index (and each cache share) is valid on a host of ``n_gpus``."""
        if not self.ranges or not (len(self.devices) == len(self.ranges) == len(self.cache_mib)):
            raise InvalidInputError(
                f"a split plan needs one GPU and one cache share per range ({len(self.ranges)} "
                f"ranges, {len(self.devices)} GPUs, {len(self.cache_mib)} shares)"
            )
        at = 0
        for r in self.ranges:
            if r.step != 1 or r.start != at or r.stop <= r.start:
                raise InvalidInputError(
                    f"split plan ranges {[(q.start, q.stop) for q in self.ranges]}: each must "
                    f"start where the one before ended, from layer 0, and hold a layer"
                )
            at = r.stop
        if at != n_layers:
            raise InvalidInputError(f"the split plan covers {at} of the {n_layers} layers")
        for d in (*self.devices, self.output_device):
            if not 0 <= d < n_gpus:
                raise InvalidInputError(
                    f"the split plan names GPU {d}: this host has {n_gpus} (0-{n_gpus - 1})"
                )
        if any(m is not None and m < 0 for m in self.cache_mib):
            raise InvalidInputError(f"split plan cache shares {self.cache_mib} must be >= 0")

    def layer_devices(self) -> tuple[int, ...]:
        """Each repeating layer's GPU, in layer order."""
        return tuple(d for d, r in zip(self.devices, self.ranges, strict=True) for _ in r)

    @property
    def several_devices(self) -> bool:
        """Whether the layers and the output layer are on more than one GPU."""
        return len({*self.devices, self.output_device}) > 1

    def device_of(self, layer: int) -> int:
        """The GPU of repeating layer ``layer``."""
        for dev, r in zip(self.devices, self.ranges, strict=True):
            if layer in r:
                return dev
        raise IndexError(f"layer {layer} is outside the plan's {self.ranges[-1].stop} layers")

    def describe(self) -> str:
        """One line for the placement log: which layers each GPU holds."""
        parts = []
        for dev, r, mib in zip(self.devices, self.ranges, self.cache_mib, strict=True):
            cache = "" if mib is None else f", {mib} MiB of experts"
            parts.append(f"GPU {dev}: layers {r.start}-{r.stop - 1}{cache}")
        return "; ".join(parts) + f"; output on GPU {self.output_device}"


def plan_split(
    n_layers: int,
    n_gpus: int,
    *,
    mode: str = "layer",
    tensor_split: Sequence[float] | None = None,
    main_gpu: int = 0,
    free_bytes: Sequence[int] | None = None,
    cache_mib: int | None = None,
    expert_bytes: Sequence[int] | None = None,
) -> SplitPlan:
    """The plan for ``n_layers`` repeating layers over ``n_gpus`` GPUs. ``free_bytes`` (one per
    GPU) weighs the GPUs when ``tensor_split`` is None; ``expert_bytes`` (one per layer, 0 for
    a dense layer) divides ``cache_mib``. Every inconsistent flag is an InvalidInputError that
    names it; ``row`` is an UnsupportedError."""
    if mode not in SPLIT_MODES:
        raise InvalidInputError(f"--split-mode {mode}: choose one of {', '.join(SPLIT_MODES)}")
    if mode == "row":
        raise UnsupportedError("--split-mode row: weights split by rows are not supported")
    if n_layers < 1 or n_gpus < 1:
        raise InvalidInputError(f"a split needs layers and GPUs ({n_layers} layers, {n_gpus} GPUs)")
    if not 0 <= main_gpu < n_gpus:
        raise InvalidInputError(
            f"--main-gpu {main_gpu}: this host has {n_gpus} GPU{'s' if n_gpus > 1 else ''} "
            f"(0-{n_gpus - 1})"
        )
    if expert_bytes is not None and len(expert_bytes) != n_layers:
        raise InvalidInputError(f"{len(expert_bytes)} expert sizes for {n_layers} layers")
    if tensor_split is not None:
        if mode == "none":
            raise InvalidInputError("--tensor-split needs --split-mode layer, not none")
        if len(tensor_split) != n_gpus:
            raise InvalidInputError(
                f"--tensor-split has {len(tensor_split)} proportions for {n_gpus} GPUs"
            )
        if any(not math.isfinite(v) or v < 0 for v in tensor_split) or not any(tensor_split):
            raise InvalidInputError(
                f"--tensor-split {','.join(map(str, tensor_split))}: proportions must be >= 0, "
                "not all zero"
            )
    if mode == "none" or n_gpus == 1:
        only = range(n_layers)
        return SplitPlan((main_gpu,), (only,), (cache_mib,), main_gpu)
    if tensor_split is not None:
        weights = [float(v) for v in tensor_split]
    elif free_bytes is not None and len(free_bytes) == n_gpus and any(free_bytes):
        weights = [float(max(b, 0)) for b in free_bytes]
    else:
        weights = [1.0] * n_gpus
    total = sum(weights)
    points, acc = [], 0.0
    for w in weights:
        acc += w
        points.append(acc / total)

    def gpu_of(i: int) -> int:
        frac = i / (n_layers + 1)
        return next((j for j, p in enumerate(points) if p > frac), n_gpus - 1)

    devices: list[int] = []
    starts: list[int] = []
    for i in range(n_layers):
        g = gpu_of(i)
        if not devices or devices[-1] != g:
            devices.append(g)
            starts.append(i)
    ranges = tuple(range(a, b) for a, b in zip(starts, [*starts[1:], n_layers], strict=True))
    return SplitPlan(
        tuple(devices), ranges, _divide_cache(cache_mib, ranges, expert_bytes), gpu_of(n_layers)
    )


def _divide_cache(
    cache_mib: int | None, ranges: Sequence[range], expert_bytes: Sequence[int] | None
) -> tuple[int | None, ...]:
    """The total cache divided in proportion to each range's expert bytes, rounded down (what
    rounding leaves goes to the range with the most experts)."""
    if cache_mib is None:
        return (None,) * len(ranges)
    if expert_bytes is None or not any(expert_bytes):
        shares = [float(len(r)) for r in ranges]
    else:
        shares = [float(sum(expert_bytes[i] for i in r)) for r in ranges]
    total = sum(shares)
    out = [int(cache_mib * s // total) for s in shares]
    out[max(range(len(out)), key=lambda j: shares[j])] += cache_mib - sum(out)
    return tuple(out)
