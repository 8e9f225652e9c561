"""The teacher-forced comparison used by the model tests: on llama.cpp's greedy continuation,
our argmax must equal llama.cpp's except at its near-ties, and the mean KL(llama.cpp || ours)
over the full vocabulary must stay small."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: llama.cpp's top two logits closer than this make its argmax a coin flip.
NEAR_TIE = 0.05


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@dataclass
class Comparison:
    """Per-position agreement of two logit sequences."""

    positions: int
    mismatches: list[int]
    near_tie_mismatches: list[int]
    mean_kl: float
    top1_agreement: float

    def describe(self) -> str:
        return (
            f"{self.positions} positions, mean KL {self.mean_kl:.5f}, top-1 agreement "
            f"{self.top1_agreement:.3f}, mismatches {self.mismatches} "
            f"(at near-ties: {self.near_tie_mismatches})"
        )


def compare(ref: np.ndarray, ours: np.ndarray) -> Comparison:
    """Compares ``[T, V]`` logits: ``ref`` the reference (llama.cpp or float64)."""
    assert ref.shape == ours.shape, (ref.shape, ours.shape)
    lp_ref, lp_ours = _log_softmax(ref), _log_softmax(ours)
    kl = (np.exp(lp_ref) * (lp_ref - lp_ours)).sum(axis=-1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    near = (top2[:, 1] - top2[:, 0]) < NEAR_TIE
    differ = ref.argmax(-1) != ours.argmax(-1)
    return Comparison(
        positions=ref.shape[0],
        mismatches=[int(i) for i in np.flatnonzero(differ & ~near)],
        near_tie_mismatches=[int(i) for i in np.flatnonzero(differ & near)],
        mean_kl=float(kl.mean()),
        top1_agreement=float(1.0 - differ.mean()),
    )
