"""The sliding-window test model of the KV cache tests (layers 0 and 2 of three see the last
``WINDOW`` positions) and how they feed it: random tokens, in steps of 1..``STEP``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from freetoken.llm import LLM
from freetoken.models.transformer import Transformer
from synthetic import SMALL_DENSE

WINDOW = 8
STEP = 5


def build(out: Path) -> Path:
    """The gemma3 model with sliding-window layers, written to ``out``."""
    from freetoken.testmodel import make_test_model

    return make_test_model(
        "gemma3",
        **SMALL_DENSE,
        seed=11,
        quant="q8_0",
        out=out,
        sliding_window=WINDOW,
        swa_pattern=2,
    )


def stepped(model: Transformer, seq: list[int], n_ctx: int, max_step: int) -> torch.Tensor:
    """Every position's logits, fed in steps of 1..``STEP`` tokens (a fixed pattern)."""
    cache = model.new_cache(n_ctx, max_step=max_step)
    out, i, n = [], 0, 1
    while i < len(seq):
        out.append(model.forward(seq[i : i + n], cache, all_logits=True))
        i, n = i + n, n % STEP + 1
    return torch.cat(out)


def random_tokens(llm: LLM, n: int) -> list[int]:
    """``n`` token ids of ``llm``'s vocabulary, the same every run."""
    return [int(t) for t in np.random.default_rng(5).integers(1, llm.vocab_size, n)]
