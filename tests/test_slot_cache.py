"""The GPU expert slot cache's bookkeeping (freetoken.runtime.slots.SlotCache) against an
independent LRU written here from the rule, and the pool plan's arithmetic (plan_pools)
checked against sums computed here. No GPU needed."""

from __future__ import annotations

import itertools
import json
import math
import re
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from freetoken.errors import (
    FileAccessError,
    InvalidInputError,
    ShapeError,
    UnsupportedError,
)
from freetoken.runtime.slots import LayerSpec, SlotCache, SlotStats, Upload, plan_pools

MIB = 1 << 20
MAX_BLOCKS = 2**31 - 1
# A pool tensor's zeroed tail is under 512 elements of one row; no type has more than 4 bytes
# an element (F32), so three tails take at most this.
TAIL_BOUND = 3 * 512 * 4


Key = tuple[int, int]


class RefLRU:
    """The rule, literally: distinct experts in order of first appearance; hits become most
    recently used first; each miss takes the lowest free slot, else the least recently used
    slot that this call does not name. ``admit`` takes the given misses in order, each into
    the lowest free slot, else over the least recently used resident that no layer's latest
    lookup or place named and that this admit did not upload; it stops when none is left."""

    def __init__(self, n_slots: int) -> None:
        self.n_slots = n_slots
        self.order: OrderedDict[Key, int] = OrderedDict()  # LRU first
        self.free = list(range(n_slots))
        self.stats: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0, 0, 0])
        self.latest: dict[int, set[Key]] = {}  # layer -> keys of its latest place/lookup
        self.layers: set[int] = set()  # every layer any call has named

    def _victim(self, protected: set[Key]) -> Key | None:
        return next((k for k in self.order if k not in protected), None)

    def _fill(self, key: Key, protected: set[Key]) -> Upload:
        evicted = None
        if self.free:
            slot = min(self.free)
            self.free.remove(slot)
        else:
            victim = self._victim(protected)
            assert victim is not None
            slot = self.order.pop(victim)
            self.stats[victim[0]][4] += 1
            evicted = victim
        self.order[key] = slot
        self.stats[key[0]][3] += 1
        return Upload(key[0], key[1], slot, evicted)

    def _count(self, layer: int, keys: list[Key], n_tokens: int) -> None:
        """A call's routes, for the policies that count them."""

    def _begin(self, layer: int, ids: np.ndarray) -> tuple[list[Key], list[Key]]:
        self.layers.add(layer)
        keys = [(layer, int(e)) for e in ids.ravel()]
        return keys, list(dict.fromkeys(keys))

    def _named(self, layer: int, keys: list[Key], distinct: list[Key], n_tokens: int) -> None:
        self.latest[layer] = set(distinct)
        self._count(layer, keys, n_tokens)

    def place(self, layer: int, ids: np.ndarray) -> tuple[list[int], list[Upload]]:
        keys, distinct = self._begin(layer, ids)
        if len(distinct) > self.n_slots:
            raise ShapeError("too many")
        self._named(layer, keys, distinct, ids.shape[0])
        hits = [k for k in distinct if k in self.order]
        for k in hits:
            self.order.move_to_end(k)
        ups = [self._fill(k, set(distinct)) for k in distinct if k not in hits]
        s = self.stats[layer]
        s[0] += 1
        s[1] += len(hits)
        s[2] += len(distinct) - len(hits)
        return [self.order[k] for k in keys], ups

    def lookup(self, layer: int, ids: np.ndarray) -> tuple[list[int], int]:
        keys, distinct = self._begin(layer, ids)
        self._named(layer, keys, distinct, ids.shape[0])
        hits = [k for k in distinct if k in self.order]
        for k in hits:
            self.order.move_to_end(k)
        s = self.stats[layer]
        s[0] += 1
        s[1] += len(hits)
        s[2] += len(distinct) - len(hits)
        slots = [self.order.get(k, -1) for k in keys]
        return slots, sum(x >= 0 for x in slots)

    def insert(self, layer: int, expert: int) -> Upload | None:
        self.layers.add(layer)
        key = (layer, expert)
        if key in self.order:
            self.order.move_to_end(key)
            return None
        return self._fill(key, set())

    def _candidates(self, keys: list[Key]) -> list[Key]:
        return keys

    def _admits(self, key: Key, victim: Key) -> bool:
        return True

    def admit(self, layer: int, experts: list[int], cap: int) -> list[Upload]:
        self.layers.add(layer)
        cand = [k for k in dict.fromkeys((layer, e) for e in experts) if k not in self.order]
        ups: list[Upload] = []
        admitted: set[Key] = set()
        for key in self._candidates(cand):
            if len(ups) >= cap:
                break
            protected = admitted.union(*self.latest.values())
            if not self.free:
                victim = self._victim(protected)
                if victim is None or not self._admits(key, victim):
                    break
            ups.append(self._fill(key, protected))
            admitted.add(key)
        return ups

    def residents(self) -> list[tuple[int, int] | None]:
        out: list[tuple[int, int] | None] = [None] * self.n_slots
        for k, slot in self.order.items():
            out[slot] = k
        return out

    def recency(self) -> list[int]:
        return list(self.order.values())


class RefAdaptive(RefLRU):
    """The adaptive rule, written from its description: a route at time t (tokens; a call of
    one of the pool's L layers lasts its tokens / L) adds 2^(t / half_life); the victim is the
    resident with the lowest sum, ties to the least recently used; ``admit`` takes the highest
    sums first, each only over a victim whose decayed count (sum / 2^(now / half_life)) it
    beats by more than ``margin`` plus 1.5 standard deviations of the difference of two
    Poisson counts, 1.5 sqrt(sum of both)."""

    def __init__(self, n_slots: int, half_life: float, margin: float) -> None:
        super().__init__(n_slots)
        self.half_life, self.margin = half_life, margin
        self.log2_unit = 0.0
        self.score: dict[Key, float] = defaultdict(float)

    def _count(self, layer: int, keys: list[Key], n_tokens: int) -> None:
        self.log2_unit += n_tokens / len(self.layers) * (1.0 / self.half_life)
        for k in keys:
            self.score[k] += 2.0**self.log2_unit

    def _victim(self, protected: set[Key]) -> Key | None:
        rank = {k: i for i, k in enumerate(self.order)}  # recency: LRU first
        open_ = [k for k in self.order if k not in protected]
        return min(open_, key=lambda k: (self.score[k], rank[k]), default=None)

    def _candidates(self, keys: list[Key]) -> list[Key]:
        return sorted(keys, key=lambda k: -self.score[k])

    def _admits(self, key: Key, victim: Key) -> bool:
        new, old = (self.score[k] / 2.0**self.log2_unit for k in (key, victim))
        return new > old + self.margin + 1.5 * math.sqrt(new + old)


def popularity(rng: np.random.Generator, n_experts: int) -> np.ndarray:
    """A skewed (Zipf 1.2) share of the routes per expert, in a random order."""
    p = 1.0 / np.arange(1, n_experts + 1) ** 1.2
    return rng.permutation(p / p.sum())


def routes(
    rng: np.random.Generator,
    n_tokens: int,
    top_k: int,
    n_experts: int,
    p: np.ndarray | None = None,
) -> np.ndarray:
    """Skewed top-k routes (distinct within a token), so that experts repeat; ``p`` the
    popularity (default: a new one)."""
    p = popularity(rng, n_experts) if p is None else p
    rows = [rng.choice(n_experts, top_k, replace=False, p=p) for _ in range(n_tokens)]
    return np.array(rows, dtype=np.int32).reshape(n_tokens, top_k)


def same_state(cache: SlotCache, ref: RefLRU) -> None:
    assert cache.residents() == ref.residents()
    assert cache.recency() == ref.recency()
    got = {la: s for la, s in cache.stats().items() if any(s)}  # type: ignore[union-attr]
    assert got == {la: SlotStats(*s) for la, s in ref.stats.items() if any(s)}


@pytest.mark.parametrize("seed", range(8))
def test_random_calls_match_the_reference_lru(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n_slots = int(rng.integers(2, 24))
    n_experts = int(rng.integers(4, 40))
    cache, ref = SlotCache(n_slots, n_experts), RefLRU(n_slots)
    refused = 0
    for _ in range(300):
        layer = int(rng.integers(0, 4))
        top_k = int(rng.integers(1, min(n_slots, n_experts, 6) + 1))
        ids = routes(rng, int(rng.integers(1, 6)), top_k, n_experts)
        op = rng.random()
        if op < 0.6:
            try:
                want = ref.place(layer, ids)
            except ShapeError:
                refused += 1
                with pytest.raises(ShapeError, match="split the batch"):
                    cache.place(layer, ids)
                same_state(cache, ref)  # a refused call changes nothing
                continue
            slots, ups = cache.place(layer, ids)
            assert slots.tolist() == np.array(want[0]).reshape(ids.shape).tolist()
            assert ups == want[1]
            # One slot per expert within the call, so no token names a slot twice.
            owner: dict[int, int] = {}
            for e, s in zip(ids.ravel().tolist(), slots.ravel().tolist(), strict=True):
                assert owner.setdefault(s, e) == e
            assert all(len(set(row)) == len(row) for row in slots.tolist())
        elif op < 0.85:
            slots, hits = cache.lookup(layer, ids)
            want_slots, want_hits = ref.lookup(layer, ids)
            assert slots.ravel().tolist() == want_slots
            assert hits == want_hits
        else:
            e = int(rng.integers(0, n_experts))
            assert cache.insert(layer, e) == ref.insert(layer, e)
        same_state(cache, ref)
    assert refused < 300


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_hybrid_steps_match_the_reference(policy: str, seed: int) -> None:
    """lookup then admit (and place, insert) against the reference of each policy."""
    rng = np.random.default_rng(100 + seed)
    n_slots = int(rng.integers(3, 20))
    n_experts = int(rng.integers(8, 40))
    if policy == "lru":
        cache, ref = SlotCache(n_slots, n_experts), RefLRU(n_slots)
    else:
        half_life, margin = float(rng.choice([32.0, 50.0, 200.0])), float(rng.choice([0.0, 1.5]))
        cache = SlotCache(n_slots, n_experts, "adaptive", half_life=half_life, margin=margin)
        ref = RefAdaptive(n_slots, half_life, margin)
    evictions = 0
    # Each layer's popularity holds for a while, so that the adaptive scores can tell.
    pops = [popularity(rng, n_experts) for _ in range(3)]
    for i in range(400):
        layer = int(rng.integers(0, 3))
        if i % 100 == 99:
            pops[layer] = popularity(rng, n_experts)
        top_k = int(rng.integers(1, min(n_slots, n_experts, 6) + 1))
        ids = routes(rng, int(rng.integers(1, 3)), top_k, n_experts, pops[layer])
        op = rng.random()
        if op < 0.7:
            slots, hits = cache.lookup(layer, ids)
            assert (slots.ravel().tolist(), hits) == ref.lookup(layer, ids)
            missed = ids[slots < 0].tolist()
            # Sometimes an expert of another layer's step or a resident, and repeats.
            missed += [int(rng.integers(0, n_experts)) for _ in range(int(rng.integers(0, 3)))]
            cap = int(rng.integers(0, 5))
            ups = cache.admit(layer, missed, cap)
            assert ups == ref.admit(layer, missed, cap)
            evictions += sum(u.evicted is not None for u in ups)
        elif op < 0.9:
            if len(set(ids.ravel().tolist())) > n_slots:
                continue
            slots, ups = cache.place(layer, ids)
            want = ref.place(layer, ids)
            assert (slots.ravel().tolist(), ups) == want
        else:
            e = int(rng.integers(0, n_experts))
            assert cache.insert(layer, e) == ref.insert(layer, e)
        same_state(cache, ref)
    assert evictions > 0


def test_policy_options_are_checked() -> None:
    assert SlotCache(4, 8).policy == "lru" and SlotCache(4, 8).policy_params is None
    c = SlotCache(4, 8, "adaptive", half_life=32, margin=0)
    params = c.policy_params
    assert c.policy == "adaptive" and params is not None
    assert (params.half_life, params.margin) == (32.0, 0.0)
    assert SlotCache(4, 8, "adaptive").policy_params is not None
    assert SlotCache(4, 8).scores(0) is None and SlotCache(4, 8).score(0, 1) is None
    bad: list[dict[str, Any]] = [
        {"policy": "lfu"},
        {"policy": "lru", "half_life": 10.0},
        {"policy": "lru", "margin": 1.0},
        {"policy": "adaptive", "half_life": 0.0},
        {"policy": "adaptive", "half_life": -5.0},
        {"policy": "adaptive", "half_life": math.nan},
        {"policy": "adaptive", "half_life": math.inf},
        {"policy": "adaptive", "margin": -1.0},
        {"policy": "adaptive", "margin": "1"},
        {"policy": "adaptive", "half_life": True},
    ]
    for kw in bad:
        with pytest.raises(InvalidInputError):
            SlotCache(4, 8, **kw)


def test_scores_halve_every_half_life_of_tokens() -> None:
    # Two layers share the pool: a token is one call of each, so 8 calls are 4 tokens.
    c = SlotCache(4, 8, "adaptive", half_life=4)
    one = np.array([[3, 5]], np.int32)
    c.lookup(0, np.array([[3, 4]], np.int32))  # layer 1 unseen yet: a call is a token
    c.lookup(1, np.array([[0, 1], [0, 2]], np.int32))  # two tokens: one route each of 1, 2
    for _ in range(4):
        c.lookup(1, np.array([[6, 7]], np.int32))
        c.lookup(0, np.array([[6, 7]], np.int32))
    # Since the first call: 2 / 2 + 4 tokens = 5 tokens: 2^-5/4. Since the second, 4 tokens.
    assert c.score(0, 3) == pytest.approx(2 ** (-5 / 4), rel=1e-12)
    assert c.score(1, 0) == pytest.approx(2 * 2**-1, rel=1e-12)
    s = c.scores(1)
    assert s is not None and s.shape == (8,)
    assert s[1] == pytest.approx(0.5, rel=1e-12) and s[3] == 0.0
    assert c.scores(9) is not None and not c.scores(9).any()  # type: ignore[union-attr]
    del one


def test_seed_rates_start_the_scores() -> None:
    c = SlotCache(4, 8, "adaptive", half_life=8)
    with pytest.raises(ShapeError):
        c.seed([(0, 1), (0, 2)], rates=[1.0])
    for bad in ([-0.5, 1.0], [math.nan, 1.0], ["x", 1.0]):
        with pytest.raises(InvalidInputError):
            c.seed([(0, 1), (0, 2)], rates=bad)
    assert c.residents() == [None] * 4
    c.seed([(0, 1), (0, 2)], rates=[0.25, 0])
    # Routed 0.25 a token at every past token, each route halving over 8 tokens.
    forever = sum(0.25 * 2 ** (-j / 8) for j in range(4000))
    assert c.score(0, 1) == pytest.approx(forever, rel=1e-12)
    assert c.score(0, 2) == 0.0
    lru = SlotCache(4, 8)
    lru.seed([(0, 1)], rates=[0.25])  # ignored
    assert lru.residents()[0] == (0, 1)


def test_admit_arguments_are_checked() -> None:
    c = SlotCache(4, 8, "adaptive")
    c.lookup(0, np.array([[1, 2]], np.int32))
    before = c.residents()
    with pytest.raises(InvalidInputError):
        c.admit(0, [1, 8])  # out of range: nothing admitted
    with pytest.raises(InvalidInputError):
        c.admit(0, [1, -1])
    with pytest.raises(InvalidInputError):
        c.admit(0, np.array([1.0, 2.0]))
    with pytest.raises(InvalidInputError):
        c.admit(0, [1], max_uploads=-1)
    assert c.residents() == before
    ups = c.admit(0, np.array([[2, 1]], np.int32), max_uploads=None)
    assert [(u.expert, u.slot, u.evicted) for u in ups] == [(2, 0, None), (1, 1, None)]
    assert c.admit(0, []) == []


def test_a_call_never_evicts_what_it_names() -> None:
    # Slots 0..3 hold experts 0..3, 0 least recently used; the call hits 0 and 1 and misses 8
    # and 9: a plain LRU would evict 0 for 8. Written out by hand from the rule.
    cache = SlotCache(4, 16)
    for e in range(4):
        cache.place(0, np.array([e], np.int32))
    slots, ups = cache.place(0, np.array([[8, 0], [9, 1]], np.int32))
    assert slots.tolist() == [[2, 0], [3, 1]]
    assert [u.evicted for u in ups] == [(0, 2), (0, 3)]
    assert cache.slot_of(0, 2) is None and cache.slot_of(0, 8) == 2


def test_bad_calls_raise_and_change_nothing() -> None:
    cache = SlotCache(3, 8)
    cache.place(1, np.array([[0, 1]], np.int32))
    before = (cache.residents(), cache.recency(), cache.stats())
    bad: list[tuple[Any, type[Exception], str]] = [
        (np.array([[0, 8]], np.int32), InvalidInputError, "out of range"),
        (np.array([[-1, 2]], np.int32), InvalidInputError, "out of range"),
        (np.array([[2, 2]], np.int32), InvalidInputError, "twice"),
        (np.array([[0, 1], [2, 3]], np.int32), ShapeError, "split the batch"),
        (np.array([[0, 1]], np.int64), InvalidInputError, "int32"),
        (np.arange(8, dtype=np.int32).reshape(2, 4)[:, ::2], InvalidInputError, "contiguous"),
        (np.zeros((1, 2, 2), np.int32), ShapeError, "tokens"),
    ]
    for ids, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            cache.place(1, ids)
    with pytest.raises(InvalidInputError, match="twice"):
        cache.lookup(1, np.array([[3, 3]], np.int32))
    with pytest.raises(ShapeError):
        cache.place(1, np.array([[0, 1]], np.int32), out=np.empty(3, np.int32))
    with pytest.raises(InvalidInputError):
        cache.place(1, np.array([[0, 1]], np.int32), out=np.empty(2, np.int64))
    ids = np.array([[4, 5]], np.int32)
    with pytest.raises(InvalidInputError, match="overlaps"):
        cache.place(1, ids, out=ids)
    with pytest.raises(InvalidInputError):
        cache.insert(1, 8)
    with pytest.raises(InvalidInputError):
        cache.insert(-1, 0)
    with pytest.raises(InvalidInputError):
        SlotCache(0, 8)
    assert (cache.residents(), cache.recency(), cache.stats()) == before


def test_split_tokens_gives_maximal_chunks_that_place_accepts() -> None:
    rng = np.random.default_rng(7)
    cache = SlotCache(6, 32)
    ids = routes(rng, 40, 4, 32)
    chunks = cache.split_tokens(ids)
    assert chunks[0][0] == 0 and chunks[-1][1] == 40
    for (a, b), (c, _) in itertools.pairwise(chunks):
        assert b == c
        assert len(set(ids[a : b + 1].ravel().tolist())) > 6  # one token more would not fit
    for a, b in chunks:
        assert len(set(ids[a:b].ravel().tolist())) <= 6
        cache.place(0, ids[a:b])
    with pytest.raises(ShapeError):
        SlotCache(3, 32).split_tokens(ids)  # a token of 4 experts cannot fit 3 slots


def test_seed_places_residents_in_order_hottest_last_evicted() -> None:
    cache = SlotCache(4, 8)
    ups = cache.seed([(2, 5), (2, 1), (3, 0)])
    assert [(u.layer, u.expert, u.slot) for u in ups] == [(2, 5, 0), (2, 1, 1), (3, 0, 2)]
    assert cache.residents() == [(2, 5), (2, 1), (3, 0), None]
    cache.place(2, np.array([[6, 7]], np.int32))  # free slot 3, then evicts the coldest
    assert cache.residents() == [(2, 5), (2, 1), (2, 7), (2, 6)]
    with pytest.raises(InvalidInputError, match="empty"):
        cache.seed([(0, 0)])
    cache.clear()
    with pytest.raises(InvalidInputError, match="twice"):
        cache.seed([(0, 0), (0, 0)])
    with pytest.raises(ShapeError):
        cache.seed([(0, e) for e in range(5)])
    cache.reset_stats()
    assert all(s == SlotStats(0, 0, 0, 0, 0) for s in cache.stats().values())


# --- plan_pools ------------------------------------------------------------------------------


def spec(layer: int, qtype: str, n: int, k: int, n_experts: int, top_k: int) -> LayerSpec:
    """gate and up (n, k), down (k, n)."""
    return LayerSpec.from_shapes(layer, [qtype] * 3, [(n, k), (n, k), (k, n)], n_experts, top_k)


def qwen_like(n_layers: int = 48) -> list[LayerSpec]:
    types = ["Q4_K", "Q4_K", "Q6_K"]
    shapes = [(768, 2048), (768, 2048), (2048, 768)]
    return [LayerSpec.from_shapes(la, types, shapes, 128, 8) for la in range(n_layers)]


def test_layer_spec_from_shapes_matches_gguf_sizes() -> None:
    s = qwen_like(1)[0]
    q4, q6 = gguf.GGMLQuantizationType.Q4_K, gguf.GGMLQuantizationType.Q6_K
    (b4, t4), (b6, t6) = gguf.GGML_QUANT_SIZES[q4], gguf.GGML_QUANT_SIZES[q6]
    n = 768 * 2048
    assert s.types == (int(q4), int(q4), int(q6))
    assert s.blocks == (n // b4, n // b4, n // b6)
    assert s.expert_bytes == 2 * n // b4 * t4 + n // b6 * t6


def check_plan(plan: Any, specs: list[LayerSpec], budget: int) -> None:
    """What every plan must satisfy, from the specs alone."""
    by_layer = {s.layer: s for s in specs}
    served = [la for p in plan.pools for la in p.layers]
    assert sorted(served) == sorted(by_layer)  # every layer in exactly one pool
    assert plan.used_bytes <= budget
    assert sum(p.bytes for p in plan.pools) == plan.used_bytes
    for p in plan.pools:
        layer_specs = {by_layer[la] for la in p.layers}
        keys = {(s.types, s.blocks, s.n_experts, s.top_k) for s in layer_specs}
        assert keys == {(p.types, p.blocks, p.n_experts, p.top_k)}
        assert p.n_slots * p.expert_bytes <= p.bytes <= p.n_slots * p.expert_bytes + TAIL_BOUND
        assert p.top_k <= p.n_slots <= len(p.layers) * p.n_experts
        assert p.n_slots * max(p.blocks) <= MAX_BLOCKS
        assert len(set(p.residents)) == len(p.residents) <= p.n_slots
        assert all(la in p.layers and 0 <= e < p.n_experts for la, e in p.residents)
    # Greedy to the end: no pool with room could take one more expert.
    left = budget - plan.used_bytes
    for p in plan.pools:
        if p.n_slots < len(p.layers) * p.n_experts and (p.n_slots + 1) * max(p.blocks) <= (
            MAX_BLOCKS
        ):
            assert left < p.expert_bytes


def test_equal_sizing_one_pool_per_type() -> None:
    specs = qwen_like()
    e = specs[0].expert_bytes
    budget = 4096 * MIB
    plan = plan_pools(specs, budget)
    check_plan(plan, specs, budget)
    assert len(plan.pools) == 1 and plan.pools[0].layers == tuple(range(48))
    assert plan.pools[0].n_slots == (budget - TAIL_BOUND) // e  # tails are under an expert
    assert plan.pools[0].residents == () and not plan.all_resident
    assert "4096.0 MiB" in plan.explanation and f"{plan.pools[0].n_slots} slots" in (
        plan.explanation
    )


def test_mixed_types_get_the_same_share_of_their_experts() -> None:
    # Unsloth-style: some layers' experts in another type, hence another pool.
    specs = [spec(la, "Q8_0" if la % 3 == 0 else "Q4_0", 512, 1024, 64, 4) for la in range(12)]
    for frac in (0.1, 0.25, 0.5, 0.9):
        budget = int(frac * sum(s.n_experts * s.expert_bytes for s in specs))
        plan = plan_pools(specs, budget)
        check_plan(plan, specs, budget)
        assert len(plan.pools) == 2
        shares = [p.n_slots / (len(p.layers) * p.n_experts) for p in plan.pools]
        # Equal shares, up to a round of one expert per layer and one expert of leftover.
        assert abs(shares[0] - shares[1]) <= 2 / 64 + 1e-9, (frac, shares)


def test_per_layer_scope_one_pool_per_layer_equal_sizes() -> None:
    specs = qwen_like(6)
    budget = 200 * MIB
    plan = plan_pools(specs, budget, scope="per-layer")
    check_plan(plan, specs, budget)
    assert [p.layers for p in plan.pools] == [(la,) for la in range(6)]
    sizes = [p.n_slots for p in plan.pools]
    assert max(sizes) - min(sizes) <= 1
    with pytest.raises(InvalidInputError, match="scope"):
        plan_pools(specs, budget, scope="global")


def test_too_small_a_budget_names_the_minimum() -> None:
    specs = qwen_like(4)
    for scope, n_pools in (("type", 1), ("per-layer", 4)):
        need = n_pools * 8 * specs[0].expert_bytes  # top-k experts per pool, tails aside
        with pytest.raises(InvalidInputError, match="at least") as e:
            plan_pools(specs, need - 1, scope=scope)
        mib = int(re.search(r"at least (\d+) MiB", str(e.value)).group(1))  # type: ignore[union-attr]
        assert mib == math.ceil(need / MIB) or mib == math.ceil((need + TAIL_BOUND) / MIB)
        plan = plan_pools(specs, mib * MIB, scope=scope)
        assert all(p.n_slots >= 8 for p in plan.pools)
        with pytest.raises(InvalidInputError):
            plan_pools(specs, (mib - 1) * MIB, scope=scope)


def test_pools_split_into_whole_layers_under_2_31_blocks() -> None:
    # Q8_0 experts of 3 x 4096 x 16384 / 32 = 2^21 blocks a matrix: 1023 slots a tensor at most.
    specs = [spec(la, "Q8_0", 4096, 16384, 256, 8) for la in range(8)]
    all_bytes = sum(s.n_experts * s.expert_bytes for s in specs)
    assert (MAX_BLOCKS // specs[0].blocks[0]) == 1023
    # A third of the experts (682 slots) fits one pool; three quarters (1536) needs two.
    plan = plan_pools(specs, all_bytes // 3)
    check_plan(plan, specs, all_bytes // 3)
    assert len(plan.pools) == 1 and plan.pools[0].n_slots == 682
    plan = plan_pools(specs, all_bytes * 3 // 4)
    check_plan(plan, specs, all_bytes * 3 // 4)
    assert [p.layers for p in plan.pools] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert "2^31" in plan.explanation
    # Everything: four layers would be 1024 slots, one too many: pools of two layers.
    plan = plan_pools(specs, all_bytes + 8 * TAIL_BOUND)
    check_plan(plan, specs, all_bytes + 8 * TAIL_BOUND)
    assert plan.all_resident
    assert [len(p.layers) for p in plan.pools] == [2, 2, 2, 2]


def test_every_expert_fits_identity_placement() -> None:
    specs = qwen_like(3)
    all_bytes = sum(s.n_experts * s.expert_bytes for s in specs)
    plan = plan_pools(specs, all_bytes + TAIL_BOUND)
    check_plan(plan, specs, all_bytes + TAIL_BOUND)
    assert plan.all_resident
    (pool,) = plan.pools
    assert pool.n_slots == 3 * 128
    assert pool.residents == tuple((la, e) for la in range(3) for e in range(128))
    assert "every expert" in plan.explanation
    cache = SlotCache(pool.n_slots, pool.n_experts)
    cache.seed(pool.residents)
    ids = np.array([[5, 9], [127, 0]], np.int32)
    slots, ups = cache.place(2, ids)
    assert ups == [] and slots.tolist() == (ids + 2 * 128).tolist()
    plan = plan_pools(specs, all_bytes - 1)
    assert not plan.all_resident and plan.pools[0].residents == ()


def profile_doc(counts: dict[int, list[int]], n_experts: int, top_k: int) -> dict[str, Any]:
    """A profile in the format of docs/expert-profile.md."""
    layers = [{"layer": la, "routes": sum(c), "counts": c} for la, c in counts.items()]
    model = {"file": "m.gguf", "name": "m", "architecture": "qwen3moe", "n_layers": 50}
    model |= {"n_experts": n_experts, "top_k": top_k}
    tokens = sum(counts[min(counts)]) // top_k
    head = {"format": "freetoken.expert-profile", "version": 1, "model": model}
    return head | {"tokens": tokens, "layers": layers}


def value(counts: list[int], e: int, top_k: int) -> float:
    """Expected routes per token to expert e, smoothed as the planner's doc says."""
    return top_k * (counts[e] + 1) / (sum(counts) + len(counts))


@pytest.mark.parametrize("scope", ["type", "per-layer"])
def test_profile_seeds_the_hottest_experts(scope: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    specs = qwen_like(6)
    counts = {la: (rng.zipf(1.3 + 0.2 * la, 128) * 3).clip(0, 10**6).tolist() for la in range(6)}
    doc = profile_doc(counts, 128, 8)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    budget = 300 * MIB
    plan = plan_pools(specs, budget, scope=scope, profile=path, architecture="qwen3moe")
    check_plan(plan, specs, budget)
    assert plan_pools(specs, budget, scope=scope, profile=doc) == plan
    taken = {(la, e) for p in plan.pools for la, e in p.residents}
    assert len(taken) == sum(p.n_slots for p in plan.pools)  # the pools are filled
    vals = {(la, e): value(counts[la], e, 8) for la in range(6) for e in range(128)}
    # Beyond each pool's first top-k, the residents are the globally hottest: nothing left
    # out is hotter than anything taken there.
    extra = [k for p in plan.pools for k in p.residents[p.top_k :]]
    out = [v for k, v in vals.items() if k not in taken]
    if extra and out:
        assert min(vals[k] for k in extra) >= max(out) - 1e-12
    for p in plan.pools:
        pv = [vals[k] for k in p.residents]
        assert pv == sorted(pv, reverse=True)  # hottest first
        routes = sum(sum(counts[la]) for la in p.layers)
        covered = sum(counts[la][e] for la, e in p.residents)
        assert p.coverage == pytest.approx(covered / routes)


def test_profile_gives_flat_layers_the_slots() -> None:
    # Layer 0 routes only to experts 3 and 6; layer 1 routes evenly: with room for 2 x 2
    # mandatory slots and 6 more, all 6 go to layer 1 (its experts carry 2/8 of a route each,
    # layer 0's unused ones 2/(N + 8) for N profiled routes).
    specs = [spec(la, "Q4_0", 256, 512, 8, 2) for la in range(2)]
    counts = {0: [0, 0, 0, 500, 0, 0, 500, 0], 1: [100] * 8}
    doc = profile_doc(counts, 8, 2)
    e = specs[0].expert_bytes
    plan = plan_pools(specs, 10 * e + 2 * TAIL_BOUND, scope="per-layer", profile=doc)
    assert [p.n_slots for p in plan.pools] == [2, 8]
    assert set(plan.pools[0].residents) == {(0, 3), (0, 6)}
    assert plan.pools[0].coverage == 1.0 and plan.pools[1].coverage == 1.0
    cache = SlotCache(plan.pools[0].n_slots, 8)
    cache.seed(plan.pools[0].residents)
    slots, ups = cache.place(0, np.array([[6, 3]], np.int32))
    assert ups == [] and sorted(slots.ravel().tolist()) == [0, 1]


def test_profile_is_checked_against_the_model(tmp_path: Path) -> None:
    specs = qwen_like(2)
    good = profile_doc({0: [1] * 128, 1: [2] * 128}, 128, 8)
    bad: list[tuple[dict[str, Any], type[Exception], str]] = [
        (good | {"format": "something"}, InvalidInputError, "not an expert-use profile"),
        (good | {"version": 2}, UnsupportedError, "version 2"),
        (good | {"model": good["model"] | {"n_experts": 64}}, InvalidInputError, "n_experts"),
        (good | {"model": good["model"] | {"top_k": 4}}, InvalidInputError, "top_k"),
        (good | {"model": good["model"] | {"architecture": "x"}}, InvalidInputError, "arch"),
        (good | {"layers": [{"layer": 7, "counts": [0] * 128}]}, InvalidInputError, "layer 7"),
        (good | {"layers": [{"layer": 0, "counts": [0] * 127}]}, InvalidInputError, "127"),
        (good | {"layers": [{"layer": 0, "counts": [-1] * 128}]}, InvalidInputError, "non-neg"),
        (
            good | {"layers": [{"layer": 0, "routes": 5, "counts": [0] * 128}]},
            InvalidInputError,
            "routes",
        ),
        (good | {"layers": [good["layers"][0]] * 2}, InvalidInputError, "twice"),
    ]
    for doc, exc, msg in bad:
        with pytest.raises(exc, match=msg):
            plan_pools(specs, 1 << 30, profile=doc, architecture="qwen3moe")
    with pytest.raises(InvalidInputError, match="n_layers"):
        plan_pools(specs, 1 << 30, profile=good, n_layers=2)
    with pytest.raises(FileAccessError):
        plan_pools(specs, 1 << 30, profile=tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(InvalidInputError, match="JSON"):
        plan_pools(specs, 1 << 30, profile=tmp_path / "bad.json")
    # A profile lacking a layer is fine: that layer is taken as uniform.
    plan = plan_pools(specs, 100 * MIB, profile=good | {"layers": good["layers"][:1]})
    assert "without counts" in plan.explanation
