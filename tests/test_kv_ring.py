"""Sliding-window layers keep a ring of the positions they can still see (``KVCache``): the
same logits as llama.cpp's (teacher-forced past the window, in steps of several tokens), bit
for bit those of a cache that keeps every position (a step sees the same keys in the same
order), less memory, and a prefix reused only while its ring still holds the keys the next
positions need."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from freetoken.llm import LLM
from freetoken.models.transformer import Transformer
from ring_model import STEP, WINDOW, build, random_tokens, stepped
from teacher_forced import compare


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("ring") / "gemma3.gguf")


def test_ring_is_used_and_smaller(gemma3: Path) -> None:
    model = LLM(gemma3, n_ctx=64).model
    ring = model.new_cache(64, max_step=STEP)
    full = model.new_cache(64)
    assert ring.ring == [WINDOW + STEP - 1, 0, WINDOW + STEP - 1]  # SWA on layers 0 and 2
    assert full.ring == [0, 0, 0]
    assert sum(k.numel() for k in ring.k) < sum(k.numel() for k in full.k)
    # A step longer than the rings allow is refused, not computed wrong.
    with pytest.raises(Exception, match="sliding-window"):
        model.forward(list(range(1, STEP + 2)), ring)


def test_swa_full_keeps_every_position(gemma3: Path) -> None:
    import argparse

    from freetoken.engine import options

    ap = argparse.ArgumentParser()
    options.add_arguments(ap)
    opts = options.from_args(ap.parse_args(["--swa-full"]))
    assert opts.swa_full
    model = LLM(gemma3, n_ctx=64, engine=opts).model
    assert model.new_cache(64, max_step=STEP).ring == [0, 0, 0]


@pytest.mark.slow
def test_ring_matches_llamacpp(gemma3: Path, llama_ref_root: Path) -> None:
    import llama_ref

    llm = LLM(gemma3, n_ctx=64)
    seq = random_tokens(llm, 48)  # six windows
    ours = stepped(llm.model, seq, 64, STEP)[:-1].numpy()
    with llama_ref.LlamaRef.load(gemma3, n_ctx=64, n_threads=2, root=llama_ref_root) as ref:
        want = ref.logits(seq)[:-1]
    c = compare(want, ours)
    assert not c.mismatches and c.mean_kl <= 0.005, c.describe()


def test_ring_matches_every_position_kept(gemma3: Path) -> None:
    llm = LLM(gemma3, n_ctx=64)
    seq = random_tokens(llm, 48)
    ring = stepped(llm.model, seq, 64, STEP)
    full = stepped(llm.model, seq, 64, 0)
    assert torch.equal(ring, full)


def test_truncate_keeps_a_prefix_only_while_the_ring_holds_it(gemma3: Path) -> None:
    llm = LLM(gemma3, n_ctx=64)
    model, seq = llm.model, random_tokens(llm, 40)
    full = stepped(model, seq, 64, 0)
    cache = model.new_cache(64, max_step=STEP)
    for i in range(0, 40, 4):
        model.forward(seq[i : i + 4], cache)
    # The ring (12 positions) holds 28..39: continuing from 36 needs 29..35.
    assert cache.truncate(36) == 36
    again = model.forward(seq[36:40], cache, all_logits=True)
    assert torch.equal(again, full[36:40])
    # From 20 it would need 13..19, long overwritten: nothing is kept.
    assert cache.truncate(20) == 0
    assert cache.length == 0
    assert torch.equal(model.forward(seq[:4], cache, all_logits=True), full[:4])


def _greedy(model: Transformer, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation on a cache that keeps every position."""
    cache, out = model.new_cache(64), []
    logits = model.forward(prompt, cache)
    for _ in range(n):
        out.append(int(logits.argmax()))
        logits = model.forward(out[-1:], cache)
    return out


def test_server_slots_reuse_a_prefix_only_while_the_ring_holds_it(gemma3: Path) -> None:
    from freetoken.runtime.sampler import SamplingParams
    from freetoken.server.scheduler import GenerationRequest, Scheduler

    llm = LLM(gemma3, n_ctx=64)
    sched = Scheduler(
        llm.model, llm.tokenizer, n_slots=1, n_ctx=64, vocab_size=llm.vocab_size,
        batch_tokens=STEP,
    )  # fmt: skip
    assert sched.slots[0].cache.ring[0] == WINDOW + STEP - 1

    async def run(prompt: list[int], n: int) -> tuple[list[int], int]:
        req = GenerationRequest(
            prompt, n, SamplingParams(temperature=0), logprobs=0, ignore_eos=True
        )
        job = sched.submit(req)
        tokens = [lp.token async for ev in job.events() for lp in ev.logprobs]
        return tokens, job.cached_tokens

    prompt = random_tokens(llm, 20)
    first = _greedy(llm.model, prompt, 30)
    sched.start()
    try:
        assert asyncio.run(run(prompt, 30)) == (first, 0)
        # The same prompt again: the ring lost its end (it holds positions 37..48, the last
        # sampled token never ran), so it runs from the start and gives the same tokens.
        assert asyncio.run(run(prompt, 30)) == (first, 0)
        # The prompt extended by what was generated: its last token runs again, from 44,
        # which needs 37..43: kept.
        longer = prompt + first[:25]
        assert asyncio.run(run(longer, 8)) == (_greedy(llm.model, longer, 8), 44)
    finally:
        sched.stop()


@pytest.mark.slow
def test_long_prompt_chunks_match_every_position_kept(default_model: Path) -> None:
    """The default model's 512-token prompt chunks past its 512-token window: the rings'
    logits equal a full cache's bit for bit (attention leaves out the keys no query of a
    chunk sees, with a ring or without)."""
    llm = LLM(default_model, n_ctx=4096)
    tokens = [2, *(int(t) for t in np.random.default_rng(0).integers(100, 20000, 1299))]
    ring, full = llm.model.new_cache(4096, max_step=512), llm.model.new_cache(4096)
    assert any(ring.ring) and not any(full.ring)
    for i in range(0, len(tokens), 512):
        a = llm.model.forward(tokens[i : i + 512], ring, all_logits=True)
        b = llm.model.forward(tokens[i : i + 512], full, all_logits=True)
        assert torch.equal(a, b), f"chunk at {i}"
