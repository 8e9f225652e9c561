"""Prefix reuse of a Gated DeltaNet hybrid (qwen35moe) through the real server, driven with
the official ``openai`` client: its recurrent states hold only the last position, so a
reused prefix restores the state snapshot saved where a prompt chunk ended and runs the rest
again. The reference of every request is the same request with ``cache_prompt: false``
(evaluated from the start in an emptied slot, the prompt chunked as on a fresh server):

- a multi-turn chat: each turn reuses the previous turns' tokens and gives the fresh run's
  tokens and log-probabilities;
- a shared system prompt: a second question after the first reuses the system prompt and
  gives the fresh run's output;
- isolation: two different conversations at once (two slots, batched steps) and one after
  another give each their own fresh outputs.

Greedy outputs must match token for token, except where the fresh run's two best tokens lie
within 0.05, with log-probabilities within ``LOGPROB_TOL``: the fresh run steps the prompt at
other boundaries, which rounds differently (up to 0.03 seen on the CPU). That is an end to
end check only: this small model's next token depends mostly on the last few, so a state
from a nearby position moves the log-probabilities about as little. The sharp check runs
the server's scheduler in-process: after every request each slot's recurrent states equal,
float for float, those of a fresh cache that ran exactly that slot's tokens in the same
steps. The module runs on the CPU engine; tests/test_gpu_qwen35.py runs the live server's
checks on ``--moe-strategy hybrid`` (the states on the GPU, decode as graphs).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

from freetoken.errors import FileAccessError  # noqa: E402
from freetoken.testmodel import make_test_model  # noqa: E402
from live_server import Server, live_server  # noqa: E402

ALIAS = "qwen35moe-test"
N_TOKENS = 24
NEAR_TIE = 0.05
LOGPROB_TOL = 0.1
SYSTEM = (
    "You are a careful assistant for a geography club. Answer in short sentences, name the "
    "river, the mountain range and the country each time, and never invent a place that "
    "does not exist; when unsure, say so plainly and suggest where to look it up."
)

#: The server's engine flags of tests/test_gpu_qwen35.py, which runs these checks on the GPU.
GPU_ARGS = ["--device", "cuda", "--moe-strategy", "hybrid", "--moe-cache-mib", "1"]


def build_model(out: Path) -> Path:
    """A small qwen35moe on the Qwen3.5 vocabulary (with its chat template) in ``out``; skips
    the calling test when the llama.cpp tree (the vocabulary) is not unpacked."""
    try:
        return make_test_model(
            "qwen35moe", out=out / "qwen35moe.gguf", log=lambda _: None, layers=4, hidden=256,
            ffn=512, heads=4, kv_heads=2, head_dim=64, experts=8, top_k=2, expert_ffn=256,
            quant="q8_0,exps=q4_k", seed=5,
        )  # fmt: skip
    except FileAccessError as e:
        pytest.skip(str(e))


@contextmanager
def serve(model: Path, log: Path, engine_args: list[str]) -> Iterator[Server]:
    """The live server these checks run on: two slots, prompt steps of 32 tokens (the prompts
    here span several, so snapshots fall inside them)."""
    args = ["--alias", ALIAS, "--parallel", "2", "-c", "1024", "-b", "32", *engine_args]
    with live_server(model, log, args) as srv:
        yield srv


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("hybrid-prefix"))


@pytest.fixture(scope="module")
def server(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serve(model, tmp_path_factory.mktemp("server") / "stderr.txt", ["--device", "cpu"]) as srv:
        yield srv


@dataclass
class Reply:
    text: str
    tokens: list[str]
    #: Per generated token: the top-2 log-probabilities.
    top: list[list[float]]
    #: Per generated token: the chosen token's log-probability.
    chosen: list[float]
    cached: int


def _body(messages: list[dict[str, str]], cache: bool) -> dict[str, Any]:
    return dict(
        model=ALIAS,
        messages=messages,
        max_tokens=N_TOKENS,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"cache_prompt": cache},
    )


def _reply(r: Any) -> Reply:
    entries = r.choices[0].logprobs.content
    return Reply(
        text=r.choices[0].message.content,
        tokens=[e.token for e in entries],
        top=[[t.logprob for t in e.top_logprobs] for e in entries],
        chosen=[e.logprob for e in entries],
        cached=r.usage.prompt_tokens_details.cached_tokens,
    )


def _chat(server: Server, messages: list[dict[str, str]], cache: bool = True) -> Reply:
    return _reply(server.client().chat.completions.create(**_body(messages, cache)))


def _same(what: str, fresh: Reply, ours: Reply) -> None:
    """``ours`` gives ``fresh``'s tokens (up to a near-tie) and log-probabilities."""
    assert fresh.tokens, what
    n = len(fresh.tokens)
    for i in range(min(n, len(ours.tokens))):
        if fresh.tokens[i] != ours.tokens[i]:
            top = fresh.top[i]
            assert len(top) == 2 and top[0] - top[1] < NEAR_TIE, (what, i, fresh, ours)
            return  # after a near-tie flip the continuations differ
        assert abs(fresh.chosen[i] - ours.chosen[i]) <= LOGPROB_TOL, (what, i, fresh, ours)
    assert len(ours.tokens) == n, (what, fresh, ours)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def check_multi_turn_chat(server: Server) -> None:
    """Each turn of a chat reuses the earlier turns and gives the fresh run's output."""
    messages = [{"role": "system", "content": SYSTEM}]
    turns = ["Tell me about the Danube.", "And the Rhine?", "Which of the two is longer?"]
    for turn, question in enumerate(turns):
        messages.append(_user(question))
        reused, fresh = _chat(server, messages), _chat(server, messages, cache=False)
        if turn > 0:
            assert reused.cached >= 32, f"turn {turn}: the previous turns were not reused"
        assert fresh.cached == 0
        _same(f"turn {turn}", fresh, reused)
        messages.append({"role": "assistant", "content": fresh.text})


def check_shared_system_prompt(server: Server) -> None:
    """A second question reuses the first one's system prompt, with the fresh run's output."""
    # A system prompt of its own: the slot of the first question is the one to reuse.
    system = "You answer questions about the Alps and the rivers that rise in them. " + SYSTEM
    first = [{"role": "system", "content": system}, _user("Where does the Loire begin?")]
    second = [{"role": "system", "content": system}, _user("How high is Mont Blanc, roughly?")]
    _chat(server, first)
    reused = _chat(server, second)
    assert reused.cached >= 32, "the system prompt was not reused"
    _same("second question", _chat(server, second, cache=False), reused)


def check_isolation(server: Server) -> None:
    """Two conversations at once and one after another: each gives its fresh output."""
    convs = [
        [_user("Name three rivers of Africa and where they flow into the sea.")],
        [{"role": "system", "content": SYSTEM}, _user("Which mountains border Nepal?")],
    ]
    fresh = [_chat(server, c, cache=False) for c in convs]

    async def together() -> list[Reply]:
        client = server.aclient()
        async with client:
            rs = await asyncio.gather(
                *(client.chat.completions.create(**_body(c, True)) for c in convs)
            )
        return [_reply(r) for r in rs]

    for fr, ours in zip(fresh, asyncio.run(together()), strict=True):
        _same("concurrent", fr, ours)
    # One after another: each evaluated in a slot where the other's state was.
    for _ in range(2):
        for conv, fr in zip(convs, fresh, strict=True):
            _same("one after another", fr, _chat(server, conv))


def test_multi_turn_chat_reuses_prefix_like_fresh_runs(server: Server) -> None:
    check_multi_turn_chat(server)


def test_shared_system_prompt_like_fresh_runs(server: Server) -> None:
    check_shared_system_prompt(server)


def test_requests_never_read_each_others_state(server: Server) -> None:
    check_isolation(server)


N_STATE_GEN = 12
BATCH = 32


def test_each_slot_holds_the_state_of_its_own_tokens(model: Path) -> None:
    """On the server's scheduler in-process (2 slots, prompt steps of 32 tokens): after each
    round of requests, every slot's recurrent states equal those of a fresh cache that ran
    exactly that slot's tokens in the same steps: the prefix up to where its request's reuse
    began (itself as the earlier requests stepped it), then the rest of the prompt in steps
    of 32 from there, then one decode step per generated token but the last. Float for float:
    any state read from another request or another position shows."""
    from freetoken.llm import LLM
    from freetoken.runtime.sampler import SamplingParams
    from freetoken.server.scheduler import GenerationRequest, Job, Scheduler

    llm = LLM(model, n_ctx=512)
    sched = Scheduler(
        llm.model, llm.tokenizer, n_slots=2, n_ctx=512, vocab_size=llm.vocab_size,
        batch_tokens=BATCH,
    )  # fmt: skip
    #: Per slot, where its steps ended since it was last emptied (the test's own account).
    ends: list[list[int]] = [[], []]

    def prompt(messages: list[dict[str, str]]) -> list[int]:
        return llm.tokenizer.encode_chat(messages, add_generation_prompt=True)

    async def run(prompts: list[list[int]]) -> list[Job]:
        async def one(p: list[int]) -> Job:
            req = GenerationRequest(p, N_STATE_GEN, SamplingParams(temperature=0), ignore_eos=True)
            job = sched.submit(req)
            async for _ in job.events():
                pass
            return job

        return list(await asyncio.gather(*(one(p) for p in prompts)))

    def account(job: Job) -> int:
        """Adds the job's steps to its slot's account; returns the slot's index."""
        slot = max(sched.slots, key=lambda s: s.last_used)  # requests run one at a time
        assert slot.tokens[: len(job.req.prompt)] == job.req.prompt
        kept, n = job.cached_tokens, len(job.req.prompt)
        steps = ends[slot.index]
        steps[:] = [e for e in steps if e <= kept]
        assert kept == 0 or steps[-1] == kept, "reuse began where no step ended"
        steps += [*range(kept + BATCH, n, BATCH), n]
        steps += [n + i for i in range(1, N_STATE_GEN)]
        return slot.index

    def check(when: str, slot_index: int) -> None:
        slot = sched.slots[slot_index]
        cache, steps = slot.cache, ends[slot_index]
        assert cache.length == len(slot.tokens) == steps[-1], when
        fresh = llm.model.new_cache(512)
        for a, b in zip([0, *steps], steps, strict=False):
            llm.model.forward(slot.tokens[a:b], fresh)
        for i, (a, b) in enumerate(
            zip(cache.ssm + cache.conv, fresh.ssm + fresh.conv, strict=True)
        ):
            assert torch.equal(a, b), (when, slot_index, i, float((a - b).abs().max()))

    sys_a = [{"role": "system", "content": SYSTEM}, _user("Tell me about the Danube.")]
    sys_b = [{"role": "system", "content": SYSTEM}, _user("Which mountains border Nepal?")]
    other = [_user("Name three rivers of Africa and where they flow into the sea.")]
    turn = [*sys_a, {"role": "assistant", "content": "Yes."}, _user("And the Rhine?")]
    reused: dict[str, int] = {}
    sched.start()
    try:
        for when, convs in [
            ("first", [sys_a]),
            ("another conversation", [other]),
            ("next turn", [turn]),
            ("shared system prompt", [sys_b]),
            ("the first again", [sys_a]),
        ]:
            (job,) = asyncio.run(run([prompt(c) for c in convs]))
            check(when, account(job))
            reused[when] = job.cached_tokens
    finally:
        sched.stop()
    # The next turn reused the first request, the second question its system prompt.
    assert reused["shared system prompt"] >= BATCH and reused["next turn"] >= 2 * BATCH, reused
