"""The device's fetch kernels as built for the GPU (``gpu.fetch_plan``, ``gpu.fetch_gather``)
against the references of ``fetch_cases.py``, the cases their CPU emulation runs: the plan's
count, list, route slots and weights, the host table row it writes in mapped memory and its
counters; the gather's copies from registered host memory (stacked and tiled layouts, 16-,
8- and 1-byte accesses) into staging pools, with the dummy slots zeroed and the span timed;
and the bad input each wrapper refuses before the library sees it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fetch_cases import (  # noqa: E402
    END,
    EXPERT_BYTES,
    GATHER_CASES,
    INT64_MAX,
    LINKS,
    PLAN_CASES,
    START,
    GatherCase,
    N,
    PlanCase,
    check_gather,
    check_plan,
    gather_layout,
    gather_list,
    plan_inputs,
)
from freetoken.engine.hybrid import MappedHost  # noqa: E402
from freetoken.errors import FreeTokenError, ShapeError  # noqa: E402
from freetoken.runtime import gpu  # noqa: E402

pytestmark = pytest.mark.gpu

LINK_FIGURES = (LINKS.cpu, LINKS.pcie, LINKS.gpu, LINKS.cpu_with_pcie, LINKS.pcie_with_cpu)


def _plan(c: PlanCase, host_row: np.ndarray, **change: object) -> tuple[torch.Tensor, ...]:
    x = plan_inputs(c)
    dev = torch.device("cuda")
    fetched = torch.full((c.experts,), -7, dtype=torch.int32, device=dev)
    stats = torch.zeros(gpu.FETCH_STATS, dtype=torch.int64, device=dev)
    args: dict[str, object] = dict(
        max_fetch=c.max_fetch,
        dummy_base=c.max_fetch,
        expert_bytes=int(EXPERT_BYTES),
        links=LINK_FIGURES,
        overhead_s=c.overhead_s,
        share=c.share,
        price_routes=c.price_routes,
    )
    args.update(change)
    slots, weights = gpu.fetch_plan(
        torch.from_numpy(x.ids).to(dev),
        torch.from_numpy(x.weights).to(dev),
        torch.from_numpy(x.resident).to(dev),
        host_row,
        fetched,
        stats,
        **args,  # type: ignore[arg-type]
    )
    torch.cuda.synchronize()
    return fetched, slots, weights, stats


@pytest.mark.parametrize("c", PLAN_CASES, ids=str)
def test_plan_matches_the_rule(c: PlanCase) -> None:
    mapped = MappedHost({"row": (np.int32, (c.experts,))})
    row = mapped.arrays["row"]
    x = plan_inputs(c)
    row[:] = x.host
    fetched, slots, weights, stats = _plan(c, row)
    chosen = check_plan(
        c,
        x,
        row,
        fetched.cpu().numpy(),
        slots.cpu().numpy(),
        weights.cpu().numpy(),
        stats.cpu().numpy(),
    )
    assert (fetched.cpu().numpy()[len(chosen) :] == -7).all()


def test_plan_refuses_bad_input() -> None:
    c = PLAN_CASES[3]
    row = MappedHost({"row": (np.int32, (c.experts,))}).arrays["row"]
    with pytest.raises(FreeTokenError, match="not mapped page-locked"):
        _plan(c, np.zeros(c.experts, dtype=np.int32))
    with pytest.raises(FreeTokenError, match="within 0-1"):
        _plan(c, row, share=1.5)
    with pytest.raises(FreeTokenError, match="fetch of at most"):
        _plan(c, row, max_fetch=c.experts + 1)
    with pytest.raises(FreeTokenError, match="bandwidths"):
        _plan(c, row, links=(0.0, *LINK_FIGURES[1:]))
    with pytest.raises(FreeTokenError, match="resident_host"):
        _plan(c, row[: c.experts - 1])


def _pools(c: GatherCase, fill: int) -> list[gpu.ExpertPool]:
    pools = [gpu.ExpertPool("q4_0", k, rows, c.experts) for k, rows in c.shapes]
    for p in pools:
        p.tensor.fill_(fill)
    return pools


@pytest.mark.parametrize("c", GATHER_CASES, ids=str)
def test_gather_copies_the_list(c: GatherCase) -> None:
    starts, strides, span = gather_layout(c, 0)
    mapped = MappedHost({"host": (np.uint8, (span,))})  # 64-byte aligned
    host = mapped.arrays["host"]
    host[:] = np.random.default_rng(c.experts).integers(0, 256, span, dtype=np.uint8)
    base = host.ctypes.data
    fill = 0xAB
    pools = _pools(c, fill)
    dev = torch.device("cuda")
    stats = torch.zeros(gpu.FETCH_STATS, dtype=torch.int64, device=dev)
    stats[N], stats[START] = c.n_fetch, INT64_MAX
    gpu.fetch_gather(
        pools,
        [(base + s, st) for s, st in zip(starts, strides, strict=True)],
        torch.from_numpy(gather_list(c)).to(dev),
        stats,
        top_k=c.top_k,
        max_fetch=c.dummy_base,
        dummy_base=c.dummy_base,
    )
    torch.cuda.synchronize()
    check_gather(c, host, [p.tensor.cpu().numpy() for p in pools], fill)
    st = stats.cpu().numpy()
    assert 0 < st[START] <= st[END] < INT64_MAX and st[N] == c.n_fetch


def _gather(c: GatherCase, pools: list[gpu.ExpertPool], sources: list[tuple[int, int]]) -> None:
    dev = torch.device("cuda")
    stats = torch.zeros(gpu.FETCH_STATS, dtype=torch.int64, device=dev)
    listed = torch.from_numpy(gather_list(c)).to(dev)
    gpu.fetch_gather(
        pools,
        sources,
        listed,
        stats,
        top_k=c.top_k,
        max_fetch=c.dummy_base,
        dummy_base=c.dummy_base,
    )


def test_gather_refuses_bad_input() -> None:
    c = GATHER_CASES[0]
    starts, strides, span = gather_layout(c, 0)
    host = MappedHost({"host": (np.uint8, (span,))}).arrays["host"]
    sources = [(host.ctypes.data + s, st) for s, st in zip(starts, strides, strict=True)]
    pageable = np.zeros(span, dtype=np.uint8)
    with pytest.raises(FreeTokenError, match="not mapped page-locked"):
        _gather(c, _pools(c, 0), [(pageable.ctypes.data, st) for st in strides])
    # One expert further on, the last expert of the last kind ends past the registration.
    shifted = [(a + c.nbytes[2], st) for a, st in sources]
    with pytest.raises(FreeTokenError, match=r"not mapped|several registrations"):
        _gather(c, _pools(c, 0), shifted)
    small = [gpu.ExpertPool("q4_0", k, rows, c.dummy_base) for k, rows in c.shapes]
    with pytest.raises(ShapeError, match="staging pool"):
        _gather(c, small, sources)
