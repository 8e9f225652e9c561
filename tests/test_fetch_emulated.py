"""The device's fetch kernels (``cuda/src/fetch.cuh``) compiled by g++ through the CPU
emulation of the CUDA constructs they use (``tests/cuda_cpu/cuda_emulation.h``), against the
references of ``fetch_cases.py``.

The plan against the fetch rule written out in float64 and against the host's
:func:`freetoken.engine.fetch.choose_fetch`: the same count, list, route slots and weights,
host table row (an earlier pass's marks replaced) and counters, over expert counts up to the
kernel's limit, one-token to long steps, forced shares and the modelled choice with each
pricing. The gather against numpy copies: stacked and tiled (fused gate/up) layouts, sizes
that allow 16-, 8- and 1-byte accesses, nothing fetched."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
from emulation import build_emulator
from fetch_cases import (
    CPU_NS,
    END,
    EXPERT_BYTES,
    GATHER_CASES,
    INT64_MAX,
    LINKS,
    PLAN_CASES,
    START,
    UPLOAD_NS,
    GatherCase,
    N,
    PlanCase,
    check_gather,
    check_plan,
    gather_layout,
    gather_list,
    plan_inputs,
)
from freetoken.engine.fetch import choose_fetch


@pytest.fixture(scope="module")
def emulator(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    return build_emulator("fetch_emulate.cpp", tmp_path_factory)


def _ptr(a: np.ndarray) -> ctypes.c_void_p:
    return ctypes.c_void_p(a.ctypes.data)


def _aligned(nbytes: int, fill: int) -> np.ndarray:
    """``nbytes`` bytes starting at a 64-byte boundary."""
    raw = np.full(nbytes + 64, fill, dtype=np.uint8)
    skip = -raw.ctypes.data % 64
    return raw[skip : skip + nbytes]


@pytest.mark.parametrize("c", PLAN_CASES, ids=str)
def test_plan_matches_the_rule(emulator: ctypes.CDLL, c: PlanCase) -> None:
    x = plan_inputs(c)
    host = x.host.copy()
    fetched = np.full(c.experts, -7, dtype=np.int32)
    slots = np.empty((c.tokens, c.top_k), dtype=np.int32)
    fweights = np.empty((c.tokens, c.top_k), dtype=np.float32)
    stats = np.zeros(8, dtype=np.int64)
    sizes = (ctypes.c_int64 * 6)(
        c.tokens, c.top_k, c.experts, c.max_fetch, c.max_fetch, int(c.price_routes)
    )
    figures = (ctypes.c_double * 8)(
        EXPERT_BYTES,
        c.overhead_s,
        -1.0 if c.share is None else c.share,
        LINKS.cpu,
        LINKS.pcie,
        LINKS.gpu,
        LINKS.cpu_with_pcie,
        LINKS.pcie_with_cpu,
    )
    emulator.fetch_plan_emulate(
        sizes,
        figures,
        *map(_ptr, (x.ids, x.weights, x.resident, host, fetched, slots, fweights, stats)),
    )
    chosen = check_plan(c, x, host, fetched, slots, fweights, stats)
    assert (fetched[len(chosen) :] == -7).all()  # nothing written past the list

    # The host's rule chooses the same (the engine's split-or-stream decision uses it).
    missed = np.flatnonzero(np.bincount(x.ids[x.resident[x.ids] < 0], minlength=c.experts))
    counts = np.bincount(x.ids[x.resident[x.ids] < 0], minlength=c.experts)[missed]
    host_choice = choose_fetch(
        missed,
        counts.astype(np.float64),
        int(EXPERT_BYTES),
        LINKS,
        share=c.share,
        max_fetch=c.max_fetch,
        overhead_s=c.overhead_s,
        price_routes=c.price_routes,
    )
    assert host_choice.n_fetch == stats[N]
    assert host_choice.fetched.tolist() == chosen
    assert stats[UPLOAD_NS] == round(host_choice.upload_s * 1e9)
    assert stats[CPU_NS] == round(host_choice.cpu_s * 1e9)


@pytest.mark.parametrize("c", GATHER_CASES, ids=str)
def test_gather_copies_the_list(emulator: ctypes.CDLL, c: GatherCase) -> None:
    starts, strides, span = gather_layout(c, 0)
    host = _aligned(span, 0)
    host[:] = np.random.default_rng(c.experts).integers(0, 256, span, dtype=np.uint8)
    base = host.ctypes.data
    fill = 0xAB
    staging = [_aligned(c.experts * n + 32, fill) for n in c.nbytes]
    listed = gather_list(c)
    stats = np.zeros(8, dtype=np.int64)
    stats[N], stats[START], stats[END] = c.n_fetch, INT64_MAX, 0
    sizes = (ctypes.c_int64 * 5)(3, c.experts, c.top_k, c.dummy_base, c.dummy_base)
    emulator.fetch_gather_emulate(
        sizes,
        _ptr(listed),
        _ptr(stats),
        (ctypes.c_void_p * 3)(*(base + s for s in starts)),
        (ctypes.c_int64 * 3)(*strides),
        (ctypes.c_int64 * 3)(*c.nbytes),
        (ctypes.c_void_p * 3)(*(s.ctypes.data for s in staging)),
    )
    check_gather(c, host, staging, fill)
    assert all((s[c.experts * n :] == fill).all() for s, n in zip(staging, c.nbytes, strict=True))
    assert 0 < stats[START] <= stats[END] < INT64_MAX
    assert stats[N] == c.n_fetch  # the plan's words are read, not changed
