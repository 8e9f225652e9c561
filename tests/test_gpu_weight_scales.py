"""NVFP4 matrices with their ``.scale`` companions on the GPU (tests/test_weight_scales.py
checks the CPU engine against llama.cpp on the same files): each GPU strategy teacher-forced
against the CPU engine, the sequence as prompt chunks and then one decode step at a time
(graphs where the strategy captures them); argmax equal except near-ties, mean KL at most
0.005 over the positions not routed at a near-tie (``teacher_forced.routing_near_ties``:
there a top-2-of-8 router's choice flips with rounding, as llama.cpp's CPU and the CPU
engine's do on the same file)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from freetoken.engine.options import EngineOptions  # noqa: E402
from freetoken.llm import LLM  # noqa: E402
from synthetic import build_models  # noqa: E402
from teacher_forced import compare, routing_near_ties  # noqa: E402
from test_weight_scales import _BASE, MODELS, PROMPT, add_scales  # noqa: E402

pytestmark = pytest.mark.gpu

N_GEN = 32
MAX_KL = 0.005


@pytest.fixture(scope="module")
def scaled_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    plain = build_models(MODELS, _BASE, tmp_path_factory.mktemp("gpu-weight-scales"))
    return {n: add_scales(p, p.with_name(f"{n}-scaled.gguf")) for n, p in plain.items()}


def _steps(llm: LLM, seq: list[int], first: int) -> np.ndarray:
    """Logits of positions ``first..`` (the prompt's last on): the prompt, then decode steps."""
    cache = llm.model.new_cache(len(seq))
    out = [llm.model.forward(seq[: first + 1], cache).numpy()]
    out += [llm.model.forward([t], cache).numpy() for t in seq[first + 1 : -1]]
    return np.stack(out)


@pytest.mark.parametrize("strategy", ["gpu", "hybrid", "cpu"])
@pytest.mark.parametrize("name", list(MODELS))
def test_scaled_nvfp4_on_the_gpu_matches_cpu(
    name: str, strategy: str, scaled_files: dict[str, Path]
) -> None:
    path = scaled_files[name]
    cpu = LLM(path, n_ctx=256, engine=EngineOptions(device="cpu"))
    prompt = cpu.tokenize(PROMPT)
    seq = list(prompt)
    for _ in range(N_GEN):
        seq.append(int(cpu.logits(seq)[-1].argmax()))
    first = len(prompt) - 1
    ref = cpu.logits(seq)[first:-1].numpy()
    # Positions routed at a near-tie are a coin flip between the two engines' roundings.
    skip = routing_near_ties(cpu.model, seq, first)
    assert len(skip) <= len(ref) // 2, f"test data: {len(skip)} routing near-ties"
    mib = 1 if strategy == "hybrid" else None
    opts = EngineOptions(device="cuda", moe_strategy=strategy, moe_cache_mib=mib)
    llm = LLM(path, n_ctx=256, engine=opts)
    for how, ours in [
        ("prefill", llm.logits(seq)[first:-1].numpy()),
        ("decode", _steps(llm, seq, first)),
    ]:
        c = compare(ref, ours, skip)
        assert not c.mismatches, f"{name} {strategy} {how}: {c.describe()}"
        assert c.mean_kl <= MAX_KL, f"{name} {strategy} {how}: {c.describe()}"
