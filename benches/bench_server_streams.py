"""Aggregate decode throughput of concurrent streams: ``freetoken serve`` against llama.cpp's
``llama-server`` on one model, side by side in one run (4 and 16 streams, hybrid
against llama.cpp's ``--n-cpu-moe`` at the same GPU memory budget).

Per engine and stream count N: the server is started on 127.0.0.1 with N slots, one warm-up
request runs, then N streamed ``/v1/completions`` requests run at once (N different prompts,
greedy, ``ignore_eos`` so each makes ``--max-tokens`` tokens). Aggregate decode tokens/s is
every token after each stream's first over the time from the first stream's first token to
the last stream's end (prompt processing left out, as llama-bench's tg leaves it out); the
per-stream rate is the mean of each stream's own. Peak VRAM (nvidia-smi, when present) and the
server's peak RSS (VmHWM) are reported beside it. Prints a markdown table; ``--json`` keeps
everything.

    python3 benches/bench_server_streams.py -m MODEL.gguf --llama-server PATH --streams 4,16 \\
        "--freetoken-args=--moe-strategy hybrid --moe-cache-mib 3888" \\
        "--llama-args=-ngl 99 -ncmoe 36 -fa off" -t 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

import aiohttp

PROMPTS = [
    "The old lighthouse keeper climbed the stairs and",
    "In the beginning of the project, the team decided",
    "def parse_config(path):\n    ",
    "The recipe calls for two cups of flour and",
    "Once the storm had passed, the villagers",
    "The theorem states that for every prime number",
    "Dear hiring manager, I am writing to",
    "The train left the station at exactly",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vram_mib() -> int | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return int(out.stdout.split()[0])


def _rss_peak_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Poller:
    """Polls nvidia-smi in a thread: the peak above the level at start."""

    def __init__(self) -> None:
        self.base = _vram_mib()
        self.peak = self.base
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._done.is_set() and self.base is not None:
            v = _vram_mib()
            if v is not None and self.peak is not None:
                self.peak = max(self.peak, v)
            time.sleep(0.2)

    def stop(self) -> int | None:
        self._done.set()
        self._t.join()
        if self.base is None or self.peak is None:
            return None
        return self.peak - self.base


def _wait_ready(url: str, proc: subprocess.Popen[bytes], timeout: float) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"the server was not ready in {timeout:.0f} s")


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str, n: int) -> list[float]:
    """The arrival times of a streamed completion's tokens (one per content chunk)."""
    body = {
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ch = json.loads(line[6:])
            if any(c.get("text") for c in ch.get("choices", [])):
                times.append(time.perf_counter())
    return times


async def _round(url: str, streams: int, max_tokens: int) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=1800)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await _stream(session, url, PROMPTS[0], 8)  # warm-up (graphs, caches)
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(streams)]
        runs = await asyncio.gather(*(_stream(session, url, p, max_tokens) for p in prompts))
    firsts = [t[0] for t in runs if t]
    lasts = [t[-1] for t in runs if t]
    decoded = sum(max(len(t) - 1, 0) for t in runs)
    span = max(lasts) - min(firsts) if firsts else 0.0
    per_stream = [(len(t) - 1) / (t[-1] - t[0]) for t in runs if len(t) > 1 and t[-1] > t[0]]
    return {
        "streams": streams,
        "tokens": [len(t) for t in runs],
        "aggregate_tps": decoded / span if span > 0 else None,
        "per_stream_tps": sum(per_stream) / len(per_stream) if per_stream else None,
    }


def _server_cmd(engine: str, args: argparse.Namespace, streams: int, port: int) -> list[str]:
    # The same KV positions for both: llama-server's -c is the total it splits over its -np
    # slots, FreeToken's the context of each slot.
    per_slot = args.max_tokens + 64
    if engine == "freetoken":
        cmd = [sys.executable, "-m", "freetoken", "serve", "-m", args.model, "--host"]
        cmd += ["127.0.0.1", "--port", str(port), "-np", str(streams), "-c", str(per_slot)]
        # Its own thread count (the executor's default beside a GPU) unless the extra
        # flags say -t: llama.cpp's best -t is not FreeToken's (benches/README.md).
        cmd += shlex.split(args.freetoken_args)
        return cmd
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(streams), "-c", str(streams * per_slot), "-t", str(args.threads)]
    # An HTTP thread per stream: with fewer (its default follows the core count) llama-server
    # dropped connections at 16 streams on the H200 (ServerDisconnectedError).
    cmd += ["--threads-http", str(streams + 2)]
    return cmd + shlex.split(args.llama_args)


def run_engine(engine: str, args: argparse.Namespace, streams: int) -> dict[str, Any]:
    """One server, one round of ``streams`` concurrent requests."""
    port = _free_port()
    cmd = _server_cmd(engine, args, streams, port)
    row: dict[str, Any] = {"engine": engine, "streams": streams, "cmd": cmd}
    print(f"bench_server_streams: {' '.join(cmd)}", file=sys.stderr, flush=True)
    poll = Poller()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_ready(url, proc, args.ready_timeout)
        row |= asyncio.run(_round(url, streams, args.max_tokens))
        row["peak_rss_mib"] = _rss_peak_mib(proc.pid)
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        proc.terminate()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, err = proc.communicate()
        row["peak_vram_mib"] = poll.stop()
        if "error" in row:
            row["stderr"] = err.decode(errors="replace")[-3000:]
    return row


def main() -> int:
    """Runs every engine at every stream count; prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-server", help="llama-server binary (left out when not given)")
    ap.add_argument("--streams", default="4,16", help="comma-separated stream counts")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("-t", "--threads", type=int, default=16, help="llama-server's -t")
    ap.add_argument("--freetoken-args", default="", help="extra freetoken serve flags")
    ap.add_argument(
        "--llama-args", default="-ngl 99", help="extra llama-server flags (--llama-args=...)"
    )
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    engines = ["freetoken"] + (["llama.cpp"] if args.llama_server else [])
    rows = [run_engine(e, args, int(n)) for n in args.streams.split(",") for e in reversed(engines)]
    print(f"model {args.model}: {args.max_tokens} tokens per stream, llama.cpp -t {args.threads}")
    print(f"freetoken: {args.freetoken_args or '(defaults)'}; llama.cpp: {args.llama_args}")
    print(
        "| streams | engine | aggregate decode t/s | per-stream t/s | ratio | VRAM MiB | RSS MiB |"
    )
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        ref = next(
            (x for x in rows if x["engine"] == "llama.cpp" and x["streams"] == r["streams"]), None
        )
        agg = r.get("aggregate_tps")
        ratio = agg / ref["aggregate_tps"] if ref and ref.get("aggregate_tps") and agg else None
        cells = [
            f"{agg:.1f}" if agg else f"failed: {r.get('error', '?')[:60]}",
            f"{r['per_stream_tps']:.1f}" if r.get("per_stream_tps") else "-",
            f"{ratio:.2f}" if ratio else "-",
            str(r.get("peak_vram_mib") if r.get("peak_vram_mib") is not None else "-"),
            f"{r['peak_rss_mib']:.0f}" if r.get("peak_rss_mib") else "-",
        ]
        print(f"| {r['streams']} | {r['engine']} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
