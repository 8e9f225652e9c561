"""The teacher-forced comparison used by the model tests: on llama.cpp's greedy continuation,
our argmax must equal llama.cpp's except at its near-ties, and the mean KL(llama.cpp || ours)
over the full vocabulary must stay small."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

#: llama.cpp's top two logits closer than this make its argmax a coin flip.
NEAR_TIE = 0.05

#: A MoE layer whose k-th and (k+1)-th router scores are closer than this many of the
#: layer's router-logit standard deviations routes by a coin flip between two engines'
#: roundings: measured on the H200, the GPU and the CPU engine (and llama.cpp's CPU and ours)
#: chose different experts at margins of 0.007 and 0.020, each such position 0.15 of KL.
ROUTING_NEAR_TIE = 0.03


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


def compare(ref: np.ndarray, ours: np.ndarray, skip: Sequence[int] = ()) -> Comparison:
    """Compares ``[T, V]`` logits: ``ref`` the reference (llama.cpp or float64); rows
    ``skip`` (routing near-ties: :func:`routing_near_ties`) left out."""
    assert ref.shape == ours.shape, (ref.shape, ours.shape)
    keep = np.setdiff1d(np.arange(ref.shape[0]), np.asarray(skip, dtype=np.int64))
    ref, ours = ref[keep], ours[keep]
    lp_ref, lp_ours = _log_softmax(ref), _log_softmax(ours)
    kl = (np.exp(lp_ref) * (lp_ref - lp_ours)).sum(axis=-1)
    top2 = np.sort(ref, axis=-1)[:, -2:]
    near = (top2[:, 1] - top2[:, 0]) < NEAR_TIE
    differ = ref.argmax(-1) != ours.argmax(-1)
    return Comparison(
        positions=ref.shape[0],
        mismatches=[int(keep[i]) for i in np.flatnonzero(differ & ~near)],
        near_tie_mismatches=[int(keep[i]) for i in np.flatnonzero(differ & near)],
        mean_kl=float(kl.mean()),
        top1_agreement=float(1.0 - differ.mean()),
    )


def routing_near_ties(model: Any, seq: list[int], first: int) -> list[int]:
    """The positions ``first..len(seq) - 2`` (as rows from 0) at which some MoE layer of the
    CPU engine's ``model`` chooses its experts at a near-tie (``ROUTING_NEAR_TIE``), over the
    whole of ``seq`` as one prompt. Scores are the router logits, or with a selection bias
    the sigmoid plus the bias (grouped routing is not modelled)."""
    import torch
    from freetoken.runtime.moe import MoeFFN

    layers = [blk.ffn for blk in model.blocks if isinstance(blk.ffn, MoeFFN)]
    seen: list[torch.Tensor] = []
    routers = [ffn.router for ffn in layers]

    def recording(router: Any) -> Any:
        def run(x: torch.Tensor) -> torch.Tensor:
            seen.append(router(x))
            return seen[-1]

        return run

    for ffn, router in zip(layers, routers, strict=True):
        ffn.router = recording(router)
    try:
        model.forward(seq, model.new_cache(len(seq)), all_logits=True)
    finally:
        for ffn, router in zip(layers, routers, strict=True):
            ffn.router = router
    near = np.zeros(len(seq), dtype=bool)
    for ffn, logits in zip(layers, seen, strict=True):
        scores = logits.double()
        if ffn.selection_bias is not None:
            scores = torch.sigmoid(scores) + ffn.selection_bias.double()
        k = ffn.routing.top_k
        top = scores.sort(-1, descending=True).values
        margin = (top[:, k - 1] - top[:, k]) / logits.double().std(-1)
        near |= (margin < ROUTING_NEAR_TIE).numpy()
    return [int(i) for i in np.flatnonzero(near[first:-1])]
