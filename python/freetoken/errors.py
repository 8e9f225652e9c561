"""FreeToken's exceptions: one hierarchy, rooted at :class:`FreeTokenError`.

Every error the Rust core reports arrives as one of these classes (mapped in one place,
``crates/ft-py/src/errors.rs``); the Python layers raise the same classes.
"""

from __future__ import annotations

__all__ = [
    "FileAccessError",
    "FreeTokenError",
    "GGUFError",
    "InvalidInputError",
    "OutOfMemoryError",
    "ShapeError",
    "UnsupportedError",
]


class FreeTokenError(Exception):
    """Base class of every error FreeToken raises on bad input or an impossible request."""


class GGUFError(FreeTokenError):
    """A GGUF file is corrupt, truncated, or inconsistent with itself."""


class UnsupportedError(FreeTokenError):
    """A type, architecture or feature this build does not handle."""


class ShapeError(FreeTokenError, ValueError):
    """Sizes or shapes that do not fit together."""


class InvalidInputError(FreeTokenError, ValueError):
    """A value that is not acceptable: NaN input, a wrong dtype, a missing importance matrix."""


class OutOfMemoryError(FreeTokenError, MemoryError):
    """An allocation (host, pinned or GPU) that could not be satisfied."""


class FileAccessError(FreeTokenError, OSError):
    """A file could not be opened, mapped or read."""
