"""A bounded load test of ``freetoken serve`` on loopback.

Starts a server (the default model unless ``-m``) on 127.0.0.1 and a free port, or uses
``--url`` (loopback addresses only), then:

1. runs each distinct prompt once alone (greedy, streamed, ``top_logprobs=2``): the reference;
2. sends ``--requests`` streamed chat requests, ``--concurrency`` at a time, cycling through
   the prompts, and checks every response: well-formed SSE chunks (one id, index 0, one
   finish reason, ``[DONE]`` last), a usage chunk whose ``completion_tokens`` equals the
   tokens received, and text equal to the prompt's reference (or parting from it only where
   the reference's two best tokens were within 0.05, a float near-tie), so no token was lost
   or crossed to another request;
   Requests send ``cache_prompt: false`` unless ``--cache-prompt``: each prompt is
   evaluated in full, as a stream of new prompts would be;
3. prints throughput and p50/p95 latencies (markdown, or ``-o json``) and exits non-zero if
   any response failed a check.

    python benches/server_load.py                      # 64 requests, 16 at a time
    python benches/server_load.py -n 32 -j 8 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import re
import statistics
import subprocess
import sys
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

import aiohttp

PROMPTS = [
    "Write a short poem about the sea.",
    "List five fruits.",
    "What is the capital of Italy?",
    "Explain gravity in one sentence.",
    "Name three colours of the rainbow.",
    "Give me a tip for learning to cook.",
    "Describe a cat to someone who has never seen one.",
    "What is 12 times 12?",
    "Tell me a fact about the moon.",
    "Suggest a name for a pet turtle.",
    "Why is the sky blue?",
    "Write a haiku about autumn leaves.",
    "What do bees make?",
    "Count from one to ten in words.",
    "Recommend a book for a long train ride.",
    "How many legs does a spider have?",
]


@dataclass
class Result:
    """One request's outcome."""

    prompt: int
    tokens: list[str] = field(default_factory=list)
    top2: list[list[float]] = field(default_factory=list)
    text: str = ""
    latency: float = 0.0
    ttft: float | None = None
    completion_tokens: int = 0
    errors: list[str] = field(default_factory=list)


def _check_loopback(url: str) -> None:
    host = urllib.parse.urlparse(url).hostname or ""
    ok = host == "localhost"
    try:
        ok = ok or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not ok:
        sys.exit(f"refusing to load-test {host!r}: loopback addresses only")


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    key: str | None,
    idx: int,
    max_tokens: int,
    cache: bool,
) -> Result:
    res = Result(prompt=idx)
    body = {
        "messages": [{"role": "user", "content": PROMPTS[idx]}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "logprobs": True,
        "top_logprobs": 2,
        "cache_prompt": cache,
    }
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    t0 = time.perf_counter()
    ids, finishes, usage, done = set(), [], None, False
    async with session.post(f"{url}/v1/chat/completions", json=body, headers=headers) as r:
        if r.status != 200:
            res.errors.append(f"HTTP {r.status}: {(await r.text())[:200]}")
            return res
        if not r.headers.get("Content-Type", "").startswith("text/event-stream"):
            res.errors.append(f"content type {r.headers.get('Content-Type')}")
        async for raw in r.content:
            line = raw.decode().rstrip("\n")
            if not line:
                continue
            if not line.startswith("data: "):
                res.errors.append(f"not an SSE data line: {line[:80]!r}")
                continue
            data = line[6:]
            if done:
                res.errors.append("data after [DONE]")
            if data == "[DONE]":
                done = True
                continue
            ch = json.loads(data)
            if "error" in ch:
                res.errors.append(f"error event: {ch['error']}")
                continue
            ids.add(ch.get("id"))
            if ch.get("object") != "chat.completion.chunk":
                res.errors.append(f"object {ch.get('object')!r}")
            usage = ch.get("usage") or usage
            for c in ch["choices"]:
                if c["index"] != 0:
                    res.errors.append("choice index != 0")
                if finishes:
                    res.errors.append("a chunk after the finish reason")
                delta = c["delta"]
                if delta.get("content"):
                    res.ttft = res.ttft or time.perf_counter() - t0
                    res.text += delta["content"]
                for e in (c.get("logprobs") or {}).get("content") or []:
                    res.tokens.append(e["token"])
                    res.top2.append([t["logprob"] for t in e["top_logprobs"]])
                if c.get("finish_reason"):
                    finishes.append(c["finish_reason"])
    res.latency = time.perf_counter() - t0
    if not done:
        res.errors.append("no [DONE]")
    if len(ids) != 1:
        res.errors.append(f"{len(ids)} distinct ids")
    if finishes not in (["stop"], ["length"]):
        res.errors.append(f"finish reasons {finishes}")
    if usage is None:
        res.errors.append("no usage")
    else:
        res.completion_tokens = usage["completion_tokens"]
        if usage["completion_tokens"] != len(res.tokens):
            res.errors.append(f"usage says {usage['completion_tokens']}, got {len(res.tokens)}")
    if "".join(res.tokens) != res.text:
        res.errors.append("the tokens do not spell the text")
    return res


def _compare(ref: Result, got: Result) -> str | None:
    """None if ``got`` is the reference's text, or parts from it only at a near-tie."""
    if got.tokens == ref.tokens:
        return None
    i = next(
        (i for i, (a, b) in enumerate(zip(ref.tokens, got.tokens, strict=False)) if a != b),
        min(len(ref.tokens), len(got.tokens)),
    )
    top = ref.top2[i] if i < len(ref.top2) else []
    if len(top) == 2 and top[0] - top[1] < 0.05:
        return None
    return f"differs from its solo run at token {i}: {ref.text!r} vs {got.text!r}"


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


async def _run(
    url: str, key: str | None, n: int, conc: int, max_tokens: int, cache: bool
) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        refs = [await _one(session, url, key, i, max_tokens, cache) for i in range(len(PROMPTS))]
        sem = asyncio.Semaphore(conc)

        async def limited(i: int) -> Result:
            async with sem:
                return await _one(session, url, key, i % len(PROMPTS), max_tokens, cache)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(i) for i in range(n)))
        wall = time.perf_counter() - t0
    failures, near_ties = [], 0
    for r in refs:
        failures += [f"reference {r.prompt}: {e}" for e in r.errors]
    for i, r in enumerate(results):
        failures += [f"request {i}: {e}" for e in r.errors]
        diff = _compare(refs[r.prompt], r)
        if diff and not r.errors:
            failures.append(f"request {i}: {diff}")
        near_ties += diff is None and r.tokens != refs[r.prompt].tokens
    lat = [r.latency for r in results]
    ttft = [r.ttft for r in results if r.ttft is not None]
    tokens = sum(r.completion_tokens for r in results)
    return {
        "requests": n,
        "concurrency": conc,
        "max_tokens": max_tokens,
        "cache_prompt": cache,
        "wall_s": wall,
        "requests_per_s": n / wall,
        "completion_tokens": tokens,
        "tokens_per_s": tokens / wall,
        "latency_p50_s": _pct(lat, 0.5),
        "latency_p95_s": _pct(lat, 0.95),
        "ttft_p50_s": _pct(ttft, 0.5) if ttft else None,
        "ttft_p95_s": _pct(ttft, 0.95) if ttft else None,
        "solo_latency_mean_s": statistics.mean(r.latency for r in refs),
        # Other work on the machine skews the figures: report it with them.
        "load_average_1m": os.getloadavg()[0],
        "near_tie_divergences": near_ties,
        "failures": failures,
    }


def _start_server(args: argparse.Namespace) -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "freetoken.server", "--host", "127.0.0.1", "--port", "0"]
    cmd += ["--parallel", str(args.parallel), "-c", str(args.ctx_size)]
    if args.model:
        cmd += ["-m", args.model]
    if args.threads:
        cmd += ["-t", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"(http://127\.0\.0\.1:\d+)", line)
    if not m:
        proc.kill()
        sys.exit(f"the server did not start: {line!r}")
    return proc, m.group(1)


def main() -> int:
    """Runs the load test; returns 0 when every response passed its checks."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", "--requests", type=int, default=64)
    ap.add_argument("-j", "--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--url", help="an already running server (loopback only)")
    ap.add_argument("--api-key")
    ap.add_argument("-m", "--model", help="model for the server this script starts")
    ap.add_argument("--parallel", type=int, default=16, help="slots of the started server")
    ap.add_argument("-c", "--ctx-size", type=int, default=1024)
    ap.add_argument("-t", "--threads", type=int)
    ap.add_argument(
        "--cache-prompt",
        action="store_true",
        help="let repeated prompts use the prefix cache (default: every prompt evaluated)",
    )
    ap.add_argument("-o", "--output", choices=["md", "json"], default="md")
    args = ap.parse_args()
    proc = None
    if args.url:
        _check_loopback(args.url)
        url = args.url.rstrip("/")
    else:
        proc, url = _start_server(args)
    try:
        out = asyncio.run(
            _run(
                url,
                args.api_key,
                args.requests,
                args.concurrency,
                args.max_tokens,
                args.cache_prompt,
            )
        )
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    if args.output == "json":
        print(json.dumps(out, indent=2))
    else:
        print(
            f"| requests | concurrency | max_tokens | wall s | req/s | gen tok/s | "
            f"latency p50 / p95 s | TTFT p50 / p95 s | failures |\n"
            f"|---|---|---|---|---|---|---|---|---|\n"
            f"| {out['requests']} | {out['concurrency']} | {out['max_tokens']} | "
            f"{out['wall_s']:.1f} | {out['requests_per_s']:.2f} | {out['tokens_per_s']:.1f} | "
            f"{out['latency_p50_s']:.2f} / {out['latency_p95_s']:.2f} | "
            f"{out['ttft_p50_s']:.2f} / {out['ttft_p95_s']:.2f} | {len(out['failures'])} |"
        )
        print(
            f"(alone, one request took {out['solo_latency_mean_s']:.2f} s on average; "
            f"1-minute load average at the end: {out['load_average_1m']:.1f} on "
            f"{os.cpu_count()} CPUs; {out['near_tie_divergences']} responses parted from "
            "their reference at a near-tie)"
        )
        for f in out["failures"]:
            print("FAIL", f)
    return 1 if out["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
