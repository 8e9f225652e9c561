"""A live ``freetoken serve`` in a subprocess on 127.0.0.1 (a free port), and how to reach
it: the official ``openai`` client, and ``http.client`` for the exact bytes."""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

API_KEY = "test-key-123"
HOST = "127.0.0.1"  # loopback only


class ServerStartError(RuntimeError):
    """The server process did not start listening."""


class Server:
    """The subprocess and how to reach it."""

    def __init__(self, proc: subprocess.Popen[str], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log
        self.base = f"http://{HOST}:{port}"

    def client(self, **kw: Any) -> Any:
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, **kw)

    def aclient(self) -> Any:
        import openai

        return openai.AsyncOpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0)

    def raw(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        key: str | None = API_KEY,
    ) -> tuple[int, Any]:
        """One request with ``http.client``: the exact bytes, no client-side validation."""
        status, _, data = self.raw_with_headers(method, path, body, key)
        return status, data

    def raw_with_headers(
        self, method: str, path: str, body: bytes | None = None, key: str | None = API_KEY
    ) -> tuple[int, dict[str, str], Any]:
        """As :meth:`raw`, with the response headers."""
        conn = http.client.HTTPConnection(HOST, self.port, timeout=60)
        headers = {"Content-Type": "application/json"}
        if key is not None:
            headers["Authorization"] = f"Bearer {key}"
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        conn.close()
        ctype = resp.getheader("Content-Type", "")
        parsed = json.loads(data) if "json" in ctype else data.decode()
        return resp.status, dict(resp.getheaders()), parsed

    def health(self) -> dict[str, Any]:
        return self.raw("GET", "/health", key=None)[1]

    def metric(self, name: str) -> float:
        text = self.raw("GET", "/metrics")[1]
        m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
        assert m, f"{name} not in /metrics"
        return float(m.group(1))

    def rss_bytes(self) -> int:
        """The server process's resident memory."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmRSS")


@contextmanager
def live_server(model: Path, log: Path, args: Sequence[str]) -> Iterator[Server]:
    """Runs ``freetoken serve -m model`` with an API key and ``args`` until the block ends."""
    cmd = [
        sys.executable, "-m", "freetoken.server", "-m", str(model),
        "--host", HOST, "--port", "0", "--api-key", API_KEY, *args,
    ]  # fmt: skip
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the server listens (or dies)
        m = re.search(r"http://[\d.]+:(\d+)", line)
        if not m:
            proc.wait(30)
            raise ServerStartError(f"server did not start: {line!r}\n{log.read_text()[-3000:]}")
        yield Server(proc, int(m.group(1)), log)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
