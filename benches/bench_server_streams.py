"""Aggregate decode and prompt throughput of concurrent streams: ``freetoken serve`` against
llama.cpp's ``llama-server`` on one model, side by side in one run (hybrid against
llama.cpp's ``--n-cpu-moe`` at the same GPU memory budget); with the same speculative decoding
flags given to both (``--spec-type draft-mtp --spec-synth-rates ...``), the speculative rows.

Each engine's server is started once on 127.0.0.1 with as many slots as the most streams
(``-np``; llama-server also gets an HTTP thread per stream) and warmed up with one request;
``--ncmoe 26,28,31`` starts one llama-server per value, ``-ncmoe N`` after ``--llama-args``.
Then ``--rounds`` rounds, each server in turn within a round (the host drifts within a
lease):

- decode, per stream count N: N streamed ``/v1/completions`` requests at once (N different
  prompts, greedy, ``ignore_eos`` so each makes ``--max-tokens`` tokens). A stream's tokens are
  its ``usage.completion_tokens`` (``stream_options.include_usage``): under speculative
  decoding one chunk can carry several. Aggregate decode tokens/s is every token after each
  stream's first (the prompt step's, its first chunk) over the time from the first stream's
  first chunk to the last stream's last (prompt processing left out, as llama-bench's tg
  leaves it out); the per-stream rate is the mean of each stream's own. Where llama-server
  sends ``timings``, its own rate (``predicted_per_second``, the mean over the streams) and its
  drafted and accepted tokens (``draft_n``, ``draft_n_accepted``) are kept beside; FreeToken's
  drafted and accepted tokens are its ``/metrics`` counters (``freetoken_spec_*``) over the
  round;
- prompts: ``--prompt-streams`` requests at once of ``--prompt-tokens`` token ids each (the
  same ids to both engines, new ones every round, prompt caching off), one token generated:
  prompt tokens/s is their tokens over the time until the last response.

Rows are the median over the rounds; each ratio is against a llama.cpp server: the only one,
or (``--ncmoe``) the fastest of the row within FreeToken's peak VRAM + 5% (bench_hybrid.py's
rule). Beside FreeToken's rows, the step's split from its ``/metrics``
(``freetoken_moe_fetch_*``, the split steps of more than one token in that round): expert MB
uploaded and computed on the GPU per step and read by the CPU per step, and each side's
milliseconds per step; and the measured milliseconds per step (the round's decode span over
its split steps). With ``--resident-args`` a second ``freetoken serve`` (every expert on the
GPU: ``--moe-strategy gpu``) runs the decode rows too, and beside each split row is the
bound its step is held to: max(upload ms, CPU ms) + the all-resident step's ms at the same
stream count (its decode span over its longest stream's tokens after the first), and the
measured step over it. Peak VRAM per server process (nvidia-smi, when present) and its peak RSS
(VmHWM) are reported beside. Prints a markdown table; ``--json`` keeps every round, saved
after each row with the peaks so far, so that a run cut by a time limit leaves its finished rows
(``--table out.json`` prints their table).

    python3 benches/bench_server_streams.py -m MODEL.gguf --llama-server PATH \\
        --streams 4,16,32 --rounds 3 --prompt-tokens 4096 \\
        "--freetoken-args=--moe-strategy hybrid --moe-cache-mib 3888 -b 2048" \\
        "--llama-args=-ngl 99 -ncmoe 31 -fa off" -t 16 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
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
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_hybrid import reference_within

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
#: Token ids the prompt rounds draw from: ordinary tokens of the model's vocabulary.
PROMPT_IDS = range(1000, 30000)
#: FreeToken's split counters (server/__init__.py FETCH_SERIES), per step size.
FETCH_METRIC = re.compile(r'^freetoken_moe_fetch_(\w+)_total\{tokens="([^"]+)"\} (\S+)$')
#: FreeToken's speculative decoding counters (server/metrics.py).
SPEC_METRIC = re.compile(r"^freetoken_spec_(drafted|accepted)_tokens_total (\S+)$")


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

    def peaks(self, pids: dict[str, int]) -> dict[str, int | None]:
        """The peak GPU memory so far of each labelled process (None: not seen)."""
        return {label: self.peak.get(pid) for label, pid in pids.items()}

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
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": n,
        "temperature": 0,
        "stream": stream,
        "ignore_eos": True,
        "cache_prompt": False,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


@dataclass
class Streamed:
    """One streamed completion: when its first and last chunks with text arrived, its tokens
    (the ``usage`` chunk's ``completion_tokens``: a chunk can carry several) and the server's
    ``timings`` where it sends them (llama-server)."""

    first: float | None = None
    last: float | None = None
    tokens: int | None = None
    timings: dict[str, Any] | None = None

    def add(self, chunk: dict[str, Any], now: float) -> None:
        """Takes in one chunk, arrived at ``now``."""
        if any(c.get("text") for c in chunk.get("choices") or []):
            if self.first is None:
                self.first = now
            self.last = now
        if chunk.get("usage"):
            self.tokens = int(chunk["usage"]["completion_tokens"])
        if chunk.get("timings"):
            self.timings = chunk["timings"]


async def _stream(session: aiohttp.ClientSession, url: str, prompt: str, n: int) -> Streamed:
    """A streamed completion, read chunk by chunk."""
    out = Streamed()
    async with session.post(f"{url}/v1/completions", json=_body(prompt, n, True)) as r:
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
        async for raw in r.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            out.add(json.loads(line[6:]), time.perf_counter())
    if out.tokens is None:
        raise RuntimeError("the stream ended without a usage chunk")
    return out


def tally(runs: list[Streamed]) -> dict[str, Any]:
    """A decode round's figures from its streams: the tokens after each stream's first (the
    prompt step's token, which its first chunk carries) over the span from the first
    stream's first chunk to the last stream's last, the mean per-stream rate, and where the
    server sent ``timings`` its own mean rate and the tokens drafted and accepted."""
    spans = [
        (s.first, s.last, s.tokens - 1)
        for s in runs
        if s.first is not None and s.last is not None and s.tokens
    ]
    decoded = sum(n for _, _, n in spans)
    span = max(t for _, t, _ in spans) - min(t for t, _, _ in spans) if spans else 0.0
    per_stream = [n / (t1 - t0) for t0, t1, n in spans if n and t1 > t0]
    out: dict[str, Any] = {
        "tokens": [s.tokens for s in runs],
        "span_s": span,
        "aggregate_tps": decoded / span if span > 0 else None,
        "per_stream_tps": sum(per_stream) / len(per_stream) if per_stream else None,
    }
    timings = [s.timings for s in runs if s.timings]
    if spans:
        # Every running stream advances one token a step: the steps are the longest stream's.
        out["decode_step_ms"] = span / max(n for _, _, n in spans) * 1e3 if span > 0 else None
    if timings:
        out["server_tps"] = statistics.mean(t["predicted_per_second"] for t in timings)
        if any("draft_n" in t for t in timings):
            out["drafted"] = sum(t.get("draft_n", 0) for t in timings)
            out["accepted"] = sum(t.get("draft_n_accepted", 0) for t in timings)
    return out


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
    return tally(list(runs))


async def _prompt_round(url: str, prompts: list[list[int]]) -> dict[str, Any]:
    async with _session() as session:
        t0 = time.perf_counter()
        counted = await asyncio.gather(*(_prompt(session, url, p) for p in prompts))
        span = time.perf_counter() - t0
    return {"prompt_tokens": counted, "span_s": span, "prompt_tps": sum(counted) / span}


def _scrape(url: str) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """FreeToken's split counters by step size, and its speculative decoding counters
    (``drafted``, ``accepted``; there once it has drafted)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    fetch: dict[str, dict[str, float]] = {}
    spec: dict[str, float] = {}
    for line in text.splitlines():
        if m := FETCH_METRIC.match(line):
            fetch.setdefault(m[2], {})[m[1]] = float(m[3])
        elif m := SPEC_METRIC.match(line):
            spec[m[1]] = float(m[2])
    return fetch, spec


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


#: The label of the all-resident ``freetoken serve`` (``--resident-args``).
RESIDENT = "freetoken resident"


class Server:
    """One server for the whole run: ``engine`` (``freetoken`` or ``llama.cpp``) with its
    extra ``flags``."""

    def __init__(self, engine: str, flags: list[str], args: argparse.Namespace, slots: int) -> None:
        self.engine = engine
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = _server_cmd(engine, args, slots, self.port) + flags
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
    """An engine's command line before its extra flags."""
    # The same KV positions for both: llama-server's -c is the total it splits over its -np
    # slots, FreeToken's the context of each slot. A multiple of 256: llama-server rounds each
    # slot's share down to one (4160 became 4096, and a 4096-token prompt was refused).
    per_slot = -(-(max(args.max_tokens, args.prompt_tokens) + 64) // 256) * 256
    if engine == "freetoken":
        # Its own thread count (the executor's default beside a GPU) unless the extra
        # flags say -t: llama.cpp's best -t is not FreeToken's (benches/README.md).
        cmd = [sys.executable, "-m", "freetoken", "serve", "-m", args.model, "--host"]
        return [*cmd, "127.0.0.1", "--port", str(port), "-np", str(slots), "-c", str(per_slot)]
    cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-np", str(slots), "-c", str(slots * per_slot), "-t", str(args.threads)]
    # An HTTP thread per stream: with fewer (its default follows the core count) llama-server
    # dropped connections at 16 streams on the H200 (ServerDisconnectedError).
    return [*cmd, "--threads-http", str(slots + 2)]


def server_specs(args: argparse.Namespace) -> list[tuple[str, str, list[str]]]:
    """(engine, label, extra flags) of each server: llama-server once, or once per
    ``--ncmoe`` value with ``-ncmoe N`` after ``--llama-args``; then freetoken serve, and the
    all-resident one with ``--resident-args``."""
    specs = []
    if args.llama_server:
        flags = shlex.split(args.llama_args)
        if args.ncmoe:
            for v in args.ncmoe.split(","):
                specs.append(("llama.cpp", f"llama.cpp -ncmoe {v}", [*flags, "-ncmoe", v]))
        else:
            specs.append(("llama.cpp", "llama.cpp", flags))
    specs.append(("freetoken", "freetoken", shlex.split(args.freetoken_args)))
    if args.resident_args:
        specs.append(("freetoken", RESIDENT, shlex.split(args.resident_args)))
    return specs


def _one_round(
    servers: dict[str, Server], args: argparse.Namespace, r: int
) -> Iterator[dict[str, Any]]:
    """Every server in turn on every stream count, then on the prompts, once: each row as
    it is measured."""
    rng = random.Random(r)
    prompts = [
        [rng.choice(PROMPT_IDS) for _ in range(args.prompt_tokens)]
        for _ in range(args.prompt_streams)
    ]
    jobs: list[tuple[str, int]] = [("decode", int(n)) for n in args.streams.split(",")]
    jobs += [("prompt", args.prompt_streams)] if args.prompt_tokens else []
    for kind, n in jobs:
        for label, srv in servers.items():
            if kind == "prompt" and label == RESIDENT:
                continue  # only its decode steps bound the split rows
            row: dict[str, Any] = {"round": r, "kind": kind, "engine": srv.engine}
            row |= {"server": label, "streams": n}
            try:
                before = _scrape(srv.url) if srv.engine == "freetoken" else None
                if kind == "decode":
                    row |= asyncio.run(_decode_round(srv.url, n, args.max_tokens))
                else:
                    row |= asyncio.run(_prompt_round(srv.url, prompts))
                if before is not None:
                    fetch, spec = _scrape(srv.url)
                    row["split"] = _split(before[0], fetch, row["span_s"])
                    for k, v in spec.items():
                        row[k] = v - before[1].get(k, 0.0)
            except Exception as e:
                row["error"] = f"{type(e).__name__}: {e}"
            print(f"bench_server_streams: {json.dumps(row)[:300]}", file=sys.stderr, flush=True)
            yield row


def _median(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _split_cell(rows: list[dict[str, Any]], resident_ms: float | None) -> str:
    """The median split per step; with the all-resident step's ms, the bound max(upload,
    CPU) + resident and the measured step over it."""
    splits = [r["split"] for r in rows if r.get("split")]
    if not splits:
        return "-"
    m = {k: statistics.median(s[k] for s in splits if s[k] is not None) for k in splits[0]}
    cell = (
        f"up {m['uploaded_mb']:.0f} MB {m['upload_ms']:.1f} ms, CPU {m['cpu_mb']:.0f} MB "
        f"{m['cpu_ms']:.1f} ms; step {m['step_ms']:.1f} ms"
    )
    if resident_ms is None or not m["step_ms"]:
        return cell
    bound = max(m["upload_ms"], m["cpu_ms"]) + resident_ms
    return (
        cell + f"; bound {bound:.1f} ms (resident {resident_ms:.1f}), {m['step_ms'] / bound:.2f}x"
    )


def reference(
    group: dict[str, list[dict[str, Any]]], metric: str, vram: dict[str, Any]
) -> str | None:
    """The llama.cpp server a row group's ratios are against (``group``: each server's rows
    of one kind and stream count): the only one, or the fastest (median ``metric``) within
    FreeToken's peak VRAM + 5% (bench_hybrid.reference_within); None without a llama.cpp
    figure, or with several and no peak VRAM to choose by."""
    speeds = {
        label: _median(rs, metric)
        for label, rs in group.items()
        if rs and rs[0]["engine"] == "llama.cpp"
    }
    ok = {label: v for label, v in speeds.items() if v}
    if len(ok) <= 1:
        return next(iter(ok), None)
    if any(vram.get(label) is None for label in ok):
        return None
    ours = [
        vram[label]
        for label, rs in group.items()
        if rs and rs[0]["engine"] == "freetoken" and _median(rs, metric) and vram.get(label)
    ]
    rows = [{"config": label, "tps": v, "peak_vram_mib": vram[label]} for label, v in ok.items()]
    ref, _ = reference_within(rows, "tps", max(ours) if ours else None, "freetoken")
    return ref["config"] if ref else None


def _spec_cell(rows: list[dict[str, Any]]) -> str:
    """Draft tokens over the rounds: drafted / accepted (the share)."""
    drafted = sum(r.get("drafted", 0) for r in rows)
    accepted = sum(r.get("accepted", 0) for r in rows)
    if not drafted:
        return "-"
    return f"{drafted:.0f} / {accepted:.0f} ({accepted / drafted:.0%})"


def table(rows: list[dict[str, Any]], vram: dict[str, Any], rss: dict[str, Any]) -> str:
    """The markdown table: each (kind, streams, server) row's median over the rounds, the
    reference server marked."""
    out = [
        "| rows | streams | server | rounds | t/s (median) | per-stream t/s | per-stream t/s, "
        "server's | ratio | drafted / accepted | split per step (median) | VRAM MiB | RSS MiB |",
        "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |",
    ]
    keys = sorted({(r["kind"], r["streams"]) for r in rows}, key=lambda k: (k[0] != "decode", k))
    labels = list(dict.fromkeys(r["server"] for r in rows))
    for kind, n in keys:
        metric = "aggregate_tps" if kind == "decode" else "prompt_tps"
        group = {
            label: [r for r in rows if (r["kind"], r["streams"], r["server"]) == (kind, n, label)]
            for label in labels
        }
        ref_label = reference(group, metric, vram)
        ref = _median(group[ref_label], metric) if ref_label else None
        resident_ms = _median(group.get(RESIDENT, []), "decode_step_ms")
        for label, rs in group.items():
            if not rs:
                continue
            tps = _median(rs, metric)
            ratio = tps / ref if tps and ref else None
            fails = [r["error"] for r in rs if "error" in r]
            cells = [
                kind,
                str(n),
                label + (" (ref)" if label == ref_label else ""),
                f"{len(rs) - len(fails)}/{len(rs)}",
                f"{tps:.1f}" if tps else f"failed: {fails[0][:60] if fails else '?'}",
                f"{_median(rs, 'per_stream_tps'):.1f}" if _median(rs, "per_stream_tps") else "-",
                f"{_median(rs, 'server_tps'):.1f}" if _median(rs, "server_tps") else "-",
                f"{ratio:.2f}" if ratio else "-",
                _spec_cell(rs),
                _split_cell(rs, resident_ms),
                str(vram.get(label) if vram.get(label) is not None else "-"),
                f"{rss[label]:.0f}" if rss.get(label) else "-",
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
    ap.add_argument("-m", "--model")
    ap.add_argument(
        "--table",
        metavar="JSON",
        help="only print the table of a saved run (--json's file, a cut run's rounds too)",
    )
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
    ap.add_argument(
        "--resident-args",
        help="flags of an all-resident freetoken serve (--moe-strategy gpu ...) whose decode "
        "step bounds the split rows",
    )
    ap.add_argument(
        "--ncmoe",
        help="comma-separated -ncmoe values: one llama-server each, -ncmoe N after --llama-args",
    )
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    if args.table:
        with open(args.table) as f:
            doc = json.load(f)
        print(table(doc["rows"], doc.get("vram_mib", {}), doc.get("rss_mib", {})), end="")
        return 0
    if not args.model:
        ap.error("-m/--model is required")
    prompt_slots = [args.prompt_streams] if args.prompt_tokens else []
    slots = max([int(n) for n in args.streams.split(",")] + prompt_slots)
    poll = Poller()
    servers: dict[str, Server] = {}
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {}
    # A server that does not come up is left out, the others run (a GPU call is scarce).
    failed: dict[str, str] = {}
    try:
        for engine, label, flags in server_specs(args):
            srv = Server(engine, flags, args, slots)
            try:
                srv.start(args.ready_timeout)
            except Exception as e:
                failed[label] = f"{type(e).__name__}: {e}"
                info[label] = srv.stop() | {"stderr": srv.stderr, "error": failed[label]}
                msg = f"bench_server_streams: {label} failed: {failed[label]}\n{srv.stderr}"
                print(msg, file=sys.stderr, flush=True)
                continue
            servers[label] = srv
        pids = {label: srv.proc.pid for label, srv in servers.items()}
        for r in range(args.rounds):
            for row in _one_round(servers, args, r):
                rows.append(row)
                # What a timeout leaves: the rows so far and each server's peaks so far.
                rss_now = {label: _rss_peak_mib(pid) for label, pid in pids.items()}
                _save(
                    args,
                    {
                        "args": vars(args),
                        "vram_mib": poll.peaks(pids),
                        "rss_mib": rss_now,
                        "rows": rows,
                    },
                )
    finally:
        for label, srv in servers.items():
            info[label] = srv.stop() | {"stderr": srv.stderr}
        poll.stop()
    vram = poll.peaks(pids)
    rss = {label: info[label]["peak_rss_mib"] for label in info}
    prompts = f"{args.prompt_tokens}-token prompts x {args.prompt_streams}"
    print(f"model {args.model}: {args.max_tokens} tokens per stream, ", end="")
    print(f"{prompts if args.prompt_tokens else 'no prompts'}, {args.rounds} rounds, ", end="")
    print(f"llama.cpp -t {args.threads}")
    print(f"freetoken: {args.freetoken_args or '(defaults)'}; llama.cpp: {args.llama_args}")
    for label, err in failed.items():
        print(f"{label}: did not start: {err}")
    print(table(rows, vram, rss))
    _save(
        args,
        {"args": vars(args), "servers": info, "vram_mib": vram, "rss_mib": rss, "rows": rows},
    )
    return 1 if failed or any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
