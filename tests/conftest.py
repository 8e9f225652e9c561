"""Shared pytest fixtures, and the `gpu` mark's rule: its tests skip without a CUDA GPU that
libfreetoken_cuda sees.

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


def _gpu_ready() -> bool:
    import torch
    from freetoken.runtime import gpu

    return bool(torch.cuda.is_available() and gpu.available())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the `gpu` tests skipped when there is no GPU to run them."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if marked and not _gpu_ready():
        skip = pytest.mark.skip(reason="needs a CUDA GPU and libfreetoken_cuda")
        for item in marked:
            item.add_marker(skip)


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
