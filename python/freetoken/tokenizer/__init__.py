"""Tokenizers built from a GGUF file's ``tokenizer.ggml.*`` metadata, matching llama.cpp.

>>> tok = Tokenizer.from_gguf_metadata(metadata)
>>> ids = tok.encode("Hello world")
>>> tok.decode(ids)

Modules: :mod:`~freetoken.tokenizer.vocab` (loading: attributes, special ids, flags),
:mod:`~freetoken.tokenizer.pretok` (BPE word splitting), :mod:`~freetoken.tokenizer.models`
(SentencePiece and BPE merging), :mod:`~freetoken.tokenizer.chat` (chat templates).
"""

from __future__ import annotations

from freetoken.tokenizer.core import IncrementalDecoder, Tokenizer

__all__ = ["IncrementalDecoder", "Tokenizer"]
