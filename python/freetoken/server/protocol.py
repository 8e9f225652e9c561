"""OpenAI request validation and response shapes.

Every check raises :class:`~freetoken.errors.RequestError` naming the offending field, which
the app answers as ``{"error": {"message", "type", "param", "code"}}`` with a 4xx status.
Fields are type-checked strictly (``true`` is not a number, ``"5"`` is not an integer);
``null`` means "not given", as the OpenAI API treats it.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, overload

from freetoken.errors import FreeTokenError, RequestError
from freetoken.runtime.sampler import SamplingParams
from freetoken.server.scheduler import Job, TokenLogprob
from freetoken.server.toolcalls import ToolCall

__all__ = [
    "ChatRequest",
    "CompletionRequest",
    "SamplingFields",
    "anthropic_error_body",
    "chat_chunk",
    "chat_logprobs",
    "chat_response",
    "completion_chunk",
    "completion_logprobs",
    "completion_response",
    "error_body",
    "parse_chat",
    "parse_completion",
    "parse_json_body",
    "usage",
]

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16
MAX_TOP_LOGPROBS = 20
_TOOL_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_UNSUPPORTED_PARTS = ("image_url", "input_audio", "file", "image", "audio")


# -- body parsing --------------------------------------------------------------------------


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def parse_json_body(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object; 400 for invalid UTF-8, bad JSON or a non-object."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RequestError(
            f"the request body is not valid UTF-8 (byte {e.start})", code="invalid_utf8"
        ) from None
    if not text.strip():
        raise RequestError("the request body is empty; send a JSON object", code="invalid_json")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except ValueError as e:
        raise RequestError(
            f"the request body is not valid JSON: {e}", code="invalid_json"
        ) from None
    if not isinstance(body, dict):
        raise RequestError(
            f"the request body must be a JSON object, got {type(body).__name__}",
            code="invalid_json",
        )
    return body


def _type_error(name: str, want: str, value: Any) -> RequestError:
    got = "null" if value is None else type(value).__name__
    return RequestError(f"'{name}' must be {want}, got {got}", param=name, code="invalid_type")


def _check_text(name: str, s: str) -> str:
    # JSON \ud800-style escapes give lone surrogates, which no tokenizer can encode.
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(
            f"'{name}' contains an unpaired UTF-16 surrogate", param=name, code="invalid_utf8"
        ) from None
    return s


@overload
def _int(body: dict[str, Any], name: str, default: int) -> int: ...
@overload
def _int(body: dict[str, Any], name: str, default: None = None) -> int | None: ...
def _int(body: dict[str, Any], name: str, default: int | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        # JSON has one number type: accept 5.0 as 5, reject 5.5.
        if isinstance(v, float) and v.is_integer():
            return int(v)
        raise _type_error(name, "an integer", v)
    return v


@overload
def _num(body: dict[str, Any], name: str, default: float) -> float: ...
@overload
def _num(body: dict[str, Any], name: str, default: None = None) -> float | None: ...
def _num(body: dict[str, Any], name: str, default: float | None = None) -> float | None:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise _type_error(name, "a finite number", v)
    return float(v)


def _bool(body: dict[str, Any], name: str, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _type_error(name, "a boolean", v)
    return v


def _str(body: dict[str, Any], name: str) -> str | None:
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, str):
        raise _type_error(name, "a string", v)
    return _check_text(name, v)


def _range(name: str, v: float | None, lo: float, hi: float) -> None:
    if v is not None and not lo <= v <= hi:
        raise RequestError(f"'{name}' must be in [{lo:g}, {hi:g}], got {v:g}", param=name)


# -- sampling fields shared by both endpoints ----------------------------------------------


@dataclass
class SamplingFields:
    """The generation options common to chat and text completions."""

    max_tokens: int
    params: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    ignore_eos: bool
    cache_prompt: bool = True
    max_tokens_field: str | None = None
    draft: dict[str, float] | None = None
    """The request's ``speculative.n_max`` / ``n_min`` / ``p_min`` (llama.cpp's fields), as
    given; the scheduler checks them against the server's settings."""
    """The request field that set ``max_tokens``; None when it is the endpoint's default."""


def _parse_sampling(body: dict[str, Any], n_ctx: int, default_max: int) -> SamplingFields:
    n = _int(body, "n", 1)
    if n != 1:
        raise RequestError(f"'n' must be 1 (one choice per request), got {n}", param="n")
    best_of = _int(body, "best_of", 1)
    if best_of != 1:
        raise RequestError("'best_of' must be 1", param="best_of")

    name = (
        "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    )
    max_tokens = _int(body, name, default_max)
    assert max_tokens is not None
    if max_tokens < 1:
        raise RequestError(f"'{name}' must be at least 1, got {max_tokens}", param=name)
    if max_tokens > n_ctx:
        raise RequestError(
            f"'{name}' is {max_tokens}, more than the context size per request ({n_ctx})",
            param=name,
        )

    temperature = _num(body, "temperature", 0.8)
    _range("temperature", temperature, 0.0, 100.0)
    top_p = _num(body, "top_p", 0.95)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise RequestError(f"'top_p' must be in (0, 1], got {top_p:g}", param="top_p")
    top_k = _int(body, "top_k", 40)
    _range("top_k", top_k, 0, 1 << 31)
    min_p = _num(body, "min_p", 0.05)
    _range("min_p", min_p, 0.0, 1.0)
    presence = _num(body, "presence_penalty", 0.0)
    _range("presence_penalty", presence, -2.0, 2.0)
    frequency = _num(body, "frequency_penalty", 0.0)
    _range("frequency_penalty", frequency, -2.0, 2.0)
    repeat_penalty = _num(body, "repeat_penalty", 1.0)
    if repeat_penalty is not None and not 0.0 < repeat_penalty <= 100.0:
        raise RequestError("'repeat_penalty' must be in (0, 100]", param="repeat_penalty")
    repeat_last_n = _int(body, "repeat_last_n", 64)
    _range("repeat_last_n", repeat_last_n, 0, n_ctx)
    seed = _int(body, "seed")
    if seed is not None and seed != -1 and not 0 <= seed < 2**64:
        raise RequestError(f"'seed' must be in [0, 2**64) or -1, got {seed}", param="seed")
    try:
        params = SamplingParams(
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            repeat_penalty=repeat_penalty,
            repeat_last_n=repeat_last_n,
            presence_penalty=presence,
            frequency_penalty=frequency,
            seed=seed,
        )
    except FreeTokenError as e:
        raise RequestError(str(e)) from None

    stop = body.get("stop")
    if stop is None:
        stops: list[str] = []
    elif isinstance(stop, str):
        stops = [_check_text("stop", stop)]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = [_check_text("stop", s) for s in stop]
    else:
        raise _type_error("stop", "a string or a list of strings", stop)
    if len(stops) > MAX_STOP:
        raise RequestError(f"at most {MAX_STOP} stop sequences", param="stop")

    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    include_usage = False
    if opts is not None:
        if not isinstance(opts, dict):
            raise _type_error("stream_options", "an object", opts)
        include_usage = _bool(opts, "include_usage")
    return SamplingFields(
        max_tokens=max_tokens,
        max_tokens_field=name if body.get(name) is not None else None,
        params=params,
        stop=stops,
        stream=stream,
        include_usage=include_usage,
        ignore_eos=_bool(body, "ignore_eos"),
        cache_prompt=_bool(body, "cache_prompt", True),
        draft=_draft_fields(body),
    )


def _draft_fields(body: dict[str, Any]) -> dict[str, float] | None:
    out: dict[str, float] = {}
    for key in ("n_max", "n_min"):
        v = _int(body, f"speculative.{key}")
        if v is not None:
            out[key] = v
    p_min = _num(body, "speculative.p_min")
    if p_min is not None:
        out["p_min"] = p_min
    return out or None


def _check_response_format(body: dict[str, Any]) -> None:
    rf = body.get("response_format")
    if rf is None:
        return
    if not isinstance(rf, dict):
        raise _type_error("response_format", "an object", rf)
    if rf.get("type", "text") != "text":
        raise RequestError(
            f"response_format type {rf.get('type')!r} is not supported (no constrained decoding)",
            param="response_format",
            code="unsupported",
        )


# -- chat ------------------------------------------------------------------------------------


@dataclass
class ChatRequest:
    """A validated ``/v1/chat/completions`` request."""

    messages: list[dict[str, Any]]
    sampling: SamplingFields
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] = "auto"
    logprobs: int | None = None
    reasoning: bool = True

    @property
    def tool_names(self) -> list[str] | None:
        """Names of the tools whose calls are parsed, or None to parse none."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [t["function"]["name"] for t in self.tools]


def _content(i: int, m: dict[str, Any], role: str) -> str | None:
    name = f"messages[{i}].content"
    c = m.get("content")
    if c is None:
        if role == "assistant":
            return None
        raise RequestError(f"'{name}' is required for role '{role}'", param=name)
    if isinstance(c, str):
        return _check_text(name, c)
    if not isinstance(c, list):
        raise _type_error(name, "a string or a list of content parts", c)
    texts = []
    for j, part in enumerate(c):
        pname = f"{name}[{j}]"
        if not isinstance(part, dict):
            raise _type_error(pname, "an object", part)
        kind = part.get("type")
        if kind in _UNSUPPORTED_PARTS:
            raise RequestError(
                f"'{pname}': content type '{kind}' is not supported (this model takes text)",
                param=pname,
                code="unsupported_content_type",
            )
        if kind != "text":
            raise RequestError(
                f"'{pname}.type' must be 'text', got {kind!r}",
                param=pname,
                code="invalid_content_type",
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise _type_error(f"{pname}.text", "a string", text)
        texts.append(_check_text(pname, text))
    return "".join(texts)


def _tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    name = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise _type_error(name, "a list", calls)
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"'{name}[{j}]' must have a function with a name", param=name)
        args: Any = fn.get("arguments", "{}")
        if isinstance(args, str):
            # Templates expect the arguments as a mapping (Hugging Face's convention).
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise RequestError(
                    f"'{name}[{j}].function.arguments' is not valid JSON", param=name
                ) from None
        out.append(
            {
                "id": c.get("id") or f"call_{j}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def _messages(raw: Any) -> list[dict[str, Any]]:
    if raw is None:
        raise RequestError("'messages' is required", param="messages")
    if not isinstance(raw, list):
        raise _type_error("messages", "a list", raw)
    if not raw:
        raise RequestError("'messages' must not be empty", param="messages")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise _type_error(f"messages[{i}]", "an object", m)
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                f"'messages[{i}].role' must be one of {', '.join(ROLES)}; got {role!r}",
                param=f"messages[{i}].role",
                code="invalid_role",
            )
        msg: dict[str, Any] = {"role": "system" if role == "developer" else role}
        msg["content"] = _content(i, m, role)
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(i, m["tool_calls"])
        if role == "assistant" and msg["content"] is None and "tool_calls" not in msg:
            raise RequestError(
                f"'messages[{i}]': an assistant message needs content or tool_calls",
                param=f"messages[{i}].content",
            )
        for key in ("name", "tool_call_id"):
            v = m.get(key)
            if v is not None:
                if not isinstance(v, str):
                    raise _type_error(f"messages[{i}].{key}", "a string", v)
                msg[key] = v
        out.append(msg)
    return out


def _tools(body: dict[str, Any]) -> tuple[list[dict[str, Any]] | None, str | dict[str, Any]]:
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _type_error("tools", "a list", tools)
        for i, t in enumerate(tools):
            fn = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function":
                raise RequestError(f"'tools[{i}].type' must be 'function'", param=f"tools[{i}]")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise RequestError(f"'tools[{i}].function.name' is required", param=f"tools[{i}]")
            if not _TOOL_NAME.match(fn["name"]):
                raise RequestError(
                    f"'tools[{i}].function.name' must match {_TOOL_NAME.pattern}",
                    param=f"tools[{i}].function.name",
                )
            params = fn.get("parameters")
            if params is not None and not isinstance(params, dict):
                raise _type_error(f"tools[{i}].function.parameters", "an object", params)
        tools = tools or None
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(
                f"'tool_choice' must be none, auto, required or a function, got {choice!r}",
                param="tool_choice",
            )
    elif isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        known = [t["function"]["name"] for t in tools or []]
        if name not in known:
            raise RequestError(
                f"'tool_choice' names function {name!r}, which is not among the tools",
                param="tool_choice",
            )
    else:
        raise _type_error("tool_choice", "a string or an object", choice)
    if choice == "required" and not tools:
        raise RequestError("'tool_choice' is 'required' but no tools were given", param="tools")
    return tools, choice


def parse_chat(body: dict[str, Any], n_ctx: int) -> ChatRequest:
    """Validates a chat completions body (the model name is checked by the caller)."""
    messages = _messages(body.get("messages"))
    sampling = _parse_sampling(body, n_ctx, default_max=n_ctx)
    _check_response_format(body)
    tools, choice = _tools(body)
    logprobs = None
    if _bool(body, "logprobs"):
        logprobs = _int(body, "top_logprobs", 0)
        _range("top_logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
    elif body.get("top_logprobs") is not None:
        raise RequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    fmt = _str(body, "reasoning_format")
    if fmt not in (None, "auto", "none", "deepseek"):
        raise RequestError(
            "'reasoning_format' must be auto, deepseek or none", param="reasoning_format"
        )
    return ChatRequest(
        messages=messages,
        sampling=sampling,
        tools=tools,
        tool_choice=choice,
        logprobs=logprobs,
        reasoning=fmt != "none",
    )


# -- text completions ------------------------------------------------------------------------


@dataclass
class CompletionRequest:
    """A validated ``/v1/completions`` request: text (tokenized later) or token ids."""

    prompt: str | list[int]
    sampling: SamplingFields
    echo: bool = False
    logprobs: int | None = None


def _is_ids(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)


def parse_completion(body: dict[str, Any], n_ctx: int) -> CompletionRequest:
    """Validates a text completions body."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and (isinstance(p[0], str) or _is_ids(p[0])):
        p = p[0]  # a batch of one
    if isinstance(p, str):
        prompt: str | list[int] = _check_text("prompt", p)
        if not p:
            raise RequestError("'prompt' must not be empty", param="prompt")
    elif _is_ids(p) and p:
        prompt = list(p)
    elif isinstance(p, list) and p and all(isinstance(x, str) or _is_ids(x) for x in p):
        raise RequestError("only one prompt per request is supported", param="prompt")
    elif p is None:
        raise RequestError("'prompt' is required", param="prompt")
    else:
        raise _type_error("prompt", "a non-empty string or list of token ids", p)
    if _str(body, "suffix"):
        raise RequestError("'suffix' is not supported", param="suffix", code="unsupported")
    sampling = _parse_sampling(body, n_ctx, default_max=16)
    logprobs = _int(body, "logprobs")
    _range("logprobs", logprobs, 0, MAX_TOP_LOGPROBS)
    echo = _bool(body, "echo")
    if echo and logprobs is not None:
        raise RequestError(
            "'echo' with 'logprobs' is not supported", param="logprobs", code="unsupported"
        )
    return CompletionRequest(prompt=prompt, sampling=sampling, echo=echo, logprobs=logprobs)


# -- responses -------------------------------------------------------------------------------


def error_body(err: RequestError) -> dict[str, Any]:
    """The OpenAI error object for ``err``."""
    return {
        "error": {
            "message": err.message,
            "type": err.err_type,
            "param": err.param,
            "code": err.code,
        }
    }


def anthropic_error_body(err: RequestError) -> dict[str, Any]:
    """Anthropic's error object for ``err`` (for ``/v1/messages``)."""
    kinds = {401: "authentication_error", 404: "not_found_error", 429: "rate_limit_error"}
    kind = kinds.get(err.status, "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def new_id(prefix: str) -> str:
    """A response id such as ``chatcmpl-<hex>``."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(job: Job) -> dict[str, Any]:
    """Token counts of a finished job, OpenAI's ``usage`` object."""
    return {
        "prompt_tokens": job.prompt_tokens,
        "completion_tokens": job.completion_tokens,
        "total_tokens": job.prompt_tokens + job.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": job.cached_tokens},
    }


def _token_str(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


def chat_logprobs(entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    """Chat ``logprobs`` object (``{"content": [...]}``) for these tokens."""
    return {
        "content": [
            {
                "token": _token_str(e.piece),
                "logprob": e.logprob,
                "bytes": list(e.piece),
                "top_logprobs": [
                    {"token": _token_str(p), "logprob": lp, "bytes": list(p)} for _, p, lp in e.top
                ],
            }
            for e in entries
        ]
    }


def completion_logprobs(entries: Sequence[TokenLogprob], offset: int) -> dict[str, Any]:
    """Legacy completions ``logprobs`` object; ``offset`` is the text offset of the first."""
    tokens, lps, tops, offsets = [], [], [], []
    for e in entries:
        s = _token_str(e.piece)
        tokens.append(s)
        lps.append(e.logprob)
        tops.append({_token_str(p): lp for _, p, lp in e.top})
        offsets.append(offset)
        offset += len(s)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


@dataclass
class ChatResult:
    """A finished chat reply, gathered from the output parser."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = "stop"


def finish_reason(reason: str, has_calls: bool) -> str:
    """OpenAI's finish reason: a stop with parsed calls is ``tool_calls``."""
    return "tool_calls" if has_calls and reason == "stop" else reason


def _envelope(obj: str, rid: str, model: str, created: int) -> dict[str, Any]:
    return {
        "id": rid,
        "object": obj,
        "created": created,
        "model": model,
        "system_fingerprint": "freetoken",
    }


def chat_response(
    rid: str, model: str, created: int, r: ChatResult, job: Job, with_logprobs: bool
) -> dict[str, Any]:
    """The ``chat.completion`` object."""
    # content is null only for a reply made of tool calls alone, as OpenAI's are.
    content = r.content if r.content or not r.tool_calls else None
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if r.reasoning:
        msg["reasoning_content"] = r.reasoning
    if r.tool_calls:
        msg["tool_calls"] = [c.to_openai() for c in r.tool_calls]
    out = _envelope("chat.completion", rid, model, created)
    out["choices"] = [
        {
            "index": 0,
            "message": msg,
            "logprobs": chat_logprobs(r.logprobs) if with_logprobs else None,
            "finish_reason": finish_reason(r.finish_reason, bool(r.tool_calls)),
        }
    ]
    out["usage"] = usage(job)
    return out


def chat_chunk(
    rid: str,
    model: str,
    created: int,
    delta: dict[str, Any] | None,
    *,
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
    usage_obj: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk``; ``delta=None`` gives the usage-only chunk."""
    out = _envelope("chat.completion.chunk", rid, model, created)
    if delta is None:
        out["choices"] = []
    else:
        out["choices"] = [
            {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        ]
    if usage_obj is not None:
        out["usage"] = usage_obj
    return out


def completion_response(
    rid: str,
    model: str,
    created: int,
    text: str,
    reason: str,
    logprobs: dict[str, Any] | None,
    job: Job,
) -> dict[str, Any]:
    """The ``text_completion`` object."""
    out = _envelope("text_completion", rid, model, created)
    out["choices"] = [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": reason}]
    out["usage"] = usage(job)
    return out


def completion_chunk(
    rid: str,
    model: str,
    created: int,
    text: str | None,
    *,
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
    usage_obj: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One streamed ``text_completion``; ``text=None`` gives the usage-only chunk."""
    out = _envelope("text_completion", rid, model, created)
    out["choices"] = (
        []
        if text is None
        else [{"text": text, "index": 0, "logprobs": logprobs, "finish_reason": finish}]
    )
    if usage_obj is not None:
        out["usage"] = usage_obj
    return out


def now() -> int:
    """Seconds since the epoch, for ``created``."""
    return int(time.time())
