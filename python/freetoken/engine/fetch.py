"""The fetch share of ``hybrid``'s steps of several tokens: how many of a MoE layer's missed
experts to upload over PCIe and compute on the GPU while the CPU expert executor computes the
others, so that both sides finish together (docs/hybrid.md, "Fetching part of the misses").

The model, per layer and step: each missed expert is read once by the side that computes it
(the executor groups a step's routes by expert), ``S`` bytes. Uploading ``n_f`` of them takes
``n_f S / B_pcie`` and the GPU then computes them in ``n_f S / B_gpu``; the CPU reads the
other ``n_c = n - n_f`` in ``n_c S / B_cpu``. The layer's time is the larger of the two, plus
a fixed cost when anything is fetched (the copy kernel's start and its first round trip over
PCIe). Each ``B`` is the layer kind's ``bench-bw`` figure: with the other link busy when both run
(``cpu_t1_with_gather``, ``pcie_gather_with_cpu``), alone when one side has nothing
(``b_cpu_gbps``: the CPU while the GPU computes the hits; ``pcie_gather``). The upload is
the fetch kernel's (the GPU's threads read the mapped experts, since only the device knows
which to fetch), which reads host memory at its own rate (22-26 GB/s on one H100 host, at
the copy engine's on another); a profile without it prices the upload at the one-expert
copies' figures. The rule takes
the whole number of experts with the least time, the fewest uploads among equals; the experts
with the most routes go first (the GPU computes many routes of an expert for little more than
one, the CPU does not). Above 8 tokens a step (``price_routes``) each CPU route is priced as
one expert read instead, as the stream-or-split rule prices it (docs/hybrid.md): the CPU
computing many tokens an expert is bound by its arithmetic.

This module is pure: numbers in, a :class:`FetchChoice` out. The engine runs the same rule
on the device on each layer's actual routes (``gpu.fetch_plan``); here it prices expected
steps (:func:`expect_step`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from freetoken.errors import InvalidInputError

if TYPE_CHECKING:
    from freetoken.engine.bandwidth_profile import KindBandwidth

__all__ = [
    "DEFAULT_B_CPU",
    "DEFAULT_B_GPU",
    "DEFAULT_B_PCIE",
    "FETCH_OVERHEAD_S",
    "FetchChoice",
    "Links",
    "choose_fetch",
    "expect_step",
    "step_bucket",
]

#: Bandwidths assumed without a ``bench-bw`` profile, GB/s: the CPU expert kernels, pinned
#: host-to-GPU copies, the GPU expert kernels.
DEFAULT_B_CPU, DEFAULT_B_PCIE, DEFAULT_B_GPU = 50.0, 25.0, 1000.0
#: Time a layer pays when it fetches at all: the copy kernel's start and its first round
#: trip over PCIe, after which the copies stream (an estimate).
FETCH_OVERHEAD_S = 20e-6
#: Upper bounds of the step-size buckets the fetch counters are kept in (tokens a step).
BUCKETS = (1, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass(frozen=True)
class Links:
    """One layer kind's bandwidths, GB/s: each link alone and while the other one runs.
    ``pcie`` is the fetch's upload (the fetch kernel's reads when measured), ``stream`` the
    copy engine's, which streamed layers use (None: ``pcie``)."""

    cpu: float
    pcie: float
    gpu: float
    cpu_with_pcie: float
    pcie_with_cpu: float
    stream: float | None = None

    @classmethod
    def of(cls, kind: KindBandwidth | None) -> Links:
        """From a layer kind's ``bench-bw`` figures; what was not measured is assumed: the
        fetch kernel's figures from the copy engine's, a link's figure together from its
        figure alone, and the defaults above for the rest."""
        if kind is None:
            return cls(DEFAULT_B_CPU, DEFAULT_B_PCIE, DEFAULT_B_GPU, DEFAULT_B_CPU, DEFAULT_B_PCIE)
        copies = kind.b_pcie_gbps or DEFAULT_B_PCIE
        if kind.b_gather_gbps is not None:
            pcie, pcie_with_cpu = kind.b_gather_gbps, kind.b_gather_with_cpu_gbps
            cpu_with_pcie = kind.b_cpu_with_gather_gbps
        else:
            pcie, pcie_with_cpu = copies, kind.b_pcie_with_cpu_gbps
            cpu_with_pcie = kind.b_cpu_with_pcie_gbps
        return cls(
            cpu=kind.b_cpu_gbps,
            pcie=pcie,
            gpu=kind.b_gpu_gbps or DEFAULT_B_GPU,
            cpu_with_pcie=cpu_with_pcie or kind.b_cpu_gbps,
            pcie_with_cpu=pcie_with_cpu or pcie,
            stream=copies,
        )


@dataclass(frozen=True)
class FetchChoice:
    """Which missed experts a layer uploads: the first ``n_fetch`` of ``order`` (the missed
    experts, most routes first); the routes and bytes on each side, and the model's times."""

    order: np.ndarray
    routes: np.ndarray
    n_fetch: int
    expert_bytes: int
    upload_s: float
    cpu_s: float

    @property
    def fetched(self) -> np.ndarray:
        """The experts to upload."""
        return self.order[: self.n_fetch]

    @property
    def share(self) -> float:
        """Uploaded experts over missed experts (0 when nothing missed)."""
        return self.n_fetch / len(self.order) if len(self.order) else 0.0

    @property
    def fetch_routes(self) -> int:
        return int(self.routes[: self.n_fetch].sum())

    @property
    def cpu_routes(self) -> int:
        return int(self.routes[self.n_fetch :].sum())

    @property
    def fetch_bytes(self) -> int:
        return self.n_fetch * self.expert_bytes

    @property
    def cpu_bytes(self) -> int:
        return (len(self.order) - self.n_fetch) * self.expert_bytes


def _times(reads: np.ndarray, expert_bytes: int, links: Links) -> tuple[np.ndarray, np.ndarray]:
    """(upload + GPU seconds, CPU seconds) of fetching the first 0..n of ``n`` missed experts
    that the CPU would read ``reads[i]`` times each."""
    n = len(reads)
    n_f = np.arange(n + 1, dtype=np.float64)
    left = reads.sum() - np.concatenate([[0.0], np.cumsum(reads)])  # CPU reads left
    both = (n_f > 0) & (n_f < n)
    b_pcie = np.where(both, links.pcie_with_cpu, links.pcie)
    b_cpu = np.where(both, links.cpu_with_pcie, links.cpu)
    upload = n_f * expert_bytes * (1 / b_pcie + 1 / links.gpu) / 1e9
    return upload, left * expert_bytes / b_cpu / 1e9


def choose_fetch(
    experts: np.ndarray,
    routes: np.ndarray,
    expert_bytes: int,
    links: Links,
    *,
    share: float | None = None,
    max_fetch: int | None = None,
    overhead_s: float = FETCH_OVERHEAD_S,
    price_routes: bool = False,
) -> FetchChoice:
    """The fetch choice of one layer's missed ``experts`` (ids), ``routes[i]`` routes each,
    ``expert_bytes`` an expert: the fastest split by the model (module docs), or the
    ``share`` forced (``--moe-fetch-share``: that fraction of the missed experts, rounded).
    At most ``max_fetch`` experts are fetched (the staging room). ``price_routes`` prices
    each of the CPU's routes as one expert read instead of each expert as one (the CPU
    computing many tokens is bound by its arithmetic, not its reads)."""
    experts = np.asarray(experts, dtype=np.int64)
    routes = np.asarray(routes, dtype=np.float64)
    if experts.shape != routes.shape or experts.ndim != 1:
        raise InvalidInputError(f"{experts.shape} experts with {routes.shape} route counts")
    if share is not None and not 0.0 <= share <= 1.0:
        raise InvalidInputError(f"a fetch share must be within 0-1, got {share}")
    order_ix = np.lexsort((experts, -routes))  # most routes first, then by id
    order, counts = experts[order_ix], routes[order_ix]
    n = len(order)
    cap = n if max_fetch is None else max(0, min(n, max_fetch))
    upload, cpu = _times(counts if price_routes else np.ones(n), expert_bytes, links)
    if share is not None:
        n_fetch = min(cap, int(np.floor(share * n + 0.5)))
    else:
        total = np.maximum(upload, cpu)[: cap + 1]
        total[1:] += overhead_s
        n_fetch = int(np.argmin(total))  # the first minimum: the fewest uploads
    return FetchChoice(
        order, counts, n_fetch, expert_bytes, float(upload[n_fetch]), float(cpu[n_fetch])
    )


def expect_step(
    n_tokens: int,
    hit_rate: float,
    n_experts: int,
    top_k: int,
    kinds: dict[tuple[Links, int], int],
    *,
    share: float | None = None,
    price_routes: bool = False,
    overhead_s: float = FETCH_OVERHEAD_S,
) -> tuple[float, float, bool]:
    """A step's expected MoE seconds split (each layer's expected misses under the fetch
    rule, or the forced ``share``) and streamed over PCIe, and whether the split fetches.
    ``kinds`` counts the layers per (links, expert bytes). A layer's expected misses: the
    distinct experts of ``n_tokens`` tokens routed uniformly, ``E (1 - (1 - k/E)^T)``, times
    the miss rate, each with an equal share of the ``T k (1 - h)`` missed routes."""
    miss, k, e = 1.0 - hit_rate, top_k, n_experts
    n = max(1, round(e * (1 - (1 - k / e) ** n_tokens) * miss))
    routes = np.full(n, n_tokens * k * miss / n)
    split_s = stream_s = 0.0
    fetch = False
    for (links, nbytes), count in kinds.items():
        c = choose_fetch(
            np.arange(n),
            routes,
            nbytes,
            links,
            share=share,
            max_fetch=e - k,
            overhead_s=overhead_s,
            price_routes=price_routes,
        )
        fixed = overhead_s if c.n_fetch else 0.0
        split_s += count * (max(c.upload_s, c.cpu_s) + fixed)
        stream_s += count * e * nbytes / ((links.stream or links.pcie) * 1e9)
        fetch |= c.n_fetch > 0
    return split_s, stream_s, fetch


def step_bucket(n_tokens: int) -> str:
    """The counters' label of a step of ``n_tokens``: ``"1"``, ``"2-4"``, ... ``"257-512"``."""
    lo = 1
    for hi in BUCKETS:
        if n_tokens <= hi:
            return str(hi) if lo == hi else f"{lo}-{hi}"
        lo = hi + 1
    return f"{lo}+"
