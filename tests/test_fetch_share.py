"""The fetch share rule of ``hybrid`` (engine/fetch.py): the expected choices are derived here
by hand from the bandwidth model (upload ``n_f S (1/B_pcie + 1/B_gpu)`` against the CPU's
``(n - n_f) S / B_cpu``, each with the other link busy when both run), not from the rule's
output."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from freetoken.engine.bandwidth_profile import KindBandwidth
from freetoken.engine.fetch import (
    DEFAULT_B_CPU,
    DEFAULT_B_GPU,
    DEFAULT_B_PCIE,
    Links,
    choose_fetch,
    expect_step,
    step_bucket,
)
from freetoken.errors import InvalidInputError

MB = 1_000_000  # one expert's bytes in these cases: n experts take n / (B * 1000) seconds
#: Alone: CPU 120, PCIe 60 GB/s; together: CPU 100, PCIe 50; the GPU kernels 100.
LINKS = Links(cpu=120.0, pcie=60.0, gpu=100.0, cpu_with_pcie=100.0, pcie_with_cpu=50.0)


def _missed(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(100, 100 + n), np.ones(n, dtype=np.int64)


def test_both_sides_finish_together() -> None:
    # n_f (1/50 + 1/100) = (40 - n_f) / 100  =>  0.03 n_f = 0.4 - 0.01 n_f  =>  n_f = 10,
    # both sides 0.3 ms; the CPU alone takes 40/120 = 0.333 ms, all uploaded
    # 40 (1/60 + 1/100) = 1.07 ms.
    c = choose_fetch(*_missed(40), MB, LINKS, overhead_s=0.0)
    assert c.n_fetch == 10 and math.isclose(c.share, 0.25)
    assert math.isclose(c.upload_s, 3e-4) and math.isclose(c.cpu_s, 3e-4)
    assert (c.fetch_bytes, c.cpu_bytes) == (10 * MB, 30 * MB)
    assert (c.fetch_routes, c.cpu_routes) == (10, 30)


def test_the_fixed_cost_keeps_small_gains_on_the_cpu() -> None:
    # The split saves 0.333 - 0.3 = 0.033 ms: less than a 0.1 ms fixed cost.
    assert choose_fetch(*_missed(40), MB, LINKS, overhead_s=1e-4).n_fetch == 0
    assert choose_fetch(*_missed(40), MB, LINKS, overhead_s=1e-5).n_fetch == 10


@pytest.mark.parametrize("seed", range(5))
def test_the_share_is_the_balance_point(seed: int) -> None:
    """With the same figures alone and together, the balance n_f (1/B_p + 1/B_g) =
    (n - n_f) / B_c gives n_f = n (1/B_c) / (1/B_c + 1/B_p + 1/B_g); the whole number chosen
    is one of the two around it."""
    rng = np.random.default_rng(seed)
    b_c, b_p, b_g = rng.uniform(10, 200, 3)
    links = Links(b_c, b_p, b_g, b_c, b_p)
    n = int(rng.integers(1, 120))
    c = choose_fetch(*_missed(n), MB, links, overhead_s=0.0)
    balance = n * (1 / b_c) / (1 / b_c + 1 / b_p + 1 / b_g)
    assert math.floor(balance) <= c.n_fetch <= math.ceil(balance)


def test_a_slow_link_fetches_nothing_and_a_fast_one_everything() -> None:
    slow = Links(cpu=100.0, pcie=1.0, gpu=100.0, cpu_with_pcie=100.0, pcie_with_cpu=1.0)
    assert choose_fetch(*_missed(8), MB, slow, overhead_s=0.0).n_fetch == 0
    # CPU at 1 GB/s: 8 experts take 8 ms there; any upload takes 8 (1/100+1/1000) = 0.088 ms.
    fast = Links(cpu=1.0, pcie=100.0, gpu=1000.0, cpu_with_pcie=1.0, pcie_with_cpu=100.0)
    c = choose_fetch(*_missed(8), MB, fast, overhead_s=0.0)
    assert c.n_fetch == 8 and c.cpu_s == 0.0
    assert math.isclose(c.upload_s, 8 * MB * (1 / 100 + 1 / 1000) / 1e9)


def test_routes_priced_as_reads() -> None:
    """``price_routes``: the CPU reads an expert once per route. Four experts of 3 routes
    and four of 1, most routed first: fetching f of the 3-route ones (f <= 4) leaves
    3 (4 - f) + 4 reads to the CPU, at 100 GB/s, against f (1/50 + 1/100) for the uploads:
    0.03 f = 0.16 - 0.03 f, f = 2.67: 3 experts (0.09 ms against 0.07 ms; 2 would be 0.10
    against 0.06)."""
    experts = np.arange(8)
    routes = np.array([1, 3, 1, 3, 1, 3, 1, 3])
    c = choose_fetch(experts, routes, MB, LINKS, overhead_s=0.0, price_routes=True)
    assert c.n_fetch == 3 and c.fetched.tolist() == [1, 3, 5]
    assert math.isclose(c.upload_s, 9e-5) and math.isclose(c.cpu_s, 7e-5)
    # Priced by reads of distinct experts the same misses fetch 8/4 = 2: n_f 0.03 =
    # (8 - n_f) / 100 gives n_f = 2 (both 0.06 ms).
    assert choose_fetch(experts, routes, MB, LINKS, overhead_s=0.0).n_fetch == 2


def test_the_most_routed_experts_go_first() -> None:
    experts = np.array([7, 3, 9, 1, 5])
    routes = np.array([1, 4, 4, 2, 1])
    c = choose_fetch(experts, routes, MB, LINKS, share=0.6)  # 3 of 5
    # By routes, ties by id: 3 (4), 9 (4), 1 (2), then 5 and 7 (1 each).
    assert c.order.tolist() == [3, 9, 1, 5, 7] and c.fetched.tolist() == [3, 9, 1]
    assert (c.fetch_routes, c.cpu_routes) == (10, 2)


@pytest.mark.parametrize(("share", "want"), [(0.0, 0), (0.5, 3), (1.0, 5), (0.39, 2)])
def test_a_forced_share(share: float, want: int) -> None:
    # 0.5 of 5 experts is 2.5: rounded half up to 3; 0.39 of 5 is 1.95: 2.
    c = choose_fetch(*_missed(5), MB, LINKS, share=share)
    assert c.n_fetch == want


def test_the_staging_room_caps_the_fetch() -> None:
    assert choose_fetch(*_missed(40), MB, LINKS, share=1.0, max_fetch=6).n_fetch == 6
    fast = Links(cpu=1.0, pcie=100.0, gpu=1000.0, cpu_with_pcie=1.0, pcie_with_cpu=100.0)
    assert choose_fetch(*_missed(40), MB, fast, max_fetch=6).n_fetch == 6
    assert choose_fetch(*_missed(4), MB, fast, max_fetch=0).n_fetch == 0


def test_nothing_missed() -> None:
    c = choose_fetch(np.array([], dtype=np.int64), np.array([], dtype=np.int64), MB, LINKS)
    assert c.n_fetch == 0 and c.share == 0.0 and c.upload_s == c.cpu_s == 0.0


def test_links_from_a_profile() -> None:
    assert Links.of(None) == Links(
        DEFAULT_B_CPU, DEFAULT_B_PCIE, DEFAULT_B_GPU, DEFAULT_B_CPU, DEFAULT_B_PCIE
    )
    # The fetch kernel's figures price the upload; the copy engine's stream layers.
    full = KindBandwidth("k", 12, 90.0, 50.0, 900.0, 1.8, 70.0, 40.0, 25.0, 80.0, 22.0)
    assert Links.of(full) == Links(90.0, 25.0, 900.0, 80.0, 22.0, stream=50.0)
    # Without the fetch kernel's figures (a host that would not register the mapping, or a
    # profile measured before them), the one-expert copies' price the upload.
    copies = KindBandwidth("k", 12, 90.0, 50.0, 900.0, 1.8, 70.0, 40.0)
    assert Links.of(copies) == Links(90.0, 50.0, 900.0, 70.0, 40.0, stream=50.0)
    # Without the together figures, each link alone.
    alone = KindBandwidth("k", 12, 90.0, 50.0, 900.0, 1.8, b_gather_gbps=25.0)
    assert Links.of(alone) == Links(90.0, 25.0, 900.0, 90.0, 25.0, stream=50.0)
    old = KindBandwidth("k", 12, 90.0, 50.0, 900.0, 1.8)
    assert Links.of(old) == Links(90.0, 50.0, 900.0, 90.0, 50.0, stream=50.0)
    cpu_only = KindBandwidth("k", 12, 90.0, None, None, None)
    assert Links.of(cpu_only) == Links(
        90.0, DEFAULT_B_PCIE, DEFAULT_B_GPU, 90.0, DEFAULT_B_PCIE, stream=DEFAULT_B_PCIE
    )


def test_a_step_without_fetching_is_the_stream_or_split_rule() -> None:
    """Share 0, routes priced as reads: the split's time is the CPU reading each missed route
    once, ``T k (1 - h) S / B_cpu`` a layer, against streaming ``E S / B_pcie``; 48 layers,
    128 experts of 2.5 MB, top-8, a 25% hit rate, T = 32 tokens: 32 * 8 * 0.75 = 192 reads
    at 120 GB/s = 4.0 ms against 128 experts at 60 GB/s = 5.33 ms a layer."""
    s = 2_500_000
    split, stream, fetch = expect_step(
        32, 0.25, 128, 8, {(LINKS, s): 48}, share=0.0, price_routes=True, overhead_s=0.0
    )
    assert math.isclose(split, 48 * 192 * s / 120e9) and math.isclose(stream, 48 * 128 * s / 60e9)
    assert not fetch


def test_a_step_that_fetches() -> None:
    """The same misses (the expected distinct ones: 128 (1 - (1 - 8/128)^32) = 111.8, of
    them 75% missed: 84 experts of 192/84 routes each, priced per expert): the fetch rule
    balances n_f (1/50 + 1/100) = (84 - n_f) / 100, n_f = 21: both sides 0.63 ms a layer
    (the CPU alone: 84 / 120 = 0.7 ms), 30.2 ms for the 48 layers."""
    s = 1_000_000
    split, stream, fetch = expect_step(32, 0.25, 128, 8, {(LINKS, s): 48}, overhead_s=0.0)
    assert fetch
    assert math.isclose(split, 48 * 63 * s / 100e9)
    assert math.isclose(stream, 48 * 128 * s / 60e9)
    # Two kinds: each counted with its own figures.
    slow = Links(cpu=10.0, pcie=5.0, gpu=100.0, cpu_with_pcie=10.0, pcie_with_cpu=5.0)
    _, stream2, _ = expect_step(
        32, 0.25, 128, 8, {(LINKS, s): 40, (slow, s): 8}, share=0.0, overhead_s=0.0
    )
    assert math.isclose(stream2, 40 * 128 * s / 60e9 + 8 * 128 * s / 5e9)
    # A copy engine faster than the fetch kernel: streaming at its rate, the fetch at the
    # kernel's (the same split as above).
    copies = dataclasses.replace(LINKS, stream=120.0)
    split3, stream3, _ = expect_step(32, 0.25, 128, 8, {(copies, s): 48}, overhead_s=0.0)
    assert math.isclose(split3, split) and math.isclose(stream3, 48 * 128 * s / 120e9)


def test_step_buckets() -> None:
    got = {n: step_bucket(n) for n in (1, 2, 4, 5, 16, 17, 256, 257, 512, 513)}
    assert got == {
        1: "1",
        2: "2-4",
        4: "2-4",
        5: "5-8",
        16: "9-16",
        17: "17-32",
        256: "129-256",
        257: "257-512",
        512: "257-512",
        513: "513+",
    }


def test_bad_input() -> None:
    with pytest.raises(InvalidInputError, match="within 0-1"):
        choose_fetch(*_missed(3), MB, LINKS, share=1.5)
    with pytest.raises(InvalidInputError, match="route counts"):
        choose_fetch(np.arange(3), np.ones(2), MB, LINKS)


def test_the_option() -> None:
    """``--moe-fetch-share F``: parsed into the engine options, 0-1, hybrid (or auto) only."""
    import argparse

    from freetoken.engine.options import EngineOptions, add_arguments, from_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    opts = from_args(p.parse_args(["--moe-strategy", "hybrid", "--moe-fetch-share", "0.5"]))
    assert opts.moe_fetch_share == 0.5 and from_args(p.parse_args([])).moe_fetch_share is None
    with pytest.raises(InvalidInputError, match="within 0-1"):
        EngineOptions(moe_fetch_share=1.5)
    with pytest.raises(InvalidInputError, match="hybrid"):
        EngineOptions(moe_strategy="offload", moe_fetch_share=0.5)
