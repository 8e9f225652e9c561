"""Tool calls and reasoning in generated text, parsed incrementally (for streaming) and whole.

Formats recognised in the model's output:

* Qwen / Hermes: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per
  call, text allowed around them;
* Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3) or
  ``[TOOL_CALLS]name[ARGS]{...}`` (v11 and later, repeated per call, an optional
  ``[CALL_ID]id`` before ``[ARGS]``);
* MiniMax-M2: ``<minimax:tool_call>`` around one or more
  ``<invoke name="..."><parameter name="key">value</parameter>...</invoke>``, each value JSON
  where it parses as JSON (the template writes non-strings with ``tojson``), else a string;
* Gemma 4: ``<|tool_call>call:name{key:value,...}<tool_call|>``, one block per call; values
  are ``<|"|>``-quoted strings, bare numbers, booleans and null, ``{...}`` objects (keys
  bare or quoted) and ``[...]`` lists, as its template writes arguments;
* Llama 3: the whole reply is one JSON object ``{"name": ..., "parameters": {...}}`` (or
  several separated by ``;``), optionally after ``<|python_tag|>``; without the tag it counts
  as a call only when the name is one of the request's tools, so ordinary JSON answers pass;
* reasoning: text inside ``<think>...</think>`` (or Gemma 4's ``<|channel>thought\n...
  <channel|>``, the channel's name dropped) goes to ``reasoning_content``.

Nothing is lost: a block that does not parse is handed back as content, markers included.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "OutputDelta",
    "OutputParser",
    "ReasoningSplitter",
    "ToolCall",
    "ToolCallStream",
    "parse_tool_calls",
]

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
MISTRAL_TAG = "[TOOL_CALLS]"
MINIMAX_OPEN, MINIMAX_CLOSE = "<minimax:tool_call>", "</minimax:tool_call>"
GEMMA4_OPEN, GEMMA4_CLOSE, GEMMA4_QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
PYTHON_TAG = "<|python_tag|>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
#: Reasoning blocks: opening and closing tags, and the channel name after a Gemma 4 opening.
_REASONING = {THINK_OPEN: (THINK_CLOSE, ""), "<|channel>": ("<channel|>", "thought")}

# A bare JSON reply that may be a Llama 3 call: decided once the first key is visible.
_LLAMA_HEAD = re.compile(r'\s*\{\s*"(name|type|function)"\s*:')
_LLAMA_UNDECIDED = re.compile(r'\s*\{\s*("[a-z]{0,8}"?\s*)?')
_ALNUM = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` and 24 random letters and digits)."""
    return "call_" + "".join(secrets.choice(_ALNUM) for _ in range(24))


@dataclass
class ToolCall:
    """One parsed call: the function name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        """The call as an OpenAI ``tool_calls`` entry (with ``index`` for stream deltas)."""
        d: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            d["index"] = index
        return d


def _held_back(buf: str, markers: Iterable[str]) -> int:
    """Length of the longest tail of ``buf`` that could be the start of a marker."""
    keep = 0
    for m in markers:
        for n in range(min(len(m) - 1, len(buf)), keep, -1):
            if buf.endswith(m[:n]):
                keep = n
                break
    return keep


def _call_from_obj(obj: Any) -> ToolCall | None:
    """A call from ``{"name", "arguments"|"parameters"}`` (or OpenAI's ``function`` nesting)."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]
    name = obj.get("name")
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(name, str) or not name:
        return None
    if isinstance(args, str):
        try:
            json.loads(args)
        except ValueError:
            return None
        return ToolCall(name, args)
    if not isinstance(args, dict):
        return None
    return ToolCall(name, json.dumps(args, ensure_ascii=False))


def _json_values(text: str, sep: str = "") -> list[Any] | None:
    """Every JSON value in ``text`` (separated by whitespace and ``sep``), or None if any
    part is not JSON."""
    dec = json.JSONDecoder()
    out: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or (sep and text[i] == sep)):
            i += 1
        if i == n:
            return out
        try:
            value, i = dec.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _parse_hermes_block(body: str) -> ToolCall | None:
    values = _json_values(body)
    return _call_from_obj(values[0]) if values and len(values) == 1 else None


#: The block formats (a call per block or several): their opening and closing markers.
_BLOCKS = {
    "hermes": (HERMES_OPEN, HERMES_CLOSE),
    "minimax": (MINIMAX_OPEN, MINIMAX_CLOSE),
    "gemma4": (GEMMA4_OPEN, GEMMA4_CLOSE),
}
_MINIMAX_INVOKE = re.compile(r'\s*<invoke name="([^"]+)">(.*?)</invoke>\s*', re.S)
_MINIMAX_PARAM = re.compile(r'\s*<parameter name="([^"]+)">(.*?)</parameter>\s*', re.S)


def _minimax_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _parse_minimax_block(body: str) -> list[ToolCall] | None:
    """The calls of one ``<minimax:tool_call>`` body; None unless all of it is invokes."""
    calls: list[ToolCall] = []
    i = 0
    while i < len(body):
        m = _MINIMAX_INVOKE.match(body, i)
        if m is None:
            return None if body[i:].strip() else calls or None
        args: dict[str, Any] = {}
        j, inner = 0, m.group(2)
        while j < len(inner) and inner[j:].strip():
            p = _MINIMAX_PARAM.match(inner, j)
            if p is None:
                return None
            args[p.group(1)] = _minimax_value(p.group(2))
            j = p.end()
        calls.append(ToolCall(m.group(1), json.dumps(args, ensure_ascii=False)))
        i = m.end()
    return calls or None


_GEMMA4_BARE = re.compile(r"[^,:{}\[\]<]+")


def _gemma4_value(text: str, i: int) -> tuple[Any, int]:
    """The Gemma 4 argument value at ``text[i]`` and the index after it; ValueError if none."""
    if text.startswith(GEMMA4_QUOTE, i):
        end = text.find(GEMMA4_QUOTE, i + len(GEMMA4_QUOTE))
        if end < 0:
            raise ValueError("unclosed string")
        return text[i + len(GEMMA4_QUOTE) : end], end + len(GEMMA4_QUOTE)
    if text.startswith("{", i) or text.startswith("[", i):
        mapping, close = text[i] == "{", "}" if text[i] == "{" else "]"
        items: Any = {} if mapping else []
        i += 1
        while not text.startswith(close, i):
            if mapping:
                key, i = _gemma4_value(text, i)
                if not isinstance(key, str) or not text.startswith(":", i):
                    raise ValueError("expected key:value")
                items[key], i = _gemma4_value(text, i + 1)
            else:
                value, i = _gemma4_value(text, i)
                items.append(value)
            if text.startswith(",", i):
                i += 1
            elif not text.startswith(close, i):
                raise ValueError(f"expected , or {close}")
        return items, i + 1
    m = _GEMMA4_BARE.match(text, i)
    if m is None:
        raise ValueError("expected a value")
    word = m.group(0).strip()
    try:
        return json.loads(word), m.end()
    except ValueError:
        return word, m.end()  # a bare word: an unquoted key, or text the model left bare


def _parse_gemma4_block(body: str) -> list[ToolCall] | None:
    """The call of one ``<|tool_call>`` body (``call:name{...}``); None if it is not one."""
    body = body.strip()
    brace = body.find("{")
    if not body.startswith("call:") or brace < 0:
        return None
    name = body[len("call:") : brace].strip()
    try:
        args, end = _gemma4_value(body, brace)
    except ValueError:
        return None
    if not name or end != len(body) or not isinstance(args, dict):
        return None
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


def _parse_mistral(body: str) -> list[ToolCall] | None:
    body = body.strip()
    if body.startswith("["):
        values = _json_values(body)
        if not values or len(values) != 1 or not isinstance(values[0], list):
            return None
        found = [_call_from_obj(v) for v in values[0]]
        ok = [c for c in found if c is not None]
        return ok if ok and len(ok) == len(found) else None
    calls = []
    for part in body.split(MISTRAL_TAG):
        if not part.strip():
            continue
        name, sep, rest = part.partition("[ARGS]")
        name = name.split("[CALL_ID]")[0].strip()
        values = _json_values(rest)
        if not sep or not name or not values or len(values) != 1:
            return None
        call = _call_from_obj({"name": name, "arguments": values[0]})
        if call is None:
            return None
        calls.append(call)
    return calls or None


def _parse_llama(body: str, names: set[str] | None) -> list[ToolCall] | None:
    values = _json_values(body, sep=";")
    if not values:
        return None
    calls = [_call_from_obj(v) for v in values]
    if not all(c is not None for c in calls):
        return None
    if names is not None and any(c.name not in names for c in calls):  # type: ignore[union-attr]
        return None
    return calls  # type: ignore[return-value]


class ToolCallStream:
    """Separates tool calls from content as text arrives.

    :meth:`feed` returns the content that is certainly not part of a call and the calls
    completed so far; text that may begin a marker is held back until it is decided.
    ``tool_names`` (the request's tools) gates the markerless Llama 3 form.
    """

    _MARKERS = (HERMES_OPEN, MINIMAX_OPEN, GEMMA4_OPEN, MISTRAL_TAG, PYTHON_TAG)

    def __init__(self, tool_names: Iterable[str] | None = None) -> None:
        self.names = set(tool_names) if tool_names is not None else None
        self.buf = ""
        self.mode = "text"  # text | hermes | minimax | gemma4 | mistral | python | llama
        self.seen_text = False  # any non-space content emitted yet
        self.n_calls = 0
        self.pending_ws = ""  # whitespace after a call: dropped if nothing else follows

    def _emit(self, text: str) -> str:
        if not text:
            return ""
        if self.n_calls and not text.strip():
            self.pending_ws += text
            return ""
        out, self.pending_ws = self.pending_ws + text, ""
        self.seen_text = True
        return out

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        """Adds generated text; returns (content to emit now, calls completed now)."""
        self.buf += text
        content, calls = [], []
        while True:
            if self.mode == "text":
                if not self.seen_text and self.names and self.buf.lstrip().startswith("{"):
                    if _LLAMA_HEAD.match(self.buf):
                        self.mode = "llama"
                        continue
                    if _LLAMA_UNDECIDED.fullmatch(self.buf):
                        break  # not enough seen to tell a call from a JSON answer
                hits = [(self.buf.find(m), m) for m in self._MARKERS]
                hits = [(i, m) for i, m in hits if i >= 0]
                if not hits:
                    keep = _held_back(self.buf, self._MARKERS)
                    content.append(self._emit(self.buf[: len(self.buf) - keep]))
                    self.buf = self.buf[len(self.buf) - keep :]
                    break
                i, m = min(hits)
                content.append(self._emit(self.buf[:i]))
                self.buf = self.buf[i:]
                self.mode = {
                    HERMES_OPEN: "hermes",
                    MINIMAX_OPEN: "minimax",
                    GEMMA4_OPEN: "gemma4",
                    MISTRAL_TAG: "mistral",
                }.get(m, "python")
            elif self.mode in _BLOCKS:
                open_, close = _BLOCKS[self.mode]
                j = self.buf.find(close)
                if j < 0:
                    break
                block = self.buf[: j + len(close)]
                parsed = self._parse_block(block[len(open_) : j])
                if parsed is None:
                    content.append(self._emit(block))
                else:
                    calls += parsed
                    self.n_calls += len(parsed)
                self.buf = self.buf[len(block) :]
                self.mode = "text"
            else:
                break  # mistral, python, llama: the call runs to the end of the output
        return "".join(content), calls

    def _parse_block(self, body: str) -> list[ToolCall] | None:
        """The calls of a block of the current mode (hermes, minimax or gemma4)."""
        if self.mode == "minimax":
            return _parse_minimax_block(body)
        if self.mode == "gemma4":
            return _parse_gemma4_block(body)
        call = _parse_hermes_block(body)
        return [call] if call else None

    def finish(self) -> tuple[str, list[ToolCall]]:
        """Ends the output: parses what is still held; returns (content, calls)."""
        content, calls = self.feed("")
        buf, mode = self.buf, self.mode
        parsed: list[ToolCall] | None = None
        if mode in _BLOCKS:
            # The model stopped before the closing tag: accept a complete body.
            parsed = self._parse_block(buf[len(_BLOCKS[mode][0]) :])
        elif mode == "mistral":
            parsed = _parse_mistral(buf[len(MISTRAL_TAG) :])
        elif mode == "python":
            parsed = _parse_llama(buf[len(PYTHON_TAG) :], None)
        elif mode == "llama":
            parsed = _parse_llama(buf, self.names)
        self.buf = ""
        if parsed:
            calls += parsed
            self.n_calls += len(parsed)
        else:
            content += self._emit(buf)
        if self.n_calls == 0:
            content += self.pending_ws
        self.pending_ws = ""
        return content, calls


def parse_tool_calls(
    text: str, tool_names: Iterable[str] | None = None
) -> tuple[str, list[ToolCall]]:
    """Whole-text form of :class:`ToolCallStream`: returns (content, calls)."""
    s = ToolCallStream(tool_names)
    content, calls = s.feed(text)
    tail, more = s.finish()
    return content + tail, calls + more


class ReasoningSplitter:
    """Splits text into reasoning (inside ``<think>...</think>`` or Gemma 4's channel) and
    content, incrementally.

    ``start_inside`` is for templates that open the think block in the prompt (the output
    then starts with reasoning and only closes the tag).
    """

    def __init__(self, start_inside: bool = False) -> None:
        self.inside = start_inside
        self.close = THINK_CLOSE  # the tag that ends the block we are inside
        self.name = ""  # a channel name still to drop at the start of the block
        self.buf = ""
        self.strip = start_inside  # drop the newlines a model writes right after a tag

    def feed(self, text: str) -> tuple[str, str]:
        """Adds generated text; returns (reasoning, content) that can be emitted now."""
        self.buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self.buf:
            if self.name:
                if len(self.buf) < len(self.name) and self.name.startswith(self.buf):
                    break  # maybe the channel's name: wait for more
                if self.buf.startswith(self.name):
                    self.buf = self.buf[len(self.name) :]
                self.name = ""
            tags = [self.close] if self.inside else list(_REASONING)
            hits = [(j, t) for t in tags if (j := self.buf.find(t)) >= 0]
            i, tag = min(hits) if hits else (-1, "")
            if i >= 0:
                part, self.buf = self.buf[:i], self.buf[i + len(tag) :]
            else:
                keep = _held_back(self.buf, tags)
                part, self.buf = self.buf[: len(self.buf) - keep], self.buf[len(self.buf) - keep :]
            if self.strip:
                part = part.lstrip()
                self.strip = not part
            (reasoning if self.inside else content).append(part)
            if i < 0:
                break
            if not self.inside:
                self.close, self.name = _REASONING[tag]
            self.inside = not self.inside
            self.strip = True
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """Ends the output; returns what was held back."""
        buf, self.buf = self.buf, ""
        return (buf, "") if self.inside else ("", buf)


@dataclass
class OutputDelta:
    """What one piece of generated text adds to the reply."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)


class OutputParser:
    """The reply pipeline of a chat request: reasoning first, then tool calls in the content.

    ``tools`` is None when tool calls are not to be parsed (no tools, or tool_choice none).
    """

    def __init__(
        self,
        *,
        reasoning: bool = True,
        start_in_reasoning: bool = False,
        tools: Iterable[str] | None = None,
    ) -> None:
        self.reasoning = ReasoningSplitter(start_in_reasoning) if reasoning else None
        self.tools = ToolCallStream(tools) if tools is not None else None

    def _content(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        if self.tools is None:
            return text, []
        content, calls = self.tools.feed(text)
        if final:
            tail, more = self.tools.finish()
            content, calls = content + tail, calls + more
        return content, calls

    def feed(self, text: str) -> OutputDelta:
        """Adds generated text; returns the delta to send."""
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        content, calls = self._content(content, False)
        return OutputDelta(reasoning, content, calls)

    def finish(self) -> OutputDelta:
        """Ends the output; returns the last delta."""
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        content, calls = self._content(content, True)
        return OutputDelta(reasoning, content, calls)
