"""``--spec-draft-n-auto`` (engine/draft_length.py): steps simulated with known costs per
draft length and known acceptance per position, the policy fed what each step cost and kept.
The best length is computed here from those known figures (float64: expected tokens per
step, 1 plus the products of the positions' rates, over the step's cost), and the policy must
settle on it, in each of three regimes (drafting never pays, always pays, pays up to a point),
within the limits of the step; a length's first step (a graph capture) is not its cost."""

from __future__ import annotations

import random

import pytest
from freetoken.engine.draft_length import DraftLength
from freetoken.engine.spec_options import DraftLimits


def _per_second(costs: list[float], rates: list[float], n: int) -> float:
    tokens, run = 1.0, 1.0
    for p in rates[:n]:
        run *= p
        tokens += run
    return tokens / costs[n]


def _simulate(
    costs: list[float], rates: list[float], limits: DraftLimits, steps: int, seed: int
) -> list[tuple[int, int, float]]:
    """Per step: the length the policy chose, the tokens the step gave and its cost (drawn
    within 10% of ``costs[n]``)."""
    rng = random.Random(seed)
    policy = DraftLength()
    out = []
    for _ in range(steps):
        n = policy.choose(limits)
        kept = 0
        while kept < n and rng.random() < rates[kept]:
            kept += 1
        cost = costs[n] * rng.uniform(0.9, 1.1)
        policy.record(n, kept, cost)
        out.append((n, kept + 1, cost))
    return out


@pytest.mark.parametrize(
    ("costs", "rates"),
    [
        # hybrid at a 25% cache: each drafted token costs most of a step
        ([13.1, 25.2, 34.2, 44.0], [0.8, 0.75, 0.667]),
        # all resident: a verify step of 4 costs little more than one token
        ([6.0, 6.6, 7.1, 7.7], [0.8, 0.75, 0.667]),
        # between: one draft pays, the later positions are kept too rarely
        ([10.0, 12.0, 16.5, 21.0], [0.85, 0.3, 0.3]),
    ],
    ids=["never", "always", "one"],
)
@pytest.mark.parametrize("seed", range(4))
def test_settles_on_the_most_tokens_per_second(
    costs: list[float], rates: list[float], seed: int
) -> None:
    best = max(range(4), key=lambda n: _per_second(costs, rates, n))
    steps = _simulate(costs, rates, DraftLimits(n_max=3), 600, seed)
    assert {n for n, _, _ in steps[:8]} == {0, 1, 2, 3}  # each length ran before a choice
    tail = steps[200:]
    # Mostly the best length (every REPROBE-th step runs another on purpose), and over the
    # tail within 7% of the tokens per second the best length gives on average.
    assert sum(n == best for n, _, _ in tail) >= 0.75 * len(tail)
    rate = sum(t for _, t, _ in tail) / sum(c for _, _, c in tail)
    assert rate >= 0.93 * _per_second(costs, rates, best)


def test_stays_within_the_limits() -> None:
    costs, rates = [6.0, 6.6, 7.1, 7.7, 8.2], [0.9, 0.9, 0.9, 0.9]
    for limits, allowed in (
        (DraftLimits(n_max=4, n_min=2), {0, 2, 3, 4}),
        (DraftLimits(1), {0, 1}),
    ):
        assert {n for n, _, _ in _simulate(costs, rates, limits, 300, 0)} == allowed


def test_a_lengths_first_step_is_not_its_cost() -> None:
    policy = DraftLength()
    policy.record(2, 1, 5.0)  # the first step of 2 drafts: a graph capture
    assert policy.cost(2) is None
    for s in (0.020, 0.021, 0.019):
        policy.record(2, 1, s)
    assert policy.cost(2) == pytest.approx(0.020)
