"""A soak of ``freetoken serve`` over loopback, bounded in count and time.

``requests`` requests, ``concurrency`` at a time, of mixed kinds and prompt lengths: OpenAI chat
(streamed and not), text completions, Anthropic messages, and bad bodies; a third of the
streaming clients disconnect mid-stream at a random event. Afterwards it checks that every slot
is free, that ``/metrics`` adds up (generations started = finished + cancelled), that the
server's RSS grew by less than ``rss_bound_mib`` over the run, and that a final greedy request
gives the same text as on a fresh server.

    python tests/soak.py --requests 500 --concurrency 16      the full soak (minutes)

``tests/test_soak.py`` runs a short one in the test command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))

from live_server import API_KEY, Server, live_server

SERVER_ARGS = ["--parallel", "4", "-c", "1024", "-b", "128", "--timeout", "60"]
WORDS = "the quick brown fox jumps over a lazy dog while seven bright stars watch quietly".split()
FINAL = {"messages": [{"role": "user", "content": "Name three colors."}], "max_tokens": 16}


@dataclass
class SoakResult:
    """What the soak saw."""

    requests: int
    seconds: float
    by_outcome: dict[str, int] = field(default_factory=dict)
    server_errors: list[str] = field(default_factory=list)
    started: float = 0.0
    finished: float = 0.0
    cancelled: float = 0.0
    rss_growth_mib: float = 0.0
    final_text: str = ""
    fresh_text: str = ""

    def problems(self, rss_bound_mib: float) -> list[str]:
        """Every check that failed, in words (empty: the soak passed)."""
        out = list(self.server_errors)
        if self.started != self.finished + self.cancelled:
            out.append(
                f"metrics do not add up: started {self.started} != finished {self.finished} "
                f"+ cancelled {self.cancelled}"
            )
        if self.rss_growth_mib > rss_bound_mib:
            out.append(f"RSS grew by {self.rss_growth_mib:.0f} MiB (bound {rss_bound_mib})")
        if self.final_text != self.fresh_text:
            out.append(f"final text {self.final_text!r} != fresh server's {self.fresh_text!r}")
        return out


def _prompt(rng: random.Random) -> str:
    n = rng.choice([3, 3, 40, 40, 250])
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _plan(rng: random.Random) -> tuple[str, str, bytes, bool, int | None]:
    """(kind, path, body, streamed, events to read before disconnecting or None)."""
    roll = rng.random()
    sampling = {"max_tokens": rng.randint(2, 12), "temperature": rng.choice([0, 0.7, 1.0])}
    msgs = [{"role": "user", "content": _prompt(rng)}]
    if roll < 0.15:
        body = rng.choice(
            [
                b'{"messages": [',
                b"[1, 2]",
                json.dumps({"messages": "hi"}).encode(),
                json.dumps({"messages": msgs, "max_tokens": "5"}).encode(),
                json.dumps({"messages": msgs, "model": "nope"}).encode(),
                json.dumps({"messages": [{"role": "user", "content": "w " * 2000}]}).encode(),
            ]
        )
        return "bad", "/v1/chat/completions", body, False, None
    if roll < 0.50:
        cut = rng.randint(1, 5) if rng.random() < 1 / 3 else None
        body = json.dumps({"messages": msgs, "stream": True, **sampling}).encode()
        return ("stream-cut" if cut else "stream"), "/v1/chat/completions", body, True, cut
    if roll < 0.75:
        body = json.dumps({"messages": msgs, **sampling}).encode()
        return "chat", "/v1/chat/completions", body, False, None
    if roll < 0.90:
        body = json.dumps({"prompt": _prompt(rng), **sampling}).encode()
        return "completion", "/v1/completions", body, False, None
    stream = rng.random() < 0.5
    body = json.dumps({"messages": msgs, "stream": stream, **sampling}).encode()
    return ("messages-stream" if stream else "messages"), "/v1/messages", body, stream, None


async def _one(
    session: aiohttp.ClientSession, base: str, plan: tuple[str, str, bytes, bool, int | None]
) -> str:
    """Runs one planned request; returns its outcome, or raises AssertionError."""
    kind, path, body, streamed, cut = plan
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    async with session.post(base + path, data=body, headers=headers) as resp:
        if resp.status >= 500:
            raise AssertionError(f"{kind}: HTTP {resp.status}: {await resp.text()}")
        if kind == "bad":
            data = await resp.json()
            assert 400 <= resp.status < 500 and data["error"]["message"], (resp.status, data)
            return "rejected"
        assert resp.status == 200, (kind, resp.status, await resp.text())
        if not streamed:
            data = await resp.json()
            assert "choices" in data or data.get("type") == "message", data
            return "done"
        events = 0
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            events += 1
            if cut is not None and events >= cut:
                resp.close()  # the client goes away mid-stream
                return "disconnected"
            if line.strip() in (b"data: [DONE]", b'data: {"type":"message_stop"}'):
                return "done"
        if cut is not None:
            return "done"  # the stream ended before the cut
        assert kind == "messages-stream", f"{kind}: the stream ended without [DONE]"
        return "done"


async def _drive(server: Server, n: int, concurrency: int, seed: int) -> dict[str, int]:
    rng = random.Random(seed)
    plans = [_plan(rng) for _ in range(n)]
    counts: dict[str, int] = {}
    sem = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=600)

    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def task(plan: tuple[str, str, bytes, bool, int | None]) -> None:
            async with sem:
                outcome = await _one(session, server.base, plan)
            counts[outcome] = counts.get(outcome, 0) + 1

        await asyncio.gather(*(task(p) for p in plans))
    return counts


def _final_text(server: Server) -> str:
    status, data = server.raw(
        "POST", "/v1/chat/completions", json.dumps(FINAL | {"temperature": 0}).encode()
    )
    assert status == 200, data
    return str(data["choices"][0]["message"]["content"])


def _wait_idle(server: Server, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        h = server.health()
        if h["slots_processing"] == 0 and h["requests_waiting"] == 0:
            return
        time.sleep(0.2)
    raise AssertionError(f"slots still busy {within_s} s after the soak: {server.health()}")


def run(model: Path, requests: int, concurrency: int, seed: int = 0) -> SoakResult:
    """The soak on ``model``; raises AssertionError at the first request that misbehaved."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "soak-server.txt"
        with live_server(model, log, SERVER_ARGS) as server:
            # Warm-up: the first requests allocate what the server keeps.
            asyncio.run(_drive(server, 8, 4, seed + 1))
            _wait_idle(server, 120)
            rss0 = server.rss_bytes()
            t0 = time.monotonic()
            counts = asyncio.run(_drive(server, requests, concurrency, seed))
            seconds = time.monotonic() - t0
            _wait_idle(server, 120)
            res = SoakResult(requests, seconds, counts)
            res.started = server.metric("freetoken_requests_started_total")
            res.finished = server.metric("freetoken_requests_finished_total")
            res.cancelled = server.metric("freetoken_requests_cancelled_total")
            res.rss_growth_mib = (server.rss_bytes() - rss0) / 2**20
            res.final_text = _final_text(server)
            if server.proc.poll() is not None:
                res.server_errors.append(f"the server exited: {log.read_text()[-2000:]}")
            text = log.read_text()
            tracebacks = text.count("Traceback")
            if tracebacks:
                first = text[text.index("Traceback") :][:3000]
                res.server_errors.append(f"{tracebacks} tracebacks in the server's log: {first}")
        with live_server(model, Path(tmp) / "fresh-server.txt", SERVER_ARGS) as fresh:
            res.fresh_text = _final_text(fresh)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", help="GGUF (default: the embedded default model)")
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rss-bound-mib", type=float, default=256.0)
    args = ap.parse_args()
    if args.model:
        model = Path(args.model)
    else:
        from freetoken.default_model import default_model_path

        model = default_model_path()
    res = run(model, args.requests, args.concurrency, args.seed)
    print(
        f"soak: {res.requests} requests at {args.concurrency} concurrent in {res.seconds:.0f} s: "
        f"{res.by_outcome}; started {res.started:.0f} = finished {res.finished:.0f} + cancelled "
        f"{res.cancelled:.0f}; RSS +{res.rss_growth_mib:.1f} MiB; final text {res.final_text!r}"
    )
    problems = res.problems(args.rss_bound_mib)
    for p in problems:
        print(f"soak: FAILED: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
