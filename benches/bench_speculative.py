"""Speculative decoding: decode speed with ``--spec-type`` and synthetic acceptance rates
against the same engine without speculation, and the cost of cutting a Gated DeltaNet model
back after a verify step (checkpoints against a recompute), in one run.

    python benches/bench_speculative.py -m MODEL [--spec-type draft-mtp]
        [--rates 0.8,0.6,0.4] [-n 128] [-t 2] [-r 3] [--device cpu]
        [--moe-strategy hybrid --moe-cache-mib 4428] [--json FILE]

Decode: ``freetoken bench -p 0 -n N`` plain, with ``--spec-type T --spec-synth-rates R``
(``--spec-draft-n-max`` the number of rates) and with ``--spec-draft-n-auto`` added (each
step's length chosen by measured cost, up to that number), subprocesses one after the other
with the same engine flags (``--device``, ``--moe-strategy``, ``--moe-cache-mib``, ``-t``;
without ``-t`` FreeToken picks its threads), with the peak RSS each reports and, off the
CPU, the peak GPU memory each adds (``run_with_vram`` of bench_gpu_vs_llamacpp.py); plus
``bench``'s verify-step costs (one step of k tokens against k one-token steps, on the
engine's device).

Rewind (hybrid models, ``--device cpu`` only: it loads the model into this process on the
CPU): after a 64-token prompt, a verify step of k tokens of which the first j are kept, then
the cut back to them:

- checkpoints: the step runs with ``keep_steps`` (the recurrence token by token, each token's
  state kept) and :meth:`HybridCache.rewind` copies the kept one back;
- recompute: the step runs as a plain multi-token step (chunked recurrence) after a copy of
  the states, which are put back before the kept tokens run again as a step of j tokens.

Each figure is the best of ``-r`` x 4 runs.

By draft length (:func:`by_draft_length`): what each draft length from 0 to the number of
rates would decode at, predicted from this run's measured costs, so that a run tells whether
a shorter draft would be faster. Not measured decodes: a prediction from the verify steps'
costs, the synthetic rates and the rest of a measured speculative step.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_gpu_vs_llamacpp import run_with_vram
from bench_hybrid import cell


def _bench(args: argparse.Namespace, extra: list[str]) -> dict[str, Any]:
    """``freetoken bench``'s JSON (its peak RSS is the process's own), with the peak GPU
    memory it added as ``peak_vram_mib`` (None on the CPU)."""
    cmd = [sys.executable, "-m", "freetoken.cli", "bench", "-m", args.model, "-p", "0"]
    cmd += ["-n", str(args.n), "-r", str(args.r), "-o", "json", "--device", args.device]
    if args.threads is not None:
        cmd += ["-t", str(args.threads)]
    if args.moe_strategy is not None:
        cmd += ["--moe-strategy", args.moe_strategy]
    if args.moe_cache_mib is not None:
        cmd += ["--moe-cache-mib", str(args.moe_cache_mib)]
    cmd += extra
    print(f"bench_speculative: {' '.join(cmd)}", file=sys.stderr, flush=True)
    vram = None
    if args.device == "cpu":
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed with {proc.returncode}: {proc.stderr[-500:]}")
        out = proc.stdout
    else:
        out, vram = run_with_vram(cmd)
    res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    res["peak_vram_mib"] = vram
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


def by_draft_length(
    rates: list[float],
    step_ms: dict[int, float],
    tokens_per_s: float,
    tokens: int,
    verify_steps: dict[int, int],
) -> list[dict[str, float]]:
    """Per draft length ``n`` from 0 to ``len(rates)``: the expected tokens of a step (1 plus
    the first ``n`` rates, ``rates[i]`` the probability that draft position ``i`` is kept) and
    the decode rate predicted for it: a verify step of ``n + 1`` tokens (``step_ms``) plus the
    rest of a measured speculative step (its time, ``tokens`` at ``tokens_per_s`` over the
    ``verify_steps`` counted by length, less their verify costs: drafting, sampling, the cut
    back), that rest either in proportion to the tokens drafted or the same in every step.
    The two bound the truth where the rest is part per draft token, part per step."""
    steps = sum(verify_steps.values())
    step = tokens / tokens_per_s * 1e3 / steps
    verify = sum(c * step_ms[k] for k, c in verify_steps.items()) / steps
    drafted = sum(c * (k - 1) for k, c in verify_steps.items()) / steps
    rest = max(step - verify, 0.0)
    rows = []
    for n in range(len(rates) + 1):
        expect = 1.0 + sum(rates[:n])
        per_draft = rest * n / drafted if drafted else 0.0
        rows.append(
            {
                "draft": n,
                "tokens_per_step": expect,
                "verify_ms": step_ms[n + 1],
                "tps_rest_by_drafts": expect * 1e3 / (step_ms[n + 1] + per_draft),
                "tps_rest_per_step": expect * 1e3 / (step_ms[n + 1] + rest),
            }
        )
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--spec-type", default="draft-mtp")
    ap.add_argument("--rates", default="0.8,0.6,0.4")
    ap.add_argument("-n", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, help="FreeToken's threads (default: its own)")
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="freetoken bench --device")
    ap.add_argument("--moe-strategy", help="freetoken bench --moe-strategy")
    ap.add_argument("--moe-cache-mib", type=int, help="freetoken bench --moe-cache-mib")
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    n_max = len(args.rates.split(","))
    spec = ["--spec-type", args.spec_type, "--spec-draft-n-max", str(n_max)]
    spec += ["--spec-synth-rates", args.rates]
    plain = _bench(args, [])
    fast = _bench(args, spec)
    auto = _bench(args, [*spec, "--spec-draft-n-auto"])
    rewind = rewind_costs(args.model, n_max + 1, args.r) if args.device == "cpu" else []
    name = os.path.basename(args.model)
    print(
        f"model {name}, {fast['threads']} threads, tg{args.n}, {args.r} reps, rates "
        f"{args.rates}; {fast['placement']}\n"
    )
    print("| | decode t/s | peak VRAM MiB | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: |")
    rows = (
        ("no speculation", plain),
        (args.spec_type, fast),
        (f"{args.spec_type}, --spec-draft-n-auto", auto),
    )
    for label, res in rows:
        print(
            f"| {label} | {res['decode_tokens_per_s']:.2f} | {cell(res['peak_vram_mib'], '.0f')} | "
            f"{cell(res['peak_rss_mib'], '.0f')} |"
        )
    ratio = fast["decode_tokens_per_s"] / plain["decode_tokens_per_s"]
    sp = fast["spec"]
    print(
        f"\nratio {ratio:.2f}x; {sp['drafted']} drafted, {sp['accepted']} accepted "
        f"({100 * sp['acceptance']:.1f}%); verify steps by tokens {sp['verify_steps']}"
    )
    sa = auto["spec"]
    print(
        f"--spec-draft-n-auto: ratio "
        f"{auto['decode_tokens_per_s'] / plain['decode_tokens_per_s']:.2f}x; "
        f"{sa['drafted']} drafted, {sa['accepted']} accepted; steps by tokens "
        f"{sa['verify_steps']}\n"
    )
    print("| step tokens | ms | vs as many one-token steps |")
    print("| ---: | ---: | ---: |")
    step_ms = {int(k): ms for k, ms in sp["step_ms"].items()}  # JSON keys are strings
    for k, ms in step_ms.items():
        print(f"| {k} | {ms:.2f} | {ms / (k * step_ms[1]):.2f} |")
    lengths = by_draft_length(
        [float(r) for r in args.rates.split(",")],
        step_ms,
        fast["decode_tokens_per_s"],
        args.n * args.r,
        {int(k): c for k, c in sp["verify_steps"].items()},
    )
    print(
        "\n| draft tokens | tokens a step | verify ms | predicted t/s, rest by drafts | "
        "predicted t/s, rest per step |"
    )
    print("| ---: | ---: | ---: | ---: | ---: |")
    for row in lengths:
        print(
            f"| {row['draft']} | {row['tokens_per_step']:.2f} | {row['verify_ms']:.2f} | "
            f"{row['tps_rest_by_drafts']:.2f} | {row['tps_rest_per_step']:.2f} |"
        )
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
            doc = {
                "args": vars(args),
                "plain": plain,
                "spec": fast,
                "auto": auto,
                "rewind": rewind,
                "by_draft_length": lengths,
            }
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
