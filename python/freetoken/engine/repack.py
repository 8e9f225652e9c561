"""Weights repacked for the CPU kernels in use (llama.cpp's CPU repack), for the weights
only the CPU reads: every product of the CPU engine, and under a GPU placement the MoE
layers whose experts only the CPU serves (``--moe-strategy cpu``, ``--moe-cpu-layers``; the
slot-cached layers stay as mapped, since the GPU uploads from those bytes). Where the active
instruction set reads a packed layout faster (AVX2: Q4_0, Q8_0 and Q4_K rows interleaved
eight at a time, ``ft_cpu::PackedRows``), each such matrix is copied once into it, and the
mapped original's pages are dropped so that the process holds one copy (the kernel reads
them from the file again if they are touched). Levels without packed layouts (AVX-512,
scalar) pack nothing. ``--no-repack`` keeps the mapping's rows.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from freetoken import _core
from freetoken.gguf import GGUFFile
from freetoken.models.layers import HeadwiseLinear, Linear
from freetoken.models.transformer import Transformer
from freetoken.quant import QuantMatrix
from freetoken.runtime.moe import MoeFFN

if TYPE_CHECKING:
    from freetoken.engine.placement import Placement

__all__ = ["RepackStats", "cpu_served", "quantized_weights", "repack"]


@dataclass
class RepackStats:
    """What :func:`repack` did: weights (a matrix, or an expert layer with any kind packed)
    packed, of those seen, and the mapped bytes it dropped."""

    packed: int = 0
    seen: int = 0
    released: int = 0


def _is_part(obj: object) -> bool:
    module = type(obj).__module__
    return module.startswith(("freetoken.models", "freetoken.runtime")) and hasattr(obj, "__dict__")


def quantized_weights(model: object) -> list[QuantMatrix | _core.MoeLayer]:
    """The quantized matrices and expert layers that ``model``'s parts hold, each once."""
    return list(_weights(model, set()))


def _weights(val: Any, seen: set[int]) -> Iterator[QuantMatrix | _core.MoeLayer]:
    if id(val) in seen:
        return
    seen.add(id(val))
    if isinstance(val, Linear):
        yield val.weight
    elif isinstance(val, HeadwiseLinear):
        yield from val.heads
    elif isinstance(val, (QuantMatrix, _core.MoeLayer)):
        yield val
    elif isinstance(val, (list, tuple)):
        for v in val:
            yield from _weights(v, seen)
    elif isinstance(val, dict):
        for v in val.values():
            yield from _weights(v, seen)
    elif _is_part(val):
        for v in vars(val).values():
            yield from _weights(v, seen)


def cpu_served(model: Transformer, place: Placement) -> list[_core.MoeLayer]:
    """The expert layers of ``model`` that only the CPU serves under ``place``: no GPU reads
    their bytes."""
    ids = {*place.cpu_layers, *place.handoff_cpu_layers}
    return [
        blk.ffn.layer
        for blk in model.blocks
        if isinstance(blk.ffn, MoeFFN) and blk.ffn.layer.index in ids
    ]


def repack(
    weights: Sequence[QuantMatrix | _core.MoeLayer],
    gguf: GGUFFile,
    progress: Callable[[int, int], None] | None = None,
) -> RepackStats:
    """Packs each of ``weights`` (matrices and expert layers whose bytes ``gguf`` maps and
    only the CPU reads) that the CPU kernels in use read faster packed, dropping the
    originals' mapped pages as they are copied; ``progress(done, total)`` after each."""
    stats = RepackStats(seen=len(weights))
    for i, w in enumerate(weights, 1):
        if isinstance(w, QuantMatrix):
            packed, released = w.spec.pack(gguf.handle)
        else:
            kinds, released = w.pack()
            packed = bool(kinds)
        stats.packed += packed
        stats.released += released
        if progress is not None:
            progress(i, len(weights))
    return stats
