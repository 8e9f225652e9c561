"""Synthetic test models shared by the model tests: make-test-model on the llama-spm
vocabulary of the pinned llama.cpp tree."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
from freetoken.errors import FileAccessError
from freetoken.testmodel import make_test_model
from freetoken.testmodel.vocab import llama_tree

#: The dense shape of the small synthetic models the llama.cpp comparisons run.
SMALL_DENSE: dict[str, int] = {
    "layers": 3,
    "hidden": 256,
    "ffn": 512,
    "heads": 4,
    "kv_heads": 2,
    "head_dim": 64,
}


def build_models(
    specs: Mapping[str, Mapping[str, Any]], base: Mapping[str, Any], out: Path
) -> dict[str, Path]:
    """One model per spec (``arch`` plus make_test_model options over ``base``) in ``out``;
    skips the calling test when the llama.cpp tree (the vocabulary) is not unpacked."""
    try:
        vocab = llama_tree() / "models" / "ggml-vocab-llama-spm.gguf"
    except FileAccessError as e:
        pytest.skip(str(e))
    files = {}
    for name, spec in specs.items():
        args = {**base, **spec}
        arch = args.pop("arch")
        files[name] = make_test_model(
            arch, vocab=vocab, out=out / f"{name}.gguf", log=lambda _: None, **args
        )
    return files
