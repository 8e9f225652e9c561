"""Where FreeToken keeps downloads and generated files (``$FREETOKEN_CACHE``, else
``~/.cache/freetoken``), and the pinned llama.cpp source (``llama_pin.toml`` beside this
module, which the build scripts read too)."""

from __future__ import annotations

import functools
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LlamaPin", "cache_dir", "llama_pin", "llama_tree"]


def cache_dir(create: bool = True) -> Path:
    """The user cache directory: ``$FREETOKEN_CACHE``, else ``~/.cache/freetoken`` (created
    unless ``create`` is False)."""
    path = Path(os.environ.get("FREETOKEN_CACHE") or Path.home() / ".cache" / "freetoken")
    if create:
        path.mkdir(parents=True, exist_ok=True)
    return path


@dataclass(frozen=True)
class LlamaPin:
    """The pinned sdist: file name stem, pip requirement, sha256 and download URL."""

    name: str
    requirement: str
    sha256: str
    url: str


@functools.cache
def llama_pin() -> LlamaPin:
    """The pin of ``llama_pin.toml``."""
    with open(Path(__file__).with_name("llama_pin.toml"), "rb") as f:
        return LlamaPin(**tomllib.load(f))


def llama_tree() -> Path:
    """Where the build unpacks the pinned sdist's ``vendor/llama.cpp``:
    ``<cache>/llama.cpp-<sha256>`` (``$FREETOKEN_LLAMA_SRC`` overrides it)."""
    src = os.environ.get("FREETOKEN_LLAMA_SRC")
    if src:
        return Path(src)
    return cache_dir(create=False) / f"llama.cpp-{llama_pin().sha256}"
