"""When a decode step's set of sequences is captured as a CUDA graph
(``runtime/cuda_graph.py``): a set of several sequences runs eagerly until it has come
``SETTLE_STEPS`` steps in a row, so a server whose requests come and go does not pay a capture
(about three eager steps) for a set that lasts a step or two. (Capture and replay themselves
are tested on the GPU: tests/test_gpu_models.py.)"""

from __future__ import annotations

from freetoken.runtime.cuda_graph import SETTLE_STEPS, Settling


def test_a_set_settles_after_its_steps_in_a_row() -> None:
    s = Settling(SETTLE_STEPS)
    assert [s.settled("a") for _ in range(SETTLE_STEPS + 2)] == [False] * (SETTLE_STEPS - 1) + [
        True
    ] * 3


def test_a_change_starts_the_count_again() -> None:
    s = Settling(3)
    assert [s.settled(k) for k in "aabaaab"] == [False, False, False, False, False, True, False]


def test_one_step_settles_at_once() -> None:
    s = Settling(1)
    assert all(s.settled(k) for k in "abab")
