"""A mapped GGUF file: metadata, tensor infos, and zero-copy tensor views."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from os import PathLike
from typing import Any

import numpy as np

from freetoken import _core
from freetoken.errors import GGUFError, ShapeError
from freetoken.quant import QuantMatrix, dequantize, type_info

__all__ = ["GGUFFile", "TensorInfo"]


@dataclass(frozen=True)
class TensorInfo:
    """A tensor's name, shape in numpy order (the row last), type id and size in bytes."""

    name: str
    shape: tuple[int, ...]
    qtype: int
    nbytes: int

    @property
    def type_name(self) -> str:
        """The type's name, as GGUF tools print it ("Q4_K")."""
        return type_info(self.qtype).name


class GGUFFile:
    """A GGUF model, parsed and mapped once by the Rust core (split files too).

    Every offset and size was checked against the file at open; tensor views share the
    mapping and keep it alive.
    """

    def __init__(
        self,
        path: str | PathLike[str],
        mmap: bool = True,
        progress: Callable[[int, int], None] | None = None,
    ) -> None:
        """``mmap=False`` (llama.cpp's ``--no-mmap``) reads the data into anonymous memory,
        backed by 2 MiB pages where transparent huge pages allow, instead of mapping the file:
        the CPU streams experts a few percent faster (an InvalidInputError when it does not
        fit MemAvailable); ``progress(done, total)`` is called as it reads."""
        self._file = _core.GGUFFile(str(path), mmap, progress)
        self.path = str(path)
        self.metadata: dict[str, Any] = self._file.metadata()
        self.tensors: dict[str, TensorInfo] = {
            t.name: TensorInfo(t.name, tuple(t.shape), t.qtype, t.nbytes)
            for t in self._file.tensors()
        }

    @property
    def handle(self) -> _core.GGUFFile:
        """The Rust-side file, for engine objects that view its tensors (MoE layers)."""
        return self._file

    @property
    def paths(self) -> list[str]:
        """The model's files: one, or every part of a split model."""
        return list(self._file.paths)

    @property
    def version(self) -> int:
        """The GGUF format version."""
        return self._file.version

    @property
    def architecture(self) -> str:
        """``general.architecture``; a GGUFError when the file has none."""
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise GGUFError(f"{self.path}: no general.architecture in the metadata")
        return arch

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        """The tensor's info; a GGUFError naming it when it is missing."""
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: missing tensor `{name}`") from None

    def expect(
        self, name: str, shape: tuple[int, ...], qtypes: Iterable[int] | None = None
    ) -> TensorInfo:
        """The tensor's info, checked: a ShapeError or GGUFError naming it on a wrong shape
        or a type outside ``qtypes``."""
        info = self.info(name)
        if info.shape != tuple(shape):
            raise ShapeError(
                f"{self.path}: tensor `{name}` has shape {info.shape}, expected {tuple(shape)}"
            )
        if qtypes is not None and info.qtype not in set(qtypes):
            raise GGUFError(
                f"{self.path}: tensor `{name}` has type {info.type_name}, which this model "
                "cannot use there"
            )
        return info

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a flat uint8 array sharing the mapping (read-only)."""
        info = self.info(name)
        # The buffer holds the mapping, so it outlives every array made from it.
        arr = np.frombuffer(memoryview(self._file.tensor_data(name)), dtype=np.uint8)
        assert arr.nbytes == info.nbytes and not arr.flags.writeable
        return arr

    def array(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in numpy shape."""
        info = self.info(name)
        return dequantize(self.raw(name), info.qtype, info.shape)

    def matrix(self, name: str) -> QuantMatrix:
        """A 2-D tensor as a :class:`QuantMatrix` over the mapping, for ``x @ W.T``."""
        info = self.info(name)
        if len(info.shape) != 2:
            raise ShapeError(f"tensor `{name}` has shape {info.shape}, not (rows, K)")
        return QuantMatrix(self.raw(name), info.qtype, info.shape)
