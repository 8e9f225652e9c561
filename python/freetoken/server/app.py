"""The aiohttp handlers of the OpenAI and llama.cpp endpoints, the API key check, OpenAI-shaped
errors, SSE streaming (server/routes.py puts them and Anthropic's on one application).

Handlers only validate, hand tokenization to a worker thread and await the scheduler's
events, so the event loop never runs model compute. The server runs with handler
cancellation on: a client that disconnects cancels its handler, whose ``finally`` cancels
the job and so frees its KV slot.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import json
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from aiohttp import web

from freetoken.errors import FreeTokenError, RequestError
from freetoken.server import protocol as P
from freetoken.server.metrics import ServerMetrics
from freetoken.server.prompt import render_chat, starts_in_reasoning
from freetoken.server.scheduler import GenerationRequest, Job, Scheduler, TokenLogprob
from freetoken.server.toolcalls import OutputDelta, OutputParser

__all__ = [
    "STATE",
    "EventStream",
    "ServerConfig",
    "ServerState",
    "auth_middleware",
    "errors_middleware",
    "open_stream",
    "serve",
    "start_chat_job",
]

log = logging.getLogger("freetoken.server")
T = TypeVar("T")

#: Paths answered without an API key (load balancers probe them).
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})
MAX_BODY = 32 << 20
SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",
}


class ServerTokenizer(Protocol):
    """What the handlers need of the tokenizer (``freetoken.tokenizer.Tokenizer``)."""

    eog_ids: Any

    def encode(
        self, text: str, add_special: bool = True, parse_special: bool = True
    ) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_to_piece(self, token: int) -> bytes: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...


@dataclass
class ServerConfig:
    """What the handlers need to know besides the engine."""

    alias: str
    model_names: frozenset[str]
    n_ctx: int
    vocab_size: int
    api_key: str | None = None
    chat_template: str | None = None
    created: int = 0
    timeout: float = 600.0
    """Seconds a client may take to send its body, or to take one streamed event."""


class ServerState:
    """Everything a handler reaches through ``request.app``."""

    def __init__(
        self,
        scheduler: Scheduler,
        tokenizer: ServerTokenizer,
        cfg: ServerConfig,
        metrics: ServerMetrics,
    ) -> None:
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.metrics = metrics
        # One worker: tokenizing and template rendering stay off the loop and in order.
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="freetoken-tokenize")

    async def offload(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Runs ``fn`` on the worker thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    def check_model(self, body: dict[str, Any]) -> None:
        """404 for a ``model`` that is not this server's (absent means the loaded one)."""
        name = body.get("model")
        if name is None:
            return
        if not isinstance(name, str):
            raise P._type_error("model", "a string", name)
        if name not in self.cfg.model_names:
            raise RequestError(
                f"the model '{name}' does not exist; this server has '{self.cfg.alias}'",
                status=404,
                param="model",
                code="model_not_found",
            )

    def status(self) -> dict[str, float]:
        """Slot and cache figures for /health and the gauges."""
        s = self.scheduler
        busy, idle, cap = s.kv_tokens()
        return {
            "requests_waiting": s.n_waiting,
            "requests_running": s.n_running,
            "slots_total": len(s.slots),
            "kv_cache_tokens_used": busy,
            "kv_cache_tokens_cached": idle,
            "kv_cache_tokens_capacity": cap,
            "kv_cache_usage_ratio": busy / cap if cap else 0.0,
        }


STATE = web.AppKey("freetoken_state", ServerState)


def _state(request: web.Request) -> ServerState:
    return request.app[STATE]


def _as_request_error(e: BaseException) -> RequestError:
    if isinstance(e, RequestError):
        return e
    if isinstance(e, FreeTokenError):
        return RequestError(str(e))
    return RequestError(f"internal error: {e}", status=500, err_type="server_error")


def error_response(err: RequestError, anthropic: bool = False) -> web.Response:
    """``err`` as an OpenAI error response (Anthropic's shape for its endpoint); a 429 says
    when to retry."""
    body = P.anthropic_error_body(err) if anthropic else P.error_body(err)
    resp = web.json_response(body, status=err.status)
    if err.status == 429:
        resp.headers["Retry-After"] = "1"
    return resp


_HTTP_TYPES = {401: "authentication_error", 404: "not_found_error"}


@web.middleware
async def errors_middleware(
    request: web.Request, handler: Callable[..., Any]
) -> web.StreamResponse:
    """Turns a handler's errors into JSON error responses (OpenAI's shape, Anthropic's on
    ``/v1/messages``) and counts each request and its time."""
    t0 = time.perf_counter()
    err: RequestError | None = None
    try:
        resp = await handler(request)
    except RequestError as e:
        err = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        err_type = _HTTP_TYPES.get(e.status, "invalid_request_error")
        err = RequestError(e.text or e.reason, status=e.status, err_type=err_type)
    except FreeTokenError as e:
        err = RequestError(str(e))
    except ClientGoneError as e:
        log.info("%s %s: the client went away mid-stream", request.method, request.path)
        return e.resp
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception as e:
        log.exception("unhandled error in %s", request.path)
        err = _as_request_error(e)
    if err is not None:
        resp = error_response(err, anthropic=request.path.endswith("/messages"))
    route = request.match_info.route.resource
    endpoint = route.canonical if route is not None else "other"
    _state(request).metrics.requests.inc(endpoint=endpoint, status=str(resp.status))
    log.info(
        "%s %s %d %.3fs%s",
        request.method,
        request.path,
        resp.status,
        time.perf_counter() - t0,
        f" ({err.message})" if err is not None else "",
    )
    return resp


@web.middleware
async def auth_middleware(request: web.Request, handler: Callable[..., Any]) -> web.StreamResponse:
    """With ``--api-key``, a 401 unless the request carries the key (``Authorization: Bearer``
    or ``x-api-key``); the public paths pass."""
    key = _state(request).cfg.api_key
    if key and request.path not in PUBLIC_PATHS:
        auth = request.headers.get("Authorization", "")
        got = (
            auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key")
        )
        if not got:
            raise RequestError(
                "missing API key: send 'Authorization: Bearer <key>'",
                status=401,
                code="invalid_api_key",
            )
        if not hmac.compare_digest(got.encode(), key.encode()):
            raise RequestError("invalid API key", status=401, code="invalid_api_key")
    return await handler(request)


#: Bodies larger than this are parsed on the worker thread, not the loop.
BIG_BODY = 1 << 20


async def _body(request: web.Request) -> dict[str, Any]:
    timeout = _state(request).cfg.timeout
    try:
        raw = await asyncio.wait_for(request.read(), timeout)
    except TimeoutError:
        raise RequestError(
            f"the request body did not arrive within {timeout:g} s",
            status=408,
            code="request_timeout",
        ) from None
    if len(raw) > BIG_BODY:
        return await _state(request).offload(P.parse_json_body, raw)
    return P.parse_json_body(raw)


class ClientGoneError(Exception):
    """The client of a started stream went away, or took none of an event within the timeout:
    the handler unwinds (its ``finally`` cancels the job, which frees the slot) and the
    middleware ends the response quietly."""

    def __init__(self, resp: web.StreamResponse) -> None:
        super().__init__("the client went away")
        self.resp = resp


class EventStream:
    """A prepared event-stream response; a write to a client that is gone, or that takes
    nothing within the timeout, raises :class:`ClientGoneError`."""

    def __init__(self, resp: web.StreamResponse, path: str, timeout: float) -> None:
        self.resp, self._path, self._timeout = resp, path, timeout

    async def write(self, data: bytes) -> None:
        try:
            await asyncio.wait_for(self.resp.write(data), self._timeout)
        except TimeoutError:
            log.info("%s: the client took nothing for %g s; dropped", self._path, self._timeout)
            raise ClientGoneError(self.resp) from None
        except ConnectionResetError:
            raise ClientGoneError(self.resp) from None

    async def send(self, obj: dict[str, Any]) -> None:
        """One OpenAI ``data:`` event."""
        data = json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
        await self.write(f"data: {data}\n\n".encode())

    async def done(self) -> None:
        await self.write(b"data: [DONE]\n\n")


async def open_stream(request: web.Request) -> EventStream:
    """Starts the event-stream response of ``request``."""
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    return EventStream(resp, request.path, _state(request).cfg.timeout)


# -- chat --------------------------------------------------------------------------------


def _merge(a: OutputDelta, b: OutputDelta) -> OutputDelta:
    return OutputDelta(
        a.reasoning + b.reasoning, a.content + b.content, a.tool_calls + b.tool_calls
    )


async def start_chat_job(
    request: web.Request,
    transform: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[ServerState, Job, OutputParser, P.ChatRequest]:
    """Validates a chat request (``transform`` maps another API's body to OpenAI's first),
    renders and tokenizes it off the loop and submits it; returns the job and the parser its
    output goes through."""
    st = _state(request)
    body = await _body(request)
    if transform is not None:
        body = transform(body)
    st.check_model(body)
    req = P.parse_chat(body, st.cfg.n_ctx)
    text = await st.offload(
        render_chat, st.tokenizer, st.cfg.chat_template, req.messages, req.tools, req.tool_choice
    )
    ids = await st.offload(st.tokenizer.encode, text, add_special=False, parse_special=True)
    job = _submit(st, ids, "messages", req.sampling, req.logprobs)
    parser = OutputParser(
        reasoning=req.reasoning,
        start_in_reasoning=starts_in_reasoning(text),
        tools=req.tool_names,
    )
    return st, job, parser, req


async def chat_completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/chat/completions``."""
    st, job, parser, req = await start_chat_job(request)
    try:
        if req.sampling.stream:
            return await _stream_chat(request, st, job, parser, req)
        return web.json_response(await _collect_chat(st, job, parser, req))
    finally:
        st.scheduler.cancel(job)  # no-op once finished; frees the slot if the client left


async def _collect_chat(
    st: ServerState, job: Job, parser: OutputParser, req: P.ChatRequest
) -> dict[str, Any]:
    r = P.ChatResult()
    async for ev in job.events():
        if ev.error is not None:
            raise _as_request_error(ev.error)
        d = parser.feed(ev.text)
        if ev.finish_reason is not None:
            d = _merge(d, parser.finish())
            r.finish_reason = ev.finish_reason
        r.content += d.content
        r.reasoning += d.reasoning
        r.tool_calls += d.tool_calls
        r.logprobs += ev.logprobs
    return P.chat_response(
        P.new_id("chatcmpl"), st.cfg.alias, P.now(), r, job, req.logprobs is not None
    )


async def _stream_chat(
    request: web.Request, st: ServerState, job: Job, parser: OutputParser, req: P.ChatRequest
) -> web.StreamResponse:
    sse = await open_stream(request)
    rid, created, model = P.new_id("chatcmpl"), P.now(), st.cfg.alias
    with_lp = req.logprobs is not None
    n_calls, first = 0, True
    pending: list[TokenLogprob] = []

    def lp() -> dict[str, Any] | None:
        if not with_lp or not pending:
            return None
        out = P.chat_logprobs(pending)
        pending.clear()
        return out

    async for ev in job.events():
        if ev.error is not None:
            await sse.send(P.error_body(_as_request_error(ev.error)))
            break
        d = parser.feed(ev.text)
        if ev.finish_reason is not None:
            d = _merge(d, parser.finish())
        pending += ev.logprobs
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if d.reasoning:
            delta["reasoning_content"] = d.reasoning
        if d.content:
            delta["content"] = d.content
        if d.tool_calls:
            delta["tool_calls"] = [c.to_openai(n_calls + i) for i, c in enumerate(d.tool_calls)]
            n_calls += len(d.tool_calls)
        if delta:
            await sse.send(P.chat_chunk(rid, model, created, delta, logprobs=lp()))
            first = False
        if ev.finish_reason is not None:
            usage = P.usage(job)
            reason = P.finish_reason(ev.finish_reason, n_calls > 0)
            await sse.send(
                P.chat_chunk(rid, model, created, {}, finish=reason, logprobs=lp(), usage_obj=usage)
            )
            if req.sampling.include_usage:
                await sse.send(P.chat_chunk(rid, model, created, None, usage_obj=usage))
    await sse.done()
    return sse.resp


# -- text completions ----------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    """``POST /v1/completions``."""
    st = _state(request)
    body = await _body(request)
    st.check_model(body)
    req = P.parse_completion(body, st.cfg.n_ctx)
    if isinstance(req.prompt, str):
        ids = await st.offload(
            st.tokenizer.encode, req.prompt, add_special=True, parse_special=True
        )
        prompt_text = req.prompt
    else:
        ids = req.prompt
        _check_ids(ids, st.cfg.vocab_size, "prompt")
        prompt_text = await st.offload(st.tokenizer.decode, ids) if req.echo else ""
    job = _submit(st, ids, "prompt", req.sampling, req.logprobs)
    echo = prompt_text if req.echo else ""
    try:
        if req.sampling.stream:
            return await _stream_completion(request, st, job, req, echo)
        text, reason, entries = echo, "stop", []
        async for ev in job.events():
            if ev.error is not None:
                raise _as_request_error(ev.error)
            text += ev.text
            entries += ev.logprobs
            reason = ev.finish_reason or reason
        lps = P.completion_logprobs(entries, len(echo)) if req.logprobs is not None else None
        rid = P.new_id("cmpl")
        return web.json_response(
            P.completion_response(rid, st.cfg.alias, P.now(), text, reason, lps, job)
        )
    finally:
        st.scheduler.cancel(job)


async def _stream_completion(
    request: web.Request, st: ServerState, job: Job, req: P.CompletionRequest, echo: str
) -> web.StreamResponse:
    sse = await open_stream(request)
    rid, created, model = P.new_id("cmpl"), P.now(), st.cfg.alias
    offset = 0
    if echo:
        await sse.send(P.completion_chunk(rid, model, created, echo))
        offset = len(echo)
    async for ev in job.events():
        if ev.error is not None:
            await sse.send(P.error_body(_as_request_error(ev.error)))
            break
        lps = None
        if req.logprobs is not None and ev.logprobs:
            lps = P.completion_logprobs(ev.logprobs, offset)
        offset += len(ev.text)
        if ev.finish_reason is None:
            if ev.text or lps:
                await sse.send(P.completion_chunk(rid, model, created, ev.text, logprobs=lps))
            continue
        usage = P.usage(job)
        await sse.send(
            P.completion_chunk(
                rid, model, created, ev.text, finish=ev.finish_reason, logprobs=lps, usage_obj=usage
            )
        )
        if req.sampling.include_usage:
            await sse.send(P.completion_chunk(rid, model, created, None, usage_obj=usage))
    await sse.done()
    return sse.resp


# -- small endpoints -----------------------------------------------------------------------


def _submit(
    st: ServerState, ids: list[int], param: str, s: P.SamplingFields, logprobs: int | None
) -> Job:
    """Checks that the prompt fits and hands the request to the scheduler."""
    _check_fits(ids, st.cfg.n_ctx, param, s)
    return st.scheduler.submit(
        GenerationRequest(
            ids, s.max_tokens, s.params, s.stop, logprobs, s.ignore_eos, s.cache_prompt, s.draft
        )
    )


def _check_fits(ids: list[int], n_ctx: int, param: str, sampling: P.SamplingFields) -> None:
    """The prompt, and the prompt with a ``max_tokens`` the request set, must fit the context
    (vLLM's rule; a default ``max_tokens`` stops at the context's end instead)."""
    if len(ids) >= n_ctx:
        raise RequestError(
            f"the prompt has {len(ids)} tokens; the context size per request is {n_ctx} "
            "(the prompt must leave room for at least one generated token)",
            param=param,
            code="context_length_exceeded",
        )
    field, n = sampling.max_tokens_field, sampling.max_tokens
    if field is not None and len(ids) + n > n_ctx:
        raise RequestError(
            f"the context size per request is {n_ctx} tokens; the request asks for "
            f"{len(ids) + n} ({len(ids)} in the prompt, {n} to generate)",
            param=field,
            code="context_length_exceeded",
        )


def _check_ids(ids: Any, vocab: int, name: str) -> list[int]:
    if not isinstance(ids, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in ids
    ):
        raise P._type_error(name, "a list of integer token ids", ids)
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"token id {bad} is outside [0, {vocab})", param=name)
    return ids


async def models(request: web.Request) -> web.Response:
    """``GET /v1/models``: the one loaded model."""
    cfg = _state(request).cfg
    entry = {
        "id": cfg.alias,
        "object": "model",
        "created": cfg.created,
        "owned_by": "freetoken",
        "meta": {"n_ctx": cfg.n_ctx, "n_vocab": cfg.vocab_size},
    }
    return web.json_response({"object": "list", "data": [entry]})


async def tokenize(request: web.Request) -> web.Response:
    """``POST /tokenize``: ``{"content", "add_special"?, "parse_special"?, "with_pieces"?}``."""
    st = _state(request)
    body = await _body(request)
    content = P._str(body, "content")
    if content is None:
        raise RequestError("'content' is required", param="content")
    add_special = P._bool(body, "add_special", False)
    parse_special = P._bool(body, "parse_special", True)
    with_pieces = P._bool(body, "with_pieces")

    def work() -> list[Any]:
        ids = st.tokenizer.encode(content, add_special=add_special, parse_special=parse_special)
        if not with_pieces:
            return ids
        piece = st.tokenizer.token_to_piece
        return [{"id": t, "piece": piece(t).decode("utf-8", errors="replace")} for t in ids]

    return web.json_response({"tokens": await st.offload(work)})


async def detokenize(request: web.Request) -> web.Response:
    """``POST /detokenize``: ``{"tokens": [ids]}`` to ``{"content"}``."""
    st = _state(request)
    body = await _body(request)
    ids = _check_ids(body.get("tokens"), st.cfg.vocab_size, "tokens")
    return web.json_response({"content": await st.offload(st.tokenizer.decode, ids)})


async def health(request: web.Request) -> web.Response:
    """``GET /health``: ok, with slot counts."""
    s = _state(request).status()
    n_slots, running = int(s["slots_total"]), int(s["requests_running"])
    return web.json_response(
        {
            "status": "ok",
            "slots_idle": n_slots - running,
            "slots_processing": running,
            "requests_waiting": int(s["requests_waiting"]),
        }
    )


async def metrics(request: web.Request) -> web.Response:
    """``GET /metrics``: Prometheus text."""
    text = _state(request).metrics.render()
    return web.Response(text=text, content_type="text/plain", charset="utf-8")


async def serve(
    app: web.Application,
    host: str,
    port: int,
    stop: asyncio.Event,
    on_ready: Callable[[str, int], None] | None = None,
) -> None:
    """Serves ``app`` on ``host:port`` until ``stop`` is set."""
    # Handlers still running at shutdown are cancelled after 5 s, which cancels their jobs.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port, reuse_address=os.name != "nt")
        await site.start()
        bound = runner.addresses[0]
        if on_ready is not None:
            on_ready(str(bound[0]), int(bound[1]))
        await stop.wait()
    finally:
        await runner.cleanup()
