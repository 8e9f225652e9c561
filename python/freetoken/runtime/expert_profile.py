"""The expert-use profile file (docs/expert-profile.md): per MoE layer the routes per expert
that the GPU expert cache is sized and seeded from. :func:`expert_profile` makes one from a
model's counters, :func:`write_profile` saves it, :func:`load_profile` reads and checks one,
:func:`profile_of_layers` keeps some layers of one (a GPU's share of a split)."""

from __future__ import annotations

import json
import os
from collections.abc import Container, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from freetoken.errors import FileAccessError, InvalidInputError, UnsupportedError

__all__ = [
    "FORMAT",
    "VERSION",
    "MoeLayer",
    "expert_profile",
    "load_profile",
    "profile_of_layers",
    "write_profile",
]

FORMAT = "freetoken.expert-profile"
VERSION = 1


def expert_profile(llm: Any) -> dict[str, Any]:
    """The profile of everything ``llm`` has computed so far (from the permanent counters)."""
    moe = llm.model.moe
    if moe is None:
        raise UnsupportedError(f"{llm.path} is not a mixture-of-experts model")
    cfg = llm.model.cfg
    layers = []
    for i, counts in enumerate(moe.collect().expert_counts()):
        if counts:
            layers.append({"layer": i, "routes": sum(counts), "counts": list(counts)})
    top_k = cfg.n_experts_used
    return {
        "format": FORMAT,
        "version": VERSION,
        "model": {
            "file": os.path.basename(llm.path),
            "name": llm.gguf.metadata.get("general.name", ""),
            "architecture": cfg.arch,
            "n_layers": cfg.n_layers,
            "n_experts": cfg.n_experts,
            "top_k": top_k,
        },
        "tokens": layers[0]["routes"] // top_k if layers and top_k else 0,
        "layers": layers,
    }


def write_profile(profile: Mapping[str, Any], path: str | os.PathLike[str]) -> None:
    """Writes ``profile`` (from :func:`expert_profile`) as indented JSON."""
    Path(path).write_text(json.dumps(profile, indent=1) + "\n")


def _read_profile(profile: Mapping[str, Any] | str | os.PathLike[str]) -> tuple[Any, str]:
    if isinstance(profile, Mapping):
        return profile, "the profile"
    path = Path(profile)
    try:
        text = path.read_text()
    except OSError as e:
        raise FileAccessError(f"cannot read the profile {path}: {e.strerror}") from None
    try:
        return json.loads(text), str(path)
    except json.JSONDecodeError as e:
        raise InvalidInputError(f"{path} is not JSON: {e}") from None


def _count_list(value: Any, n: int, where: str) -> list[int]:
    ok = isinstance(value, list) and all(
        isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in value
    )
    if not ok:
        raise InvalidInputError(f"{where}: counts must be a list of non-negative integers")
    if len(value) != n:
        raise InvalidInputError(f"{where}: {len(value)} counts for {n} experts")
    return value


class MoeLayer(Protocol):
    """What a profile is checked against, per MoE layer (``slots.LayerSpec`` has it)."""

    @property
    def layer(self) -> int: ...
    @property
    def n_experts(self) -> int: ...
    @property
    def top_k(self) -> int: ...


def load_profile(
    profile: Mapping[str, Any] | str | os.PathLike[str],
    layers: Sequence[MoeLayer],
    *,
    architecture: str | None = None,
    n_layers: int | None = None,
) -> dict[int, list[int]]:
    """Reads and checks an expert-use profile (docs/expert-profile.md: the parsed JSON or a
    path) against the model: its format and version, and its model's ``n_experts`` and
    ``top_k`` (from ``layers``), ``architecture`` and ``n_layers`` when given; every profiled
    layer must be one of ``layers``. Returns the counts by layer."""
    doc, src = _read_profile(profile)
    if not isinstance(doc, Mapping) or doc.get("format") != FORMAT:
        got = doc.get("format") if isinstance(doc, Mapping) else type(doc).__name__
        raise InvalidInputError(f"{src} is not an expert-use profile ({FORMAT!r}): {got!r}")
    if doc.get("version") != VERSION:
        raise UnsupportedError(
            f"{src} has profile version {doc.get('version')!r}; this build reads version {VERSION}"
        )
    model = doc.get("model")
    if not isinstance(model, Mapping):
        raise InvalidInputError(f"{src} has no model description")
    by_layer = {s.layer: s for s in layers}
    want: dict[str, Any] = {"architecture": architecture, "n_layers": n_layers}
    if layers:
        want |= {"n_experts": layers[0].n_experts, "top_k": layers[0].top_k}
    for key, value in want.items():
        if value is not None and model.get(key) != value:
            raise InvalidInputError(
                f"{src} was made on another model: its {key} is {model.get(key)!r}, this "
                f"model's is {value!r}"
            )
    entries = doc.get("layers")
    if not isinstance(entries, list):
        raise InvalidInputError(f"{src}: `layers` must be a list")
    counts: dict[int, list[int]] = {}
    for entry in entries:
        layer = entry.get("layer") if isinstance(entry, Mapping) else None
        if not isinstance(layer, int) or layer not in by_layer:
            raise InvalidInputError(f"{src}: layer {layer!r} is not a MoE layer of this model")
        if layer in counts:
            raise InvalidInputError(f"{src}: layer {layer} is listed twice")
        where = f"{src}, layer {layer}"
        c = _count_list(entry.get("counts"), by_layer[layer].n_experts, where)
        if "routes" in entry and entry["routes"] != sum(c):
            raise InvalidInputError(f"{where}: routes {entry['routes']} != sum of counts")
        counts[layer] = c
    return counts


def profile_of_layers(
    profile: Mapping[str, Any] | str | os.PathLike[str], layers: Container[int]
) -> Any:
    """The profile (the parsed JSON or a path) with the entries of ``layers`` only: the
    counts a GPU's share of a split plans its pools from. A document without a list of
    layers comes back as it is, for :func:`load_profile` to report."""
    doc, _ = _read_profile(profile)
    entries = doc.get("layers") if isinstance(doc, Mapping) else None
    if not isinstance(entries, list):
        return doc
    kept = [e for e in entries if not isinstance(e, Mapping) or e.get("layer") in layers]
    return {**doc, "layers": kept}
