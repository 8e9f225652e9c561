"""Cases and the reference of the device's fetch kernels (``cuda/src/fetch.cuh``), shared by
their CPU emulation (``test_fetch_emulated.py``) and the GPU (``test_gpu_fetch.py``).

The plan's reference is the fetch rule written out plainly in float64 (the missed experts
ordered by routes then id, every candidate count's modelled time, the first minimum); the
gather's is numpy copies of the experts' bytes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from freetoken.engine.fetch import Links

FETCHED = np.iinfo(np.int32).max
INT64_MAX = np.iinfo(np.int64).max
# The stats words (include/freetoken_cuda.h, FT_CUDA_FETCH_*).
N, MISSED, ROUTES, MISSED_ROUTES, START, END, UPLOAD_NS, CPU_NS = range(8)
LINKS = Links(cpu=40.0, pcie=50.0, gpu=3000.0, cpu_with_pcie=30.0, pcie_with_cpu=45.0)
EXPERT_BYTES = 1.77e6


@dataclass(frozen=True)
class PlanCase:
    tokens: int
    top_k: int
    experts: int
    resident_share: float
    share: float | None  # forced, or None: the modelled choice
    price_routes: bool
    overhead_s: float = 20e-6

    @property
    def max_fetch(self) -> int:
        return self.experts - self.top_k


PLAN_CASES = [
    PlanCase(1, 8, 256, 0.25, None, False),
    PlanCase(2, 8, 256, 0.25, None, False, overhead_s=300e-6),  # the fixed cost decides
    PlanCase(4, 8, 256, 0.25, None, False),
    PlanCase(16, 8, 256, 0.25, None, False),
    PlanCase(16, 8, 256, 0.1, None, True),
    PlanCase(64, 8, 128, 0.5, None, True),
    PlanCase(300, 10, 512, 0.25, None, True),
    PlanCase(16, 8, 1024, 0.3, None, False),
    PlanCase(32, 2, 8, 0.25, None, False),
    PlanCase(16, 8, 256, 0.25, 0.0, False),
    PlanCase(16, 8, 256, 0.25, 0.5, False),
    PlanCase(16, 8, 256, 0.25, 1.0, True),
    PlanCase(5, 4, 64, 1.0, None, False),  # every expert resident: nothing missed
    PlanCase(5, 4, 64, 0.0, 0.5, False),
]


@dataclass
class PlanInputs:
    ids: np.ndarray  # int32 [tokens, top_k]
    weights: np.ndarray  # float32 [tokens, top_k]
    resident: np.ndarray  # int32 [experts]: slot or -1
    host: np.ndarray  # the host's row before the plan: resident with an earlier pass's marks


def plan_inputs(c: PlanCase) -> PlanInputs:
    """Skewed routing (route counts differ and tie), a random resident set."""
    rng = np.random.default_rng(c.tokens * 1000 + c.experts + c.top_k)
    p = rng.zipf(1.3, c.experts).astype(np.float64)
    p /= p.sum()
    ids = np.stack(
        [rng.choice(c.experts, c.top_k, replace=False, p=p) for _ in range(c.tokens)]
    ).astype(np.int32)
    weights = rng.random((c.tokens, c.top_k), dtype=np.float32) + 0.1
    resident = np.full(c.experts, -1, dtype=np.int32)
    held = rng.choice(c.experts, int(c.experts * c.resident_share), replace=False)
    resident[held] = np.arange(len(held), dtype=np.int32)
    host = resident.copy()
    host[rng.choice(c.experts, c.experts // 4, replace=False)] = FETCHED
    return PlanInputs(ids, weights, resident, host)


def reference_plan(c: PlanCase, x: PlanInputs) -> tuple[list[int], int, dict[int, int]]:
    """The missed experts in order, the count fetched and each missed expert's routes."""
    counts: dict[int, int] = {}
    for e in x.ids.ravel().tolist():
        if x.resident[e] < 0:
            counts[e] = counts.get(e, 0) + 1
    order = sorted(counts, key=lambda e: (-counts[e], e))
    n = len(order)
    cap = min(n, c.max_fetch)
    if c.share is not None:
        return order, min(cap, math.floor(c.share * n + 0.5)), counts
    reads = [counts[e] if c.price_routes else 1 for e in order]
    best, best_t = 0, math.inf
    for nf in range(cap + 1):
        both = 0 < nf < n
        b_pcie = LINKS.pcie_with_cpu if both else LINKS.pcie
        b_cpu = LINKS.cpu_with_pcie if both else LINKS.cpu
        upload = nf * EXPERT_BYTES * (1 / b_pcie + 1 / LINKS.gpu) / 1e9
        cpu = float(sum(reads[nf:])) * EXPERT_BYTES / b_cpu / 1e9
        t = max(upload, cpu) + (c.overhead_s if nf else 0.0)
        if t < best_t:
            best, best_t = nf, t
    return order, best, counts


def check_plan(
    c: PlanCase,
    x: PlanInputs,
    host: np.ndarray,
    fetched: np.ndarray,
    slots: np.ndarray,
    fetch_weights: np.ndarray,
    stats: np.ndarray,
) -> list[int]:
    """Asserts a plan's outputs against the reference; returns the experts fetched."""
    order, nf, counts = reference_plan(c, x)
    chosen = order[:nf]
    assert stats[N] == nf and stats[MISSED] == len(order)
    assert stats[ROUTES] == sum(counts[e] for e in chosen)
    assert stats[MISSED_ROUTES] == sum(counts.values())
    assert stats[START] == INT64_MAX and stats[END] == 0
    assert fetched[:nf].tolist() == chosen
    marks = x.resident.copy()
    marks[chosen] = FETCHED
    np.testing.assert_array_equal(host, marks)
    dummy = c.max_fetch
    place = {e: r for r, e in enumerate(chosen)}
    want = np.array([[place.get(int(e), dummy + j) for j, e in enumerate(row)] for row in x.ids])
    np.testing.assert_array_equal(slots, want)
    np.testing.assert_array_equal(fetch_weights, np.where(want < nf, x.weights, 0.0))
    return chosen


@dataclass(frozen=True)
class GatherCase:
    experts: int
    top_k: int
    shapes: tuple[tuple[int, int], tuple[int, int], tuple[int, int]]  # Q4_0 (k, rows) per kind
    fused: bool  # gate and up tiled per expert in one region
    n_fetch: int

    @property
    def nbytes(self) -> tuple[int, ...]:
        return tuple(k // 32 * 18 * rows for k, rows in self.shapes)

    @property
    def dummy_base(self) -> int:
        return self.experts - self.top_k


GATHER_CASES = [
    GatherCase(16, 4, ((512, 16), (512, 16), (512, 16)), False, 9),  # 4608 B: 16-byte accesses
    GatherCase(16, 4, ((64, 32), (64, 32), (64, 64)), True, 12),  # tiled: 8-byte accesses
    GatherCase(12, 3, ((32, 3), (32, 3), (32, 5)), False, 5),  # 54 and 90 B: 1-byte accesses
    GatherCase(12, 3, ((32, 4), (32, 4), (32, 4)), False, 0),  # nothing fetched
]


def gather_layout(c: GatherCase, base: int) -> tuple[list[int], list[int], int]:
    """Each kind's offset of expert 0 from ``base`` and its stride, and the bytes the layout
    spans: stacked kinds one after another, or gate/up tiled per expert (``base`` 8 bytes
    into the region, so 8- and not 16-byte aligned) then down stacked."""
    gate, up, down = c.nbytes
    e = c.experts
    if c.fused:
        return (
            [8, 8 + gate, 8 + e * (gate + up)],
            [gate + up, gate + up, down],
            8 + e * (gate + up + down),
        )
    starts = [0, e * gate, e * (gate + up)]
    return starts, list(c.nbytes), e * (gate + up + down)


def gather_list(c: GatherCase) -> np.ndarray:
    """The plan's list: ``n_fetch`` distinct experts, then entries the gather must not read."""
    rng = np.random.default_rng(c.experts * 31 + c.n_fetch)
    out = np.full(c.experts, -1, dtype=np.int32)
    out[: c.n_fetch] = rng.choice(c.experts, c.n_fetch, replace=False)
    return out


def check_gather(c: GatherCase, host: np.ndarray, staging: list[np.ndarray], fill: int) -> None:
    """Each kind's staging (pre-filled with ``fill``) holds the listed experts' bytes of
    ``host`` (the layout's region) in slots from 0, zeros in the ``top_k`` slots from
    ``dummy_base``, and ``fill`` elsewhere."""
    starts, strides, _ = gather_layout(c, 0)
    listed = gather_list(c)[: c.n_fetch]
    for kind, n in enumerate(c.nbytes):
        got = staging[kind]
        for r, e in enumerate(listed.tolist()):
            src = starts[kind] + e * strides[kind]
            np.testing.assert_array_equal(got[r * n : (r + 1) * n], host[src : src + n])
        lo, hi = c.dummy_base * n, (c.dummy_base + c.top_k) * n
        assert (got[c.n_fetch * n : lo] == fill).all()
        assert (got[lo:hi] == 0).all()
        assert (got[hi : c.experts * n] == fill).all()
