"""GGUF models: the file, parsed and mapped once in Rust, seen from Python."""

from freetoken.gguf.file import GGUFFile, TensorInfo

__all__ = ["GGUFFile", "TensorInfo"]
