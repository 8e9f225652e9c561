"""The CPU expert executor's cost per one-token job, by the number of experts it reads.

A hybrid decode step hands the CPU one job per MoE layer: one token, the 1-8 experts that
missed the GPU cache. Each job's time is a fixed part plus its experts' bytes over the
host's bandwidth; the fixed part is paid 48 times a step (benches/README.md, "Hybrid decode").
This times ``run_experts`` on jobs of ``m`` distinct experts drawn at random over the
model's MoE layers (so none is in the CPU's caches), the model mapped (``mmap``) and read
into huge-page-backed memory (``--no-mmap``), and fits time = fixed + m x per expert.
``--gap-us G[,G...]`` waits G microseconds between jobs, as the GPU's part of a layer does in a
hybrid step (about 100): past the pool's poll time (``--poll``, llama.cpp's 0-100 x 20 µs)
the workers sleep and each job pays their wake-up.

    python3 benches/bench_moe_jobs.py -m MODEL.gguf -t 1,12 [--gap-us 0,100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from freetoken.engine.bandwidth import group_layers
from freetoken.engine.options import POLL_STEP_US
from freetoken.gguf import GGUFFile
from freetoken.models import load_model
from freetoken.runtime.moe import run_experts

EXPERTS = (1, 2, 4, 8)


def job_times(
    gguf: GGUFFile, threads: int, calls: int, gaps_us: list[float], poll_us: int | None
) -> dict[float, dict[int, float]]:
    """Per gap between jobs (µs) and per m, the median microseconds of a one-token job of m
    experts (a tenth of the calls first, untimed); the model loaded once for them all."""
    model = load_model(gguf, None, threads, moe_poll_us=poll_us)
    layers = [ex for kind in group_layers(model).values() for ex in kind]
    executor = model.moe.executor  # type: ignore[union-attr]  # group_layers checked
    x = torch.randn(1, layers[0].gate.k)
    out = torch.empty_like(x)
    # Every expert once first: the mapping's page-table entries are filled on first touch
    # (a minor fault per 4 KiB page), which a long run pays once, not per job.
    ones = torch.ones(1, 8) / 8
    for ex in layers:
        for e0 in range(0, ex.n_experts - 7, 8):
            ids = torch.arange(e0, e0 + 8, dtype=torch.int32).view(1, 8)
            run_experts(executor, ex.layer, x, ids, ones, out)
    rng = np.random.default_rng(0)
    result: dict[float, dict[int, float]] = {}
    for gap_us in gaps_us:
        result[gap_us] = {}
        for m in EXPERTS:
            weights = torch.full((1, m), 1.0 / m)
            times = []
            for i in range(calls + calls // 10):
                t_gap = time.perf_counter() + gap_us / 1e6
                while time.perf_counter() < t_gap:  # a busy wait: sleeps overshoot by ~50 us
                    pass
                ex = layers[i % len(layers)]
                ids = rng.choice(ex.n_experts, m, replace=False).astype(np.int32)
                ids_t = torch.from_numpy(ids).view(1, m)
                t0 = time.perf_counter()
                run_experts(executor, ex.layer, x, ids_t, weights, out)
                times.append(time.perf_counter() - t0)
            result[gap_us][m] = float(np.median(times[calls // 10 :])) * 1e6
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True, help="a MoE GGUF")
    ap.add_argument("-t", "--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--calls", type=int, default=400, help="timed jobs per expert count")
    ap.add_argument("--gap-us", default="0", help="comma-separated waits between jobs (µs)")
    ap.add_argument("--poll", type=int, default=None, help="the executor's --poll (0-100)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = []
    gaps = [float(g) for g in args.gap_us.split(",")]
    poll_us = None if args.poll is None else args.poll * POLL_STEP_US
    print("| load | threads | gap µs | " + " | ".join(f"{m} experts, µs" for m in EXPERTS), end="")
    print(" | fixed µs | µs per expert |")
    print("| --- | ---: | ---: |" + " ---: |" * (len(EXPERTS) + 2))
    for mmap in (True, False):
        gguf = GGUFFile(args.model, mmap=mmap)
        for threads in (int(t) for t in args.threads.split(",")):
            by_gap = job_times(gguf, threads, args.calls, gaps, poll_us)
            for gap, times in by_gap.items():
                per, fixed = np.polyfit(list(times), list(times.values()), 1)
                rows.append({"mmap": mmap, "threads": threads, "gap_us": gap, "us": times})
                rows[-1] |= {"fixed_us": fixed, "per_expert_us": per}
                cells = " | ".join(f"{times[m]:.1f}" for m in EXPERTS)
                load = "mmap" if mmap else "--no-mmap"
                row = f"| {load} | {threads} | {gap:.0f} | {cells} | {fixed:.1f} | {per:.1f} |"
                print(row, flush=True)
        del gguf
    if args.json:
        with open(args.json, "w") as f:
            doc = {"model": args.model, "calls": args.calls}
            json.dump(doc | {"poll": args.poll, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
