"""FreeToken on the GPU against llama.cpp's llama-bench, side by side in one run, on one model.

Runs ``freetoken bench`` once per configuration (``--moe-strategy``, ``--dense-weights``) and
llama-bench with every layer on the GPU (``-ngl 99``, flash attention off), each as its own
process while ``nvidia-smi`` is polled for the GPU memory in use: the peak over the run
(minus what was in use before) is the process's peak VRAM. Prints a markdown table and
writes the figures as JSON.

    python benches/bench_gpu_vs_llamacpp.py -m MODEL.gguf --llama-bench PATH \\
        -p 512 -n 64 -r 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from typing import Any


def _vram_used_mib() -> int:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.strip().splitlines()[0])


def run_with_vram(cmd: list[str]) -> tuple[str, int]:
    """Runs ``cmd``; returns its stdout and the peak GPU memory it added, in MiB."""
    base = _vram_used_mib()
    peak = base
    done = threading.Event()

    def poll() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _vram_used_mib())
            time.sleep(0.2)

    t = threading.Thread(target=poll, daemon=True)
    t.start()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    finally:
        done.set()
        t.join()
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}")
    sys.stderr.write(proc.stderr[-2000:])
    return proc.stdout, peak - base


def freetoken(args: argparse.Namespace, strategy: str, dense: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "freetoken", "bench", "-m", args.model, "-p", str(args.p)]
    cmd += ["-n", str(args.n), "-r", str(args.r), "-o", "json", "-t", str(args.threads)]
    cmd += ["--moe-strategy", strategy, "--dense-weights", dense]
    out, vram = run_with_vram(cmd)
    res = json.loads(out.strip().splitlines()[-1])
    return {
        "engine": f"freetoken {strategy}/{dense}",
        "pp": res["pp_tokens_per_s"],
        "tg": res["decode_tokens_per_s"],
        "peak_vram_mib": vram,
        "peak_rss_mib": res["peak_rss_mib"],
        "placement": res.get("placement"),
    }


def llama(args: argparse.Namespace) -> dict[str, Any]:
    cmd = [args.llama_bench, "-m", args.model, "-ngl", "99", "-fa", "0", "-p", str(args.p)]
    cmd += ["-n", str(args.n), "-r", str(args.r), "-t", str(args.threads), "-o", "json"]
    out, vram = run_with_vram(cmd)
    rows = json.loads(out)
    speed = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
    return {
        "engine": "llama.cpp -ngl 99 -fa 0",
        "pp": speed.get("pp"),
        "tg": speed.get("tg"),
        "peak_vram_mib": vram,
        "build": rows[0].get("build_commit"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-bench", required=True)
    ap.add_argument("-p", type=int, default=512)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=16)
    ap.add_argument(
        "--configs",
        default="gpu/quant,gpu/bf16",
        help="comma-separated strategy/dense pairs for freetoken",
    )
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    rows = [llama(args)]
    for cfg in args.configs.split(","):
        strategy, dense = cfg.split("/")
        rows.append(freetoken(args, strategy, dense))
    ref = rows[0]
    print(f"model {args.model}: pp{args.p}, tg{args.n}, {args.r} repetitions")
    print("| engine | pp t/s | tg t/s | pp ratio | tg ratio | peak VRAM MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        pr = r["pp"] / ref["pp"] if r["pp"] and ref["pp"] else float("nan")
        tr = r["tg"] / ref["tg"] if r["tg"] and ref["tg"] else float("nan")
        print(
            f"| {r['engine']} | {r['pp'] or 0:.1f} | {r['tg'] or 0:.1f} | {pr:.2f} | {tr:.2f} "
            f"| {r['peak_vram_mib']} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "p": args.p, "n": args.n, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
