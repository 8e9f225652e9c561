"""The GPU expert slot cache's bookkeeping and sizing (the Rust core does the work).

A *slot pool* holds expert matrices on the GPU, ``n_slots`` of them per (gate, up, down)
tensor; :class:`SlotCache` tracks which (layer, expert) sits in which slot, chooses what to
evict (the least recently used, or with ``policy="adaptive"`` the expert with the lowest aged
route count), and tells the caller what to upload. :func:`plan_pools` decides the pools
from a byte budget (``--moe-cache-mib``), a scope (``--moe-cache-scope``) and optionally an
expert-use profile (``--moe-cache-profile``, docs/expert-profile.md)::

    plan = plan_pools(specs, 8 << 30, profile="profile.json")
    print(plan.explanation)
    for pool in plan.pools:
        cache = SlotCache(pool.n_slots, pool.n_experts)
        uploads = cache.seed(pool.residents)      # copy these experts in, then decode:
    slots, uploads = cache.place(layer, ids)      # ids: int32 (tokens, top_k)

Hybrid decode looks up, runs the hits on the GPU and the misses on the CPU, then (off the
critical path) asks which misses to upload::

    cache = SlotCache(pool.n_slots, pool.n_experts, policy="adaptive")
    slots, hits = cache.lookup(layer, ids)
    uploads = cache.admit(layer, ids[slots < 0], max_uploads=4)

Route ids and slots are int32 numpy arrays of shape ``(tokens, top_k)``, C-contiguous (a 1-D
array is one token). Within one ``place`` call no slot is given to two experts, so a token
never names one slot twice (the guard ggml-cuda's MMQ needs).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from freetoken import _core
from freetoken.errors import (
    InvalidInputError,
    ShapeError,
)
from freetoken.quant import QType, type_info
from freetoken.runtime.expert_profile import load_profile

__all__ = [
    "POLICIES",
    "CachePlan",
    "LayerSpec",
    "PoolPlan",
    "SlotCache",
    "SlotStats",
    "Upload",
    "load_profile",
    "plan_pools",
]

SCOPES = ("type", "per-layer")
#: Replacement policies of :class:`SlotCache` (crates/ft-core/src/slot_policy.rs).
POLICIES = ("lru", "adaptive")


class Upload(NamedTuple):
    """An expert to copy into ``slot`` before the GPU reads it; ``evicted`` is the
    (layer, expert) the slot held before, if any."""

    layer: int
    expert: int
    slot: int
    evicted: tuple[int, int] | None


class SlotStats(NamedTuple):
    """One layer's counters. ``hits`` and ``misses`` count distinct experts per call (an
    expert shared by several tokens is read once); ``uploads`` experts copied in (misses of
    ``place``, ``insert``, ``seed``); ``evictions`` this layer's experts pushed out."""

    calls: int
    hits: int
    misses: int
    uploads: int
    evictions: int


def _upload(u: _core.Upload) -> Upload:
    return Upload(u.layer, u.expert, u.slot, u.evicted)


def _stats(s: _core.SlotStats) -> SlotStats:
    return SlotStats(s.calls, s.hits, s.misses, s.uploads, s.evictions)


def _ids(ids: Any) -> np.ndarray:
    a = np.asarray(ids)
    if a.dtype != np.int32:
        raise InvalidInputError(f"expert ids must be int32, got {a.dtype}")
    if a.ndim == 1:
        a = a.reshape(1, -1)
    if a.ndim != 2:
        raise ShapeError(f"expert ids must be (tokens, top_k), got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise InvalidInputError("expert ids must be C-contiguous")
    return a


def _out(out: np.ndarray | None, ids: np.ndarray) -> np.ndarray:
    if out is None:
        return np.empty(ids.shape, dtype=np.int32)
    if not isinstance(out, np.ndarray) or out.dtype != np.int32:
        raise InvalidInputError("the slots output must be an int32 numpy array")
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise InvalidInputError("the slots output must be C-contiguous and writable")
    if out.size != ids.size:
        raise ShapeError(f"the slots output has {out.size} entries for {ids.size} ids")
    return out


def _index(value: int, what: str) -> int:
    if int(value) < 0:
        raise InvalidInputError(f"{what} must be non-negative, got {value}")
    return int(value)


def _number(value: float | None, what: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidInputError(f"{what} must be a number, got {type(value).__name__}")
    return float(value)


def _rate(value: float) -> float:
    rate = _number(value, "a rate")
    if rate is None:
        raise InvalidInputError("a rate must be a number, got None")
    return rate


def _triple(values: Sequence[int]) -> tuple[int, int, int]:
    """(gate, up, down) values."""
    a, b, c = values
    return (int(a), int(b), int(c))


class SlotCache:
    """The bookkeeping of one slot pool of ``n_slots`` slots, shared by any number of layers
    of ``n_experts`` experts each.

    ``policy`` picks what is evicted: ``"lru"`` (the least recently used slot) or
    ``"adaptive"``: every route that :meth:`lookup` or :meth:`place` sees adds one to its
    expert's score, which halves every ``half_life`` tokens; the resident with the lowest
    score goes first, and :meth:`admit` uploads a miss into a full pool only when its score
    beats that resident's by more than ``margin`` routes (defaults 128 tokens and 2 routes;
    benches/README.md, "Expert cache policy (simulation)", compares the policies). Within a
    :meth:`place` call, hits are used first, then each miss takes the lowest free slot, else
    the victim among the slots the call does not name."""

    def __init__(
        self,
        n_slots: int,
        n_experts: int,
        policy: str = "lru",
        *,
        half_life: float | None = None,
        margin: float | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise InvalidInputError(f"slot cache policy {policy!r} is not one of {POLICIES}")
        self._c = _core.SlotCache(
            _index(n_slots, "n_slots"),
            _index(n_experts, "n_experts"),
            policy,
            _number(half_life, "half_life"),
            _number(margin, "margin"),
        )

    @property
    def policy(self) -> str:
        """``"lru"`` or ``"adaptive"``."""
        return self._c.policy

    @property
    def policy_params(self) -> _core.AdaptiveParams | None:
        """The adaptive policy's ``half_life`` and ``margin``; None under LRU."""
        return self._c.policy_params

    @property
    def n_slots(self) -> int:
        """Slots in the pool."""
        return self._c.n_slots

    @property
    def n_experts(self) -> int:
        """Experts per layer."""
        return self._c.n_experts

    def place(
        self, layer: int, ids: Any, out: np.ndarray | None = None
    ) -> tuple[np.ndarray, list[Upload]]:
        """``offload``: gives every expert of one call's routes a slot. ``ids`` is int32
        ``(tokens, top_k)``; a 1-D array is one token, not flattened routes. Returns each route's
        slot (into ``out`` if given) and the uploads to perform first. Raises, changing
        nothing, on an id out of range, a token naming an expert twice, or more distinct
        experts than slots (ShapeError: split the batch with :meth:`split_tokens`)."""
        a = _ids(ids)
        o = _out(out, a)
        ups = self._c.place(_index(layer, "layer"), a, a.shape[1], o)
        return o, [_upload(u) for u in ups]

    def lookup(self, layer: int, ids: Any, out: np.ndarray | None = None) -> tuple[np.ndarray, int]:
        """``hybrid``: the slots of the resident experts (touched as recently used), -1 for
        the others, nothing inserted. Returns the slots and how many routes hit."""
        a = _ids(ids)
        o = _out(out, a)
        return o, self._c.lookup(_index(layer, "layer"), a, a.shape[1], o)

    def insert(self, layer: int, expert: int) -> Upload | None:
        """Makes one expert resident: None if it already is (then touched), else the upload,
        which may evict the policy's victim with no admission test and nothing protected: do
        not insert while a computation still reads that slot (:meth:`admit` protects)."""
        u = self._c.insert(_index(layer, "layer"), _index(expert, "expert"))
        return None if u is None else _upload(u)

    def admit(self, layer: int, experts: Any, max_uploads: int | None = None) -> list[Upload]:
        """``hybrid`` fill after a step's :meth:`lookup`: which of ``experts`` (the step's
        misses, any int sequence or array; residents and repeats are skipped) to upload, at
        most ``max_uploads`` (None: no cap), and where. Free slots are always taken; once the
        pool is full, LRU admits each in order over the least recently used resident, the
        adaptive policy the highest-scored first, each only over a resident it out-scores by
        the margin. Never evicts what the latest lookup or place of any layer named, nor what
        this call uploads."""
        a = np.asarray(experts)
        if a.size and not np.issubdtype(a.dtype, np.integer):
            raise InvalidInputError(f"expert ids must be integers, got {a.dtype}")
        ex = [_index(e, "expert") for e in a.ravel().tolist()]
        cap = len(ex) if max_uploads is None else _index(max_uploads, "max_uploads")
        return [_upload(u) for u in self._c.admit(_index(layer, "layer"), ex, cap)]

    def score(self, layer: int, expert: int) -> float | None:
        """The adaptive policy's aged route count of one expert; None under LRU."""
        return self._c.score(_index(layer, "layer"), _index(expert, "expert"))

    def scores(self, layer: int) -> np.ndarray | None:
        """Every expert's aged route count in ``layer`` (float64); None under LRU."""
        s = self._c.scores(_index(layer, "layer"))
        return None if s is None else np.asarray(s, dtype=np.float64)

    def seed(
        self, residents: Sequence[tuple[int, int]], rates: Sequence[float] | None = None
    ) -> list[Upload]:
        """Fills an empty pool: ``residents[i]`` (layer, expert) goes to slot ``i``, listed
        hottest first (``residents[0]`` is the most recently used), as
        :attr:`PoolPlan.residents` lists them. Returns the uploads.

        ``rates`` (adaptive policy; ignored under LRU): each resident's routes per token in the
        profile (its count over the profiled tokens). Its score then starts where an expert
        routed that often would have it, so that early misses do not displace the profile's
        experts before their own routes are counted."""
        pairs = [(_index(la, "layer"), _index(e, "expert")) for la, e in residents]
        r = None if rates is None else [_rate(x) for x in rates]
        return [_upload(u) for u in self._c.seed(pairs, r)]

    def split_tokens(self, ids: Any) -> list[tuple[int, int]]:
        """Token ranges ``[start, stop)`` that each name at most ``n_slots`` distinct
        experts, as long as possible: how to split a batch :meth:`place` refuses."""
        a = _ids(ids)
        return self._c.split_tokens(a, a.shape[1])

    def slot_of(self, layer: int, expert: int) -> int | None:
        """The slot holding the expert, or None (does not count as a use)."""
        return self._c.slot_of(_index(layer, "layer"), _index(expert, "expert"))

    def residents(self) -> list[tuple[int, int] | None]:
        """Per slot, the (layer, expert) it holds."""
        return self._c.residents()

    def recency(self) -> list[int]:
        """The occupied slots, least recently used first."""
        return self._c.recency()

    def stats(self, layer: int | None = None) -> SlotStats | dict[int, SlotStats]:
        """One layer's counters, or every layer's (by layer) when ``layer`` is None."""
        if layer is None:
            return {la: _stats(s) for la, s in self._c.all_stats()}
        return _stats(self._c.stats(_index(layer, "layer")))

    def reset_stats(self) -> None:
        """Zeroes every layer's counters."""
        self._c.reset_stats()

    def clear(self) -> None:
        """Empties the pool; the counters stay."""
        self._c.clear()


class LayerSpec(NamedTuple):
    """One MoE layer for :func:`plan_pools`: ggml type ids of its (gate, up, down) expert
    matrices, the bytes of one expert (all three), the blocks of each matrix of one expert."""

    layer: int
    types: tuple[int, int, int]
    expert_bytes: int
    blocks: tuple[int, int, int]
    n_experts: int
    top_k: int

    @classmethod
    def from_shapes(
        cls,
        layer: int,
        types: Sequence[QType],
        shapes: Sequence[tuple[int, int]],
        n_experts: int,
        top_k: int,
    ) -> LayerSpec:
        """From the (gate, up, down) types and the ``(rows, K)`` shape of one expert's
        matrices."""
        if len(types) != 3 or len(shapes) != 3:
            raise ShapeError("a layer spec needs the gate, up and down types and shapes")
        infos = [type_info(t) for t in types]
        nbytes = sum(i.row_size(k) * n for i, (n, k) in zip(infos, shapes, strict=True))
        g, u, d = (n * k // i.block_size for i, (n, k) in zip(infos, shapes, strict=True))
        ids = (infos[0].id, infos[1].id, infos[2].id)
        return cls(layer, ids, nbytes, (g, u, d), n_experts, top_k)


@dataclass(frozen=True)
class PoolPlan:
    """One slot pool: its key (``types``), the layers it serves, its size, and the experts to
    seed it with (slot ``i`` holds ``residents[i]``; hottest first from a profile, every
    expert in layer-then-expert order when all are resident, else none). ``bytes`` is its
    share of the budget (slots and zeroed tensor tails); ``coverage`` the share of its
    layers' profiled routes the residents cover."""

    types: tuple[int, int, int]
    layers: tuple[int, ...]
    n_experts: int
    top_k: int
    expert_bytes: int
    blocks: tuple[int, int, int]
    n_slots: int
    bytes: int
    residents: tuple[tuple[int, int], ...]
    coverage: float | None


@dataclass(frozen=True)
class CachePlan:
    """The pools, the bytes they use out of the budget, the minimum budget (``top_k`` slots
    per pool) and the bytes of every expert; ``all_resident`` means the budget holds every
    expert (the ``gpu`` strategy); ``explanation`` is the arithmetic in words."""

    pools: tuple[PoolPlan, ...]
    budget_bytes: int
    used_bytes: int
    min_bytes: int
    all_bytes: int
    all_resident: bool
    explanation: str

    def pool_of(self, layer: int) -> int:
        """The index of the pool serving ``layer``."""
        for i, p in enumerate(self.pools):
            if layer in p.layers:
                return i
        raise InvalidInputError(f"layer {layer} is not served by any pool")


def plan_pools(
    layers: Sequence[LayerSpec],
    budget_bytes: int,
    *,
    scope: str = "type",
    profile: Mapping[str, Any] | str | os.PathLike[str] | None = None,
    architecture: str | None = None,
    n_layers: int | None = None,
) -> CachePlan:
    """Plans the slot pools of the MoE ``layers`` within ``budget_bytes``.

    ``scope`` is ``"type"`` (layers with the same expert types and shapes share a pool) or
    ``"per-layer"``. Without a profile every layer gets the same share of its experts; with
    one (see :func:`load_profile`; ``architecture`` and ``n_layers`` are checked against it)
    the experts with the most routes over all layers are taken first and seed the pools.
    Every pool gets at least ``top_k`` slots (InvalidInputError naming the minimum MiB
    otherwise); a pool over 2^31 blocks per tensor is split into pools of whole layers. The
    rule in full: ``crates/ft-core/src/cache_plan.rs``.
    """
    if scope not in SCOPES:
        raise InvalidInputError(f"cache scope {scope!r} is not one of {SCOPES}")
    specs = [LayerSpec(*s) for s in layers]
    counts: list[list[int]] | None = None
    if profile is not None:
        by_layer = load_profile(profile, specs, architecture=architecture, n_layers=n_layers)
        counts = [[] for _ in range(max(by_layer, default=-1) + 1)]
        for layer, c in by_layer.items():
            counts[layer] = c
    rows = [
        (_index(layer, "layer"), _triple(types), nbytes, _triple(blocks), n_experts, top_k)
        for layer, types, nbytes, blocks, n_experts, top_k in specs
    ]
    plan = _core.plan_pools(rows, _index(budget_bytes, "budget_bytes"), scope, counts)
    return CachePlan(
        pools=tuple(
            PoolPlan(
                types=_triple(p.types),
                layers=tuple(p.layers),
                n_experts=p.n_experts,
                top_k=p.top_k,
                expert_bytes=p.expert_bytes,
                blocks=_triple(p.blocks),
                n_slots=p.n_slots,
                bytes=p.bytes,
                residents=tuple(p.residents),
                coverage=p.coverage,
            )
            for p in plan.pools
        ),
        budget_bytes=int(budget_bytes),
        used_bytes=plan.used,
        min_bytes=plan.min_bytes,
        all_bytes=plan.all_bytes,
        all_resident=plan.all_resident,
        explanation=plan.explanation,
    )
