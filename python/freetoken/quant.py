"""Quantized tensors: type lookup, dequantize, quantize, and the quantized product.

Shapes are in numpy order, ``(rows, K)``: a row of ``K`` elements is a whole number of the
type's blocks. ``qtype`` is a ``gguf.GGMLQuantizationType``, its integer value, or its name in
any case (``"Q4_K"``, ``"q4_k"``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from freetoken import _core
from freetoken.errors import InvalidInputError, ShapeError, UnsupportedError

if TYPE_CHECKING:
    import torch

__all__ = [
    "QType",
    "QuantMatrix",
    "TypeInfo",
    "all_types",
    "dequantize",
    "quantize",
    "type_info",
]

QType = int | str
"""A type id, a type name, or a ``gguf.GGMLQuantizationType`` (an ``int``)."""


@dataclass(frozen=True)
class TypeInfo:
    """A ggml tensor type and its block geometry."""

    id: int
    name: str
    block_size: int
    type_size: int
    is_storage: bool
    has_vec_dot: bool
    vec_dot_type: int
    requires_imatrix: bool

    def row_size(self, k: int) -> int:
        """Bytes of a row of ``k`` elements; ShapeError unless ``k`` is whole blocks."""
        if k % self.block_size:
            raise ShapeError(
                f"row length {k} is not a multiple of {self.name}'s block size {self.block_size}"
            )
        return k // self.block_size * self.type_size


def qtype_id(qtype: QType) -> int:
    """The integer id of ``qtype`` (an id, a name in any case, or a GGMLQuantizationType)."""
    if isinstance(qtype, str):
        return _core.type_from_name(qtype)
    if isinstance(qtype, (int, np.integer)) and not isinstance(qtype, bool):
        if not 0 <= int(qtype) < 2**32:
            raise UnsupportedError(f"tensor type id {qtype} is unsupported: not a ggml type id")
        return int(qtype)
    raise InvalidInputError(f"qtype must be a type name or id, not {type(qtype).__name__}")


@functools.cache
def _info(type_id: int) -> TypeInfo:
    t = _core.type_info(type_id)
    return TypeInfo(
        type_id,
        t.name,
        t.block_size,
        t.type_size,
        t.is_storage,
        t.has_vec_dot,
        t.vec_dot_type,
        t.requires_imatrix,
    )


def all_types() -> list[TypeInfo]:
    """Every type this build knows (storage and activation-only), in id order."""
    return [_info(i) for i in _core.type_ids()]


def type_info(qtype: QType) -> TypeInfo:
    """The :class:`TypeInfo` of ``qtype``; UnsupportedError for unknown or removed types."""
    return _info(qtype_id(qtype))


def _byte_view(raw: Any, what: str) -> np.ndarray:
    """A flat uint8 view (no copy) of a bytes-like object or a C-contiguous array."""
    if isinstance(raw, np.ndarray):
        if not raw.flags.c_contiguous:
            raise InvalidInputError(f"{what} must be C-contiguous")
        return raw.reshape(-1).view(np.uint8)
    if isinstance(raw, memoryview) and not raw.c_contiguous:
        raise InvalidInputError(f"{what} must be C-contiguous")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        return np.frombuffer(raw, dtype=np.uint8)
    raise InvalidInputError(f"{what} must be bytes-like or a numpy array, not {type(raw).__name__}")


def _f32_array(array: Any, what: str) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise InvalidInputError(f"{what} must be a numpy array, not {type(array).__name__}")
    if array.dtype != np.float32:
        raise InvalidInputError(f"{what} must be float32, got {array.dtype}")
    if not array.flags.c_contiguous:
        raise InvalidInputError(f"{what} must be C-contiguous")
    return array


def _shape(shape: Any) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if not dims or any(not isinstance(d, (int, np.integer)) or d < 0 for d in dims):
        raise ShapeError(f"shape must be non-negative integers, got {shape!r}")
    return tuple(int(d) for d in dims)


def _check_size(info: TypeInfo, shape: tuple[int, ...], nbytes: int) -> None:
    k = shape[-1]
    want = info.row_size(k) * (math.prod(shape) // k if k else 0)
    if nbytes != want:
        raise ShapeError(f"{shape} {info.name} needs {want} bytes, got {nbytes}")


def dequantize(raw: Any, qtype: QType, shape: Any) -> np.ndarray:
    """Decodes ``raw`` (``shape`` elements of ``qtype``, last dim the row) to float32."""
    info = type_info(qtype)
    shape = _shape(shape)
    buf = _byte_view(raw, "raw")
    _check_size(info, shape, buf.nbytes)
    out = np.empty(shape, dtype=np.float32)
    _core.dequantize(info.id, buf, out)
    return out


def quantize(array: np.ndarray, qtype: QType, imatrix: np.ndarray | None = None) -> bytes:
    """Quantizes a float32 array, rows along the last axis, to ``qtype``.

    ``imatrix`` holds one importance weight per column; types that use one (K-quants, IQ)
    weigh their rounding error by it, the others ignore it; IQ2_XXS, IQ2_XS and IQ1_S
    require it.
    """
    info = type_info(qtype)
    array = _f32_array(array, "array")
    if array.ndim == 0:
        raise ShapeError("cannot quantize a scalar")
    k = array.shape[-1]
    info.row_size(k)
    if imatrix is not None:
        imatrix = _f32_array(imatrix, "imatrix")
        if imatrix.shape != (k,):
            raise ShapeError(f"imatrix must have shape ({k},), got {imatrix.shape}")
    return _core.quantize(info.id, array, k, imatrix)


class QuantMatrix:
    """A quantized weight matrix of shape ``(N, K)`` for products ``x @ W.T``.

    ``raw`` is kept by reference (no copy): bytes, a numpy array, or a memory-mapped view.
    """

    def __init__(self, raw: Any, qtype: QType, shape: tuple[int, int]) -> None:
        self.info = type_info(qtype)
        dims = _shape(shape)
        if len(dims) != 2:
            raise ShapeError(f"QuantMatrix shape must be (rows, K), got {dims}")
        self._buf = _byte_view(raw, "raw")
        _check_size(self.info, dims, self._buf.nbytes)
        self.shape: tuple[int, int] = (dims[0], dims[1])

    @property
    def qtype(self) -> int:
        """The type id."""
        return self.info.id

    @property
    def raw(self) -> np.ndarray:
        """The weight's bytes, a flat uint8 array (shared, not copied)."""
        return self._buf

    @functools.cached_property
    def spec(self) -> _core.QuantWeight:
        """The weight as ``_core.matmul_group`` takes it (UnsupportedError for a type without
        a CPU dot product)."""
        return _core.QuantWeight(self.info.id, self._buf, *self.shape)

    def dequantize(self) -> np.ndarray:
        """The weights as a float32 ``(N, K)`` array."""
        return dequantize(self._buf, self.info.id, self.shape)

    def matmul(self, x: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor:
        """``x @ W.T`` for float32 ``x`` of shape ``(T, K)`` or ``(K,)``.

        numpy in, numpy out; a CPU torch tensor in, a torch tensor out. Each row of ``x`` is
        quantized once to the type's activation type; the GIL is released while it runs.
        """
        n, k = self.shape
        if not isinstance(x, np.ndarray) and type(x).__module__.startswith("torch"):
            return self._matmul_torch(x)
        x = _f32_array(x, "x")
        if x.ndim not in (1, 2) or x.shape[-1] != k:
            raise ShapeError(f"x must have shape (T, {k}) or ({k},), got {x.shape}")
        y = np.empty((*x.shape[:-1], n), dtype=np.float32)
        _core.matmul(self.spec, x, y)
        return y

    def _matmul_torch(self, x: torch.Tensor) -> torch.Tensor:
        import torch

        n, k = self.shape
        if x.dtype != torch.float32:
            raise InvalidInputError(f"x must be float32, got {x.dtype}")
        if x.device.type != "cpu":
            raise InvalidInputError(f"x must be on the CPU, got {x.device}")
        if not x.is_contiguous():
            raise InvalidInputError("x must be contiguous")
        if x.dim() not in (1, 2) or x.shape[-1] != k:
            raise ShapeError(f"x must have shape (T, {k}) or ({k},), got {tuple(x.shape)}")
        y = torch.empty((*x.shape[:-1], n), dtype=torch.float32)
        _core.matmul(self.spec, x, y)
        return y
