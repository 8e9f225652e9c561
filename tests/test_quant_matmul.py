"""``QuantMatrix.matmul`` against a float64 product.

y = x @ W.T with W quantized is compared with ``x (float64) @ dequantize(W) (float64) .T``; the
per-token relative error ``||y[t] - y_ref[t]|| / ||y_ref[t]||`` must be at most 1e-2. What is
left is the error of quantizing each activation row to the type's vec_dot type (Q8_0, Q8_1,
Q8_K: about 0.3% here; F16 / BF16 less) and of float32 accumulation.

Grid: T in {1, 2, 7, 33}, N in {1, 31, 4096}, K in {256, 768, 2304, 2560} (every K is a whole
number of blocks of every type). The full grid runs for a few main types, one per activation
type; every other type with a vec_dot runs four cases that between them take every value of
T, N and K. Each case checks numpy and torch input, and 1-D input.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from freetoken import _core, quant

TS = (1, 2, 7, 33)
NS = (1, 31, 4096)
KS = (256, 768, 2304, 2560)
TOLERANCE = 1e-2

# Full grid: Q4_0 and Q8_0 (Q8_0 activations), Q4_1 (Q8_1), Q4_K and Q6_K (Q8_K).
MAIN_TYPES = ("Q4_0", "Q4_1", "Q8_0", "Q4_K", "Q6_K")


def vec_dot_types() -> list[str]:
    """Every type with a CPU dot product, by id."""
    return [info.name for info in quant.all_types() if info.has_vec_dot]


ALL_TYPES = vec_dot_types()
OTHER_TYPES = [t for t in ALL_TYPES if t not in MAIN_TYPES]


def sampled_cases(index: int) -> list[tuple[int, int, int]]:
    """Four (T, N, K) cases covering every T, N and K value, varied with the type's index.
    N = 4096 goes with K = 256 to keep the slow IQ quantizers affordable."""
    ts = TS[index % 4 :] + TS[: index % 4]
    ks = (768, 2304, 2560)
    ks = ks[index % 3 :] + ks[: index % 3]
    nks = [(4096, 256), (1, ks[0]), (31, ks[1]), (31, ks[2])]
    return [(t, n, k) for t, (n, k) in zip(ts, nks, strict=True)]


def cases() -> Iterator[tuple[str, int, int, int]]:
    # (N, K) outermost so that one quantized matrix serves consecutive cases (cached below).
    for qtype in MAIN_TYPES:
        for n in NS:
            for k in KS:
                for t in TS:
                    yield qtype, t, n, k
    for index, qtype in enumerate(OTHER_TYPES):
        for t, n, k in sampled_cases(index):
            yield qtype, t, n, k


CASES = list(cases())


@functools.lru_cache(maxsize=2)
def weights(qtype: str, n: int, k: int) -> tuple[quant.QuantMatrix, np.ndarray, np.ndarray]:
    """(quantized matrix, its dequantization in float64, the float32 source) for N x K.

    Rows are independent standard normals, so a row or block mix-up changes the product
    completely."""
    info = quant.type_info(qtype)
    rng = np.random.default_rng([info.id, n, k])
    w = rng.standard_normal((n, k)).astype(np.float32)
    imatrix = rng.uniform(0.5, 2.0, k).astype(np.float32) if info.requires_imatrix else None
    raw = quant.quantize(w, qtype, imatrix)
    m = quant.QuantMatrix(raw, qtype, (n, k))
    return m, quant.dequantize(raw, qtype, (n, k)).astype(np.float64), w


def activations(seed: list[int], t: int, w: np.ndarray) -> np.ndarray:
    """T x K float32: magnitudes in [0.5, 1] (small crest factor, so 8-bit activation
    quantization stays well inside the tolerance) times a per-token scale.

    Signs are random, except for N = 1: one output per token is a ratio of two scalars, and a
    random dot product can cancel to ~0; there the signs follow the weight row's, so the exact
    product is large, and pairing the wrong weights with the wrong activations still gives
    O(1) error."""
    n, k = w.shape
    rng = np.random.default_rng(seed)
    if n == 1:
        signs = np.where(w[0] >= 0, 1.0, -1.0)[None, :]
    else:
        signs = rng.choice([-1.0, 1.0], (t, k))
    scale = rng.uniform(0.5, 2.0, (t, 1))
    return (scale * signs * rng.uniform(0.5, 1.0, (t, k))).astype(np.float32)


def relative_errors(y: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """Per-token ||y - ref|| / ||ref|| of (T, N) arrays."""
    y64 = y.astype(np.float64)
    return np.linalg.norm(y64 - ref, axis=1) / np.linalg.norm(ref, axis=1)


@pytest.mark.parametrize(("qtype", "t", "n", "k"), CASES)
def test_matmul_matches_float64_product(qtype: str, t: int, n: int, k: int) -> None:
    m, w64, w = weights(qtype, n, k)
    x = activations([quant.type_info(qtype).id, t, n, k], t, w)
    ref = x.astype(np.float64) @ w64.T
    assert np.all(np.linalg.norm(ref, axis=1) > 0)

    y = m.matmul(x)
    assert isinstance(y, np.ndarray) and y.dtype == np.float32 and y.shape == (t, n)
    err = relative_errors(y, ref)
    assert err.max() <= TOLERANCE, f"{qtype} T={t} N={n} K={k}: per-token errors {err}"

    yt = m.matmul(torch.from_numpy(x))
    assert isinstance(yt, torch.Tensor) and yt.dtype == torch.float32 and yt.shape == (t, n)
    assert relative_errors(yt.numpy(), ref).max() <= TOLERANCE
    np.testing.assert_array_equal(yt.numpy(), y)  # the same kernel on the same values

    # 1-D input: a single token (the last one), numpy and torch.
    y1 = m.matmul(x[-1])
    assert isinstance(y1, np.ndarray) and y1.shape == (n,)
    assert relative_errors(y1[None], ref[-1:]).item() <= TOLERANCE
    y1t = m.matmul(torch.from_numpy(x[-1]))
    assert isinstance(y1t, torch.Tensor) and tuple(y1t.shape) == (n,)
    np.testing.assert_array_equal(y1t.numpy(), y1)
    # Each token is quantized and multiplied on its own: batching does not change it, but for
    # the AVX2 level's tiled kernels (crates/ft-cpu/src/kernels/avx2_gemm.rs), which round
    # otherwise than the one-token kernel (ggml's) within the bound stated there, checked per
    # token and row by `cargo test -p ft-cpu`. For the legacy types, here its looser form
    # 2 gamma_(K/32 + 5) x sum_i |w_i| x max |x|, as |d_a q_a| <= the block's max |x|.
    if _core.cpu_kernel_isa() != "avx2":
        np.testing.assert_array_equal(y1, y[-1])
    elif qtype in ("Q4_0", "Q5_0", "Q8_0"):
        nu = (k // 32 + 5) * 2.0**-24
        bound = 2 * nu / (1 - nu) * np.abs(w64).sum(axis=1) * np.abs(x[-1]).max()
        assert np.all(np.abs(y1.astype(np.float64) - y[-1]) <= bound)


def test_grid_covers_every_value_for_every_type() -> None:
    seen: dict[str, tuple[set[int], set[int], set[int]]] = {}
    for qtype, t, n, k in CASES:
        ts, ns, ks = seen.setdefault(qtype, (set(), set(), set()))
        ts.add(t)
        ns.add(n)
        ks.add(k)
        assert k % quant.type_info(qtype).block_size == 0
    assert sorted(seen) == sorted(ALL_TYPES)
    for qtype, (ts, ns, ks) in seen.items():
        assert (ts, ns, ks) == (set(TS), set(NS), set(KS)), qtype
    # Storage types with a dot product: all of them but none of the activation-only types.
    assert len(ALL_TYPES) == 28 and "Q8_K" not in ALL_TYPES and "Q8_1" not in ALL_TYPES


@pytest.fixture
def restore_threads() -> Iterator[None]:
    before = _core.num_threads()
    yield
    _core.set_num_threads(before)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q4_K", "IQ4_NL", "F16"])
@pytest.mark.usefixtures("restore_threads")
def test_matmul_is_the_same_for_any_thread_count(qtype: str) -> None:
    """Rows are split across the pool; the result must not depend on how (each output is one
    dot product). 517 rows: not a multiple of any task size."""
    n, k, t = 517, 768, 5
    rng = np.random.default_rng(3)
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = quant.quantize(w, qtype)
    m = quant.QuantMatrix(raw, qtype, (n, k))
    x = activations([4], t, w)
    ref = x.astype(np.float64) @ quant.dequantize(raw, qtype, (n, k)).astype(np.float64).T
    results = []
    for threads in (1, 2, 3, 8):
        _core.set_num_threads(threads)
        assert _core.num_threads() == threads
        y = m.matmul(x)
        assert relative_errors(y, ref).max() <= TOLERANCE, threads
        results.append(y)
    for y in results[1:]:
        np.testing.assert_array_equal(y, results[0])


def test_matmul_on_a_view_of_a_larger_buffer() -> None:
    """Weights given as a slice of a bigger array (as from a memory-mapped file) are read in
    place, from the slice's start."""
    n, k = 64, 256
    rng = np.random.default_rng(11)
    w = rng.standard_normal((2 * n, k)).astype(np.float32)
    raw = np.frombuffer(quant.quantize(w, "Q4_K"), np.uint8)
    row = quant.type_info("Q4_K").row_size(k)
    second = raw[n * row :]
    m = quant.QuantMatrix(second, "Q4_K", (n, k))
    x = activations([12], 3, w[n:])
    ref = x.astype(np.float64) @ quant.dequantize(second, "Q4_K", (n, k)).astype(np.float64).T
    assert relative_errors(m.matmul(x), ref).max() <= TOLERANCE
    np.testing.assert_array_equal(m.dequantize(), quant.dequantize(raw, "Q4_K", (2 * n, k))[n:])
