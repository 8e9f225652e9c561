"""Shared pytest fixtures.

`llama_ref_root` builds the llama.cpp reference (`tools/llama_ref.py`) on first use, once per
session; later sessions find it in the cache.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

TOOLS_DIR = Path(__file__).resolve().parent.parent / "tools"
if str(TOOLS_DIR) not in sys.path:
    sys.path.insert(0, str(TOOLS_DIR))


@pytest.fixture(scope="session")
def llama_ref_root() -> Path:
    """The install directory of the llama.cpp reference build (built here if needed)."""
    import llama_ref

    return llama_ref.build()


@pytest.fixture(scope="session")
def default_model() -> Path:
    """The embedded default model (Gemma 3 270M Q4_K_M), assembled into the cache."""
    from freetoken.default_model import default_model_path

    return default_model_path()
