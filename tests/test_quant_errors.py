"""Bad input to ``freetoken.quant`` raises ``FreeTokenError`` subclasses naming the problem
and nothing crashes the interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from freetoken import quant
from freetoken.errors import (
    FreeTokenError,
    InvalidInputError,
    ShapeError,
    UnsupportedError,
)


def raises(exc: type[FreeTokenError], match: str, fn: Callable[..., Any], *args: Any) -> str:
    """Calls ``fn(*args)``, expecting exactly ``exc`` (a FreeTokenError) with ``match`` in the
    message (case-insensitive); returns the message."""
    with pytest.raises(FreeTokenError) as info:
        fn(*args)
    assert type(info.value) is exc, f"{type(info.value).__name__}: {info.value}"
    message = str(info.value)
    assert match.lower() in message.lower(), message
    return message


def q4_0_matrix(n: int = 2, k: int = 64) -> quant.QuantMatrix:
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    return quant.QuantMatrix(quant.quantize(w, "Q4_0"), "Q4_0", (n, k))


# --- type ids and names ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("type_id", "why"),
    [
        (4, "removed"),  # Q4_2
        (5, "removed"),  # Q4_3
        (31, "removed"),
        (36, "removed"),
        (24, "integer"),  # I8
        (27, "integer"),  # I64
        (28, "F64"),
        (43, "not a ggml type id"),
        (99, "not a ggml type id"),
    ],
)
def test_unsupported_type_ids(type_id: int, why: str) -> None:
    raw = bytes(64)
    x = np.zeros((1, 32), np.float32)
    for fn, args in [
        (quant.type_info, (type_id,)),
        (quant.dequantize, (raw, type_id, (32,))),
        (quant.quantize, (x, type_id)),
        (quant.QuantMatrix, (raw, type_id, (1, 32))),
    ]:
        msg = raises(UnsupportedError, why, fn, *args)
        assert str(type_id) in msg, msg


def test_unsupported_gguf_enum_members() -> None:
    raises(UnsupportedError, "integer", quant.type_info, gguf.GGMLQuantizationType.I8)
    raises(UnsupportedError, "F64", quant.type_info, gguf.GGMLQuantizationType.F64)


@pytest.mark.parametrize("type_id", [-1, 2**32 + 2, 2**64])
def test_out_of_range_type_ids(type_id: int) -> None:
    """Ids that do not fit a u32 are unknown types like any other, not an OverflowError (nor
    wrapped around to a valid id: 2**32 + 2 is not Q4_0)."""
    raises(UnsupportedError, str(type_id), quant.type_info, type_id)
    raises(UnsupportedError, str(type_id), quant.dequantize, bytes(18), type_id, (32,))
    raises(UnsupportedError, str(type_id), quant.quantize, np.ones(32, np.float32), type_id)
    raises(UnsupportedError, str(type_id), quant.QuantMatrix, bytes(18), type_id, (1, 32))


@pytest.mark.parametrize("name", ["Q4_Z", "q4", "", " Q4_0", "Q4_0 ", "Q8_0_X"])
def test_unknown_type_names(name: str) -> None:
    msg = raises(UnsupportedError, "unknown tensor type name", quant.type_info, name)
    assert f"`{name}`" in msg
    raises(UnsupportedError, "unknown", quant.dequantize, bytes(18), name, (32,))


@pytest.mark.parametrize("name", ["I8", "I32", "F64", "Q4_2"])
def test_names_of_unsupported_types(name: str) -> None:
    raises(UnsupportedError, name, quant.type_info, name)
    raises(UnsupportedError, name, quant.quantize, np.ones(32, np.float32), name)


@pytest.mark.parametrize("qtype", [2.0, None, True, b"Q4_0", [2]])
def test_type_of_wrong_kind(qtype: Any) -> None:
    raises(InvalidInputError, "qtype must be a type name or id", quant.type_info, qtype)


def test_names_ids_and_enum_agree() -> None:
    """Not an error case: the accepted spellings, so that the rejections above are specific."""
    for spelling in ("Q4_K", "q4_k", "Q4_k", 12, np.int64(12), gguf.GGMLQuantizationType.Q4_K):
        assert quant.type_info(spelling).name == "Q4_K"


# --- activation-only types -------------------------------------------------------------------


@pytest.mark.parametrize(("qtype", "k"), [("Q8_1", 32), ("Q8_K", 256)])
def test_activation_types_are_not_storage(qtype: str, k: int) -> None:
    info = quant.type_info(qtype)
    assert not info.is_storage and not info.has_vec_dot
    x = np.ones((2, k), np.float32)
    raises(UnsupportedError, f"{qtype} is an activation type", quant.quantize, x, qtype)
    raw = bytes(2 * info.row_size(k))
    raises(
        UnsupportedError, f"{qtype} is an activation type", quant.dequantize, raw, qtype, x.shape
    )
    m = quant.QuantMatrix(raw, qtype, (2, k))
    raises(UnsupportedError, f"no dot product for {qtype}", m.matmul, x)


# --- buffer sizes ----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q4_0", "Q4_K", "IQ2_XXS", "NVFP4", "Q2_0"])
@pytest.mark.parametrize("delta", [-1, +1, "half", "empty"])
def test_wrong_length_buffers(qtype: str, delta: int | str) -> None:
    info = quant.type_info(qtype)
    shape = (3, 256)
    good = 3 * info.row_size(256)
    size = good // 2 if delta == "half" else 0 if delta == "empty" else good + int(delta)
    raw = bytes(size)
    want = f"needs {good} bytes, got {size}"
    raises(ShapeError, want, quant.dequantize, raw, qtype, shape)
    raises(ShapeError, want, quant.QuantMatrix, raw, qtype, shape)
    raises(ShapeError, want, quant.dequantize, np.frombuffer(raw, np.uint8), qtype, shape)


def test_wrong_length_counts_every_dimension() -> None:
    raw = bytes(18 * 4)  # four Q4_0 blocks
    assert quant.dequantize(raw, "Q4_0", (2, 2, 32)).shape == (2, 2, 32)
    raises(ShapeError, "needs 108 bytes, got 72", quant.dequantize, raw, "Q4_0", (3, 2, 32))
    raises(ShapeError, "needs 36 bytes", quant.dequantize, raw, "Q4_0", (2, 32))
    raises(ShapeError, "got 72", quant.dequantize, raw, "Q4_0", (2**62, 2**62, 32))
    raises(ShapeError, "got 72", quant.QuantMatrix, raw, "Q4_0", (2**64, 32))


@pytest.mark.parametrize("shape", [(), (-1, 32), (2, 32.0), "32", (2, None)])
def test_bad_shapes(shape: Any) -> None:
    raises(ShapeError, "shape must be non-negative integers", quant.dequantize, b"", "F32", shape)


@pytest.mark.parametrize("shape", [(32,), (1, 2, 32)])
def test_quant_matrix_must_be_2d(shape: tuple[int, ...]) -> None:
    raises(ShapeError, "shape must be (rows, K)", quant.QuantMatrix, bytes(18), "Q4_0", shape)


@pytest.mark.parametrize("raw", [[0] * 18, "x" * 18, 18, None])
def test_raw_of_wrong_kind(raw: Any) -> None:
    raises(InvalidInputError, "raw must be bytes-like", quant.dequantize, raw, "Q4_0", (32,))
    raises(InvalidInputError, "raw must be bytes-like", quant.QuantMatrix, raw, "Q4_0", (1, 32))


def test_non_contiguous_raw() -> None:
    buf = np.zeros(36, np.uint8)
    raises(InvalidInputError, "C-contiguous", quant.dequantize, buf[::2], "Q4_0", (32,))
    raises(InvalidInputError, "C-contiguous", quant.dequantize, memoryview(bytes(36))[::2], 2, 32)
    raises(InvalidInputError, "C-contiguous", quant.QuantMatrix, buf[::2], "Q4_0", (1, 32))


# --- K not a whole number of blocks ----------------------------------------------------------


@pytest.mark.parametrize(
    ("qtype", "k"),
    [("Q4_0", 48), ("Q4_K", 128), ("Q4_K", 300), ("IQ4_NL", 31), ("NVFP4", 32), ("Q1_0", 64)],
)
def test_k_not_divisible_by_block_size(qtype: str, k: int) -> None:
    bs = quant.type_info(qtype).block_size
    want = f"row length {k} is not a multiple of {qtype}'s block size {bs}"
    x = np.ones((2, k), np.float32)
    im = np.ones(k, np.float32)
    raises(ShapeError, want, quant.quantize, x, qtype)
    raises(ShapeError, want, quant.quantize, x, qtype, im)
    raises(ShapeError, want, quant.dequantize, bytes(1000), qtype, (2, k))
    raises(ShapeError, want, quant.QuantMatrix, bytes(1000), qtype, (2, k))
    raises(ShapeError, want, quant.type_info(qtype).row_size, k)


# --- arrays: dtype, contiguity, shape --------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32, np.uint8, np.complex64])
def test_quantize_non_float32(dtype: Any) -> None:
    x = np.ones((2, 32), dtype)
    raises(InvalidInputError, f"array must be float32, got {np.dtype(dtype)}", quant.quantize, x, 2)
    im = np.ones(32, dtype)
    msg = f"imatrix must be float32, got {np.dtype(dtype)}"
    raises(InvalidInputError, msg, quant.quantize, np.ones((2, 32), np.float32), 2, im)


def test_quantize_non_contiguous() -> None:
    x = np.ones((4, 64), np.float32)
    raises(InvalidInputError, "array must be C-contiguous", quant.quantize, x[:, ::2], "Q4_0")
    raises(InvalidInputError, "array must be C-contiguous", quant.quantize, x[::2, :32], "Q4_0")
    f = np.asfortranarray(np.ones((64, 32), np.float32))
    raises(InvalidInputError, "array must be C-contiguous", quant.quantize, f, "Q4_0")
    im = np.ones(64, np.float32)[::2]
    msg = "imatrix must be C-contiguous"
    raises(InvalidInputError, msg, quant.quantize, np.ones((1, 32), np.float32), "Q4_0", im)


@pytest.mark.parametrize("array", [[1.0] * 32, 1.0, torch.ones(32)])
def test_quantize_not_an_array(array: Any) -> None:
    raises(InvalidInputError, "array must be a numpy array", quant.quantize, array, "Q4_0")


def test_quantize_scalar_and_imatrix_shape() -> None:
    raises(ShapeError, "cannot quantize a scalar", quant.quantize, np.array(1.0, np.float32), 0)
    x = np.ones((2, 256), np.float32)
    msg = "imatrix must have shape (256,), got (128,)"
    raises(ShapeError, msg, quant.quantize, x, "Q4_K", np.ones(128, np.float32))
    raises(
        ShapeError,
        "imatrix must have shape",
        quant.quantize,
        x,
        "Q4_K",
        np.ones((1, 256), np.float32),
    )


def test_unaligned_float_array() -> None:
    """A float32 array at an odd address (legal in numpy) is refused, not read misaligned."""
    x = np.frombuffer(bytes(4 * 32 + 1), np.float32, 32, 1)
    assert x.flags.c_contiguous and not x.flags.aligned
    raises(InvalidInputError, "aligned", quant.quantize, x, "Q4_0")
    raises(InvalidInputError, "aligned", q4_0_matrix(k=32).matmul, x)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_matmul_numpy_non_float32(dtype: Any) -> None:
    m = q4_0_matrix()
    raises(
        InvalidInputError, f"x must be float32, got {np.dtype(dtype)}", m.matmul, np.ones(64, dtype)
    )


def test_matmul_numpy_non_contiguous_and_shapes() -> None:
    m = q4_0_matrix()
    x = np.ones((3, 128), np.float32)
    raises(InvalidInputError, "x must be C-contiguous", m.matmul, x[:, ::2])
    raises(InvalidInputError, "x must be C-contiguous", m.matmul, np.asfortranarray(x[:, :64]))
    raises(ShapeError, "x must have shape (T, 64) or (64,), got (3, 128)", m.matmul, x)
    raises(ShapeError, "got (63,)", m.matmul, np.ones(63, np.float32))
    raises(ShapeError, "got (1, 3, 64)", m.matmul, np.ones((1, 3, 64), np.float32))
    raises(ShapeError, "got ()", m.matmul, np.array(1.0, np.float32))
    raises(InvalidInputError, "x must be a numpy array", m.matmul, [1.0] * 64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_matmul_torch_non_float32(dtype: torch.dtype) -> None:
    m = q4_0_matrix()
    raises(
        InvalidInputError, f"x must be float32, got {dtype}", m.matmul, torch.ones(64, dtype=dtype)
    )


def test_matmul_torch_non_contiguous_device_and_shapes() -> None:
    m = q4_0_matrix()
    raises(InvalidInputError, "x must be contiguous", m.matmul, torch.ones(64, 3).T)
    raises(InvalidInputError, "x must be contiguous", m.matmul, torch.ones(3, 128)[:, ::2])
    meta = torch.ones(3, 64, device="meta")
    raises(InvalidInputError, "x must be on the CPU, got meta", m.matmul, meta)
    raises(
        ShapeError, "x must have shape (T, 64) or (64,), got (3, 65)", m.matmul, torch.ones(3, 65)
    )
    raises(ShapeError, "got (2, 3, 64)", m.matmul, torch.ones(2, 3, 64))


def test_empty_matrices_and_batches() -> None:
    """Zero rows, zero tokens: empty results, no error and no crash."""
    m = q4_0_matrix()
    assert m.matmul(np.ones((0, 64), np.float32)).shape == (0, 2)
    assert tuple(m.matmul(torch.ones(0, 64)).shape) == (0, 2)
    empty = quant.QuantMatrix(b"", "Q4_0", (0, 64))
    assert empty.matmul(np.ones((3, 64), np.float32)).shape == (3, 0)
    assert quant.dequantize(b"", "Q4_K", (0, 256)).shape == (0, 256)
    assert quant.quantize(np.ones((0, 256), np.float32), "Q4_K") == b""


def test_zero_length_rows() -> None:
    """K = 0: (rows, 0) arrays. Either a FreeTokenError or the empty / zero result will do (an
    empty dot product is 0); a Rust panic will not."""
    try:
        assert quant.quantize(np.ones((3, 0), np.float32), "Q4_0") == b""
    except FreeTokenError as e:
        assert type(e) is ShapeError, e
    m = quant.QuantMatrix(b"", "Q4_0", (4, 0))
    for x in (np.ones((2, 0), np.float32), torch.ones(2, 0)):
        try:
            y = m.matmul(x)
        except FreeTokenError:
            continue
        np.testing.assert_array_equal(np.asarray(y), np.zeros((2, 4), np.float32))


# --- values ----------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q4_0", "Q8_0", "Q4_K", "IQ4_XS", "TQ1_0"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_quantize_non_finite(qtype: str, bad: float) -> None:
    x = np.ones((3, 256), np.float32)
    x[2, 17] = bad
    msg = raises(InvalidInputError, "cannot quantize non-finite value", quant.quantize, x, qtype)
    assert f"at index {2 * 256 + 17}" in msg
    assert str(np.float32(bad)).lower().lstrip("-") in msg.lower()


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "IQ2_XS", "IQ1_S"])
def test_iq_type_without_importance_matrix(qtype: str) -> None:
    assert quant.type_info(qtype).requires_imatrix
    x = np.ones((2, 256), np.float32)
    raises(
        InvalidInputError,
        f"quantizing to {qtype} requires an importance matrix",
        quant.quantize,
        x,
        qtype,
    )


def test_only_those_types_require_an_importance_matrix() -> None:
    required = {info.name for info in quant.all_types() if info.requires_imatrix}
    assert required == {"IQ2_XXS", "IQ2_XS", "IQ1_S"}


@pytest.mark.parametrize("bad", [-1.0, np.nan, np.inf])
def test_bad_importance_matrix_values(bad: float) -> None:
    x = np.ones((2, 256), np.float32)
    im = np.ones(256, np.float32)
    im[5] = bad
    msg = "importance matrix values must be finite and non-negative"
    raises(InvalidInputError, msg, quant.quantize, x, "IQ2_XXS", im)
    raises(InvalidInputError, msg, quant.quantize, x, "Q4_K", im)


# --- no crash --------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    import numpy as np
    from freetoken import quant
    from freetoken.errors import FreeTokenError

    rng = np.random.default_rng(0)
    normal = rng.standard_normal((4, 256))
    inputs = {
        "const 1e16": (np.full((4, 256), 1e16), 1.0),
        "const 1e18": (np.full((4, 256), 1e18), 1.0),
        "const 3e38": (np.full((4, 256), 3e38), 1.0),
        "normal * 1e15": (normal * 1e15, 1.0),
        "normal * 1e16": (normal * 1e16, 1.0),
        "normal * 1e30": (normal * 1e30, 1.0),
        "one 3e38 among normal": (np.where(np.arange(256) == 9, 3e38, normal), 1.0),
        "subnormal": (normal * 1e-40, 1.0),
        "normal, imatrix 3e38": (normal, 3e38),
        "normal, imatrix 1e-45": (normal, 1e-45),
        "normal, imatrix 0": (normal, 0.0),
    }
    for qtype in sys.argv[1:]:
        for what, (x, im) in inputs.items():
            print(f"{qtype}: {what}", flush=True)
            try:
                quant.quantize(x.astype(np.float32), qtype, np.full(256, im, np.float32))
            except FreeTokenError:
                pass
    print("done", flush=True)
    """
)


@pytest.mark.slow
def test_extreme_finite_values_do_not_crash() -> None:
    """Huge, tiny and outlying finite input, and extreme importance matrices, quantized to
    every storage type (in a child process, so that an abort fails this test only). Each must
    quantize or raise a FreeTokenError."""
    types = [info.name for info in quant.all_types() if info.is_storage]
    crashed = []
    env = {**os.environ, "GGML_NO_BACKTRACE": "1"}
    remaining = types
    while remaining:
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, *remaining],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        lines = proc.stdout.splitlines()
        if proc.returncode == 0:
            assert lines[-1] == "done", proc.stdout[-2000:]
            break
        last = lines[-1] if lines else "(start-up)"
        crashed.append(f"{last} -> exit {proc.returncode}: {proc.stderr.strip()[-300:]}")
        # Go on with the next type, so every crashing type is listed.
        failed_type = last.split(":")[0]
        remaining = (
            remaining[remaining.index(failed_type) + 1 :] if failed_type in remaining else []
        )
    assert not crashed, "\n".join(crashed)
