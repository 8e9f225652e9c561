"""Router statistics of the synthetic MoE models: the routing weights' power (which sizes
the experts' outputs) and, for skewed routing, the per-expert logit biases that give a
Zipf-like expert popularity.

All of it is simulated on router logits ``z + bias`` with ``z`` independent N(0, R^2) per
expert (R: :data:`ROUTER_SCALE`), llama.cpp's ``build_moe_ffn`` steps, and a fixed seed, so
the same model options always give the same weights.

One scale serves every gating function. For sigmoid gating a smaller one (about 1: scores
spread over (0.27, 0.73) rather than crowding near 0 and 1) was tried to make the top-k choice
robust to the rounding differences between engines: it is not. Rounding perturbs the logits
in proportion to their size, and so do the gaps between them, so how often a choice flips
does not depend on the scale. Measured on tests/test_moe_families_b.py's sigmoid cases
(llama.cpp against FreeToken, 20 seeds each), the seeds whose comparison fails (a prompt's
mean KL over 0.005 or an argmax mismatch): deepseek2 (2 groups, 1 used: a flip of the group
swaps every routed expert) 12, 10 and 9 of 20 at R = 3, 1 and 0.5; glm4moe 4, 3 and 1 of 20.
Shifting glm4moe's logits down by 4, so the weights gather on the top expert, gave 3 of 20.
"""

from __future__ import annotations

import numpy as np

from freetoken.testmodel.archs import RoutingSpec

__all__ = [
    "PROBS_BIAS_STD",
    "ROUTER_SCALE",
    "ZIPF_S",
    "popularity_bias",
    "route",
    "routed_power",
    "zipf_shares",
]

#: Spread of the router logits: they spread over a few units, so tokens pick varied experts.
ROUTER_SCALE = 3.0
#: Selection bias (exp_probs_b) spread, against sigmoid scores spread over (0, 1).
PROBS_BIAS_STD = 0.02
#: The default Zipf exponent of skewed routing: with 128 experts the hottest 25% take half
#: of the routes, about what Qwen3-30B-A3B's routers show. (In make-test-model's 8-layer cut of
#: that shape, over 1024 tokens, they took 0.49-0.56 per layer; uniform routing: 0.30.)
ZIPF_S = 0.55
#: Rows simulated to estimate the routing statistics.
_ROUTE_SAMPLES = 4096
#: Rows and rounds of the popularity calibration.
_CALIBRATION_SAMPLES = 8192
_CALIBRATION_ROUNDS = 60
#: The hottest expert's share at most, relative to the most possible (1 / top-k: chosen by
#: every token), so that the bias it needs stays finite.
_MAX_SHARE = 0.9


def route(
    r: RoutingSpec,
    logits: np.ndarray,
    selection_bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """The chosen experts ``(rows, top_k)`` and their weights for router ``logits``
    ``(rows, experts)``, as llama.cpp's ``build_moe_ffn`` computes them (``selection_bias``:
    ``exp_probs_b``, added to the scores for the selection only)."""
    rows = logits.shape[0]
    if r.func == "softmax":
        e = np.exp(logits - logits.max(-1, keepdims=True))
        probs = e / e.sum(-1, keepdims=True)
    elif r.func == "sigmoid":
        probs = 1.0 / (1.0 + np.exp(-logits))
    else:
        probs = logits
    select = probs + selection_bias if selection_bias is not None else probs.copy()
    if r.groups > 1:
        g = select.reshape(rows, r.groups, -1)
        score = np.sort(g, axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-score, axis=-1)[:, : r.groups_used]
        mask = np.ones(score.shape, dtype=bool)
        np.put_along_axis(mask, keep, False, axis=-1)
        select = np.where(mask[..., None], -np.inf, g).reshape(rows, -1)
    ids = np.argsort(-select, axis=-1)[:, : r.top_k]
    w = np.take_along_axis(probs, ids, axis=-1)
    if r.func == "softmax_weight":
        w = np.exp(w - w.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
    if r.normalize:
        w /= np.maximum(w.sum(-1, keepdims=True), 6.103515625e-5)
    return ids, w * r.scale


def routed_power(r: RoutingSpec, n_experts: int, bias: np.ndarray | None = None) -> float:
    """E[sum_k w_k^2] of the routing weights of ``r`` for router logits N(0, R^2) plus
    ``bias`` (one per expert; skewed routing)."""
    rng = np.random.default_rng(0x5EED)
    logits = ROUTER_SCALE * rng.standard_normal((_ROUTE_SAMPLES, n_experts))
    if bias is not None:
        logits += bias
    sel = PROBS_BIAS_STD * rng.standard_normal(n_experts) if r.selection_bias else None
    _, w = route(r, logits, sel)
    return float((w * w).sum(-1).mean())


def zipf_shares(n_experts: int, top_k: int, s: float) -> np.ndarray:
    """The route shares (summing to 1) of experts by popularity rank: proportional to
    ``rank^-s``, the hottest capped below ``1 / top_k`` (an expert is chosen at most once
    per token), the excess spread over the others in proportion."""
    shares = np.arange(1, n_experts + 1, dtype=np.float64) ** -s
    shares /= shares.sum()
    cap = _MAX_SHARE / top_k
    capped = np.zeros(n_experts, dtype=bool)
    while shares.max() > cap * (1 + 1e-9):
        capped |= shares >= cap
        free = 1.0 - cap * capped.sum()
        shares = np.where(capped, cap, shares * free / shares[~capped].sum())
    return shares


def popularity_bias(
    n_experts: int, top_k: int, s: float, scale: float = ROUTER_SCALE
) -> np.ndarray:
    """Router logit biases, hottest first, under which top-k selection over logits
    N(0, ``scale``^2) + bias gives the route shares of :func:`zipf_shares` (calibrated by
    simulation; with ``s`` 0 all biases are 0). The selection is taken as plain top-k over
    the logits: sigmoid gating's selection bias and expert groups are left out."""
    target = zipf_shares(n_experts, top_k, s)
    if s == 0 or top_k >= n_experts:
        return np.zeros(n_experts)
    rng = np.random.default_rng(0x21F)
    z = scale * rng.standard_normal((_CALIBRATION_SAMPLES, n_experts))
    bias = np.zeros(n_experts)
    for _ in range(_CALIBRATION_ROUNDS):
        top = np.argpartition(-(z + bias), top_k - 1, axis=-1)[:, :top_k]
        counts = np.bincount(top.ravel(), minlength=n_experts) + 0.5
        shares = counts / counts.sum()
        bias += 0.5 * scale * np.log(target / shares)
        bias -= bias.mean()
    # Sampling noise may leave two cold neighbours out of order.
    return np.sort(bias)[::-1]
