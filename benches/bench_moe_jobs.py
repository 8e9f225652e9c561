"""The CPU expert executor's cost per one-token job, by the number of experts it reads.

A hybrid decode step hands the CPU one job per MoE layer: one token, the 1-8 experts that
missed the GPU cache. Each job's time is a fixed part plus its experts' bytes over the
host's bandwidth; the fixed part is paid 48 times a step (benches/README.md, session 7).
This times ``run_experts`` on jobs of ``m`` distinct experts drawn at random over the
model's MoE layers (so none is in the CPU's caches), the model mapped (``mmap``) and read
into huge-page-backed memory (``--no-mmap``), and fits time = fixed + m x per expert.

    python3 benches/bench_moe_jobs.py -m MODEL.gguf -t 1,12 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from freetoken.engine.bandwidth import group_layers
from freetoken.engine.moe import run_experts
from freetoken.gguf import GGUFFile
from freetoken.models import load_model

EXPERTS = (1, 2, 4, 8)


def job_times(gguf: GGUFFile, threads: int, calls: int) -> dict[int, float]:
    """Median microseconds of a one-token job of m experts, per m (a tenth of the calls
    first, untimed)."""
    model = load_model(gguf, None, threads)
    layers = [ex for kind in group_layers(model).values() for ex in kind]
    executor = model.moe.executor  # type: ignore[union-attr]  # group_layers checked
    x = torch.randn(1, layers[0].gate.k)
    out = torch.empty_like(x)
    rng = np.random.default_rng(0)
    result = {}
    for m in EXPERTS:
        weights = torch.full((1, m), 1.0 / m)
        times = []
        for i in range(calls + calls // 10):
            ex = layers[i % len(layers)]
            ids = torch.from_numpy(rng.choice(ex.n_experts, m, replace=False).astype(np.int32))
            t0 = time.perf_counter()
            run_experts(executor, ex.layer, x, ids.view(1, m), weights, out)
            times.append(time.perf_counter() - t0)
        result[m] = float(np.median(times[calls // 10 :])) * 1e6
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True, help="a MoE GGUF")
    ap.add_argument("-t", "--threads", default="1", help="comma-separated thread counts")
    ap.add_argument("--calls", type=int, default=400, help="timed jobs per expert count")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = []
    print("| load | threads | " + " | ".join(f"{m} experts, us" for m in EXPERTS), end="")
    print(" | fixed us | us per expert |")
    print("| --- | ---: |" + " ---: |" * (len(EXPERTS) + 2))
    for mmap in (True, False):
        gguf = GGUFFile(args.model, mmap=mmap)
        for threads in (int(t) for t in args.threads.split(",")):
            times = job_times(gguf, threads, args.calls)
            per, fixed = np.polyfit(list(times), list(times.values()), 1)
            rows.append({"mmap": mmap, "threads": threads, "us": times, "fixed_us": fixed})
            rows[-1]["per_expert_us"] = per
            cells = " | ".join(f"{times[m]:.1f}" for m in EXPERTS)
            load = "mmap" if mmap else "--no-mmap"
            print(f"| {load} | {threads} | {cells} | {fixed:.1f} | {per:.1f} |", flush=True)
        del gguf
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "calls": args.calls, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
