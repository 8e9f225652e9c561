"""``--spec-draft-n-auto``: each step's draft length chosen by the tokens it is expected to
yield per second, from the steps already run.

A step that drafts ``n`` tokens yields ``1 + p_1 + p_1 p_2 + ... + p_1 ... p_n`` tokens on
average (``p_j``: the chance that draft position ``j`` is kept when the ones before it were)
and costs its wall time: the drafting, the verify step of ``n + 1`` tokens, the sampling and
the cut back. Both are measured on the steps themselves. A length's cost is the median of its
last ``WINDOW`` steps, its first step left out (it may capture a graph or allocate). A
position's rate counts its kept and dropped drafts with one of each assumed, so that a
position never tried is neither trusted nor ruled out. Every candidate length runs before the
first choice, and every ``REPROBE`` steps the one that ran longest ago runs again, so that
the choice follows costs that drift (the expert cache's hits, the context's length).

Where drafting does not pay (a verify step of two tokens costs more than the two tokens it
yields on average are worth), the choice is 0: a plain step, the drafter still shown it.
"""

from __future__ import annotations

import collections
import logging
import statistics

from freetoken.engine.spec_options import MAX_DRAFT, DraftLimits

__all__ = ["REPROBE", "WINDOW", "DraftLength"]

log = logging.getLogger("freetoken.speculative")

#: Steps of a length whose median is its cost.
WINDOW = 5
#: Every this many steps a length other than the best runs again.
REPROBE = 16
#: A position's counts are halved past this many tries, so its rate follows the text.
RATE_MEMORY = 64


class DraftLength:
    """The draft length of each step of one sequence (or server slot), chosen within the
    step's limits from the costs and acceptance :meth:`record` was given."""

    def __init__(self) -> None:
        self._costs: dict[int, collections.deque[float]] = {}
        #: The step count at each length's latest step (absent: the length never ran).
        self._last_run: dict[int, int] = {}
        self._tried = [0.0] * MAX_DRAFT
        self._kept = [0.0] * MAX_DRAFT
        self._steps = 0
        self._best = -1

    @staticmethod
    def candidates(limits: DraftLimits) -> list[int]:
        """The lengths a step may draft: none, or ``n_min`` (at least 1) to ``n_max``."""
        return [0, *range(max(limits.n_min, 1), limits.n_max + 1)]

    def rate(self, position: int) -> float:
        """The estimated chance that draft position ``position`` (from 1) is kept when the
        ones before it were."""
        j = position - 1
        return (self._kept[j] + 1.0) / (self._tried[j] + 2.0)

    def expected_tokens(self, n: int) -> float:
        """The tokens a step drafting ``n`` yields on average: the target's own plus each
        draft position's chance of being kept with all before it."""
        total = run = 1.0
        for position in range(1, n + 1):
            run *= self.rate(position)
            total += run
        return total

    def cost(self, n: int) -> float | None:
        """The measured seconds of a step drafting ``n`` (None: not measured yet)."""
        runs = self._costs.get(n)
        return statistics.median(runs) if runs else None

    def choose(self, limits: DraftLimits) -> int:
        """The number of tokens the next step drafts, within ``limits``."""
        cands = self.candidates(limits)
        costs = {n: c for n in cands if (c := self.cost(n)) is not None}
        if len(costs) < len(cands):  # every candidate runs before the first choice
            return max(set(cands) - costs.keys())
        best = max(cands, key=lambda n: self.expected_tokens(n) / costs[n])
        if best != self._best:
            log.debug(
                "draft length %d (%s)",
                best,
                ", ".join(
                    f"{n}: {self.expected_tokens(n):.2f} tokens in {costs[n] * 1e3:.1f} ms"
                    for n in cands
                ),
            )
            self._best = best
        if len(cands) > 1 and (self._steps + 1) % REPROBE == 0:
            return min((n for n in cands if n != best), key=lambda n: self._last_run.get(n, -1))
        return best

    def record(self, drafted: int, kept: int, seconds: float) -> None:
        """A step that drafted ``drafted`` tokens, of which the first ``kept`` were kept, in
        ``seconds`` of wall time."""
        assert 0 <= kept <= drafted <= MAX_DRAFT, (kept, drafted)
        self._steps += 1
        if drafted in self._last_run:  # a length's first step is not its cost
            self._costs.setdefault(drafted, collections.deque(maxlen=WINDOW)).append(seconds)
        self._last_run[drafted] = self._steps
        for j in range(min(kept + 1, drafted)):
            self._tried[j] += 1.0
            self._kept[j] += 1.0 if j < kept else 0.0
            if self._tried[j] > RATE_MEMORY:
                self._tried[j] /= 2.0
                self._kept[j] /= 2.0
