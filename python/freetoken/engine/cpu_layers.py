"""``--moe-cpu-layers SPEC``: MoE layers whose experts only the CPU serves (no GPU slots, no
page-locked memory), for hosts that cannot pin every expert byte.

``SPEC`` is a list of MoE layer ids and ranges (``0,2,5-7``: a range takes the MoE layers
inside it), a count ``N`` (the first N MoE
layers, as llama.cpp's ``--n-cpu-moe N``), or ``auto``: the layers are taken in order for
the GPU while their expert bytes fit what the host lets this process page-lock
(:func:`pin_budget`: ``MemAvailable``, ``RLIMIT_MEMLOCK``, and ``FREETOKEN_PIN_LIMIT_MIB``
when set), and each is then pinned for real; the rest, and any layer the driver refuses,
are served by the CPU.
"""

from __future__ import annotations

import os
import re
import resource
from collections.abc import Callable, Sequence

from freetoken.errors import InvalidInputError

__all__ = ["PIN_LIMIT_ENV", "parse_cpu_layers", "pin_budget", "split_for_pinning"]

#: Caps the bytes ``auto`` page-locks (MiB): for tests, and for hosts that share memory.
PIN_LIMIT_ENV = "FREETOKEN_PIN_LIMIT_MIB"
_MIB = 1 << 20
_ITEM = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_layers(spec: str | None, moe_layers: Sequence[int]) -> set[int] | None:
    """The layer ids of ``spec`` among ``moe_layers`` (model order); None for ``auto``.
    An empty or missing spec is no layer."""
    if spec is None or not spec.strip():
        return set()
    spec = spec.strip()
    if spec == "auto":
        return None
    if spec.isdigit():
        n = int(spec)
        if n > len(moe_layers):
            raise InvalidInputError(
                f"--moe-cpu-layers {n}: the model has {len(moe_layers)} MoE layers"
            )
        return set(moe_layers[:n])
    moe = set(moe_layers)
    chosen: set[int] = set()
    for item in spec.split(","):
        m = _ITEM.match(item.strip())
        if m is None:
            raise InvalidInputError(
                f"--moe-cpu-layers {spec!r}: expected ids and ranges (0,2,5-7), a count or auto"
            )
        if m[2] is None:  # one id: it must be a MoE layer
            if int(m[1]) not in moe:
                raise InvalidInputError(f"--moe-cpu-layers: {m[1]} is not a MoE layer")
            chosen.add(int(m[1]))
            continue
        lo, hi = int(m[1]), int(m[2])
        if hi < lo:
            raise InvalidInputError(f"--moe-cpu-layers: range {item.strip()} is empty")
        chosen.update(moe.intersection(range(lo, hi + 1)))  # the MoE layers in the range
    return chosen


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def pin_budget() -> tuple[int | None, str]:
    """Bytes this process may page-lock (None: no limit found) and where the limit comes
    from: the smallest of MemAvailable, the soft RLIMIT_MEMLOCK, and FREETOKEN_PIN_LIMIT_MIB."""
    limits: list[tuple[int, str]] = []
    avail = _mem_available()
    if avail is not None:
        limits.append((avail, "MemAvailable"))
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft != resource.RLIM_INFINITY:
        limits.append((soft, "RLIMIT_MEMLOCK"))
    env = os.environ.get(PIN_LIMIT_ENV)
    if env is not None:
        try:
            limits.append((int(float(env) * _MIB), PIN_LIMIT_ENV))
        except ValueError:
            raise InvalidInputError(f"{PIN_LIMIT_ENV}={env!r} is not a number of MiB") from None
    if not limits:
        return None, "no limit"
    return min(limits)


def split_for_pinning(
    layers: Sequence[tuple[int, int]],
    budget: int | None,
    pin: Callable[[int], bool],
) -> tuple[list[int], list[int]]:
    """``auto``: ``layers`` are (layer id, expert bytes) in model order. Each is pinned
    (``pin(layer)``, which may refuse) while the bytes so far fit ``budget``; returns the
    pinned layers and the others, which the CPU serves. Nothing is pinned past the first
    layer that does not fit or is refused (the rest would likely fail too)."""
    pinned: list[int] = []
    used = 0
    for i, (layer, nbytes) in enumerate(layers):
        if (budget is not None and used + nbytes > budget) or not pin(layer):
            return pinned, [la for la, _ in layers[i:]]
        pinned.append(layer)
        used += nbytes
    return pinned, []
