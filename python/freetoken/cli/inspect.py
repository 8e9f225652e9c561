"""``freetoken inspect``: a GGUF file's metadata and tensors, summarised per layer."""

from __future__ import annotations

import argparse
import re
import sys
from collections import OrderedDict
from typing import Any

from freetoken.gguf import GGUFFile

__all__ = ["add_arguments", "describe", "run"]

_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def _value(v: Any) -> str:
    if isinstance(v, list):
        head = ", ".join(repr(x) for x in v[:4])
        return f"[{head}{', ...' if len(v) > 4 else ''}] ({len(v)} items)"
    if isinstance(v, str) and len(v) > 120:
        return repr(v[:117] + "...")
    return repr(v)


def _ranges(layers: list[int]) -> str:
    out: list[str] = []
    start: int | None = layers[0]
    for a, b in zip(layers, [*layers[1:], None], strict=True):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def describe(path: str, full: bool = False) -> str:
    """The report ``freetoken inspect`` prints: metadata, then tensors; layers that share a
    tensor's shape and type are listed once with their range."""
    f = GGUFFile(path)
    lines = [f"GGUF v{f.version}: {', '.join(f.paths)}", "", "metadata:"]
    lines += [f"  {k} = {_value(v)}" for k, v in f.metadata.items()]
    lines += ["", f"tensors: {len(f.tensors)}"]
    groups: OrderedDict[tuple[str, tuple[int, ...], str], list[int]] = OrderedDict()
    total = 0
    for t in f.tensors.values():
        total += t.nbytes
        m = _LAYER.match(t.name)
        if m is None or full:
            lines.append(f"  {t.name:40s} {t.shape!s:22s} {t.type_name}")
            continue
        groups.setdefault((m.group(2), t.shape, t.type_name), []).append(int(m.group(1)))
    for (name, shape, tname), layers in groups.items():
        lines.append(f"  blk.[{_ranges(layers)}].{name:28s} {shape!s:22s} {tname}")
    lines.append(f"total tensor bytes: {total} ({total / 2**20:.1f} MiB)")
    return "\n".join(lines) + "\n"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The file, and ``--all``."""
    p.add_argument("file")
    p.add_argument("--all", action="store_true", help="list every tensor, not per layer")


def run(args: argparse.Namespace) -> int:
    """Prints :func:`describe` of the file."""
    sys.stdout.write(describe(args.file, full=args.all))
    return 0
