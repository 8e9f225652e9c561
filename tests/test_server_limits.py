"""The limits an operator expects of ``freetoken serve``, each driven over loopback against the
real server (the default model): the body size, the prompt and ``max_tokens`` against the
context, requests beyond ``--max-concurrent-requests`` (429 with Retry-After), a client that
sends its body slowly (408 after ``--timeout``) or never reads its stream (its slot is freed),
and ``--api-key`` on every endpoint that runs the model (``/health`` answers without it,
``/metrics`` does not). Every error is OpenAI's JSON shape."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("openai")

from live_server import API_KEY, HOST, Server, live_server

N_CTX = 256
TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("limits") / "stderr.txt"
    args = ["--parallel", "1", "-c", str(N_CTX), "--timeout", str(TIMEOUT_S)]
    args += ["--max-concurrent-requests", "2"]
    with live_server(default_model, log, args) as srv:
        yield srv


def _assert_openai_error(data: Any, param: Any = None, code: Any = None) -> dict[str, Any]:
    assert set(data) == {"error"}, data
    err = data["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["param"] == param
    if code is not None:
        assert err["code"] == code
    return err


def _chat_body(content: str, **kw: Any) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": content}], **kw}).encode()


def _request_head(path: str, length: int) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _read_response(sock: socket.socket) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of one HTTP/1.1 response read from ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {data!r}"
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(x.split(":")[1]) for x in lines if x.lower().startswith("content-length"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk
        rest += chunk
    return status, json.loads(rest[:length])


def _wait_idle(server: Server, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        h = server.health()
        if h["slots_processing"] == 0 and h.get("requests_waiting", 0) == 0:
            return
        time.sleep(0.2)
    pytest.fail(f"slots still busy after {within_s} s: {server.health()}")


def test_a_body_over_the_limit_is_413(server: Server) -> None:
    size = 33 << 20  # the server takes 32 MiB
    with socket.create_connection((HOST, server.port), timeout=60) as sock:
        sock.sendall(_request_head("/v1/chat/completions", size))

        def send_body() -> None:
            try:
                for _ in range(size >> 20):
                    sock.sendall(b" " * (1 << 20))
            except OSError:
                pass  # the server answered and stopped reading

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        status, data = _read_response(sock)
    assert status == 413
    _assert_openai_error(data)
    assert server.health()["status"] == "ok"


def test_a_prompt_longer_than_the_context_is_400(server: Server) -> None:
    status, data = server.raw("POST", "/v1/chat/completions", _chat_body("word " * N_CTX))
    assert status == 400
    _assert_openai_error(data, "messages", "context_length_exceeded")
    status, data = server.raw(
        "POST", "/v1/completions", json.dumps({"prompt": "word " * N_CTX}).encode()
    )
    assert status == 400
    _assert_openai_error(data, "prompt", "context_length_exceeded")


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_past_the_context_is_400(server: Server, field: str) -> None:
    # A few prompt tokens plus max_tokens just under the context: over by the prompt.
    status, data = server.raw(
        "POST", "/v1/chat/completions", _chat_body("Hello there", **{field: N_CTX - 2})
    )
    assert status == 400
    err = _assert_openai_error(data, field, "context_length_exceeded")
    assert str(N_CTX) in err["message"]
    # The same prompt with a max_tokens that fits runs.
    status, data = server.raw(
        "POST", "/v1/chat/completions", _chat_body("Hello there", **{field: 2})
    )
    assert status == 200, data


def _open_stream(server: Server, n_tokens: int) -> socket.socket:
    """A streaming chat request that generates ``n_tokens``; its response is left unread."""
    body = _chat_body("Count", stream=True, max_tokens=n_tokens, ignore_eos=True, temperature=0)
    sock = socket.create_connection((HOST, server.port), timeout=60)
    sock.sendall(_request_head("/v1/chat/completions", len(body)) + body)
    return sock


def test_requests_beyond_the_limit_get_429_with_retry_after(server: Server) -> None:
    # One slot and --max-concurrent-requests 2: one running, one waiting, the third refused.
    socks = [_open_stream(server, 200) for _ in range(2)]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            h = server.health()
            if h["slots_processing"] == 1 and h["requests_waiting"] == 1:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"the two requests did not get in: {server.health()}")
        status, headers, data = server.raw_with_headers(
            "POST", "/v1/chat/completions", _chat_body("Hi", max_tokens=2)
        )
        assert status == 429
        assert headers.get("Retry-After") == "1"
        _assert_openai_error(data, None, "too_many_requests")
    finally:
        for s in socks:
            s.close()
    _wait_idle(server, 30)
    status, data = server.raw("POST", "/v1/chat/completions", _chat_body("Hi", max_tokens=2))
    assert status == 200, data


def test_a_body_that_never_arrives_is_408_after_the_timeout(server: Server) -> None:
    body = _chat_body("Hi", max_tokens=2)
    with socket.create_connection((HOST, server.port), timeout=30) as sock:
        sock.sendall(_request_head("/v1/chat/completions", len(body)) + body[:10])
        t0 = time.monotonic()
        status, data = _read_response(sock)
        waited = time.monotonic() - t0
    assert status == 408
    _assert_openai_error(data, None, "request_timeout")
    assert TIMEOUT_S * 0.9 <= waited < TIMEOUT_S + 10
    assert server.health()["status"] == "ok"


def test_a_client_that_never_reads_its_stream_does_not_keep_its_slot(server: Server) -> None:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect((HOST, server.port))
    body = _chat_body("Count", stream=True, max_tokens=200, ignore_eos=True, temperature=0)
    try:
        sock.sendall(_request_head("/v1/chat/completions", len(body)) + body)
        deadline = time.monotonic() + 30
        while server.health()["slots_processing"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        # The slot is freed while the connection stays open and unread.
        _wait_idle(server, 120)
        status, data = server.raw("POST", "/v1/chat/completions", _chat_body("Hi", max_tokens=2))
        assert status == 200, data
    finally:
        sock.close()


MODEL_ENDPOINTS = [
    ("POST", "/v1/chat/completions", _chat_body("Hi", max_tokens=1)),
    ("POST", "/chat/completions", _chat_body("Hi", max_tokens=1)),
    ("POST", "/v1/completions", b'{"prompt": "Hi", "max_tokens": 1}'),
    ("POST", "/v1/messages", b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}'),
    ("POST", "/tokenize", b'{"content": "Hi"}'),
    ("POST", "/detokenize", b'{"tokens": [1]}'),
    ("GET", "/v1/models", None),
    ("GET", "/metrics", None),
]


@pytest.mark.parametrize(("method", "path", "body"), MODEL_ENDPOINTS, ids=lambda v: str(v))
def test_the_api_key_guards_every_endpoint_but_health(
    server: Server, method: str, path: str, body: bytes | None
) -> None:
    for key in (None, "wrong-key"):
        status, data = server.raw(method, path, body, key=key)
        assert status == 401, (key, data)
        if path == "/v1/messages":
            assert data["type"] == "error" and data["error"]["message"]
        else:
            _assert_openai_error(data, None, "invalid_api_key")
    status, _ = server.raw(method, path, body)
    assert status == 200
    assert server.raw("GET", "/health", key=None)[0] == 200
