"""Tests of freetoken.runtime.routing against a float64 numpy reference written here.

The reference (`ref_route`) follows llama.cpp's ``build_moe_ffn`` (src/llama-graph.cpp of the
pinned tree) from its definitions:

- probabilities: softmax over all experts, sigmoid per expert, or (``softmax_weight``,
  gpt-oss) the raw logits;
- the selection scores are the probabilities plus the selection bias (``exp_probs_b``); the
  bias moves the choice only, the weights stay unbiased;
- grouped top-k (DeepSeek V3): a group's score is the sum of its two best selection scores, the
  ``groups_used`` best groups are kept and the others masked to -inf before the top-k;
- weights: the unbiased probabilities of the chosen experts; ``softmax_weight`` softmaxes them
  (the chosen logits) over the k; renormalization divides by their sum clamped to the smallest
  normal half (6.1e-5); the routed scaling factor multiplies them unless it is 0 or 1.

It never calls the code under test. Every test that exercises a feature also checks that the
feature changes the answer on its data (a bias that selects nothing else, or groups that keep
every top-k expert anyway, would let a broken implementation pass), and that the reference's
decisions are far enough from ties that float32 rounding in the code under test cannot flip
them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from freetoken.errors import FreeTokenError, InvalidInputError, ShapeError, UnsupportedError
from freetoken.runtime.routing import GATING_FUNCS, Routing, route

#: float32 softmax / sigmoid against float64: relative error of a few ulp.
RTOL = 1e-5
ATOL = 1e-7
#: The smallest gap between a chosen and a rejected score (or group score) that the tests
#: accept in their own data: far above float32 rounding (1e-7 relative).
MIN_MARGIN = 1e-5
MIN_WEIGHT_SUM = 6.103515625e-5


# -- the reference ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RefResult:
    ids: np.ndarray  # [T, k] int, in descending selection order
    weights: np.ndarray  # [T, k] float64
    margin: float  # the smallest gap between a kept and a dropped expert or group


def ref_route(
    logits: np.ndarray,
    top_k: int,
    func: str = "softmax",
    normalize: bool = False,
    scale: float = 1.0,
    n_groups: int = 1,
    groups_used: int = 1,
    bias: np.ndarray | None = None,
    group_top: int = 2,
) -> RefResult:
    """``group_top`` is the number of best experts summed per group score (llama.cpp: 2);
    other values exist only to show a wrong grouping would be caught."""
    z = np.asarray(logits, dtype=np.float64)
    t_count, e = z.shape
    ids = np.zeros((t_count, top_k), dtype=np.int64)
    weights = np.zeros((t_count, top_k))
    margin = math.inf
    for t in range(t_count):
        if func == "softmax":
            ex = np.exp(z[t] - z[t].max())
            p = ex / ex.sum()
        elif func == "sigmoid":
            p = 1.0 / (1.0 + np.exp(-z[t]))
        elif func == "softmax_weight":
            p = z[t].copy()
        else:
            raise AssertionError(func)
        s = p + np.asarray(bias, dtype=np.float64) if bias is not None else p.copy()
        if n_groups > 1:
            g = s.reshape(n_groups, e // n_groups)
            score = np.sort(g, axis=1)[:, -group_top:].sum(axis=1)
            order = np.argsort(-score, kind="stable")
            if groups_used < n_groups:
                margin = min(margin, score[order[groups_used - 1]] - score[order[groups_used]])
            masked = np.full_like(g, -np.inf)
            masked[order[:groups_used]] = g[order[:groups_used]]
            s = masked.reshape(e)
        order = np.argsort(-s, kind="stable")
        chosen = order[:top_k]
        if top_k < e and np.isfinite(s[order[top_k]]):
            margin = min(margin, s[order[top_k - 1]] - s[order[top_k]])
        w = p[chosen]
        if func == "softmax_weight":
            ex = np.exp(w - w.max())
            w = ex / ex.sum()
        if normalize:
            w = w / max(w.sum(), MIN_WEIGHT_SUM)
        if scale not in (0.0, 1.0):
            w = w * scale
        ids[t] = chosen
        weights[t] = w
    return RefResult(ids, weights, margin)


def as_maps(ids: np.ndarray, weights: np.ndarray) -> list[dict[int, float]]:
    """Per token, expert id -> weight (the order of the k routes does not matter)."""
    return [
        {int(i): float(w) for i, w in zip(ti, tw, strict=True)}
        for ti, tw in zip(ids, weights, strict=True)
    ]


def check_route(
    logits: np.ndarray, r: Routing, bias: np.ndarray | None = None, **ref_options: object
) -> RefResult:
    """Runs ``route`` on ``logits`` and compares it to the reference; returns the reference."""
    ref = ref_route(
        logits,
        r.top_k,
        r.func,
        r.normalize,
        r.scale,
        r.n_groups,
        r.groups_used,
        bias,
        **ref_options,  # type: ignore[arg-type]
    )
    assert ref.margin > MIN_MARGIN, "test data too close to a tie"
    tb = torch.from_numpy(bias.astype(np.float32)) if bias is not None else None
    ids, weights = route(torch.from_numpy(logits.astype(np.float32)), r, tb)
    assert_matches(ids, weights, ref)
    return ref


def assert_matches(
    ids: torch.Tensor, weights: torch.Tensor, ref: RefResult, rtol: float = RTOL
) -> None:
    """The same experts per token (in any order), each with the reference's weight."""
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32
    assert ids.shape == ref.ids.shape and weights.shape == ref.ids.shape
    assert ids.is_contiguous() and weights.is_contiguous()
    got = as_maps(ids.numpy(), weights.numpy())
    want = as_maps(ref.ids, ref.weights)
    for t, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys(), f"token {t}: experts {sorted(g)} != {sorted(w)}"
        for i, wi in w.items():
            assert math.isclose(g[i], wi, rel_tol=rtol, abs_tol=ATOL), (t, i, g[i], wi)


def differs(a: RefResult, b: RefResult) -> bool:
    """Whether two references disagree on some token's experts or weights."""
    ma, mb = as_maps(a.ids, a.weights), as_maps(b.ids, b.weights)
    for x, y in zip(ma, mb, strict=True):
        if x.keys() != y.keys():
            return True
        if any(not math.isclose(x[i], y[i], rel_tol=1e-3, abs_tol=1e-6) for i in x):
            return True
    return False


def n_changed_selections(a: RefResult, b: RefResult) -> int:
    return sum(set(x) != set(y) for x, y in zip(a.ids.tolist(), b.ids.tolist(), strict=True))


def logits_for(seed: int, t: int, e: int, spread: float = 2.0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((t, e)) * spread


# -- softmax ---------------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [1, 2, 8])
@pytest.mark.parametrize("normalize", [False, True])
def test_softmax_topk(top_k: int, normalize: bool) -> None:
    """Qwen2-MoE / OLMoE (no renormalization) and Qwen3 / Mixtral (renormalized)."""
    z = logits_for(1, 24, 64)
    r = Routing(top_k=top_k, func="softmax", normalize=normalize)
    ref = check_route(z, r)
    sums = ref.weights.sum(axis=1)
    if normalize:
        np.testing.assert_allclose(sums, 1.0, rtol=1e-12)
    else:
        # The probabilities of the chosen experts over all 64: short of 1 on every token.
        assert (sums < 0.999).all()
    # Renormalizing changes the weights (softmax over all experts, then renormalized over the
    # k, is softmax over the k: what gpt-oss's softmax_weight computes).
    other = ref_route(z, top_k, "softmax", normalize=not normalize)
    assert differs(ref, other)
    if normalize:
        np.testing.assert_allclose(ref.weights, ref_route(z, top_k, "softmax_weight").weights)


def test_softmax_selection_order_is_by_probability() -> None:
    """Top-k picks the largest probabilities; the ids come with their own weights."""
    z = np.array([[0.0, 3.0, -1.0, 2.0, 1.0, 2.5]])
    ids, weights = route(torch.tensor(z, dtype=torch.float32), Routing(top_k=3))
    assert sorted(ids[0].tolist()) == [1, 3, 5]
    p = np.exp(z[0]) / np.exp(z[0]).sum()
    for i, w in zip(ids[0].tolist(), weights[0].tolist(), strict=True):
        assert math.isclose(w, p[i], rel_tol=RTOL)


# -- sigmoid, selection bias, groups ---------------------------------------------------------


@pytest.mark.parametrize("normalize", [False, True])
def test_sigmoid_with_selection_bias(normalize: bool) -> None:
    """DeepSeek V3 / GLM-4.5: the bias moves the choice; the weights stay sigmoid(logit)."""
    rng = np.random.default_rng(2)
    t, e, k = 32, 64, 8
    z = rng.standard_normal((t, e)) * 1.5
    bias = rng.standard_normal(e) * 0.3
    r = Routing(top_k=k, func="sigmoid", normalize=normalize)
    ref = check_route(z, r, bias)
    no_bias = ref_route(z, k, "sigmoid", normalize)
    # The bias changes the selection on (nearly) every token here...
    assert n_changed_selections(ref, no_bias) >= t // 2
    # ...but never the weight of a chosen expert: it is the unbiased sigmoid.
    biased_weights = ref_route(z, k, "sigmoid", normalize, bias=bias)
    p = 1.0 / (1.0 + np.exp(-z))
    chosen = np.take_along_axis(p, biased_weights.ids, axis=1)
    if normalize:
        chosen = chosen / chosen.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(biased_weights.weights, chosen, rtol=1e-12)
    # A mistaken implementation that weighs by the biased score would be caught.
    s = p + bias
    wrong = np.take_along_axis(s, ref.ids, axis=1)
    if normalize:
        wrong = wrong / wrong.sum(axis=1, keepdims=True)
    assert np.abs(wrong - ref.weights).max() > 1e-2


def test_sigmoid_without_bias() -> None:
    z = logits_for(3, 16, 32)
    ref = check_route(z, Routing(top_k=4, func="sigmoid"))
    assert (ref.weights > 0).all() and (ref.weights < 1).all()


@pytest.mark.parametrize(
    ("e", "n_groups", "groups_used", "k"),
    [(64, 8, 3, 6), (256, 8, 4, 8), (32, 4, 1, 2)],
)
def test_grouped_topk(e: int, n_groups: int, groups_used: int, k: int) -> None:
    """DeepSeek V3: score groups by their two best experts, keep ``groups_used`` groups."""
    rng = np.random.default_rng(4 + e)
    t = 24
    z = rng.standard_normal((t, e)) * 1.5
    bias = rng.standard_normal(e) * 0.2
    r = Routing(
        top_k=k,
        func="sigmoid",
        normalize=True,
        scale=2.5,
        n_groups=n_groups,
        groups_used=groups_used,
    )
    ref = check_route(z, r, bias)
    per_group = e // n_groups
    for row in ref.ids:
        assert len({int(i) // per_group for i in row}) <= groups_used
    # The groups matter on this data: plain top-k, and groups scored by their best expert
    # alone, would both pick other experts for some tokens.
    plain = ref_route(z, k, "sigmoid", True, 2.5, bias=bias)
    assert n_changed_selections(ref, plain) > 0
    best_only = ref_route(z, k, "sigmoid", True, 2.5, n_groups, groups_used, bias, group_top=1)
    assert n_changed_selections(ref, best_only) > 0
    np.testing.assert_allclose(ref.weights.sum(axis=1), 2.5, rtol=1e-12)


def test_grouped_topk_uses_biased_scores_for_groups() -> None:
    """The group scores come from the biased selection scores, as the top-k itself does."""
    e, n_groups = 16, 4
    z = np.zeros((1, e))
    bias = np.zeros(e)
    # Without the bias group 0 wins (two high logits); with it group 3 does.
    z[0, 0:2] = 3.0
    z[0, 12:14] = 1.0
    bias[12:14] = 0.5
    r = Routing(top_k=2, func="sigmoid", n_groups=n_groups, groups_used=1)
    ref = check_route(z, r, bias)
    assert sorted(ref.ids[0].tolist()) == [12, 13]
    ids, _ = route(torch.tensor(z, dtype=torch.float32), r)
    assert sorted(ids[0].tolist()) == [0, 1]


# -- scaling, gpt-oss ------------------------------------------------------------------------


@pytest.mark.parametrize("scale", [2.5, 16.0, 0.5])
def test_routed_scaling_factor(scale: float) -> None:
    z = logits_for(5, 16, 64)
    ref = check_route(z, Routing(top_k=6, func="sigmoid", normalize=True, scale=scale))
    np.testing.assert_allclose(ref.weights.sum(axis=1), scale, rtol=1e-12)
    check_route(z, Routing(top_k=6, func="softmax", scale=scale))


def test_scale_zero_means_none() -> None:
    """llama.cpp scales only when the factor is neither 0 nor 1 (0 is the unset value)."""
    z = logits_for(6, 8, 16)
    a = route(torch.from_numpy(z.astype(np.float32)), Routing(top_k=4, scale=0.0))
    b = route(torch.from_numpy(z.astype(np.float32)), Routing(top_k=4, scale=1.0))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert (a[1] > 0).all()


@pytest.mark.parametrize("top_k", [1, 4])
def test_softmax_weight_gpt_oss(top_k: int) -> None:
    """gpt-oss: top-k on the logits, then softmax over the k chosen logits."""
    z = logits_for(7, 32, 32)
    ref = check_route(z, Routing(top_k=top_k, func="softmax_weight"))
    np.testing.assert_allclose(ref.weights.sum(axis=1), 1.0, rtol=1e-12)
    if top_k > 1:
        # Not the probabilities over all experts.
        assert differs(ref, ref_route(z, top_k, "softmax"))
        # The same selection as softmax top-k (softmax is monotone).
        np.testing.assert_array_equal(ref.ids, ref_route(z, top_k, "softmax").ids)


def test_softmax_weight_with_bias() -> None:
    """As in llama.cpp: a selection bias (no model has one today) moves the choice, and the
    softmax runs over the chosen experts' unbiased logits."""
    rng = np.random.default_rng(8)
    z = rng.standard_normal((16, 32))
    bias = rng.standard_normal(32)
    ref = check_route(z, Routing(top_k=4, func="softmax_weight"), bias)
    assert n_changed_selections(ref, ref_route(z, 4, "softmax_weight")) > 0


def test_normalize_clamps_tiny_sums() -> None:
    """The weight sum is clamped to 6.1e-5 before dividing (no 0/0 for saturated sigmoids)."""
    z = np.stack([np.linspace(-31.0, -24.0, 8), np.linspace(-8.0, -1.0, 8)])
    r = Routing(top_k=2, func="sigmoid", normalize=True)
    ref = ref_route(z, 2, "sigmoid", normalize=True)
    ids, weights = route(torch.from_numpy(z.astype(np.float32)), r)
    assert_matches(ids, weights, ref, rtol=1e-4)
    assert np.isfinite(ref.weights).all()
    p = 1.0 / (1.0 + np.exp(-z[0, -2:]))
    np.testing.assert_allclose(ref.weights[0].sum(), p.sum() / MIN_WEIGHT_SUM)  # clamped
    np.testing.assert_allclose(ref.weights[1].sum(), 1.0)  # a plain renormalization


# -- inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_input_dtypes(dtype: torch.dtype) -> None:
    """Half or double logits are routed in float32; the outputs are int32 and float32."""
    z = torch.from_numpy(logits_for(9, 8, 16)).to(dtype)
    ids, weights = route(z, Routing(top_k=3, normalize=True))
    ref = ref_route(z.double().numpy(), 3, normalize=True)
    assert ref.margin > MIN_MARGIN
    assert_matches(ids, weights, ref)


def test_non_contiguous_logits() -> None:
    z = torch.from_numpy(logits_for(10, 32, 12)).float().t()  # [12, 32], transposed view
    assert not z.is_contiguous()
    r = Routing(top_k=4, func="sigmoid", n_groups=4, groups_used=2)
    ids, weights = route(z, r)
    ref = ref_route(z.double().numpy(), 4, "sigmoid", n_groups=4, groups_used=2)
    assert ref.margin > MIN_MARGIN
    assert_matches(ids, weights, ref)


def test_gating_func_ids_follow_llama_cpp() -> None:
    """GGUF ``expert_gating_func``: llama.cpp's enum (0 = unset, treated as softmax)."""
    assert GATING_FUNCS == {0: "softmax", 1: "softmax", 2: "sigmoid", 3: "softmax_weight"}


def test_bad_routing() -> None:
    with pytest.raises(UnsupportedError):
        Routing(top_k=2, func="sqrt_softplus")
    with pytest.raises(InvalidInputError):
        Routing(top_k=0)
    with pytest.raises(InvalidInputError):
        Routing(top_k=2, n_groups=4, groups_used=5)
    z = torch.zeros(3, 16)
    with pytest.raises(ShapeError):
        route(z, Routing(top_k=17))
    with pytest.raises(ShapeError):
        route(z, Routing(top_k=2, n_groups=3, groups_used=2))
    with pytest.raises(ShapeError):
        route(z, Routing(top_k=2, n_groups=16, groups_used=2))  # groups of one expert
    with pytest.raises(ShapeError):
        route(z, Routing(top_k=9, n_groups=4, groups_used=2))  # only 8 experts in 2 groups
    with pytest.raises(ShapeError):
        route(z, Routing(top_k=2, func="sigmoid"), torch.zeros(15))
    with pytest.raises(ShapeError):
        route(torch.zeros(16), Routing(top_k=2))
    for err in (UnsupportedError, InvalidInputError, ShapeError):
        assert issubclass(err, FreeTokenError)
