"""The model-free parts of speculative decoding: the acceptance rule, n-gram drafts from the
context, synthetic acceptance for benchmarks, and the counters.

Acceptance (the standard rule): a draft token ``d`` drawn from the draft's distribution ``q``
is kept with probability ``min(1, p(d) / q(d))`` where ``p`` is the target's distribution at
that position (the sampler's final one, after penalties, truncation and temperature); on
rejection the token is drawn from the residual ``max(p - q, 0)`` renormalised. The token that
comes out is distributed as ``p`` whatever ``q`` is. Greedy drafts are one-hot ``q``: ``d`` is
kept with probability ``p(d)``, else the token comes from ``p`` without ``d``. A greedy target
(one-hot ``p``) keeps ``d`` exactly when it is the target's argmax.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from freetoken.errors import InvalidInputError

if TYPE_CHECKING:
    import torch

__all__ = [
    "SpecCounters",
    "accept_draft",
    "ngram_draft",
    "synth_conditional",
    "synth_rates",
]


@dataclass
class SpecCounters:
    """Drafted and accepted tokens, and the verify steps by length (tokens in the step)."""

    drafted: int = 0
    accepted: int = 0
    steps: dict[int, int] = field(default_factory=dict)

    def add(self, drafted: int, accepted: int) -> None:
        """Counts one verify step of ``drafted + 1`` tokens that kept ``accepted`` drafts."""
        self.drafted += drafted
        self.accepted += accepted
        self.steps[drafted + 1] = self.steps.get(drafted + 1, 0) + 1

    @property
    def acceptance(self) -> float:
        """Accepted over drafted tokens (0 without drafts)."""
        return self.accepted / self.drafted if self.drafted else 0.0


def accept_draft(p: torch.Tensor, draft: int, q: torch.Tensor | None, gen: torch.Generator) -> int:
    """The token at a draft position by the standard rule (module docstring): ``p`` the
    target's probabilities ``[vocab]`` (float64), ``q`` the draft's (None: one-hot at
    ``draft``). Returns ``draft`` when it is kept, else a token from the residual."""
    import torch

    pd = float(p[draft])
    qd = 1.0 if q is None else float(q[draft])
    u = float(torch.rand((), generator=gen, dtype=torch.float64))
    if qd > 0.0 and u * qd < pd:
        return draft
    if q is None:
        residual = p.clone()
        residual[draft] = 0.0
    else:
        residual = (p - q.to(p.dtype)).clamp_min(0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p is all on draft (rounding): nothing else to draw
        return draft
    cum = residual.cumsum(0)
    v = float(torch.rand((), generator=gen, dtype=torch.float64)) * total
    pos = int(torch.searchsorted(cum, torch.tensor([v], dtype=cum.dtype), right=True))
    # The first index where cum reaches the total is the last token with weight.
    return min(pos, int((cum < total).sum()))


def ngram_draft(tokens: Sequence[int], size_n: int, size_m: int) -> list[int]:
    """llama.cpp's ``ngram-simple`` draft: ``tokens`` is the context ending with the token
    just sampled; its ``size_n`` last tokens are looked up among the earlier ones (the latest
    match before the last), and the up to ``size_m`` context tokens that followed the match
    are the draft (none when fewer than ``size_n`` follow it, or no match)."""
    n = len(tokens) - 1  # the context before the sampled token
    if n <= size_n + size_m + 1:
        return []
    pattern = list(tokens[n + 1 - size_n :])
    # The latest earlier occurrence; position 0 does not count (llama.cpp's convention).
    for j in range(n - size_n - 1, 0, -1):
        if tokens[j] == pattern[0] and list(tokens[j : j + size_n]) == pattern:
            copy = min(size_m, n - (j + size_n))
            if copy < size_n:
                return []
            return list(tokens[j + size_n : j + size_n + copy])
    return []


def synth_rates(length: float | None, rates: Sequence[float] | None, n_max: int) -> list[float]:
    """The unconditional per-position acceptance rates of ``--spec-synth-len`` or
    ``--spec-synth-rates`` (llama.cpp's rules: one of them, ``n_max`` rates within [0, 1]
    that do not increase; a mean length in [1, n_max + 1] becomes geometric rates ``p^i``).
    Empty when neither is given; InvalidInputError naming the flag otherwise."""
    if length is None and not rates:
        return []
    if length is not None and rates:
        raise InvalidInputError("--spec-synth-len and --spec-synth-rates are mutually exclusive")
    if n_max <= 0:
        raise InvalidInputError("synthetic acceptance needs --spec-draft-n-max of at least 1")
    if rates:
        out = [float(r) for r in rates]
        if len(out) != n_max:
            raise InvalidInputError(
                f"--spec-synth-rates must give {n_max} values (--spec-draft-n-max), got {len(out)}"
            )
        for i, r in enumerate(out):
            if not math.isfinite(r) or not 0.0 <= r <= 1.0:
                raise InvalidInputError(f"--spec-synth-rates: {r} is not finite and within [0, 1]")
            if i and r > out[i - 1]:
                raise InvalidInputError(
                    f"--spec-synth-rates must not increase: {out[i - 1]} then {r}"
                )
        return out
    assert length is not None
    top = n_max + 1.0
    if not math.isfinite(length) or not 1.0 <= length <= top:
        raise InvalidInputError(f"--spec-synth-len {length} is not within [1, {top:.0f}]")
    if length == top:
        p = 1.0
    elif length == 1.0:
        p = 0.0
    else:
        # The p whose p + p^2 + ... + p^n_max is length - 1, by bisection.
        lo, hi = 0.0, 1.0
        for _ in range(32):
            mid = 0.5 * (lo + hi)
            if sum(mid ** (j + 1) for j in range(n_max)) < length - 1.0:
                lo = mid
            else:
                hi = mid
        p = 0.5 * (lo + hi)
    return [p ** (i + 1) for i in range(n_max)]


def synth_conditional(rates: Sequence[float]) -> list[float]:
    """The probability of keeping draft position ``i`` given that the ones before it were
    kept: ``rates[i] / rates[i - 1]`` (0 after a rate of 0)."""
    out, prev = [], 1.0
    for r in rates:
        out.append(r / prev if prev > 0.0 else 0.0)
        prev = r
    return out
