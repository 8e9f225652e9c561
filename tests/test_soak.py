"""A short soak of the real server (tests/soak.py): mixed requests, a third of the streaming
clients disconnecting mid-stream, bad bodies; then free slots, metrics that add up, bounded
RSS growth and the same greedy text as a fresh server."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("openai")

import soak


@pytest.mark.slow
def test_short_soak(default_model: Path) -> None:
    res = soak.run(default_model, requests=48, concurrency=8, seed=7)
    assert res.by_outcome.get("disconnected", 0) > 0, res.by_outcome
    assert res.by_outcome.get("rejected", 0) > 0, res.by_outcome
    problems = res.problems(rss_bound_mib=256.0)
    assert not problems, problems
