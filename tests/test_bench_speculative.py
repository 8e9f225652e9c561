"""benches/bench_speculative.py's prediction by draft length, on figures worked by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))

import bench_speculative as bs  # noqa: E402  (benches/ is not a package)


def test_by_draft_length_worked_example() -> None:
    # 10 verify steps of 3 tokens (2 drafts each) gave 28 tokens in 0.2 s: 20 ms a step, of
    # which the 3-token verify is 15 ms, so 5 ms of rest, 2.5 ms per drafted token.
    rows = bs.by_draft_length([0.8, 0.6], {1: 10.0, 2: 12.0, 3: 15.0}, 140.0, 28, {3: 10})
    assert [r["draft"] for r in rows] == [0, 1, 2]
    assert [r["tokens_per_step"] for r in rows] == pytest.approx([1.0, 1.8, 2.4])
    assert [r["verify_ms"] for r in rows] == [10.0, 12.0, 15.0]
    assert [r["tps_rest_by_drafts"] for r in rows] == pytest.approx(
        [1000 / 10, 1800 / (12 + 2.5), 2400 / (15 + 5)]
    )
    assert [r["tps_rest_per_step"] for r in rows] == pytest.approx(
        [1000 / 15, 1800 / 17, 2400 / 20]
    )


def test_by_draft_length_mixed_steps() -> None:
    # Three steps of 2 tokens and one of 4 (1 and 3 drafts): 1.5 drafts a step; 30 ms a step
    # against a mean verify of (3 x 20 + 1 x 32) / 4 = 23 ms leaves 7 ms, 14 ms for 3 drafts.
    rows = bs.by_draft_length(
        [0.9, 0.5, 0.2], {1: 15.0, 2: 20.0, 3: 26.0, 4: 32.0}, 100.0, 12, {2: 3, 4: 1}
    )
    assert rows[3]["tps_rest_by_drafts"] == pytest.approx(2.6e3 / (32 + 14))
    assert rows[1]["tps_rest_per_step"] == pytest.approx(1.9e3 / (20 + 7))
