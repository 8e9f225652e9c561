"""Aggregate decode and prompt throughput of concurrent streams: ``freetoken serve`` against
llama.cpp's ``llama-server`` on one model, side by side in one run (hybrid against
llama.cpp's ``--n-cpu-moe`` at the same GPU memory budget).

Each engine's server is started once on 127.0.0.1 with as many slots as the most streams
(``-np``; llama-server also gets an HTTP thread per stream) and warmed up with one request.
Then ``--rounds`` rounds, each engine in turn within a round (the host drifts within a
lease):

- decode, per stream count N: N streamed ``/v1/completions`` requests at once (N different
  prompts, greedy, ``ignore_eos`` so each makes ``--max-tokens`` tokens). Aggregate decode
  tokens/s is every token after each stream's first over the time from the first stream's
  first token to the last stream's end (prompt processing left out, as llama-bench's tg
  leaves it out); the per-stream rate is the mean of each stream's own;
- prompts: ``--prompt-streams`` requests at once of ``--prompt-tokens`` token ids each (the
  same ids to both engines, new ones every round, prompt caching off), one token generated:
  prompt tokens/s is their tokens over the time until the last response.

Rows are the median over the rounds. Beside FreeToken's rows, the step's split from its
``/metrics`` (``freetoken_moe_fetch_*``, the split steps of more than one token in that
round): expert MB uploaded and computed on the GPU per step and read by the CPU per step,
and each side's milliseconds per step; and the measured milliseconds per step (the round's
decode span over its split steps). Peak VRAM per server process (nvidia-smi, when present)
and its peak RSS (VmHWM) are reported beside. Prints a markdown table; ``--json`` keeps every
round.

    python3 benches/bench_server_streams.py -m MODEL.gguf --llama-server PATH \\
        --streams 4,16,32 --rounds 3 --prompt-tokens 4096 \\
        "--freetoken-args=--moe-strategy hybrid --moe-cache-mib 3888 -b 2048" \\
        "--llama-args=-ngl 99 -ncmoe 31 -fa off" -t 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import shlex
import socket
import statistics
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
ENGINES = ("llama.cpp", "freetoken")
#: Token ids the prompt rounds draw from: ordinary tokens of the model's vocabulary.
PROMPT_IDS = range(1000, 30000)
#: FreeToken's split counters (server/__init__.py FETCH_SERIES), per step size.
FETCH_METRIC = re.compile(r'^freetoken_moe_fetch_(\w+)_total\{tokens="([^"]+)"\} (\S+)$')


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _vram_by_pid() -> dict[int, int] | None:
    """GPU memory (MiB) of each process using the GPU, or None without nvidia-smi."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-compute-apps=pid,used_memory",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    used: dict[int, int] = {}
    for line in out.stdout.splitlines():
        pid, _, mib = line.partition(",")
        if mib.strip().isdigit():
            used[int(pid)] = used.get(int(pid), 0) + int(mib)
    return used


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
    """Polls nvidia-smi in a thread: the peak GPU memory of each process."""

    def __init__(self) -> None:
        self.peak: dict[int, int] = {}
        self.available = _vram_by_pid() is not None
        self._done = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while self.available and not self._done.is_set():
            for pid, mib in (_vram_by_pid() or {}).items():
                self.peak[pid] = max(self.peak.get(pid, 0), mib)
            time.sleep(0.5)

    def stop(self) -> None:
        self._done.set()
        self._t.join()


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


def _body(prompt: str | list[int], n: int, stream: bool) -> dict[str, Any]:
    return {
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
        "cache_prompt": False,
    }


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str, n: int) -> list[float]:
    """The arrival times of a streamed completion's tokens (one per content chunk)."""
    times: list[float] = []
    async with session.post(f"{url}/v1/completions", json=_body(prompt, n, True)) as r:
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


async def _prompt(session: aiohttp.ClientSession, url: str, ids: list[int]) -> int:
    """One prompt of token ids, one token generated; the prompt tokens the server counted."""
    async with session.post(f"{url}/v1/completions", json=_body(ids, 1, False)) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        return int((await r.json())["usage"]["prompt_tokens"])


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800))


async def _decode_round(url: str, streams: int, max_tokens: int) -> dict[str, Any]:
    async with _session() as session:
        prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(streams)]
        runs = await asyncio.gather(*(_stream(session, url, p, max_tokens) for p in prompts))
    firsts = [t[0] for t in runs if t]
    lasts = [t[-1] for t in runs if t]
    decoded = sum(max(len(t) - 1, 0) for t in runs)
    span = max(lasts) - min(firsts) if firsts else 0.0
    per_stream = [(len(t) - 1) / (t[-1] - t[0]) for t in runs if len(t) > 1 and t[-1] > t[0]]
    return {
        "tokens": [len(t) for t in runs],
        "span_s": span,
        "aggregate_tps": decoded / span if span > 0 else None,
        "per_stream_tps": sum(per_stream) / len(per_stream) if per_stream else None,
    }


async def _prompt_round(url: str, prompts: list[list[int]]) -> dict[str, Any]:
    async with _session() as session:
        t0 = time.perf_counter()
        counted = await asyncio.gather(*(_prompt(session, url, p) for p in prompts))
        span = time.perf_counter() - t0
    return {"prompt_tokens": counted, "span_s": span, "prompt_tps": sum(counted) / span}


def _fetch_counters(url: str) -> dict[str, dict[str, float]]:
    """FreeToken's split counters by step size (empty for a server without them)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        m = FETCH_METRIC.match(line)
        if m:
            out.setdefault(m[2], {})[m[1]] = float(m[3])
    return out


def _split(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]], span: float
) -> dict[str, Any] | None:
    """Per split step of more than one token between two scrapes: MB uploaded and read by
    the CPU, each side's ms, and the decode span's ms per split step (all sizes)."""

    def total(field: str, sizes: list[str]) -> float:
        return sum(after[s].get(field, 0) - before.get(s, {}).get(field, 0) for s in sizes)

    several = [s for s in after if s != "1"]
    steps = total("steps", several)
    if not steps:
        return None
    every = total("steps", list(after))
    return {
        "steps": steps,
        "uploaded_mb": total("uploaded_bytes", several) / steps / 1e6,
        "cpu_mb": total("cpu_bytes", several) / steps / 1e6,
        "upload_ms": total("upload_seconds", several) / steps * 1e3,
        "cpu_ms": total("cpu_seconds", several) / steps * 1e3,
        "uploaded_routes": total("uploaded_routes", several),
        "cpu_routes": total("cpu_routes", several),
        "step_ms": span / every * 1e3 if every else None,
    }


class Server:
    """One engine's server for the whole run."""

    def __init__(self, engine: str, args: argparse.Namespace, slots: int) -> None:
        self.engine = engine
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = _server_cmd(engine, args, slots, self.port)
        print(f"bench_server_streams: {' '.join(self.cmd)}", file=sys.stderr, flush=True)
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        self.stderr = ""

    def start(self, timeout: float) -> None:
        """Waits until the server answers, then warms it up (graphs, caches)."""
        _wait_ready(self.url, self.proc, timeout)
        asyncio.run(_decode_round(self.url, 1, 8))

    def stop(self) -> dict[str, Any]:
        info = {"cmd": self.cmd, "peak_rss_mib": _rss_peak_mib(self.proc.pid)}
        self.proc.terminate()
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.stderr = err.decode(errors="replace")[-3000:]
        return info


def _server_cmd(engine: str, args: argparse.Namespace, slots: int, port: int) -> list[str]:
    # The same KV positions for both: llama-server's -c is the total it splits over its -np
    # slots, FreeToken's the context of each slot.
    per_slot = max(args.max_tokens, args.prompt_tokens) + 64
    if engine == "freetoken":
        cmd = [sys.executable, "-m", "freetoken", "serve", "-m", args.model, "--host"]
        cmd += ["127.0.0.1", "--port", str(port), "-np", str(slots), "-c", str(per_slot)]
        # Its own thread count (the executor's default beside a GPU) unless the extra
        # flags say -t: llama.cpp's best -t is not FreeToken's (benches/README.md).
        cmd += shlex.split(args.freetoken_args)
        return cmd
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(slots), "-c", str(slots * per_slot), "-t", str(args.threads)]
    # An HTTP thread per stream: with fewer (its default follows the core count) llama-server
    # dropped connections at 16 streams on the H200 (ServerDisconnectedError).
    cmd += ["--threads-http", str(slots + 2)]
    return cmd + shlex.split(args.llama_args)


def _one_round(
    servers: dict[str, Server], args: argparse.Namespace, r: int
) -> list[dict[str, Any]]:
    """Every engine in turn on every stream count, then on the prompts, once."""
    rows: list[dict[str, Any]] = []
    rng = random.Random(r)
    prompts = [
        [rng.choice(PROMPT_IDS) for _ in range(args.prompt_tokens)]
        for _ in range(args.prompt_streams)
    ]
    jobs: list[tuple[str, int]] = [("decode", int(n)) for n in args.streams.split(",")]
    jobs += [("prompt", args.prompt_streams)] if args.prompt_tokens else []
    for kind, n in jobs:
        for engine, srv in servers.items():
            row: dict[str, Any] = {"round": r, "kind": kind, "engine": engine, "streams": n}
            try:
                before = _fetch_counters(srv.url) if engine == "freetoken" else {}
                if kind == "decode":
                    row |= asyncio.run(_decode_round(srv.url, n, args.max_tokens))
                else:
                    row |= asyncio.run(_prompt_round(srv.url, prompts))
                if engine == "freetoken":
                    row["split"] = _split(before, _fetch_counters(srv.url), row["span_s"])
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            print(f"bench_server_streams: {json.dumps(row)[:300]}", file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _split_cell(rows: list[dict[str, Any]]) -> str:
    splits = [r["split"] for r in rows if r.get("split")]
    if not splits:
        return "-"
    m = {k: statistics.median(s[k] for s in splits if s[k] is not None) for k in splits[0]}
    return (
        f"up {m['uploaded_mb']:.0f} MB {m['upload_ms']:.1f} ms, CPU {m['cpu_mb']:.0f} MB "
        f"{m['cpu_ms']:.1f} ms; step {m['step_ms']:.1f} ms"
    )


def table(rows: list[dict[str, Any]], vram: dict[str, Any], rss: dict[str, Any]) -> str:
    """The markdown table: each (kind, streams, engine) row's median over the rounds."""
    out = [
        "| rows | streams | engine | rounds | t/s (median) | per-stream t/s | ratio | split "
        "per step (median) | VRAM MiB | RSS MiB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    keys = sorted({(r["kind"], r["streams"]) for r in rows}, key=lambda k: (k[0] != "decode", k))
    for kind, n in keys:
        metric = "aggregate_tps" if kind == "decode" else "prompt_tps"
        group = {e: [r for r in rows if (r["kind"], r["streams"], r["engine"]) == (kind, n, e)]
                 for e in ENGINES}  # fmt: skip
        ref = _median(group["llama.cpp"], metric)
        for engine, rs in group.items():
            if not rs:
                continue
            tps = _median(rs, metric)
            ratio = tps / ref if tps and ref else None
            fails = [r["error"] for r in rs if "error" in r]
            cells = [
                kind,
                str(n),
                engine,
                f"{len(rs) - len(fails)}/{len(rs)}",
                f"{tps:.1f}" if tps else f"failed: {fails[0][:60] if fails else '?'}",
                f"{_median(rs, 'per_stream_tps'):.1f}" if _median(rs, "per_stream_tps") else "-",
                f"{ratio:.2f}" if ratio else "-",
                _split_cell(rs),
                str(vram.get(engine) if vram.get(engine) is not None else "-"),
                f"{rss[engine]:.0f}" if rss.get(engine) else "-",
            ]
            out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def _save(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)


def main() -> int:
    """Starts the servers, runs the rounds, prints the table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--llama-server", help="llama-server binary (left out when not given)")
    ap.add_argument("--streams", default="4,16,32", help="comma-separated stream counts")
    ap.add_argument("-n", "--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of every row, in turn")
    ap.add_argument("--prompt-tokens", type=int, default=4096, help="0: no prompt rows")
    ap.add_argument("--prompt-streams", type=int, default=4, help="prompts at once")
    ap.add_argument("-t", "--threads", type=int, default=16, help="llama-server's -t")
    ap.add_argument("--freetoken-args", default="", help="extra freetoken serve flags")
    ap.add_argument(
        "--llama-args", default="-ngl 99", help="extra llama-server flags (--llama-args=...)"
    )
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    engines = [e for e in ENGINES if e == "freetoken" or args.llama_server]
    slots = max([int(n) for n in args.streams.split(",")] + [args.prompt_streams])
    poll = Poller()
    servers: dict[str, Server] = {}
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    try:
        for e in engines:
            servers[e] = Server(e, args, slots)
            servers[e].start(args.ready_timeout)
        for r in range(args.rounds):
            rows += _one_round(servers, args, r)
            _save(args, {"args": vars(args), "rows": rows})  # what a timeout leaves
    finally:
        for e, srv in servers.items():
            info[e] = srv.stop() | {"stderr": srv.stderr}
        poll.stop()
    vram = {e: poll.peak.get(s.proc.pid) for e, s in servers.items()}
    rss = {e: info[e]["peak_rss_mib"] for e in info}
    print(f"model {args.model}: {args.max_tokens} tokens per stream, {args.prompt_tokens}-token")
    print(f"prompts x {args.prompt_streams}, {args.rounds} rounds, llama.cpp -t {args.threads}")
    print(f"freetoken: {args.freetoken_args or '(defaults)'}; llama.cpp: {args.llama_args}")
    print(table(rows, vram, rss))
    _save(args, {"args": vars(args), "servers": info, "vram_mib": vram, "rows": rows})
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
