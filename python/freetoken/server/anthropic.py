"""``POST /v1/messages``: the Anthropic Messages API over the same engine.

A request is translated into the equivalent OpenAI chat request (system prompt, text,
``tool_use`` and ``tool_result`` blocks, tools, sampling fields) and validated by the same
code; the reply is shaped as a ``message`` with ``thinking``, ``text`` and ``tool_use``
content blocks, or streamed as Anthropic's named SSE events. Errors use Anthropic's shape,
``{"type": "error", "error": {"type", "message"}}``.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from aiohttp import web

from freetoken.errors import RequestError
from freetoken.server import protocol as P
from freetoken.server.app import EventStream, open_stream, start_chat_job
from freetoken.server.scheduler import Job
from freetoken.server.toolcalls import OutputDelta, OutputParser, ToolCall

__all__ = ["collect", "messages", "stream", "to_chat_body"]

_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def _text_of(name: str, content: Any) -> str:
    """The text of a tool result: a string or a list of text blocks."""
    if isinstance(content, str):
        return content
    if content is None:
        return ""
    if isinstance(content, list):
        parts = []
        for j, b in enumerate(content):
            if (
                not isinstance(b, dict)
                or b.get("type") != "text"
                or not isinstance(b.get("text"), str)
            ):
                raise RequestError(f"'{name}[{j}]' must be a text block", param=name)
            parts.append(b["text"])
        return "".join(parts)
    raise P._type_error(name, "a string or a list of text blocks", content)


def _blocks(i: int, role: str, content: Any) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI messages (tool results become tool messages)."""
    name = f"messages[{i}].content"
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise P._type_error(name, "a string or a list of content blocks", content)
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, b in enumerate(content):
        bname = f"{name}[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text" and isinstance(b.get("text"), str):
            texts.append(b["text"])
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("name"), str) or not isinstance(b.get("input", {}), dict):
                raise RequestError(f"'{bname}' needs a name and an input object", param=bname)
            calls.append(
                {
                    "id": b.get("id") or f"toolu_{j}",
                    "type": "function",
                    "function": {"name": b["name"], "arguments": json.dumps(b.get("input", {}))},
                }
            )
        elif kind == "tool_result" and role == "user":
            results.append(
                {
                    "role": "tool",
                    "tool_call_id": str(b.get("tool_use_id", "")),
                    "content": _text_of(f"{bname}.content", b.get("content")),
                }
            )
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue  # earlier reasoning is not fed back
        elif kind in ("image", "document"):
            raise RequestError(
                f"'{bname}': content type '{kind}' is not supported (this model takes text)",
                param=bname,
                code="unsupported_content_type",
            )
        else:
            raise RequestError(
                f"'{bname}': invalid content block {kind!r} for role {role}", param=bname
            )
    out: list[dict[str, Any]] = list(results)
    if texts or calls or not results:
        msg: dict[str, Any] = {"role": role, "content": "".join(texts) if texts else None}
        if calls:
            msg["tool_calls"] = calls
        elif msg["content"] is None:
            msg["content"] = ""
        out.append(msg)
    return out


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The OpenAI chat request equivalent to an Anthropic Messages request."""
    if body.get("max_tokens") is None:
        raise RequestError("'max_tokens' is required", param="max_tokens")
    raw = body.get("messages")
    if not isinstance(raw, list):
        raise P._type_error("messages", "a list", raw)
    if not raw:
        raise RequestError("'messages' must not be empty", param="messages")
    msgs: list[dict[str, Any]] = []
    system = body.get("system")
    if system is not None:
        msgs.append({"role": "system", "content": _text_of("system", system)})
    for i, m in enumerate(raw):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in ("user", "assistant"):
            raise RequestError(
                f"'messages[{i}].role' must be user or assistant, got {role!r}",
                param=f"messages[{i}].role",
                code="invalid_role",
            )
        msgs += _blocks(i, role, m.get("content"))
    chat: dict[str, Any] = {"messages": msgs}
    for key in ("model", "max_tokens", "temperature", "top_p", "top_k", "stream", "seed"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if body.get("stop_sequences") is not None:
        chat["stop"] = body["stop_sequences"]
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise P._type_error("tools", "a list", tools)
        chat["tools"] = [
            {
                "type": "function",
                "function": {
                    "name": t.get("name"),
                    "description": t.get("description", ""),
                    "parameters": t.get("input_schema", {}),
                },
            }
            if isinstance(t, dict)
            else t
            for t in tools
        ]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        kind = choice.get("type")
        mapped = {"auto": "auto", "any": "required", "none": "none"}.get(str(kind))
        if kind == "tool":
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.get("name")}}
        elif mapped is None:
            raise RequestError(f"'tool_choice.type' {kind!r} is not valid", param="tool_choice")
        else:
            chat["tool_choice"] = mapped
    elif choice is not None:
        raise P._type_error("tool_choice", "an object", choice)
    return chat


def _usage(job: Job) -> dict[str, int]:
    return {
        "input_tokens": job.prompt_tokens,
        "output_tokens": job.completion_tokens,
        "cache_read_input_tokens": job.cached_tokens,
    }


def _stop_reason(job: Job, reason: str, has_calls: bool) -> str:
    if has_calls and reason == "stop":
        return "tool_use"
    if job.stop_string is not None:
        return "stop_sequence"
    return _STOP_REASONS.get(reason, "end_turn")


def _tool_block(c: ToolCall) -> dict[str, Any]:
    return {"type": "tool_use", "id": c.id, "name": c.name, "input": json.loads(c.arguments)}


def _msg_id() -> str:
    return "msg_" + uuid.uuid4().hex[:24]


def _message(rid: str, model: str) -> dict[str, Any]:
    return {
        "id": rid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
    }


async def collect(job: Job, parser: OutputParser, model: str) -> dict[str, Any]:
    """Runs ``job`` to its end; returns the ``message`` object."""
    reasoning, text, calls, reason = "", "", [], "stop"
    async for ev in job.events():
        if ev.error is not None:
            raise (
                ev.error
                if isinstance(ev.error, RequestError)
                else RequestError(f"engine error: {ev.error}", status=500, err_type="server_error")
            )
        d = parser.feed(ev.text)
        if ev.finish_reason is not None:
            e = parser.finish()
            d = OutputDelta(
                d.reasoning + e.reasoning, d.content + e.content, d.tool_calls + e.tool_calls
            )
            reason = ev.finish_reason
        reasoning += d.reasoning
        text += d.content
        calls += d.tool_calls
    msg = _message(_msg_id(), model)
    if reasoning:
        msg["content"].append({"type": "thinking", "thinking": reasoning, "signature": ""})
    if text or not calls:
        msg["content"].append({"type": "text", "text": text})
    msg["content"] += [_tool_block(c) for c in calls]
    msg["stop_reason"] = _stop_reason(job, reason, bool(calls))
    msg["stop_sequence"] = job.stop_string
    msg["usage"] = _usage(job)
    return msg


class _Events:
    """Anthropic's streaming events, with content blocks opened and closed as needed."""

    def __init__(self, out: EventStream) -> None:
        self.out = out
        self.index = -1
        self.open: str | None = None  # type of the open block

    async def send(self, event: str, data: dict[str, Any]) -> None:
        payload = json.dumps({"type": event, **data}, ensure_ascii=False, separators=(",", ":"))
        await self.out.write(f"event: {event}\ndata: {payload}\n\n".encode())

    async def close_block(self) -> None:
        if self.open is not None:
            await self.send("content_block_stop", {"index": self.index})
            self.open = None

    async def block(self, kind: str, start: dict[str, Any]) -> None:
        if self.open == kind and kind != "tool_use":
            return
        await self.close_block()
        self.index += 1
        self.open = kind
        await self.send("content_block_start", {"index": self.index, "content_block": start})

    async def delta(self, kind: str, delta: dict[str, Any]) -> None:
        start: dict[str, Any] = (
            {"type": "thinking", "thinking": "", "signature": ""}
            if kind == "thinking"
            else {"type": "text", "text": ""}
        )
        await self.block(kind, start)
        await self.send("content_block_delta", {"index": self.index, "delta": delta})


async def stream(
    request: web.Request, job: Job, parser: OutputParser, model: str
) -> web.StreamResponse:
    """Streams ``job`` as Anthropic SSE events."""
    out = await open_stream(request)
    resp = out.resp
    ev_out = _Events(out)
    msg = _message(_msg_id(), model)
    msg["usage"] = {"input_tokens": job.prompt_tokens, "output_tokens": 0}
    await ev_out.send("message_start", {"message": msg})
    n_calls = 0
    async for ev in job.events():
        if ev.error is not None:
            err = ev.error if isinstance(ev.error, RequestError) else RequestError(str(ev.error))
            await ev_out.send("error", {"error": P.anthropic_error_body(err)["error"]})
            return resp
        d = parser.feed(ev.text)
        if ev.finish_reason is not None:
            e = parser.finish()
            d = OutputDelta(
                d.reasoning + e.reasoning, d.content + e.content, d.tool_calls + e.tool_calls
            )
        if d.reasoning:
            await ev_out.delta("thinking", {"type": "thinking_delta", "thinking": d.reasoning})
        if d.content:
            await ev_out.delta("text", {"type": "text_delta", "text": d.content})
        for c in d.tool_calls:
            n_calls += 1
            await ev_out.block("tool_use", {**_tool_block(c), "input": {}})
            await ev_out.send(
                "content_block_delta",
                {
                    "index": ev_out.index,
                    "delta": {"type": "input_json_delta", "partial_json": c.arguments},
                },
            )
        if ev.finish_reason is not None:
            if ev_out.index < 0:  # an empty reply still has one (empty) text block
                await ev_out.block("text", {"type": "text", "text": ""})
            await ev_out.close_block()
            await ev_out.send(
                "message_delta",
                {
                    "delta": {
                        "stop_reason": _stop_reason(job, ev.finish_reason, n_calls > 0),
                        "stop_sequence": job.stop_string,
                    },
                    "usage": _usage(job),
                },
            )
            await ev_out.send("message_stop", {})
    return resp


async def messages(request: web.Request) -> web.StreamResponse:
    """``POST /v1/messages``."""
    st, job, parser, req = await start_chat_job(request, to_chat_body)
    try:
        if req.sampling.stream:
            return await stream(request, job, parser, st.cfg.alias)
        return web.json_response(await collect(job, parser, st.cfg.alias))
    finally:
        st.scheduler.cancel(job)
