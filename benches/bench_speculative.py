"""Speculative decoding: decode speed with ``--spec-type`` and synthetic acceptance rates
against the same engine without speculation, and the cost of cutting a Gated DeltaNet model
back after a verify step (checkpoints against a recompute), in one run.

    python benches/bench_speculative.py -m MODEL [--spec-type draft-mtp]
        [--rates 0.8,0.6,0.4] [-n 128] [-t 2] [-r 3] [--json FILE]

Decode: ``freetoken bench -p 0 -n N`` plain and with ``--spec-type T --spec-synth-rates R``
(``--spec-draft-n-max`` the number of rates), subprocesses one after the other, with the peak
RSS each reports; plus ``bench``'s verify-step costs (one step of k tokens against k one-token
steps).

Rewind (hybrid models only): after a 64-token prompt, a verify step of k tokens of which the
first j are kept, then the cut back to them:

- checkpoints: the step runs with ``keep_steps`` (the recurrence token by token, each token's
  state kept) and :meth:`HybridCache.rewind` copies the kept one back;
- recompute: the step runs as a plain multi-token step (chunked recurrence) after a copy of
  the states, which are put back before the kept tokens run again as a step of j tokens.

Each figure is the best of ``-r`` x 4 runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from typing import Any


def _bench(model: str, n: int, t: int, r: int, extra: list[str]) -> dict[str, Any]:
    """``freetoken bench``'s JSON (its peak RSS is the process's own)."""
    cmd = [sys.executable, "-m", "freetoken.cli", "bench", "-m", model, "-p", "0"]
    cmd += ["-n", str(n), "-t", str(t), "-r", str(r), "-o", "json", "--device", "cpu", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with {proc.returncode}: {proc.stderr[-500:]}")
    res: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return res


def _best(fn: Any, reps: int) -> float:
    best = math.inf
    for _ in range(reps):
        best = min(best, fn())
    return best * 1e3


def rewind_costs(model_path: str, k_max: int, reps: int) -> list[dict[str, Any]]:
    """Milliseconds of a verify step plus its cut back, per (k tokens, j kept)."""
    import torch
    from freetoken.gguf import GGUFFile
    from freetoken.models import load_model
    from freetoken.runtime.kv_cache import KVCache
    from freetoken.runtime.recurrent_cache import HybridCache

    torch.set_num_threads(1)
    model = load_model(GGUFFile(model_path))
    prompt = [(37 * i) % 3000 + 100 for i in range(64)]
    cache = model.new_cache(128)
    if not isinstance(cache, HybridCache):
        return []
    model.forward(prompt, cache)
    rows = []
    for k in range(2, k_max + 1):
        step = [(53 * i) % 2000 + 200 for i in range(k)]
        for j in range(1, k):

            def checkpoints(step: list[int] = step, j: int = j) -> float:
                t0 = time.perf_counter()
                cache.keep_steps = True
                model.forward(step, cache, all_logits=True)
                cache.keep_steps = False
                cache.rewind(64 + j)
                dt = time.perf_counter() - t0
                cache.truncate(64)  # back to the prompt's snapshot for the next run
                return dt

            def recompute(step: list[int] = step, j: int = j) -> float:
                t0 = time.perf_counter()
                put_back = cache.checkpoint()
                model.forward(step, cache, all_logits=True)
                put_back()
                KVCache.truncate(cache, 64)
                model.forward(step[:j], cache, all_logits=True)
                dt = time.perf_counter() - t0
                cache.truncate(64)
                return dt

            rows.append(
                {
                    "k": k,
                    "kept": j,
                    "checkpoints_ms": _best(checkpoints, 4 * reps),
                    "recompute_ms": _best(recompute, 4 * reps),
                }
            )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--spec-type", default="draft-mtp")
    ap.add_argument("--rates", default="0.8,0.6,0.4")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    n_max = len(args.rates.split(","))
    spec = ["--spec-type", args.spec_type, "--spec-draft-n-max", str(n_max)]
    spec += ["--spec-synth-rates", args.rates]
    plain = _bench(args.model, args.n, args.t, args.r, [])
    fast = _bench(args.model, args.n, args.t, args.r, spec)
    rewind = rewind_costs(args.model, n_max + 1, args.r)
    name = os.path.basename(args.model)
    print(f"model {name}, {args.t} threads, tg{args.n}, {args.r} reps, rates {args.rates}\n")
    print("| | decode t/s | peak RSS MiB |")
    print("| --- | ---: | ---: |")
    print(f"| no speculation | {plain['decode_tokens_per_s']:.2f} | {plain['peak_rss_mib']} |")
    print(f"| {args.spec_type} | {fast['decode_tokens_per_s']:.2f} | {fast['peak_rss_mib']} |")
    ratio = fast["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    sp = fast["spec"]
    print(
        f"\nratio {ratio:.2f}x; {sp['drafted']} drafted, {sp['accepted']} accepted "
        f"({100 * sp['acceptance']:.1f}%)\n"
    )
    print("| step tokens | ms | vs as many one-token steps |")
    print("| ---: | ---: | ---: |")
    one = sp["step_ms"]["1"]
    for k, ms in sp["step_ms"].items():
        print(f"| {k} | {ms:.2f} | {ms / (int(k) * one):.2f} |")
    if rewind:
        print("\n| verify tokens | kept | checkpoints ms | recompute ms |")
        print("| ---: | ---: | ---: | ---: |")
        for row in rewind:
            print(
                f"| {row['k']} | {row['kept']} | {row['checkpoints_ms']:.2f} | "
                f"{row['recompute_ms']:.2f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"plain": plain, "spec": fast, "rewind": rewind}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
