"""The scheduler's request limit (server/scheduler.py): ``n_slots`` jobs run and ``max_waiting``
more wait, counted the way a client sees them: a job just submitted counts once whether the
engine thread has moved it into a slot yet or not, and a finished job not at all."""

from __future__ import annotations

import asyncio

import pytest
from freetoken.errors import RequestError
from freetoken.llm import LLM
from freetoken.runtime.sampler import SamplingParams
from freetoken.server.scheduler import GenerationRequest, Job, Scheduler
from synthetic import build_models


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    base = dict(layers=1, hidden=64, ffn=128, heads=2, kv_heads=1, seed=5, quant="q8_0")
    spec = dict(arch="qwen3", head_dim=32)
    path = build_models({"dense": spec}, base, tmp_path_factory.mktemp("limits"))["dense"]
    return LLM(path, n_ctx=64)


def _scheduler(llm: LLM) -> Scheduler:
    return Scheduler(
        llm.model, llm.tokenizer, n_slots=1, n_ctx=64, vocab_size=llm.vocab_size, max_waiting=1
    )


def _request(n: int) -> GenerationRequest:
    return GenerationRequest([5, 6, 7], n, SamplingParams(temperature=0), ignore_eos=True)


def test_one_running_and_one_waiting_before_the_engine_takes_either(llm: LLM) -> None:
    sched = _scheduler(llm)  # not started: nothing leaves the queue

    async def run() -> None:
        sched.submit(_request(2))
        sched.submit(_request(2))
        with pytest.raises(RequestError) as e:
            sched.submit(_request(2))
        assert e.value.status == 429 and e.value.code == "too_many_requests"
        assert "0 running and 2 waiting" in str(e.value)

    asyncio.run(run())


def test_finished_jobs_leave_room_for_new_ones(llm: LLM) -> None:
    sched = _scheduler(llm)

    async def drain(job: Job) -> None:
        async for _ in job.events():
            pass

    async def run() -> None:
        for _ in range(4):  # each pair fills the limit; both finish before the next pair
            jobs = [sched.submit(_request(3)), sched.submit(_request(3))]
            for job in jobs:
                await drain(job)

    sched.start()
    try:
        asyncio.run(run())
    finally:
        sched.stop()
