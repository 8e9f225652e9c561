"""Round-trip error on ggml's own quantization test data.

Mirrors ``tests/test-quantize-fns.cpp`` of the pinned llama.cpp (read for its facts):

* data: ``x[i] = 0.1 + 2 * cosf(i + offset)`` for ``i < 32 * 128``, quantized as one row;
* error: what that file calls ``array_rmse``, which is ``sqrt(sum((x - y)^2)) / n``. That is not
  the RMSE ``sqrt(sum((x - y)^2) / n)``: it is the RMSE divided by ``sqrt(n) = 64``. The bounds
  below are ggml's and are meant for ggml's measure, so that is what is asserted; the true RMSE
  is the same number times 64 (0.072 for Q4_0), so asserting it as well against the same
  bounds would fail for every 4-bit type, and against 64 times the bounds would repeat the
  first check. It is reported in the failure message.
* bounds by type, as ggml classifies them: 0.025 binary (Q1_0); 0.01 ternary (TQ1_0, TQ2_0 and
  also Q2_0, which ggml puts with the ternary types); 0.0075 for its 2-bit types (Q2_K, IQ2_S);
  0.004 for 3-bit (Q3_K, IQ3_S); 0.005 for IQ3_XXS; 0.003 for NVFP4; 0.002 for everything else.

ggml quantizes with each type's CPU ``from_float``; ours goes through ``ggml_quantize_chunk``
without an importance matrix, which for these types is the same reference quantizer (ggml's
Q8_0 ``from_float`` may be a SIMD version of it). ggml's
test skips the types without a CPU ``from_float`` (IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, and in this
version IQ2_S, IQ3_XXS, IQ3_S too); we test them all, IQ1_S / IQ2_XXS / IQ2_XS with a uniform
importance matrix since they require one, and give the ones ggml's table does not name a class
by bits per weight (see ``BOUNDS``).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from freetoken import quant

TEST_SIZE = 32 * 128  # ggml's test_size
# ggml's quantization check uses offset 0.0; 1.0, 3.0 and 4.0 are the offsets of its other
# test vectors. The error is the same to 3 digits for all four (measured).
OFFSETS = (0.0, 1.0, 3.0, 4.0)

# ggml's MAX_QUANTIZATION_TOTAL_ERROR* constants.
BINARY = 0.025
TERNARY = 0.01
BITS2 = 0.0075
BITS3 = 0.004
BITS3_XXS = 0.005
FP4 = 0.003
GENERAL = 0.002

BOUNDS: dict[str, float] = {
    # As test-quantize-fns.cpp classifies them.
    "Q1_0": BINARY,
    "TQ1_0": TERNARY,
    "TQ2_0": TERNARY,
    "Q2_0": TERNARY,
    "Q2_K": BITS2,
    "IQ2_S": BITS2,
    "Q3_K": BITS3,
    "IQ3_S": BITS3,
    "IQ3_XXS": BITS3_XXS,
    "NVFP4": FP4,
    # Not in ggml's table (no CPU from_float there), classed by bits per weight:
    "IQ2_XXS": BITS2,  # 2.06 bpw
    "IQ2_XS": BITS2,  # 2.31 bpw
    "IQ1_S": BINARY,  # 1.56 bpw: below 2 bits, the binary class is the only one that applies
    "IQ1_M": BINARY,  # 1.75 bpw (measured 0.0122: more than the ternary 0.01)
    # ggml's general bound.
    **dict.fromkeys(
        "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q4_K Q5_K Q6_K IQ4_NL IQ4_XS MXFP4".split(),
        GENERAL,
    ),
}


def storage_types() -> list[str]:
    """Every storage type this build knows (so a new type needs a bound here)."""
    return [info.name for info in quant.all_types() if info.is_storage]


def ggml_test_data(offset: float, n: int = TEST_SIZE) -> np.ndarray:
    """``0.1 + 2 * cosf(i + offset)``: the cosine in float32, the rest in double, as in C."""
    c = np.cos(np.arange(n, dtype=np.float32) + np.float32(offset))
    return (0.1 + 2.0 * c.astype(np.float64)).astype(np.float32)


def ggml_error(x: np.ndarray, y: np.ndarray) -> float:
    """test-quantize-fns.cpp's ``array_rmse``: ``sqrt(sum of squared differences) / n``."""
    d = x.astype(np.float64) - y.astype(np.float64)
    return math.sqrt(float(np.sum(d * d))) / x.size


def rmse(x: np.ndarray, y: np.ndarray) -> float:
    d = x.astype(np.float64) - y.astype(np.float64)
    return math.sqrt(float(np.mean(d * d)))


def test_every_storage_type_has_a_bound() -> None:
    assert sorted(storage_types()) == sorted(BOUNDS)


def test_error_measure_is_ggmls() -> None:
    """On a known difference: all n values off by 1 gives sqrt(n) / n, RMSE 1."""
    x = np.zeros(TEST_SIZE, np.float32)
    y = np.ones(TEST_SIZE, np.float32)
    assert ggml_error(x, y) == pytest.approx(1 / 64)
    assert rmse(x, y) == 1.0


def test_data_matches_ggml_formula() -> None:
    x = ggml_test_data(0.0)
    assert x.dtype == np.float32 and x.shape == (4096,)
    assert x[0] == np.float32(2.1)
    i = np.arange(TEST_SIZE)
    np.testing.assert_allclose(x, 0.1 + 2 * np.cos(i), rtol=0, atol=1e-6)


@pytest.mark.parametrize("offset", OFFSETS)
@pytest.mark.parametrize("qtype", sorted(BOUNDS, key=lambda t: quant.type_info(t).id))
def test_round_trip_error_within_ggml_bounds(qtype: str, offset: float) -> None:
    info = quant.type_info(qtype)
    x = ggml_test_data(offset)
    imatrix = np.ones(TEST_SIZE, np.float32) if info.requires_imatrix else None
    q = quant.quantize(x, qtype, imatrix)
    assert len(q) == info.row_size(TEST_SIZE)
    y = quant.dequantize(q, qtype, x.shape)
    err = ggml_error(x, y)
    assert np.isfinite(y).all()
    assert err < BOUNDS[qtype], (
        f"{qtype} offset {offset}: ggml error {err:.6f} >= {BOUNDS[qtype]} (RMSE {rmse(x, y):.5f})"
    )
    if qtype == "F32":
        assert err == 0.0
