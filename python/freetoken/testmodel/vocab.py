"""Vocabularies for the test models: reading a vocab-only GGUF and finding the default ones.

The defaults are the vocab-only GGUFs of the pinned llama.cpp tree (``models/ggml-vocab-*.gguf``
of the pinned sdist's ``vendor/llama.cpp``, freetoken/llama_pin.toml), and for gemma3 the tokenizer
of the embedded default model (Gemma 3 270M).
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFValueType

from freetoken import paths
from freetoken.errors import FileAccessError, GGUFError, InvalidInputError
from freetoken.testmodel.archs import MetaItem

__all__ = [
    "Vocab",
    "default_vocab",
    "llama_tree",
    "read_vocab",
    "resolve_vocab",
]

#: The vocabulary each architecture's test models use unless ``--vocab`` says otherwise: a file
#: under the llama.cpp tree's ``models/``, or None for the default model's tokenizer.
DEFAULT_VOCABS: dict[str, str | None] = {
    "llama": "ggml-vocab-llama-spm.gguf",
    "qwen2": "ggml-vocab-qwen2.gguf",
    "qwen3": "ggml-vocab-qwen2.gguf",
    "gemma3": None,
    "qwen2moe": "ggml-vocab-qwen2.gguf",
    "qwen3moe": "ggml-vocab-qwen2.gguf",
    "olmoe": "ggml-vocab-gpt-neox.gguf",
    # gpt-oss (o200k) and GLM-4.5 vocabularies are not in the tree: another large BPE one.
    "gpt-oss": "ggml-vocab-qwen2.gguf",
    "glm4moe": "ggml-vocab-qwen2.gguf",
    "deepseek2": "ggml-vocab-deepseek-llm.gguf",
    "qwen35": "ggml-vocab-qwen35.gguf",
    "qwen35moe": "ggml-vocab-qwen35.gguf",
    # Qwen3-Next has the Qwen2/3 vocabulary.
    "qwen3next": "ggml-vocab-qwen2.gguf",
    "gemma4": "ggml-vocab-gemma-4.gguf",
    # Mistral 3's tekken vocabulary is not in the tree: a large BPE one of the same kind.
    "mistral3": "ggml-vocab-llama-bpe.gguf",
    # Qwen3-VL and MiniMax-M2 (whose own vocabulary is not in the tree either): Qwen2/3's.
    "qwen3vl": "ggml-vocab-qwen2.gguf",
    "qwen3vlmoe": "ggml-vocab-qwen2.gguf",
    "minimax-m2": "ggml-vocab-qwen2.gguf",
}

# GGUF token types (llama.cpp's llama_token_type).
TOKEN_NORMAL = 1


def llama_tree() -> Path:
    """The unpacked llama.cpp source tree (:func:`freetoken.paths.llama_tree`, where the build
    unpacks it). FileAccessError if it is not there; nothing is downloaded here."""
    path = paths.llama_tree()
    if not (path / "models").is_dir():
        raise FileAccessError(
            f"the llama.cpp source tree is not unpacked at {path}; build FreeToken once, set "
            "FREETOKEN_LLAMA_SRC, or pass --vocab FILE.gguf"
        )
    return path


def default_vocab(arch: str) -> Path:
    """The vocabulary file ``arch``'s test models use by default."""
    if arch not in DEFAULT_VOCABS:
        raise InvalidInputError(f"no default vocabulary for `{arch}`; pass --vocab FILE.gguf")
    name = DEFAULT_VOCABS[arch]
    if name is None:
        from freetoken.default_model import default_model_path

        return default_model_path()
    path = llama_tree() / "models" / name
    if not path.is_file():
        raise FileAccessError(f"{path} does not exist; pass --vocab FILE.gguf")
    return path


@dataclass
class Vocab:
    """The ``tokenizer.*`` metadata of a GGUF, ready to copy into another."""

    path: Path
    items: list[MetaItem]
    n_tokens: int
    token_types: np.ndarray | None
    """int32 per token, or None if the file has none."""
    bos_id: int | None
    add_bos: bool

    def normal_tokens(self) -> np.ndarray:
        """A bool mask of the ordinary tokens (not control, unused, byte or user-defined)."""
        if self.token_types is None:
            return np.ones(self.n_tokens, dtype=bool)
        return self.token_types == TOKEN_NORMAL


_SCALAR = {
    GGUFValueType.UINT8: "<B",
    GGUFValueType.INT8: "<b",
    GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h",
    GGUFValueType.UINT32: "<I",
    GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f",
    GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q",
    GGUFValueType.FLOAT64: "<d",
}


class _KVReader:
    """Reads the metadata section of a little-endian GGUF (v2, v3), keeping each value's type.

    gguf.GGUFReader would do, but it parses a 262144-token vocabulary in about 30 s (a numpy
    view per array element); this reads it in well under one. Strings stay raw bytes, so a
    vocabulary is copied byte for byte. The tests check it against GGUFReader.
    """

    def __init__(self, buf: mmap.mmap, path: Path) -> None:
        self.buf, self.path, self.pos = buf, path, 0

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFError(f"{self.path}: truncated metadata")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> bytes:
        n = self.take("<Q")
        if self.pos + n > len(self.buf):
            raise GGUFError(f"{self.path}: truncated metadata")
        value = self.buf[self.pos : self.pos + n]
        self.pos += n
        return value

    def value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self.string()
        return self.take(_SCALAR[vtype])

    def array(self) -> tuple[list[Any], GGUFValueType]:
        sub = self.vtype()
        n = self.take("<Q")
        if sub == GGUFValueType.STRING:
            return [self.string() for _ in range(n)], sub
        if sub == GGUFValueType.ARRAY:
            raise GGUFError(f"{self.path}: nested metadata arrays are not supported")
        dtype = np.dtype(_SCALAR[sub])
        if self.pos + n * dtype.itemsize > len(self.buf):
            raise GGUFError(f"{self.path}: truncated metadata")
        values = np.frombuffer(self.buf, dtype=dtype, count=n, offset=self.pos).tolist()
        self.pos += n * dtype.itemsize
        return values, sub

    def vtype(self) -> GGUFValueType:
        raw = self.take("<I")
        try:
            return GGUFValueType(raw)
        except ValueError:
            raise GGUFError(f"{self.path}: unknown metadata value type {raw}") from None


def _read_metadata(path: Path) -> list[MetaItem]:
    """Every metadata key of the GGUF at ``path``, with its type."""
    with open(path, "rb") as f:
        try:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:
            raise GGUFError(f"{path} is empty, not a GGUF file") from None
    with buf:
        r = _KVReader(buf, path)
        if len(buf) < 24 or buf[:4] != b"GGUF":
            raise GGUFError(f"{path} is not a GGUF file (bad magic)")
        r.pos = 4
        version = r.take("<I")
        if version not in (2, 3):
            raise GGUFError(f"{path}: unsupported GGUF version {version} (or big-endian)")
        r.take("<Q")  # tensor count
        n_kv = r.take("<Q")
        items = []
        for _ in range(n_kv):
            key = r.string().decode("utf-8", errors="replace")
            vtype = r.vtype()
            if vtype == GGUFValueType.ARRAY:
                values, sub = r.array()
                items.append(MetaItem(key, values, vtype, sub))
            else:
                items.append(MetaItem(key, r.value(vtype), vtype))
        return items


def read_vocab(path: str | os.PathLike[str]) -> Vocab:
    """Reads every ``tokenizer.*`` key of a GGUF (a vocab-only file or a whole model)."""
    path = Path(path)
    if not path.is_file():
        raise FileAccessError(f"vocabulary file {path} does not exist")
    try:
        meta = _read_metadata(path)
    except OSError as e:
        raise FileAccessError(f"cannot read {path}: {e}") from None
    # GGUFWriter cannot write an empty array, and one carries nothing.
    items = [
        m
        for m in meta
        if m.key.startswith("tokenizer.") and not (m.vtype == GGUFValueType.ARRAY and not m.value)
    ]
    by_key = {m.key: m for m in items}
    tokens = by_key.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise InvalidInputError(f"{path} has no tokenizer.ggml.tokens: not a vocabulary")
    types = by_key.get("tokenizer.ggml.token_type")
    token_types = np.asarray(types.value, dtype=np.int32) if types is not None else None
    bos = by_key.get("tokenizer.ggml.bos_token_id")
    add_bos = by_key.get("tokenizer.ggml.add_bos_token")
    model = by_key.get("tokenizer.ggml.model")
    n_tokens = len(tokens.value)
    if token_types is not None and len(token_types) != n_tokens:
        raise GGUFError(f"{path}: {len(token_types)} token types for {n_tokens} tokens")
    return Vocab(
        path=path,
        items=items,
        n_tokens=n_tokens,
        token_types=token_types,
        bos_id=int(bos.value) if bos is not None else None,
        # Without the key, llama.cpp adds BOS for SentencePiece ("llama") vocabularies.
        add_bos=bos is not None
        and (
            bool(add_bos.value)
            if add_bos is not None
            else model is not None and model.value == b"llama"
        ),
    )


def resolve_vocab(vocab: str | os.PathLike[str] | None, arch: str) -> Path:
    """``vocab`` as a path, or ``arch``'s default vocabulary when it is None."""
    return default_vocab(arch) if vocab is None else Path(vocab)
