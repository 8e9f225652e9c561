"""Where FreeToken keeps downloads and generated files: ``$FREETOKEN_CACHE`` or
``~/.cache/freetoken``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """The user cache directory (created on demand)."""
    path = Path(os.environ.get("FREETOKEN_CACHE") or Path.home() / ".cache" / "freetoken")
    path.mkdir(parents=True, exist_ok=True)
    return path
