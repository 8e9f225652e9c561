"""``-t``, ``--moe-cpu-threads`` and ``--poll`` reach the CPU pools of a loaded model: the
dense products' pool and the expert executor (llama.cpp's ``-t`` sizes both)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from freetoken import _core
from freetoken.engine.options import CPU_ENGINE_POLL, POLL_STEP_US, EngineOptions
from freetoken.errors import InvalidInputError
from freetoken.llm import LLM
from freetoken.runtime.moe import default_threads
from synthetic import build_models


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = dict(arch="qwen3moe", head_dim=32, experts=8, top_k=2, expert_ffn=128)
    base = dict(layers=2, hidden=128, ffn=128, heads=4, kv_heads=2, seed=9, quant="q8_0,exps=q4_0")
    return build_models({"moe": spec}, base, tmp_path_factory.mktemp("threads"))["moe"]


@pytest.fixture(autouse=True)
def restore_pool():
    before = (_core.num_threads(), _core.poll_us())
    yield
    _core.set_num_threads(*before)


def _logits(model: Path, n_threads: int | None, engine: EngineOptions) -> tuple[LLM, torch.Tensor]:
    llm = LLM(model, n_ctx=64, n_threads=n_threads, engine=engine)
    return llm, llm.logits(llm.tokenize("Threads and polling change the timing only"))


def test_threads_and_poll_reach_both_pools(model: Path) -> None:
    llm, parked = _logits(model, 2, EngineOptions(device="cpu", poll=0))
    executor = llm.model.moe.executor
    assert (executor.n_threads, executor.poll_us) == (2, 0)
    assert (_core.num_threads(), _core.poll_us()) == (2, 0)

    llm, polled = _logits(model, 2, EngineOptions(device="cpu", moe_cpu_threads=1, poll=50))
    executor = llm.model.moe.executor
    assert (executor.n_threads, executor.poll_us) == (1, 50 * POLL_STEP_US)
    assert _core.poll_us() == 50 * POLL_STEP_US
    # Work is split by task index, not by thread, so parked and polling workers (and one
    # thread against two) compute the same bits.
    assert torch.equal(parked, polled)


def test_the_cpu_engine_shares_one_pool(model: Path) -> None:
    """On the CPU engine an executor of the process pool's size runs on that pool, which
    polls for llama.cpp's default (level 50) unless ``--poll`` says; one of another size
    keeps its own; a shared executor of the wrong size is refused."""
    llm, shared = _logits(model, 2, EngineOptions(device="cpu"))
    executor = llm.model.moe.executor
    assert executor.shared and executor.n_threads == 2
    assert executor.poll_us == _core.poll_us() == CPU_ENGINE_POLL * POLL_STEP_US
    llm, own = _logits(model, 2, EngineOptions(device="cpu", moe_cpu_threads=1, poll=3))
    executor = llm.model.moe.executor
    assert not executor.shared and (executor.n_threads, executor.poll_us) == (1, 60)
    assert torch.equal(shared, own)
    with pytest.raises(InvalidInputError, match="process pool"):
        _core.MoeExecutor(_core.num_threads() + 1, shared=True)


@pytest.mark.parametrize("poll", [-1, 101])
def test_poll_out_of_range(model: Path, poll: int) -> None:
    with pytest.raises(InvalidInputError, match="--poll"):
        EngineOptions(poll=poll)
    cmd = ["generate", "-m", str(model), "-n", "1", "-p", "hi", "--poll", str(poll)]
    r = subprocess.run(
        [sys.executable, "-m", "freetoken.cli", *cmd], capture_output=True, text=True
    )
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "--poll" in lines[0], r.stderr


def test_default_threads_leave_cores_beside_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(16)))
    assert default_threads(with_gpu=False) == 16
    assert default_threads(with_gpu=True) == 12
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    assert default_threads(with_gpu=True) == 1


def test_cpu_model_uses_every_allowed_cpu_by_default(model: Path) -> None:
    llm = LLM(model, n_ctx=64, engine=EngineOptions(device="cpu"))
    assert llm.model.moe.executor.n_threads == len(os.sched_getaffinity(0))


def test_llm_puts_torch_threads_back(model: Path) -> None:
    """Loading sets torch's intra-op threads to 1 (the Rust pools compute); close(), here by
    leaving the with block, restores what the caller had."""
    before = torch.get_num_threads()
    want = 3 if before != 3 else 2
    torch.set_num_threads(want)
    try:
        with LLM(model, n_ctx=32, engine=EngineOptions(device="cpu")) as llm:
            assert torch.get_num_threads() == 1
            assert llm.generate("a", max_tokens=2, temperature=0)  # still usable
        assert torch.get_num_threads() == want
    finally:
        torch.set_num_threads(before)
