"""``freetoken bench``: prompt-processing and decode speed with peak memory, in the manner
of llama-bench (pp: one forward pass over a prompt of random tokens from an empty context;
tg: that many single-token steps)."""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import sys
import time

from freetoken.errors import InvalidInputError

__all__ = ["run_bench"]


def _peak_rss_mib() -> float:
    # ru_maxrss is in KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_bench(args: argparse.Namespace) -> int:
    """Measures and prints the table (md) or one JSON object (json)."""
    from freetoken import _core
    from freetoken.llm import LLM

    if args.repetitions < 1 or args.n_prompt < 0 or args.n_gen < 0:
        raise InvalidInputError("-r must be at least 1 and -p, -n non-negative")
    llm = LLM(
        args.model,
        n_ctx=max(args.n_prompt + args.n_gen + 1, 16),
        n_threads=args.threads,
        progress=args.output == "md",
    )
    rng = random.Random(1234)
    vocab = llm.vocab_size
    pp, tg = [], []
    for _ in range(args.repetitions):
        if args.n_prompt:
            tokens = [rng.randrange(vocab) for _ in range(args.n_prompt)]
            cache = llm.model.new_cache(args.n_prompt)
            t0 = time.perf_counter()
            for i in range(0, len(tokens), 512):
                llm.model.forward(tokens[i : i + 512], cache)
            pp.append(args.n_prompt / (time.perf_counter() - t0))
        if args.n_gen:
            cache = llm.model.new_cache(args.n_gen + 1)
            tok = rng.randrange(vocab)
            t0 = time.perf_counter()
            for _ in range(args.n_gen):
                tok = int(llm.model.forward([tok], cache).argmax())
            tg.append(args.n_gen / (time.perf_counter() - t0))
    result = {
        "model": os.path.basename(llm.path),
        "threads": _core.num_threads(),
        "n_prompt": args.n_prompt,
        "n_gen": args.n_gen,
        "repetitions": args.repetitions,
        "pp_tokens_per_s": statistics.mean(pp) if pp else None,
        "pp_stddev": statistics.pstdev(pp) if pp else None,
        "decode_tokens_per_s": statistics.mean(tg) if tg else None,
        "decode_stddev": statistics.pstdev(tg) if tg else None,
        "peak_rss_mib": round(_peak_rss_mib(), 1),
    }
    if args.output == "json":
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
        return 0
    print("| model | threads | test | t/s | peak RSS MiB |")
    print("| --- | ---: | --- | ---: | ---: |")
    for name, n, mean, sd in (
        ("pp", args.n_prompt, result["pp_tokens_per_s"], result["pp_stddev"]),
        ("tg", args.n_gen, result["decode_tokens_per_s"], result["decode_stddev"]),
    ):
        if mean is not None:
            print(
                f"| {result['model']} | {result['threads']} | {name}{n} | "
                f"{mean:.2f} ± {sd:.2f} | {result['peak_rss_mib']} |"
            )
    return 0
