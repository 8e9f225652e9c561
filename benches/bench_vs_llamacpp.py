"""Side-by-side speed and peak RSS: `freetoken bench` against llama.cpp's `llama-bench`, built
from the same pinned source with the same CPU options (tools/llama_ref.py), in one run.

    python benches/bench_vs_llamacpp.py [-m MODEL] [-p 128] [-n 64] [-d 0] [-t 2] [-r 3]
        [-ctk f16 -ctv f16] [--rounds 1]

Prints a markdown table (and, with --json FILE, the raw figures) with the ratio ours/llama.cpp;
with --rounds N the two alternate N times (on a shared host each sees the same load on average)
and the ratio is of the medians, each round's load average beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import llama_ref


def _run_with_rss(cmd: list[str]) -> tuple[str, float]:
    """Runs ``cmd`` and returns (stdout, peak RSS in MiB) from the kernel's rusage."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.dup2(w, 1)
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
        os.execvp(cmd[0], cmd)
    os.close(w)
    chunks = []
    with os.fdopen(r) as f:
        chunks.append(f.read())
    _, status, usage = os.wait4(pid, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with {os.waitstatus_to_exitcode(status)}")
    return "".join(chunks), usage.ru_maxrss / 1024


def _common(p: int, n: int, d: int, t: int, r: int, ctk: str, ctv: str) -> list[str]:
    """The arguments both tools take the same way (llama-bench's names)."""
    sizes = ["-p", str(p), "-n", str(n), "-d", str(d), "-t", str(t), "-r", str(r)]
    return [*sizes, "-ctk", ctk, "-ctv", ctv]


def bench_llamacpp(model: str, *common: str) -> dict[str, Any]:
    exe = str(llama_ref.tool_path("llama-bench"))
    out, rss = _run_with_rss([exe, "-m", model, *common, "-o", "json"])
    rows = json.loads(out)
    pp = next(x["avg_ts"] for x in rows if x["n_prompt"] > 0)
    tg = next(x["avg_ts"] for x in rows if x["n_gen"] > 0)
    return {"pp_tokens_per_s": pp, "decode_tokens_per_s": tg, "peak_rss_mib": rss}


def bench_ours(model: str, *common: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "freetoken.cli", "bench", "-m", model, *common, "-o", "json"]
    out, rss = _run_with_rss(cmd)
    res = json.loads(out.strip().splitlines()[-1])
    res["peak_rss_mib"] = rss
    return res


def _row(label: str, res: dict[str, Any]) -> str:
    return (
        f"| {label} | {res['pp_tokens_per_s']:.1f} | {res['decode_tokens_per_s']:.1f} | "
        f"{res['peak_rss_mib']:.0f} |"
    )


def _median(values: list[float]) -> float:
    s = sorted(values)
    mid = len(s) // 2
    return s[mid] if len(s) % 2 else (s[mid - 1] + s[mid]) / 2


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the embedded default model)")
    ap.add_argument("-p", type=int, default=128)
    ap.add_argument("-n", type=int, default=64)
    ap.add_argument("-d", type=int, default=0, help="context tokens before each test")
    ap.add_argument("-t", type=int, default=2)
    ap.add_argument("-r", type=int, default=3)
    ap.add_argument(
        "-ctk", default="f16", help="KV cache key type for both (llama-bench's default: f16)"
    )
    ap.add_argument("-ctv", default="f16", help="KV cache value type for both")
    ap.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternate llama.cpp and ours this many times; the ratio is of the medians",
    )
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args()
    if args.model is None:
        from freetoken.default_model import default_model_path

        args.model = str(default_model_path())
    refs: list[dict[str, Any]] = []
    ourss: list[dict[str, Any]] = []
    loads: list[float] = []
    common = _common(args.p, args.n, args.d, args.t, args.r, args.ctk, args.ctv)
    for _ in range(args.rounds):
        loads.append(os.getloadavg()[0])
        refs.append(bench_llamacpp(args.model, *common))
        ourss.append(bench_ours(args.model, *common))
    name = os.path.basename(args.model)
    at = f" at depth {args.d}" if args.d else ""
    kv = f"KV cache {args.ctk}/{args.ctv}"
    print(f"model {name}, {args.t} threads, pp{args.p} / tg{args.n}{at}, {kv}, {args.r} reps\n")
    print("| | pp t/s | decode t/s | peak RSS MiB |")
    print("| --- | ---: | ---: | ---: |")
    for i, (ref, ours) in enumerate(zip(refs, ourss, strict=True)):
        tag = f" (round {i + 1}, load {loads[i]:.1f})" if args.rounds > 1 else ""
        print(_row(f"llama.cpp{tag}", ref))
        print(_row(f"freetoken{tag}", ours))
    keys = ("pp_tokens_per_s", "decode_tokens_per_s", "peak_rss_mib")
    ref = {k: _median([r[k] for r in refs]) for k in keys}
    ours = {k: _median([r[k] for r in ourss]) for k in keys}
    if args.rounds > 1:
        print(_row("llama.cpp median", ref))
        print(_row("freetoken median", ours))
    pp_ratio = ours["pp_tokens_per_s"] / ref["pp_tokens_per_s"]
    tg_ratio = ours["decode_tokens_per_s"] / ref["decode_tokens_per_s"]
    print(f"| ratio | {pp_ratio:.2f}x | {tg_ratio:.2f}x | |")
    if args.json:
        rounds = [
            {"llama.cpp": r, "freetoken": o, "load": la}
            for r, o, la in zip(refs, ourss, loads, strict=True)
        ]
        figures = {"llama.cpp": ref, "freetoken": ours, "rounds": rounds}
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
