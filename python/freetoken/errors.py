"""FreeToken's exceptions: one hierarchy, rooted at :class:`FreeTokenError`.

Every error the Rust core reports arrives as one of these classes (mapped in one place,
``crates/ft-py/src/errors.rs``); the Python layers raise the same classes.
"""

from __future__ import annotations

__all__ = [
    "DeviceError",
    "FileAccessError",
    "FreeTokenError",
    "GGUFError",
    "InvalidInputError",
    "OutOfMemoryError",
    "RequestError",
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


class DeviceError(FreeTokenError):
    """The GPU failed: a kernel launch, a lost device, a driver error."""


class FileAccessError(FreeTokenError, OSError):
    """A file could not be opened, mapped or read."""


class RequestError(FreeTokenError):
    """A server request that cannot be served, answered as an OpenAI-shaped error.

    ``status`` is the HTTP status (4xx for the client's mistakes), ``param`` the offending
    request field if one is to blame, ``code`` a short machine-readable reason, and
    ``err_type`` the OpenAI error type (``invalid_request_error``, ``authentication_error``,
    ``not_found_error``, ``server_error``).
    """

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        err_type: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.err_type = err_type
