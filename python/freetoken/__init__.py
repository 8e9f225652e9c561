"""FreeToken: mixture-of-experts LLM inference beyond GPU memory."""

from __future__ import annotations

from freetoken import errors, quant
from freetoken._core import __version__

__all__ = ["__version__", "errors", "quant"]
