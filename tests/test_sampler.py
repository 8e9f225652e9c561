"""Tests of freetoken.runtime.sampler against float64 numpy references written here.

The reference (`ref_probs`) follows llama.cpp's default chain from its definitions: penalties
over the last repeat_last_n history tokens, then top-k, top-p (softmax of the survivors at
temperature 1, keeping the first token whose cumulative mass reaches top_p), min-p (logit at
least max + log(min_p)), temperature, softmax. It never calls the code under test. Each
distribution test also checks that plausible mistakes (temperature applied first, top-p
without the crossing token, dividing negative logits by the repeat penalty, ...) would move
some probability by far more than the tolerance, so a wrong implementation fails.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from freetoken.errors import InvalidInputError, ShapeError
from freetoken.runtime.sampler import Sampler, SamplingParams, log_softmax

# Everything off: a plain softmax at temperature 1.
PLAIN = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1234)


# -- the reference ---------------------------------------------------------------------------


@dataclass
class Mistakes:
    """Deliberate errors, to show the tests can tell them from the right chain."""

    temp_first: bool = False  # temperature before top-p / min-p
    top_p_exclusive: bool = False  # drop the token whose cumulative mass crosses top_p
    top_p_full_norm: bool = False  # top-p on the whole-vocabulary softmax, ignoring top-k
    divide_negative: bool = False  # repeat penalty divides negative logits too
    no_window: bool = False  # penalties over the whole history
    presence_per_count: bool = False  # presence penalty applied once per occurrence


def softmax64(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def ref_penalize(
    logits: np.ndarray, history: Sequence[int], p: SamplingParams, m: Mistakes | None = None
) -> np.ndarray:
    m = m or Mistakes()
    out = np.array(logits, dtype=np.float64)
    if p.repeat_last_n == 0:
        return out
    window = list(history) if m.no_window else list(history)[-p.repeat_last_n :]
    for tok, count in Counter(window).items():
        v = out[tok]
        if v <= 0 and not m.divide_negative:
            v *= p.repeat_penalty
        else:
            v /= p.repeat_penalty
        presence = p.presence_penalty * (count if m.presence_per_count else 1)
        out[tok] = v - count * p.frequency_penalty - presence
    return out


def ref_chain(
    logits: np.ndarray, history: Sequence[int], p: SamplingParams, m: Mistakes | None = None
) -> tuple[np.ndarray, float]:
    """The final distribution over the vocabulary (zeros outside the kept set) and the smallest
    distance of any top-p / min-p decision from its threshold (to check the test's own margin
    against float32 rounding in the code under test)."""
    m = m or Mistakes()
    lg = ref_penalize(logits, history, p, m)
    vocab = lg.shape[0]
    out = np.zeros(vocab)
    if p.temperature <= 0:
        out[int(np.argmax(lg))] = 1.0
        return out, math.inf
    if m.temp_first:
        lg = lg / p.temperature
    margin = math.inf
    kept = np.argsort(-lg, kind="stable")
    if 0 < p.top_k < vocab:
        kept = kept[: p.top_k]
    if p.top_p < 1.0:
        probs = softmax64(lg)[kept] if m.top_p_full_norm else softmax64(lg[kept])
        cum = np.cumsum(probs)
        margin = min(margin, float(np.min(np.abs(cum - p.top_p))))
        n = int(np.sum(cum < p.top_p)) + (0 if m.top_p_exclusive else 1)
        kept = kept[: max(1, min(n, len(kept)))]
    if p.min_p > 0.0:
        threshold = lg[kept[0]] + math.log(p.min_p)
        margin = min(margin, float(np.min(np.abs(lg[kept] - threshold))))
        kept = kept[lg[kept] >= threshold]
    z = lg[kept] if m.temp_first else lg[kept] / p.temperature
    out[kept] = softmax64(z)
    return out, margin


def ref_probs(
    logits: np.ndarray, history: Sequence[int], p: SamplingParams, m: Mistakes | None = None
) -> np.ndarray:
    return ref_chain(logits, history, p, m)[0]


def draw_many(p: SamplingParams, logits: np.ndarray, history: Sequence[int], n: int) -> np.ndarray:
    """n draws for the same position, through sample_batch (equal to n sample() calls, which
    test_batch_equals_sequential checks)."""
    sampler = Sampler(p, logits.shape[0])
    rows = torch.from_numpy(logits.astype(np.float32)).expand(n, -1)
    return np.array(sampler.sample_batch(rows, [history] * n))


def assert_matches(draws: np.ndarray, ref: np.ndarray) -> None:
    """Never a token outside the kept set; each frequency within 5 sigma of its probability."""
    n = draws.shape[0]
    freq = np.bincount(draws, minlength=ref.shape[0]) / n
    outside = np.nonzero((ref == 0) & (freq > 0))[0]
    assert outside.size == 0, f"drew tokens outside the kept set: {outside.tolist()}"
    sigma = np.sqrt(ref * (1 - ref) / n)
    bad = np.nonzero(np.abs(freq - ref) > 5 * sigma + 1e-12)[0]
    assert bad.size == 0, (
        f"frequencies off at {bad.tolist()}: got {freq[bad].round(4).tolist()}, "
        f"want {ref[bad].round(4).tolist()}"
    )


def assert_distinguishable(ref: np.ndarray, wrong: np.ndarray, n: int) -> None:
    """Some token's probability moves by over 10 sigma at n draws (twice assert_matches's
    tolerance), so draws from the wrong distribution fail assert_matches."""
    sigma = np.sqrt(np.maximum(ref * (1 - ref), wrong * (1 - wrong)) / n)
    z = np.abs(ref - wrong) / np.where(sigma > 0, sigma, 1.0)
    assert z.max() > 10, f"mistake not detectable (max deviation {z.max():.1f} sigma)"


# Well-separated logits of a small vocabulary; token 9 and 10 are negative.
BASE = np.array([3.0, 2.6, 2.2, 1.9, 1.5, 1.0, 0.4, 0.1, 0.0, -0.4, -0.8, -2.0], dtype=np.float32)
# Flatter, with more mass on negative logits, so the penalty rules matter.
PEN = np.array([1.2, 0.9, 0.6, 0.3, -0.1, -0.3, -0.6, -1.0], dtype=np.float32)

N_DRAWS = 20000

# (name, params, history, logits, mistakes the test must be able to tell apart)
CASES = [
    ("temperature", replace(PLAIN, temperature=0.7), [], BASE, []),
    ("hot", replace(PLAIN, temperature=1.8), [], BASE, []),
    ("top_k", replace(PLAIN, top_k=3), [], BASE, []),
    (
        "top_p",
        replace(PLAIN, top_p=0.8, temperature=1.5),
        [],
        BASE,
        [Mistakes(temp_first=True), Mistakes(top_p_exclusive=True)],
    ),
    ("min_p", replace(PLAIN, min_p=0.15, temperature=1.5), [], BASE, [Mistakes(temp_first=True)]),
    (
        "top_k_then_top_p",
        replace(PLAIN, top_k=4, top_p=0.75),
        [],
        BASE,
        [Mistakes(top_p_full_norm=True), Mistakes(top_p_exclusive=True)],
    ),
    (
        "penalties",
        replace(
            PLAIN,
            repeat_penalty=2.0,
            presence_penalty=0.3,
            frequency_penalty=0.2,
            repeat_last_n=6,
        ),
        # token 1 only outside the window of 6; inside: 0 twice, 5 (negative logit) twice, 6
        [1, 1, 4, 0, 5, 0, 6, 5],
        PEN,
        [
            Mistakes(divide_negative=True),
            Mistakes(no_window=True),
            Mistakes(presence_per_count=True),
        ],
    ),
    (
        "llama_defaults_with_penalties",
        replace(SamplingParams(seed=99), repeat_penalty=1.2, frequency_penalty=0.1),
        [3, 3, 7, 60, 61],
        (np.linspace(4.0, -4.0, 64) + np.random.default_rng(3).normal(0, 0.3, 64)).astype(
            np.float32
        ),
        [Mistakes(temp_first=True)],
    ),
]


@pytest.mark.parametrize(
    ("params", "history", "logits", "mistakes"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_empirical_distribution(
    params: SamplingParams, history: list[int], logits: np.ndarray, mistakes: list[Mistakes]
) -> None:
    ref, margin = ref_chain(logits, history, params)
    assert margin > 1e-3, "test logits too close to a top-p / min-p threshold"
    assert (ref > 0).sum() >= 2, "degenerate case: nothing to sample"
    for m in mistakes:
        assert_distinguishable(ref, ref_probs(logits, history, params, m), N_DRAWS)
    assert_matches(draw_many(params, logits, history, N_DRAWS), ref)


@pytest.mark.parametrize(
    ("params", "history", "logits"), [c[1:4] for c in CASES], ids=[c[0] for c in CASES]
)
def test_candidates_equal_reference(
    params: SamplingParams, history: list[int], logits: np.ndarray
) -> None:
    """The exact final distribution (kept set and log-probabilities), no sampling noise."""
    ref = ref_probs(logits, history, params)
    sampler = Sampler(params, logits.shape[0])
    ids, logprobs = sampler.candidates(torch.from_numpy(logits), history)
    assert sorted(ids.tolist()) == np.nonzero(ref)[0].tolist()
    assert logprobs.dtype == torch.float64
    np.testing.assert_allclose(logprobs.numpy(), np.log(ref[ids.numpy()]), atol=2e-6)
    assert np.all(np.diff(logprobs.numpy()) <= 0), "candidates must come most likely first"


def test_wrong_parameters_are_detected() -> None:
    """Temperature ignored or inverted, or top-k off by one, is far beyond the tolerance."""
    p = replace(PLAIN, temperature=0.7)
    ref = ref_probs(BASE, [], p)
    assert_distinguishable(ref, ref_probs(BASE, [], PLAIN), N_DRAWS)
    assert_distinguishable(ref, ref_probs(BASE, [], replace(p, temperature=1 / 0.7)), N_DRAWS)
    p = replace(PLAIN, top_k=3)
    ref = ref_probs(BASE, [], p)
    for k in (2, 4):
        assert_distinguishable(ref, ref_probs(BASE, [], replace(p, top_k=k)), N_DRAWS)


# -- greedy and penalties ----------------------------------------------------------------------


def test_greedy_equals_argmax() -> None:
    rng = np.random.default_rng(0)
    for vocab in (2, 17, 1000, 262144):
        for temperature in (0.0, -1.0):
            p = SamplingParams(temperature=temperature, seed=0)
            assert p.greedy
            sampler = Sampler(p, vocab)
            for _ in range(5):
                logits = rng.normal(0, 3, vocab).astype(np.float32)
                assert sampler.sample(torch.from_numpy(logits), []) == int(np.argmax(logits))


def test_greedy_batch_equals_argmax() -> None:
    logits = np.random.default_rng(1).normal(0, 2, (8, 5000)).astype(np.float32)
    sampler = Sampler(SamplingParams(temperature=0.0), 5000)
    got = sampler.sample_batch(torch.from_numpy(logits), [[]] * 8)
    assert got == np.argmax(logits, axis=1).tolist()


def test_greedy_takes_the_first_of_equal_maxima() -> None:
    """llama.cpp's greedy sampler keeps the first token with the largest logit."""
    sampler = Sampler(SamplingParams(temperature=0.0), 6)
    x = torch.tensor([[0.5, 2.0, -1.0, 2.0, 1.0, 2.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    assert sampler.sample_batch(x, [[], []]) == [1, 0]
    with pytest.raises(InvalidInputError):
        sampler.sample(torch.tensor([0.0, math.inf, 1.0, 2.0, 3.0, 4.0]))


def test_penalties_change_greedy_pick() -> None:
    """Hand-worked cases, each fooling one plausible mistake."""
    greedy = SamplingParams(temperature=0.0, repeat_last_n=64)

    def pick(logits: list[float], history: list[int], **kw: float) -> int:
        x = torch.tensor(logits, dtype=torch.float32)
        return Sampler(replace(greedy, **kw), len(logits)).sample(x, history)

    # positive logit divided: 2.0 / 1.1 = 1.82 < 1.9
    assert pick([2.0, 1.9, -1.0], [0], repeat_penalty=1.1) == 1
    # negative logit multiplied: -1.0 * 1.1 = -1.1 < -1.05 (dividing would give -0.91: pick 0)
    assert pick([-1.0, -1.05, -3.0], [0], repeat_penalty=1.1) == 1
    # repeat penalty once per distinct token, however often it occurs: 2.0 / 1.1 = 1.82 > 1.8
    assert pick([2.0, 1.8, 0.0], [0, 0, 0, 0], repeat_penalty=1.1) == 0
    # frequency counts occurrences: 2.0 - 3 * 0.1 = 1.7 < 1.8; presence once: 2.0 - 0.1 = 1.9
    assert pick([2.0, 1.8, 0.0], [0, 0, 0], frequency_penalty=0.1) == 1
    assert pick([2.0, 1.8, 0.0], [0, 0, 0], presence_penalty=0.1) == 0
    # only the last repeat_last_n tokens count: token 0 is outside a window of 2
    assert pick([2.0, 1.9, 0.0], [0, 2, 2], repeat_penalty=2.0, repeat_last_n=2) == 0
    assert pick([2.0, 1.9, 0.0], [2, 0, 2], repeat_penalty=2.0, repeat_last_n=2) == 1
    # repeat_last_n = 0 disables every penalty
    assert pick([2.0, 1.9, 0.0], [0], presence_penalty=5.0, repeat_last_n=0) == 0
    # a negative presence penalty raises a logit
    assert pick([2.0, 1.9, 0.0], [1], presence_penalty=-0.2) == 1


def test_penalties_random_greedy_against_reference() -> None:
    rng = np.random.default_rng(7)
    checked = 0
    for _ in range(300):
        vocab = int(rng.integers(2, 40))
        logits = rng.normal(0, 2, vocab).astype(np.float32)
        history = rng.integers(0, vocab, int(rng.integers(0, 30))).tolist()
        p = SamplingParams(
            temperature=0.0,
            repeat_penalty=float(rng.uniform(0.5, 2.0)),
            repeat_last_n=int(rng.integers(0, 20)),
            presence_penalty=float(rng.uniform(-1, 1)),
            frequency_penalty=float(rng.uniform(-0.5, 0.5)),
        )
        want = ref_penalize(logits, history, p)
        top2 = np.sort(want)[-2:] if vocab > 1 else want
        if top2[-1] - top2[0] < 1e-4:
            continue  # a float32 tie: either answer is right
        got = Sampler(p, vocab).sample(torch.from_numpy(logits), history)
        assert got == int(np.argmax(want)), (p, history, logits)
        checked += 1
    assert checked > 250


def test_penalties_do_not_modify_callers_logits() -> None:
    x = torch.tensor(BASE)
    before = x.clone()
    p = replace(PLAIN, repeat_penalty=1.3, presence_penalty=1.0, frequency_penalty=1.0)
    Sampler(p, BASE.shape[0]).sample(x, [0, 1, 2, 9])
    assert torch.equal(x, before)


def test_history_may_be_tuple_array_or_tensor() -> None:
    p = replace(PLAIN, temperature=0.0, repeat_penalty=2.0)
    x = torch.tensor([2.0, 1.9, 0.0])
    sampler = Sampler(p, 3)
    for history in ([0], (0,), np.array([0]), torch.tensor([0]), range(1)):
        assert sampler.sample(x, history) == 1


# -- kept set, large vocabularies ------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        replace(PLAIN, top_k=7),
        replace(PLAIN, top_p=0.5),
        replace(PLAIN, min_p=0.1),
        SamplingParams(seed=5),
    ],
    ids=["top_k", "top_p", "min_p", "defaults"],
)
def test_never_draws_outside_kept_set(params: SamplingParams) -> None:
    logits = np.random.default_rng(11).normal(0, 2, 1000).astype(np.float32)
    ref, margin = ref_chain(logits, [], params)
    assert margin > 1e-4
    draws = draw_many(params, logits, [], 5000)
    assert set(draws.tolist()) <= set(np.nonzero(ref)[0].tolist())
    assert len(set(draws.tolist())) >= 2


def _big_logits(scale: float, head: bool) -> np.ndarray:
    """A 262144-token row: noise, plus (if head) a decaying head like a real model's logits."""
    rng = np.random.default_rng(5)
    x = rng.normal(0, scale, 262144)
    if head:
        x[rng.permutation(262144)[:200]] += np.linspace(12, 4, 200)
    return x.astype(np.float32)


@pytest.mark.parametrize(
    ("top_k", "top_p", "min_p", "scale", "head", "kept_range"),
    [
        (40, 0.95, 0.05, 1.0, True, (10, 40)),  # llama.cpp defaults: topk path
        (0, 0.95, 0.05, 1.0, True, (10, 40)),  # top-k off, min-p's prefix the shorter
        (0, 0.5, 0.01, 1.0, True, (3, 20)),  # top-k off, top-p's prefix the shorter
        (0, 1.0, 0.05, 1.0, True, (10, 256)),  # min-p alone, few survivors: topk
        (0, 1.0, 1e-5, 1.0, True, (257, 5000)),  # min-p alone, many: masked unsorted row
        (0, 0.9, 0.0, 1.5, True, (10, 1024)),  # top-p alone within the first chunk
        (0, 0.95, 0.0, 1.0, True, (1025, 8192)),  # ... within the second
        (0, 0.99, 0.0, 2.0, True, (8193, 65536)),  # ... within the third
        (0, 0.9, 0.0, 0.5, False, (65537, 262144)),  # ... needing a full sort
        (0, 1.0, 0.0, 1.0, True, (262144, 262144)),  # everything off: the whole row
    ],
)
def test_large_vocab_paths(
    top_k: int, top_p: float, min_p: float, scale: float, head: bool, kept_range: tuple[int, int]
) -> None:
    logits = _big_logits(scale, head)
    p = SamplingParams(temperature=0.9, top_k=top_k, top_p=top_p, min_p=min_p, seed=3)
    ref = ref_probs(logits, [], p)
    kept = set(np.nonzero(ref)[0].tolist())
    assert kept_range[0] <= len(kept) <= kept_range[1], "case does not take the intended path"
    ids, logprobs = Sampler(p, logits.shape[0]).candidates(torch.from_numpy(logits))
    got = dict(zip(ids.tolist(), logprobs.tolist(), strict=True))
    # With thousands of tokens kept, float32 rounding may move the top-p cut by a token of
    # negligible probability; anything more is an error.
    differ = kept ^ got.keys()
    assert len(differ) <= 2, f"kept sets differ by {len(differ)} tokens"
    for tok in differ:
        assert max(ref[tok], math.exp(got.get(tok, -math.inf))) < 1e-5
    common = sorted(kept & got.keys())
    np.testing.assert_allclose([got[t] for t in common], np.log(ref[common]), rtol=0, atol=1e-4)
    draws = Sampler(p, logits.shape[0]).sample_batch(
        torch.from_numpy(logits).expand(20, -1), [[]] * 20
    )
    assert set(draws) <= got.keys()


# -- seeds and batches -----------------------------------------------------------------------


def _flat_logits(vocab: int = 500) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(2).normal(0, 0.5, vocab).astype(np.float32))


def test_same_seed_same_tokens() -> None:
    x = _flat_logits()
    p = SamplingParams(seed=42, top_k=0, min_p=0.0)
    history: list[int] = []
    a = Sampler(p, 500)
    b = Sampler(p, 500)
    seq_a, seq_b = [], []
    for _ in range(300):
        seq_a.append(a.sample(x, history))
        seq_b.append(b.sample(x, history))
    assert seq_a == seq_b
    assert len(set(seq_a)) > 50  # really random, not stuck
    c = Sampler(replace(p, seed=43), 500)
    assert [c.sample(x, history) for _ in range(300)] != seq_a


def test_random_seed_is_reported_and_reusable() -> None:
    x = _flat_logits()
    for seed in (None, -1):
        p = SamplingParams(seed=seed)
        assert p.seed is None
        s1 = Sampler(p, 500)
        assert isinstance(s1.seed, int)
        s2 = Sampler(replace(p, seed=s1.seed), 500)
        assert [s1.sample(x) for _ in range(50)] == [s2.sample(x) for _ in range(50)]
    assert Sampler(SamplingParams(), 500).seed != Sampler(SamplingParams(), 500).seed


def test_batch_equals_sequential() -> None:
    rng = np.random.default_rng(9)
    rows = torch.from_numpy(rng.normal(0, 1, (64, 300)).astype(np.float32))
    histories = [rng.integers(0, 300, int(rng.integers(0, 80))).tolist() for _ in range(64)]
    p = SamplingParams(seed=17, repeat_penalty=1.3, presence_penalty=0.2, frequency_penalty=0.1)
    batch = Sampler(p, 300).sample_batch(rows, histories)
    one = Sampler(p, 300)
    assert batch == [one.sample(rows[i], histories[i]) for i in range(64)]


def test_sample_batch_empty() -> None:
    assert Sampler(SamplingParams(), 10).sample_batch(torch.zeros(0, 10), []) == []


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu() -> None:
    x = _flat_logits()
    p = SamplingParams(seed=8, repeat_penalty=1.2)
    history = [1, 2, 3, 2]
    cpu = Sampler(p, 500)
    gpu = Sampler(p, 500)
    xc = x.cuda()
    assert [cpu.sample(x, history) for _ in range(100)] == [
        gpu.sample(xc, history) for _ in range(100)
    ]


# -- logprobs ----------------------------------------------------------------------------------


def test_log_softmax_reference() -> None:
    x = np.random.default_rng(4).normal(0, 5, (3, 1000)).astype(np.float32)
    got = log_softmax(torch.from_numpy(x))
    assert got.dtype == torch.float32
    x64 = x.astype(np.float64)
    want = x64 - x64.max(axis=1, keepdims=True)
    want -= np.log(np.exp(want).sum(axis=1, keepdims=True))
    np.testing.assert_allclose(got.numpy(), want, atol=1e-5)
    half = log_softmax(torch.from_numpy(x[0]).to(torch.bfloat16))
    assert half.dtype == torch.float32 and half.shape == (1000,)


# -- parameters and input validation ---------------------------------------------------------


def test_defaults_are_llama_cpp_defaults() -> None:
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.8, 40, 0.95, 0.05)
    assert (p.repeat_penalty, p.repeat_last_n) == (1.0, 64)
    assert (p.presence_penalty, p.frequency_penalty, p.seed) == (0.0, 0.0, None)
    assert not p.greedy and not p.penalties_enabled
    assert SamplingParams(temperature=0).greedy and SamplingParams(temperature=-0.5).greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", -0.1),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", math.nan),
        ("repeat_penalty", 0.0),
        ("repeat_penalty", -1.0),
        ("repeat_penalty", math.nan),
        ("repeat_penalty", math.inf),
        ("repeat_penalty", 1e-320),
        ("repeat_last_n", -1),
        ("repeat_last_n", 2.0),
        ("presence_penalty", math.nan),
        ("presence_penalty", -math.inf),
        ("frequency_penalty", math.nan),
        ("frequency_penalty", math.inf),
        ("seed", -2),
        ("seed", 2**64),
        ("seed", 1.5),
    ],
)
def test_invalid_params(field: str, value: object) -> None:
    with pytest.raises(InvalidInputError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    "kw",
    [
        {"temperature": -1.0},
        {"top_k": 0},
        {"top_k": 10**6},
        {"top_p": 1.0},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"repeat_last_n": 0},
        {"seed": 0},
        {"seed": 2**64 - 1},
        {"seed": np.int64(5)},
        {"temperature": np.float32(0.5)},
    ],
)
def test_valid_edge_params(kw: dict[str, object]) -> None:
    p = SamplingParams(**kw)  # type: ignore[arg-type]
    x = torch.from_numpy(BASE)
    assert 0 <= Sampler(p, BASE.shape[0]).sample(x, [0, 1]) < BASE.shape[0]


def test_min_p_one_keeps_only_the_top() -> None:
    draws = draw_many(replace(PLAIN, min_p=1.0), BASE, [], 200)
    assert set(draws.tolist()) == {0}


def test_bad_inputs() -> None:
    s = Sampler(SamplingParams(seed=1, repeat_penalty=1.1), 12)
    x = torch.from_numpy(BASE)
    with pytest.raises(InvalidInputError, match="vocab_size"):
        Sampler(SamplingParams(), 0)
    with pytest.raises(ShapeError):
        s.sample(torch.zeros(13))
    with pytest.raises(ShapeError):
        s.sample(torch.zeros(1, 12))
    with pytest.raises(ShapeError):
        s.sample_batch(torch.zeros(12), [[]])
    with pytest.raises(ShapeError):
        s.sample_batch(torch.zeros(2, 12), [[]])
    with pytest.raises(InvalidInputError, match="floating"):
        s.sample(torch.zeros(12, dtype=torch.int64))
    with pytest.raises(InvalidInputError, match="outside"):
        s.sample(x, [12])
    with pytest.raises(InvalidInputError, match="outside"):
        s.sample(x, [-1])
    with pytest.raises(InvalidInputError, match="integer"):
        s.sample(x, [1.5])


@pytest.mark.parametrize(
    "params",
    [SamplingParams(temperature=0.0), SamplingParams(seed=1), replace(PLAIN, top_p=0.9)],
    ids=["greedy", "defaults", "top_p"],
)
@pytest.mark.parametrize("where", [0, 5, 11])
def test_nan_logits_rejected(params: SamplingParams, where: int) -> None:
    x = torch.from_numpy(BASE.copy())
    x[where] = math.nan
    with pytest.raises(InvalidInputError, match="NaN"):
        Sampler(params, 12).sample(x)
    with pytest.raises(InvalidInputError, match="row 1"):
        Sampler(params, 12).sample_batch(torch.stack([torch.from_numpy(BASE), x]), [[], []])
    with pytest.raises(InvalidInputError):
        Sampler(params, 12).sample(torch.full((12,), -math.inf))
