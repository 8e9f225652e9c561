"""Where a GPU step's time goes: the CUDA kernels of one prompt pass and of eager decode
steps (no graph, so each kernel shows), by total time and count, from torch.profiler, and
with ``--sequence N`` the first N kernels of a step in order; the replayed-graph decode
step's time and the GPU's busy time within it; with ``--batch N[,N...]``, decode steps
of N sequences at once (the server's continuous batching: replayed graphs up to
``MAX_BATCH`` sequences, eager above), timed, with the host's share (hybrid's CPU thread busy
time) and a profile of one.

With hybrid, also where the host's time goes over replayed decode steps (cProfile: waiting
for the step, slot bookkeeping, uploads).

    python benches/profile_gpu_step.py -m MODEL.gguf [-p 512] [--dense-weights quant] \
        [--moe-strategy hybrid --moe-cache-mib N [--moe-cache-adaptive] \
        [--moe-cache-profile FILE]] [-t THREADS] [--batch 4,16,32] [--sequence 120]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch
from freetoken.engine.options import EngineOptions
from freetoken.llm import LLM
from freetoken.models.transformer import Transformer
from torch.profiler import ProfilerActivity, profile


def _table(prof: profile, title: str, rows: int, sort_by: str = "cuda_time_total") -> None:
    print(f"\n## {title}, by {sort_by}")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=rows, max_name_column_width=70))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=8, help="decode steps profiled")
    ap.add_argument("--dense-weights", default="quant")
    ap.add_argument("--moe-strategy", default="gpu")
    ap.add_argument("--moe-cache-mib", type=int, default=None)
    ap.add_argument("--moe-cache-adaptive", action="store_true")
    ap.add_argument("--moe-cache-profile", default=None)
    ap.add_argument("--rows", type=int, default=30)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument(
        "--batch",
        type=lambda v: [int(n) for n in v.split(",")],
        default=[],
        help="sequences of a batched decode step (comma separated: each size in turn)",
    )
    ap.add_argument(
        "--sequence", type=int, default=0, help="list this many kernels of a step in order"
    )
    args = ap.parse_args()
    llm = LLM(
        args.model,
        n_ctx=args.p + 192,
        n_threads=args.threads,
        engine=EngineOptions(
            device="cuda",
            moe_strategy=args.moe_strategy,
            dense_weights=args.dense_weights,
            moe_cache_mib=args.moe_cache_mib,
            moe_cache_adaptive=args.moe_cache_adaptive,
            moe_cache_profile=args.moe_cache_profile,
        ),
    )
    model = llm.model
    tokens = list(range(100, 100 + args.p))
    cache = model.new_cache(args.p + 192)
    model.forward(tokens, cache)  # warm-up
    cache.truncate(0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        model.forward(tokens, cache)
        torch.cuda.synchronize()
    _table(prof, f"prompt pass of {args.p} tokens", args.rows)

    graphs, model.graphs = model.graphs, None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(args.n):
            model.forward([200 + i], cache)
        torch.cuda.synchronize()
    kernels = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    layers = model.cfg.n_layers
    per_step = kernels / args.n
    print(f"\neager decode: {per_step:.0f} kernels per step, {per_step / layers:.1f} per layer")
    _table(prof, f"{args.n} eager decode steps", args.rows)
    _sequence(prof, round(per_step), args.sequence)

    model.graphs = graphs
    cache.truncate(args.p)
    for i in range(4):
        model.forward([300 + i], cache)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(32):
        model.forward([400 + i], cache)
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) / 32
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(32):
            model.forward([500 + i], cache)
        torch.cuda.synchronize()
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 32 / 1e3
    print(
        f"\ngraph decode: {wall * 1e3:.3f} ms per step, the GPU busy {busy:.3f} ms of it "
        "(kernels and copies)"
    )
    if model.step_hook is not None:
        host_profile(model, cache)
    for n in args.batch:
        batched_steps(model, n, args)


def _sequence(prof: profile, per_step: int, n: int) -> None:
    """The first ``n`` kernels of the last profiled step in the order they ran, a run of one
    kernel repeated shown once with its count."""
    if n <= 0:
        return
    kernels = sorted(
        (e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start
    )[-per_step:][:n]
    print(f"\n## the first {len(kernels)} kernels of the last eager decode step, in order")
    runs: list[list] = []
    for e in kernels:
        if runs and runs[-1][0] == e.name:
            runs[-1][1] += 1
            runs[-1][2] += e.time_range.elapsed_us()
        else:
            runs.append([e.name, 1, e.time_range.elapsed_us()])
    for name, count, us in runs:
        print(f"{count:3d} x {us / count:7.2f} us  {name[:90]}")


def host_profile(model: Transformer, cache: object, steps: int = 64) -> None:
    """The host's time over replayed decode steps by function, and the hybrid counters."""
    hook = model.step_hook
    before = hook.stats()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    with prof:
        for i in range(steps):
            model.forward([600 + i], cache)
        torch.cuda.synchronize()
    secs = (time.perf_counter() - t0) / steps
    after = hook.stats()
    per = {
        "busy": after.cpu_busy_s - before.cpu_busy_s,
        "bookkeeping": after.bookkeeping_s - before.bookkeeping_s,
    }
    print(
        f"\nhost profile of {steps} graph decode steps: {secs * 1e3:.3f} ms per step; CPU expert "
        f"thread busy {per['busy'] / steps * 1e3:.2f} ms, bookkeeping "
        f"{per['bookkeeping'] / steps * 1e3:.3f} ms per step; swaps {after.swaps - before.swaps}, "
        f"fills {after.fills - before.fills}"
    )
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


def batched_steps(model: Transformer, batch: int, args: argparse.Namespace) -> None:
    """Times decode steps of ``batch`` sequences (one token each, each its own cache)."""
    caches = [model.new_cache(args.p + 64) for _ in range(batch)]
    for i, c in enumerate(caches):
        model.forward(list(range(100 + i, 100 + i + args.p)), c)
    hook = model.step_hook
    steps = 16

    def step(i: int) -> None:
        model.forward_batch([([500 + 7 * j + i], c) for j, c in enumerate(caches)])

    for i in range(4):
        step(i)
    busy = hook.stats().cpu_busy_s if hook is not None else 0.0
    t0 = time.perf_counter()
    for i in range(steps):
        step(4 + i)
    secs = (time.perf_counter() - t0) / steps
    busy = ((hook.stats().cpu_busy_s if hook is not None else 0.0) - busy) / steps
    print(
        f"\nbatched decode, {batch} sequences: {secs * 1e3:.2f} ms per step "
        f"({batch / secs:.1f} t/s), host expert thread busy {busy * 1e3:.2f} ms per step"
    )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(4 + steps)
        torch.cuda.synchronize()
    for key in ("cuda_time_total", "self_cpu_time_total"):
        _table(prof, f"one batched decode step of {batch} sequences", args.rows, key)


if __name__ == "__main__":
    main()
