"""The server's continuous batching (server/scheduler.py): a step runs one token of every
decoding request and prompt chunks up to ``batch_tokens`` together, however many requests
run (nothing caps a step at a cache or pool size), as its module docs state."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from freetoken.llm import LLM
from freetoken.runtime.sampler import SamplingParams
from freetoken.server.scheduler import GenerationRequest, Scheduler
from synthetic import build_models

CHUNK = 8
N_DECODING = 9


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    spec = dict(arch="qwen3moe", head_dim=32, experts=8, top_k=2, expert_ffn=64)
    base = dict(layers=2, hidden=128, ffn=256, heads=4, kv_heads=2, seed=3, quant="q8_0")
    return build_models({"moe": spec}, base, tmp_path_factory.mktemp("sched"))["moe"]


class Recorder:
    """The model, with the token count of each sequence of every step written down."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.steps: list[list[int]] = []

    def new_cache(self, n_ctx: int, max_step: int = 0) -> Any:
        return self.model.new_cache(n_ctx, max_step=max_step)

    def forward_batch(
        self, seqs: list[tuple[list[int], Any]], all_logits: Any = False, hidden: Any = None
    ) -> Any:
        self.steps.append([len(tokens) for tokens, _ in seqs])
        return self.model.forward_batch(seqs, all_logits, hidden)


def test_every_decoding_request_and_a_prompt_chunk_share_a_step(model: Path) -> None:
    llm = LLM(model, n_ctx=128)
    rec = Recorder(llm.model)
    sched = Scheduler(
        rec, llm.tokenizer, n_slots=N_DECODING + 1, n_ctx=128, vocab_size=llm.vocab_size,
        batch_tokens=CHUNK,
    )  # fmt: skip
    short = [[10 + i] for i in range(N_DECODING)]  # one-token prompts: decoding at once
    long = list(range(100, 100 + 5 * CHUNK))  # five chunks

    async def run() -> None:
        def request(prompt: list[int], n: int) -> Any:
            params = SamplingParams(temperature=0)
            return sched.submit(GenerationRequest(prompt, n, params, ignore_eos=True))

        jobs = [request(p, 3 * CHUNK) for p in short]
        jobs.append(request(long, 2))
        for job in jobs:
            async for _ in job.events():
                pass

    sched.start()
    try:
        asyncio.run(run())
    finally:
        sched.stop()
    # A step with every short request decoding (one token each) and a whole chunk of the
    # long prompt: N_DECODING + 1 sequences, N_DECODING + CHUNK tokens.
    want = sorted([1] * N_DECODING + [CHUNK])
    assert any(sorted(s) == want for s in rec.steps), rec.steps
    assert max(len(s) for s in rec.steps) == N_DECODING + 1
