"""``--moe-cpu-precise`` reaches the CPU expert executor of a loaded model (the executor's own
accuracy in both modes: tests/test_moe_executor.py)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pytest
from freetoken.engine import options as engine_options
from freetoken.engine.options import EngineOptions
from freetoken.llm import LLM
from synthetic import build_models


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Q4_K experts: q8_K activations, where the two modes differ most.
    spec = dict(arch="qwen3moe", head_dim=32, experts=8, top_k=2, expert_ffn=256)
    base = dict(layers=2, hidden=256, ffn=256, heads=4, kv_heads=2, seed=5, quant="q8_0,exps=q4_k")
    return build_models({"moe": spec}, base, tmp_path_factory.mktemp("precise"))["moe"]


def test_flag_parses() -> None:
    p = argparse.ArgumentParser()
    engine_options.add_arguments(p)
    assert engine_options.from_args(p.parse_args(["--moe-cpu-precise"])).moe_cpu_precise
    assert not engine_options.from_args(p.parse_args([])).moe_cpu_precise


def test_models_use_the_chosen_mode(model: Path) -> None:
    """The loaded model's executor has the option's mode, switching back and forth, and the
    two modes' logits differ by rounding only."""
    logits = {}
    for precise in (True, False):
        llm = LLM(model, n_ctx=64, engine=EngineOptions(device="cpu", moe_cpu_precise=precise))
        assert llm.model.moe is not None
        assert llm.model.moe.executor.residual_acts is precise
        logits[precise] = llm.logits(llm.tokenize("The capital of France is")).numpy()
    a, b = logits[True], logits[False]
    assert not np.array_equal(a, b)
    assert np.abs(a - b).max() < 0.05 * np.abs(b).max()
