"""``--moe-cache-audit FILE.jsonl``: one JSON line per generation on where the routed experts
were computed, and the same counters as ``/metrics`` series.

A record holds the counts since the previous record: per MoE layer the routes, those served
from a GPU slot (``gpu_routes``; every route of a layer with slots under ``gpu`` and
``offload``, none on the CPU executor) and of those the ones whose expert was seeded from the
plan or profile (``seeded_hits``) or filled in later (``filled_hits``, hybrid only), the
routes computed on the GPU on experts uploaded for their step only (``fetched_routes``,
hybrid), the routes the CPU computed, the hit rate; the bytes uploaded to the GPU, the fills
and swaps (hybrid); each layer's resident expert ids at the end (hybrid); and per step size
(``fetch``, hybrid: ``"1"``, ``"2-4"``, ... tokens a step) the split steps, the routes
uploaded and computed on the GPU for that step against those computed on the CPU, the
expert bytes each side read and the seconds each took. With concurrent server requests the
counts since the previous record go to the request that finished.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

import numpy as np

from freetoken.errors import FileAccessError

__all__ = ["ExpertAudit", "expert_counters"]


def expert_counters(model: Any, placement: Any) -> dict[str, Any]:
    """The cumulative counters of ``model``'s MoE layers under ``placement`` (None: CPU)."""
    moe = getattr(model, "moe", None)
    if moe is None:
        return {"layers": {}}
    counts = moe.collect().expert_counts()
    experts = getattr(placement, "experts", None)
    strategy = getattr(placement, "strategy", "cpu")
    stats = experts.stats() if experts is not None and hasattr(experts, "stats") else None
    on_gpu = set(getattr(experts, "layers", {}) or {})
    layers: dict[int, dict[str, int]] = {}
    for li, c in enumerate(counts):
        routes = int(sum(c))
        if not routes and li not in on_gpu:
            continue
        # gpu and offload serve every route of their layers from a slot; hybrid: see below.
        gpu_routes = routes if strategy in ("gpu", "offload") and li in on_gpu else 0
        layers[li] = {"routes": routes, "gpu_routes": gpu_routes}
    out: dict[str, Any] = {"layers": layers}
    if stats is not None:
        for i, li in enumerate(stats.layers):
            entry = layers.setdefault(li, {"routes": 0, "gpu_routes": 0})
            entry["gpu_routes"] = int(stats.hits[i])
            entry["seeded_hits"] = int(stats.seeded_hits[i])
            entry["filled_hits"] = int(stats.filled_hits[i])
            entry["fetched_routes"] = int(stats.fetched[i])
        out |= {"fills": stats.fills, "swaps": stats.swaps, "fetch": stats.fetch}
        out["resident"] = {str(li): r for li, r in zip(stats.layers, stats.resident, strict=True)}
    if experts is not None and hasattr(experts, "uploaded_bytes"):
        out["uploaded_bytes"] = int(experts.uploaded_bytes)
    return out


def _delta(now: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    layers = []
    for li, c in now["layers"].items():
        b = before["layers"].get(li, {})
        d = {k: v - b.get(k, 0) for k, v in c.items()}
        d["cpu_routes"] = d["routes"] - d["gpu_routes"] - d.get("fetched_routes", 0)
        d["hit_rate"] = d["gpu_routes"] / d["routes"] if d["routes"] else None
        layers.append({"layer": li, **d})
    out: dict[str, Any] = {"layers": layers}
    routes = sum(la["routes"] for la in layers)
    out["hit_rate"] = sum(la["gpu_routes"] for la in layers) / routes if routes else None
    out["cpu_routes"] = sum(la["cpu_routes"] for la in layers)
    for key in ("fills", "swaps", "uploaded_bytes"):
        if key in now:
            out[key] = now[key] - before.get(key, 0)
    if "resident" in now:
        out["resident"] = now["resident"]
    if "fetch" in now:
        old = before.get("fetch", {})
        out["fetch"] = {
            size: {f: v - old.get(size, {}).get(f, 0) for f, v in c.items()}
            for size, c in now["fetch"].items()
            if c["steps"] != old.get(size, {}).get("steps", 0)
        }
    return out


class ExpertAudit:
    """Appends a record to ``path`` per :meth:`record` call (thread-safe)."""

    def __init__(self, path: str | os.PathLike[str], model: Any, placement: Any) -> None:
        self.path = os.fspath(path)
        self.model, self.placement = model, placement
        try:
            with open(self.path, "a"):
                pass
        except OSError as e:
            raise FileAccessError(f"cannot write the audit log {self.path}: {e.strerror}") from None
        self._lock = threading.Lock()
        self._last = expert_counters(model, placement)

    def record(self, **fields: Any) -> dict[str, Any]:
        """Writes the counts since the previous record, with ``fields`` (request id, token
        counts), and returns the record."""
        with self._lock:
            now = expert_counters(self.model, self.placement)
            rec = {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "strategy": getattr(self.placement, "strategy", "cpu"),
                **fields,
                **_delta(now, self._last),
            }
            self._last = now
            with open(self.path, "a") as f:
                f.write(json.dumps(rec, default=_plain) + "\n")
        return rec


def _plain(v: Any) -> Any:
    if isinstance(v, np.generic):
        return v.item()
    raise TypeError(f"{type(v).__name__} is not JSON")
