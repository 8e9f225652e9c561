"""The bandwidth figures of this machine (``freetoken bench-bw`` measures them,
:mod:`freetoken.engine.bandwidth`): per layer kind of a MoE model, the CPU expert kernels',
pinned host-to-GPU and the GPU expert kernels' bandwidths, and from them the fetch rule: fetch
a missed expert over PCIe instead of computing it on the CPU when
``expected_reuse * B_pcie > B_cpu``, i.e. above a break-even reuse of ``B_cpu / B_pcie``.

The figures are saved per machine and GPU in ``<cache>/bandwidth/<gpu name or "cpu">-<hash of
the CPU model>.json`` (``<cache>``: :func:`freetoken.paths.cache_dir`), merged by layer kind
with what runs on other models wrote there; :func:`load_bandwidth_profile` reads them back for
the engine. This module imports no torch until it measures.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from freetoken.errors import InvalidInputError
from freetoken.paths import cache_dir

if TYPE_CHECKING:
    from freetoken.engine.gpu_moe import ExpertLayer
    from freetoken.models.transformer import Transformer

__all__ = [
    "FORMAT",
    "VERSION",
    "BandwidthProfile",
    "KindBandwidth",
    "cpu_model",
    "document",
    "load_bandwidth_profile",
    "profile_path",
    "save",
]

log = logging.getLogger("freetoken")

FORMAT = "freetoken.bandwidth"
#: 2: version-1 files measured PCIe from pageable memory (the expert pins were released at
#: once), a sixth of the page-locked rate; they are ignored and measured again.
VERSION = 2


def cpu_model() -> str:
    """The host CPU's model name (``/proc/cpuinfo``, else what platform knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def profile_path(gpu_name: str | None) -> Path:
    """``<cache>/bandwidth/<gpu name or "cpu">-<hash of the CPU model>.json``."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", gpu_name).strip("-") if gpu_name else "cpu"
    digest = hashlib.sha256(cpu_model().encode()).hexdigest()[:12]
    return cache_dir() / "bandwidth" / f"{name or 'gpu'}-{digest}.json"


def document(
    model: str | os.PathLike[str], threads: int | None, seconds: float, mmap: bool = True
) -> dict[str, Any]:
    """Measures ``model`` (mapped, or read into memory: ``mmap``) and returns what ``bench-bw
    -o json`` prints: the machine, the GPU (or why there is none) and one entry per layer
    kind."""
    from freetoken.engine.bandwidth import measure_model

    measured = measure_model(model, threads, seconds, mmap)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    name = os.path.basename(model)
    return {
        "format": FORMAT,
        "version": VERSION,
        "host": {"cpu": cpu_model(), "threads": measured["host_threads"], "mmap": mmap},
        "gpu": measured["gpu"],
        "model": name,
        "seconds": seconds,
        "measured_at": now,
        "kinds": {
            key: {**entry, "model": name, "measured_at": now}
            for key, entry in measured["kinds"].items()
        },
    }


def _read(path: Path) -> dict[str, Any] | None:
    """A saved profile, or None when there is none or it is not one (said on stderr)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring bandwidth profile %s: %s", path, e)
        return None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("version") != VERSION:
        log.warning("ignoring %s: not a %s v%d file", path, FORMAT, VERSION)
        return None
    return doc


def save(doc: dict[str, Any]) -> Path:
    """Writes ``doc`` to :func:`profile_path` of its GPU, keeping the layer kinds of earlier
    runs (on other models) that it does not measure again."""
    path = profile_path(doc["gpu"]["name"])
    old = _read(path) or {}
    kinds = {**old.get("kinds", {}), **doc["kinds"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({**doc, "kinds": kinds}, indent=1) + "\n")
    tmp.replace(path)
    return path


@dataclass(frozen=True)
class KindBandwidth:
    """The bandwidths of one layer kind (GB/s, 10^9 bytes/s) and its fetch rule."""

    key: str
    threads: int
    """The CPU expert executor's threads when measured."""
    b_cpu_gbps: float
    """The CPU expert executor's, while the GPU computes when that was measured, else alone."""
    b_pcie_gbps: float | None
    """Page-locked host-to-GPU copies of one expert each; None without a GPU."""
    b_gpu_gbps: float | None
    """The GPU expert kernels' on resident experts, one token."""
    break_even_reuse: float | None
    """``B_cpu / B_pcie``; None without a GPU."""
    b_cpu_with_pcie_gbps: float | None = None
    """The CPU expert executor's while one-expert copies run over PCIe (both links busy)."""
    b_pcie_with_cpu_gbps: float | None = None
    """One-expert copies' while the CPU expert executor runs."""
    b_gather_gbps: float | None = None
    """Hybrid's fetch kernel's reads of the page-locked mapping."""
    b_cpu_with_gather_gbps: float | None = None
    """The CPU expert executor's while the fetch kernel runs."""
    b_gather_with_cpu_gbps: float | None = None
    """The fetch kernel's while the CPU expert executor runs."""

    def should_fetch(self, expected_reuse: float) -> bool:
        """Whether a missed expert expected to be used ``expected_reuse`` times (this miss
        included) is better uploaded than computed on the CPU: ``reuse * B_pcie > B_cpu``."""
        return self.b_pcie_gbps is not None and expected_reuse * self.b_pcie_gbps > self.b_cpu_gbps


@dataclass(frozen=True)
class BandwidthProfile:
    """A saved ``bench-bw`` profile of this machine and GPU."""

    path: Path
    gpu: str | None
    cpu: str
    kinds: dict[str, KindBandwidth]

    def for_layer(self, ex: ExpertLayer) -> KindBandwidth | None:
        """The figures of ``ex``'s layer kind, if it was measured."""
        from freetoken.engine.bandwidth import LayerKind

        return self.kinds.get(LayerKind.of(ex).key)

    def for_layers(self, layers: Sequence[ExpertLayer]) -> dict[int, KindBandwidth]:
        """Each layer's own kind's figures, by layer index; InvalidInputError naming the
        first layer whose kind this profile has not measured (``bench-bw`` measures every
        kind of the model it runs on, so that runs on this model fills the gap)."""
        from freetoken.engine.bandwidth import LayerKind

        out: dict[int, KindBandwidth] = {}
        for ex in layers:
            key = LayerKind.of(ex).key
            kind = self.kinds.get(key)
            if kind is None:
                raise InvalidInputError(
                    f"bandwidth profile {self.path} has no entry for layer {ex.index}'s kind "
                    f"{key!r} (it has {', '.join(map(repr, self.kinds)) or 'none'}): run "
                    "`freetoken bench-bw -m MODEL.gguf` on this model"
                )
            out[ex.index] = kind
        return out


def _kind(key: str, entry: dict[str, Any]) -> KindBandwidth:
    def opt(name: str) -> float | None:
        value = entry.get(name)
        return None if value is None else float(value)

    return KindBandwidth(
        key=key,
        threads=int(entry["threads"]),
        b_cpu_gbps=float(entry["b_cpu_gbps"]),
        b_pcie_gbps=opt("b_pcie_gbps"),
        b_gpu_gbps=opt("b_gpu_gbps"),
        break_even_reuse=opt("break_even_reuse"),
        b_cpu_with_pcie_gbps=opt("b_cpu_with_pcie_gbps"),
        b_pcie_with_cpu_gbps=opt("b_pcie_with_cpu_gbps"),
        b_gather_gbps=opt("b_gather_gbps"),
        b_cpu_with_gather_gbps=opt("b_cpu_with_gather_gbps"),
        b_gather_with_cpu_gbps=opt("b_gather_with_cpu_gbps"),
    )


def _current_gpu() -> str | None:
    """The name of the GPU FreeToken would use, None without one."""
    from freetoken.engine.bandwidth import gpu_device

    device, name = gpu_device()
    return name if device is not None else None


def load_bandwidth_profile(
    model: Transformer | None = None, gpu_name: str | None = None
) -> BandwidthProfile | None:
    """This machine's saved profile for ``gpu_name`` (default: the GPU FreeToken would use,
    ``"cpu"`` without one); with ``model``, only its layer kinds, and None if none of them
    was measured. None when nothing (or nothing readable) was saved."""
    if gpu_name is None:
        gpu_name = _current_gpu()
    path = profile_path(gpu_name)
    doc = _read(path)
    if doc is None:
        return None
    try:
        kinds = {key: _kind(key, entry) for key, entry in doc["kinds"].items()}
        cpu = str(doc["host"]["cpu"])
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        log.warning("ignoring bandwidth profile %s: %r", path, e)
        return None
    if model is not None:
        from freetoken.engine.bandwidth import group_layers

        wanted = {kind.key for kind in group_layers(model)}
        kinds = {key: k for key, k in kinds.items() if key in wanted}
        if not kinds:
            return None
    return BandwidthProfile(path, gpu_name, cpu, kinds)
