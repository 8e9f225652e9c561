"""``freetoken bench``: prompt-processing and decode speed with peak memory, in the manner
of llama-bench (pp: one forward pass over a prompt of random tokens; tg: that many
single-token steps; each from an empty context, or with ``-d`` after that many context tokens,
which are not timed)."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import statistics
import sys
import time
from typing import Any

from freetoken.cli.args import add_model_arguments
from freetoken.engine import spec_options
from freetoken.errors import InvalidInputError
from freetoken.runtime.sampler import SamplingParams
from freetoken.runtime.speculative import SpecCounters

__all__ = ["add_arguments", "run"]


def _peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The model's flags, the test sizes, repetitions and the output format."""
    add_model_arguments(p)
    p.add_argument("-p", "--n-prompt", type=int, default=512)
    p.add_argument("-n", "--n-gen", type=int, default=128)
    p.add_argument(
        "-d", "--n-depth", type=int, default=0, help="context tokens before each test (untimed)"
    )
    p.add_argument("-r", "--repetitions", type=int, default=3)
    p.add_argument("-o", "--output", choices=["md", "json"], default="md")
    spec_options.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    """Measures and prints the table (md) or one JSON object (json)."""
    from freetoken import _core

    if args.repetitions < 1 or args.n_prompt < 0 or args.n_gen < 0 or args.n_depth < 0:
        raise InvalidInputError("-r must be at least 1 and -p, -n, -d non-negative")
    from freetoken.llm import PROMPT_CHUNK, load_llm

    spec = spec_options.from_args(args)
    # Speculation drafts past the last token: room for one more verify step.
    depth = args.n_depth
    n_ctx = max(depth + max(args.n_prompt, args.n_gen + 1), 16)
    n_ctx += spec.n_max + 1 if spec.enabled else 0
    llm = load_llm(args, n_ctx=n_ctx, progress=args.output == "md")
    rng = random.Random(1234)
    vocab = llm.vocab_size
    greedy = SamplingParams(temperature=0.0)
    # One cache per test, reused across repetitions (as llama-bench reuses its context), and
    # one warm-up pass first: it captures the GPU's decode graphs outside the timing.
    pp_cache = llm.model.new_cache(depth + max(args.n_prompt, 1))
    tg_cache = llm.model.new_cache(depth + args.n_gen + 1)
    context = [rng.randrange(vocab) for _ in range(depth)]

    def fill(tokens: list[int], cache: Any) -> None:
        for i in range(0, len(tokens), PROMPT_CHUNK):
            llm.model.forward(tokens[i : i + PROMPT_CHUNK], cache)

    def prompt_pass() -> float:
        tokens = [rng.randrange(vocab) for _ in range(args.n_prompt)]
        pp_cache.truncate(0)
        fill(context, pp_cache)
        t0 = time.perf_counter()
        fill(tokens, pp_cache)
        return args.n_prompt / (time.perf_counter() - t0)

    decode_steps = 0
    decode_seconds = 0.0

    spec_counts = SpecCounters()

    def spec_pass(n: int) -> float:
        # Greedy generation from one random token with the drafter; the counters add up.
        nonlocal decode_steps, decode_seconds
        t0 = time.perf_counter()
        prompt = [*context, rng.randrange(vocab)]
        produced = sum(1 for _ in llm.stream_tokens(prompt, n, greedy))
        dt = time.perf_counter() - t0 - llm.last_stats.prompt_seconds
        stats = llm.last_stats.spec
        assert stats is not None
        spec_counts.drafted += stats.drafted
        spec_counts.accepted += stats.accepted
        for k, c in stats.steps.items():
            spec_counts.steps[k] = spec_counts.steps.get(k, 0) + c
        decode_steps += produced
        decode_seconds += dt
        return produced / dt

    def decode_pass(n: int) -> float:
        if spec.enabled:
            return spec_pass(n)
        nonlocal decode_steps, decode_seconds
        tg_cache.truncate(0)
        fill(context, tg_cache)
        tok = rng.randrange(vocab)
        t0 = time.perf_counter()
        for _ in range(n):
            tok = int(llm.model.forward([tok], tg_cache).argmax())
        dt = time.perf_counter() - t0
        decode_steps += n
        decode_seconds += dt
        return n / dt

    if args.n_prompt:
        prompt_pass()
    if args.n_gen:
        decode_pass(args.n_gen)
    decode_steps, decode_seconds = 0, 0.0
    spec_counts = SpecCounters()
    placement = llm.placement
    stats_fn = getattr(placement.experts, "stats", None) if placement is not None else None
    warm = stats_fn() if callable(stats_fn) else None
    pp = [prompt_pass() for _ in range(args.repetitions)] if args.n_prompt else []
    tg = [decode_pass(args.n_gen) for _ in range(args.repetitions)] if args.n_gen else []
    result = {
        "model": os.path.basename(llm.path),
        "threads": _core.num_threads(),
        "n_prompt": args.n_prompt,
        "n_gen": args.n_gen,
        "n_depth": depth,
        "repetitions": args.repetitions,
        "pp_tokens_per_s": statistics.mean(pp) if pp else None,
        "pp_stddev": statistics.pstdev(pp) if pp else None,
        "decode_tokens_per_s": statistics.mean(tg) if tg else None,
        "decode_stddev": statistics.pstdev(tg) if tg else None,
        "peak_rss_mib": round(_peak_rss_mib(), 1),
        "placement": llm.placement.describe() if llm.placement is not None else "cpu",
    }
    if spec.enabled:
        result["spec"] = {
            "type": spec.spec_type,
            "n_max": spec.n_max,
            "drafted": spec_counts.drafted,
            "accepted": spec_counts.accepted,
            "acceptance": spec_counts.acceptance,
            "verify_steps": dict(sorted(spec_counts.steps.items())),
            "step_ms": _step_costs(llm.model, spec.n_max + 1, vocab, rng, args.repetitions),
        }
    if placement is not None:
        result["dense_bytes"] = placement.dense_bytes
        result["expert_bytes"] = placement.expert_bytes
        if warm is not None:
            # The timed passes' counters (prompt passes included), as tg's: not the warm-up's
            # fills and graph captures.
            assert callable(stats_fn)
            stats = stats_fn().since(warm)
            result["hybrid"] = {
                "hit_rate": float(stats.hit_rate),
                "routes": int(stats.routes.sum()),
                "hits": int(stats.hits.sum()),
                "answered": int(stats.answered),
                "cpu_busy_s": float(stats.cpu_busy_s),
                "bookkeeping_s": float(stats.bookkeeping_s),
                "fills": int(stats.fills),
                "swaps": int(stats.swaps),
                "decode_steps": decode_steps,
                "decode_seconds": decode_seconds,
            }
    if args.output == "json":
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return 0
    print("| model | threads | test | t/s | peak RSS MiB |")
    print("| --- | ---: | --- | ---: | ---: |")
    at = f" @ d{depth}" if depth else ""
    for name, n, mean, sd in (
        ("pp", args.n_prompt, result["pp_tokens_per_s"], result["pp_stddev"]),
        ("tg", args.n_gen, result["decode_tokens_per_s"], result["decode_stddev"]),
    ):
        if mean is not None:
            print(
                f"| {result['model']} | {result['threads']} | {name}{n}{at} | "
                f"{mean:.2f} ± {sd:.2f} | {result['peak_rss_mib']} |"
            )
    if spec.enabled:
        sp = result["spec"]
        print(
            f"\n{sp['type']}: {sp['drafted']} drafted, {sp['accepted']} accepted "
            f"({100 * sp['acceptance']:.1f}%)"
        )
        print("| step tokens | ms | vs as many one-token steps |")
        print("| ---: | ---: | ---: |")
        one = sp["step_ms"][1]
        for k, ms in sp["step_ms"].items():
            print(f"| {k} | {ms:.2f} | {ms / (k * one):.2f} |")
    return 0


def _step_costs(
    model: Any, n_max: int, vocab: int, rng: random.Random, reps: int
) -> dict[int, float]:
    """Milliseconds of one forward step of 1..``n_max`` tokens after 64 positions (the best
    of ``reps`` x 4 runs): 2 and more as verify steps (every logit, the states after each
    token kept), cut back after each; 1 as the plain decode step a draft of nothing runs,
    last, one after another (a plain step keeps no states to cut back to)."""
    runs = 4 * reps
    cache = model.new_cache(64 + max(n_max, runs) + 1)
    model.forward([rng.randrange(vocab) for _ in range(64)], cache)
    out = {}
    for k in range(2, n_max + 1):
        best = math.inf
        for _ in range(runs):
            tokens = [rng.randrange(vocab) for _ in range(k)]
            cache.keep_steps = True
            t0 = time.perf_counter()
            model.forward(tokens, cache, all_logits=True)
            best = min(best, time.perf_counter() - t0)
            cache.keep_steps = False
            cache.rewind(64)
        out[k] = best * 1e3
    best = math.inf
    for _ in range(runs):
        token = rng.randrange(vocab)
        t0 = time.perf_counter()
        model.forward([token], cache)
        best = min(best, time.perf_counter() - t0)
    return {1: best * 1e3, **out}
