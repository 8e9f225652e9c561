"""The peakedness check of a test model: the mean top-1 probability over a prompt.

Greedy comparisons between two engines are coin flips on a model whose next-token distribution
is flat; make-test-model requires a mean top-1 probability of at least :data:`MIN_TOP1`.
The logits come from FreeToken's own engine (``freetoken.LLM``) or, where that cannot be
imported, from the llama.cpp reference (``tools/llama_ref.py`` of a source checkout).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import numpy as np

from freetoken.errors import FreeTokenError, UnsupportedError
from freetoken.testmodel.vocab import read_vocab

__all__ = ["MIN_TOP1", "check_peakedness", "default_prompt", "top1_probabilities"]

#: The least mean top-1 probability make-test-model accepts.
MIN_TOP1 = 0.2
#: Tokens in the default prompt.
PROMPT_LEN = 48
_PROMPT_SEED = 20240229


def default_prompt(path: str | os.PathLike[str], n: int = PROMPT_LEN) -> list[int]:
    """A fixed prompt for the model at ``path``: BOS (if the vocabulary adds one) and ordinary
    tokens drawn with a fixed seed, so that it does not depend on a tokenizer."""
    vocab = read_vocab(path)
    normal = np.flatnonzero(vocab.normal_tokens())
    rng = np.random.default_rng(_PROMPT_SEED)
    tokens = rng.choice(normal, size=n, replace=len(normal) < n).tolist()
    if vocab.add_bos and vocab.bos_id is not None:
        tokens = [vocab.bos_id, *tokens[: n - 1]]
    return [int(t) for t in tokens]


def _llama_ref_module() -> ModuleType:
    """``tools/llama_ref.py`` of the source checkout this package runs from."""
    if "llama_ref" in sys.modules:
        return sys.modules["llama_ref"]
    path = Path(__file__).resolve().parents[3] / "tools" / "llama_ref.py"
    if not path.is_file():
        raise UnsupportedError(
            "freetoken.LLM is not importable and the llama.cpp reference (tools/llama_ref.py) "
            "is not here"
        )
    spec = importlib.util.spec_from_file_location("llama_ref", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["llama_ref"] = module
    spec.loader.exec_module(module)
    return module


def _logits_freetoken(path: str, tokens: list[int]) -> np.ndarray:
    from freetoken.llm import LLM

    llm = LLM(path, n_ctx=max(len(tokens) + 1, 64))
    return llm.logits(tokens).detach().to("cpu").float().numpy()


def _logits_llama_cpp(path: str, tokens: list[int]) -> np.ndarray:
    llama_ref = _llama_ref_module()
    with llama_ref.LlamaRef.load(path, n_ctx=max(len(tokens) + 1, 64), n_threads=2) as ref:
        return ref.logits(tokens)


def _freetoken_available() -> bool:
    try:
        import freetoken.llm  # noqa: F401
    except ImportError:
        return False
    return True


def top1_probabilities(
    path: str | os.PathLike[str],
    prompt_tokens: Sequence[int] | None = None,
    backend: str = "auto",
) -> tuple[np.ndarray, str]:
    """The top-1 probability at each prompt position, and the engine that computed them.

    ``backend``: ``"freetoken"`` (``freetoken.LLM``), ``"llama.cpp"`` (the reference) or
    ``"auto"`` (FreeToken where importable, else llama.cpp).
    """
    path = os.fspath(path)
    tokens = list(prompt_tokens) if prompt_tokens is not None else default_prompt(path)
    if not tokens:
        raise FreeTokenError("the prompt is empty")
    if backend == "auto":
        backend = "freetoken" if _freetoken_available() else "llama.cpp"
    if backend == "freetoken":
        logits = _logits_freetoken(path, tokens)
    elif backend == "llama.cpp":
        logits = _logits_llama_cpp(path, tokens)
    else:
        raise FreeTokenError(f"unknown backend `{backend}` (auto, freetoken, llama.cpp)")
    x = logits.astype(np.float64)
    if not np.isfinite(x).all():
        raise FreeTokenError(f"{path}: the logits are not all finite")
    x -= x.max(axis=-1, keepdims=True)
    p = np.exp(x)
    top1 = p.max(axis=-1) / p.sum(axis=-1)
    return top1, backend


def check_peakedness(
    path: str | os.PathLike[str],
    prompt_tokens: Sequence[int] | None = None,
    backend: str = "auto",
) -> float:
    """The mean top-1 probability of the model at ``path`` over a prompt (default:
    :func:`default_prompt`); see :func:`top1_probabilities` for ``backend``."""
    top1, _ = top1_probabilities(path, prompt_tokens, backend)
    return float(top1.mean())
