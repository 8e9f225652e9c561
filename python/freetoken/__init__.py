"""FreeToken: mixture-of-experts LLM inference beyond GPU memory."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from freetoken import errors, quant
from freetoken._core import __version__

if TYPE_CHECKING:
    from freetoken.engine.spec_options import SpecOptions
    from freetoken.llm import LLM

__all__ = ["LLM", "SpecOptions", "__version__", "errors", "quant"]


def __getattr__(name: str) -> Any:
    # LLM pulls in torch: import it only when asked for.
    if name == "LLM":
        from freetoken.llm import LLM

        return LLM
    if name == "SpecOptions":
        from freetoken.engine.spec_options import SpecOptions

        return SpecOptions
    raise AttributeError(f"module 'freetoken' has no attribute {name!r}")
