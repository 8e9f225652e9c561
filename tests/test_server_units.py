"""Unit tests of the server's pure parts: tool-call and reasoning parsing, stop strings,
request validation and the Prometheus text. No model, no sockets."""

from __future__ import annotations

import json

import pytest
from freetoken.errors import RequestError
from freetoken.server.metrics import Counter, Histogram, Registry
from freetoken.server.prompt import render_chat
from freetoken.server.protocol import parse_chat, parse_completion, parse_json_body
from freetoken.server.toolcalls import (
    OutputParser,
    ReasoningSplitter,
    ToolCallStream,
    parse_tool_calls,
)
from freetoken.tokenizer.textstream import StopFilter, TextStream

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
ARGS = {"city": "Paris", "unit": "C"}


def _stream(text: str, names: list[str] | None, step: int = 1) -> tuple[str, list]:
    """Feeds ``text`` in pieces of ``step`` characters, as tokens would arrive."""
    s = ToolCallStream(names)
    content, calls = "", []
    for i in range(0, len(text), step):
        c, k = s.feed(text[i : i + step])
        content += c
        calls += k
    c, k = s.finish()
    return content + c, calls + k


CASES = [
    # (format, model output, tool names, expected content, expected calls)
    ("hermes", f"<tool_call>\n{WEATHER}\n</tool_call>", None, "", [("get_weather", ARGS)]),
    (
        "hermes two calls and text",
        f'Let me check.\n<tool_call>{WEATHER}</tool_call>\n<tool_call>{{"name": "now", '
        '"arguments": {}}</tool_call>\n',
        None,
        "Let me check.\n",
        [("get_weather", ARGS), ("now", {})],
    ),
    ("hermes unclosed at eos", f"<tool_call>\n{WEATHER}\n", None, "", [("get_weather", ARGS)]),
    (
        "hermes string arguments",
        '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
        None,
        "",
        [("f", {"a": 1})],
    ),
    (
        "minimax two invokes",
        'Let me check.\n<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">'
        'Paris</parameter>\n<parameter name="unit">C</parameter>\n</invoke>\n<invoke name="f">'
        '<parameter name="days">[1, 2]</parameter></invoke>\n</minimax:tool_call>',
        None,
        "Let me check.\n",
        [("get_weather", ARGS), ("f", {"days": [1, 2]})],
    ),
    (
        "minimax unclosed at eos",
        '<minimax:tool_call><invoke name="now"></invoke>\n',
        None,
        "",
        [("now", {})],
    ),
    (
        "broken minimax",
        "<minimax:tool_call>oops</minimax:tool_call> b",
        None,
        "<minimax:tool_call>oops</minimax:tool_call> b",
        [],
    ),
    (
        "gemma4 two calls and text",
        'Let me check.\n<|tool_call>call:get_weather{city:<|"|>Paris<|"|>,unit:<|"|>C<|"|>}'
        "<tool_call|><|tool_call>call:f{days:[1,2.5],opts:{deep:true,tag:null},"
        'note:<|"|>a, b: {c}<|"|>}<tool_call|>',
        None,
        "Let me check.\n",
        [
            ("get_weather", ARGS),
            ("f", {"days": [1, 2.5], "opts": {"deep": True, "tag": None}, "note": "a, b: {c}"}),
        ],
    ),
    ("gemma4 no arguments", "<|tool_call>call:now{}<tool_call|>", None, "", [("now", {})]),
    (
        "broken gemma4",
        '<|tool_call>call:f{a:<|"|>x}<tool_call|> b',
        None,
        '<|tool_call>call:f{a:<|"|>x}<tool_call|> b',
        [],
    ),
    ("mistral v3", f"[TOOL_CALLS][{WEATHER}]", None, "", [("get_weather", ARGS)]),
    (
        "mistral v11",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "C"}[TOOL_CALLS]now[ARGS]{}',
        None,
        "",
        [("get_weather", ARGS), ("now", {})],
    ),
    (
        "mistral call id",
        '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "unit": "C"}',
        None,
        "",
        [("get_weather", ARGS)],
    ),
    (
        "llama3 json",
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
        ["get_weather"],
        "",
        [("get_weather", ARGS)],
    ),
    (
        "llama3 typed",
        '{"type": "function", "name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
        ["get_weather"],
        "",
        [("get_weather", ARGS)],
    ),
    (
        "llama3 python tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}',
        None,
        "",
        [("get_weather", ARGS)],
    ),
    (
        "llama3 two calls",
        '{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}',
        ["a", "b"],
        "",
        [("a", {}), ("b", {"x": 1})],
    ),
    # Not calls: everything comes back as content.
    ("plain text", "The weather is fine.", ["get_weather"], "The weather is fine.", []),
    ("json answer", '{"answer": 42}', ["get_weather"], '{"answer": 42}', []),
    (
        "json naming an unknown tool",
        '{"name": "other", "parameters": {}}',
        ["get_weather"],
        '{"name": "other", "parameters": {}}',
        [],
    ),
    (
        "broken hermes",
        "a <tool_call>{oops</tool_call> b",
        None,
        "a <tool_call>{oops</tool_call> b",
        [],
    ),
    ("broken mistral", "[TOOL_CALLS] not json", None, "[TOOL_CALLS] not json", []),
    ("less-than sign", "1 < 2 and <b>bold</b>", None, "1 < 2 and <b>bold</b>", []),
]


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    ("fmt", "text", "names", "content", "calls"), CASES, ids=[c[0] for c in CASES]
)
def test_tool_call_formats(
    fmt: str, text: str, names: list[str] | None, content: str, calls: list, step: int
) -> None:
    got_content, got_calls = _stream(text, names, step)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert all(c.id.startswith("call_") and len(c.id) == 29 for c in got_calls)
    # The whole-text form agrees with the streamed one.
    whole_content, whole_calls = parse_tool_calls(text, names)
    assert whole_content == content
    assert [c.name for c in whole_calls] == [c[0] for c in calls]


def test_tool_call_streaming_emits_content_before_the_call() -> None:
    s = ToolCallStream(None)
    content, calls = s.feed("Checking the weather")
    assert content == "Checking the weather" and not calls
    content, calls = s.feed(" now.<tool_")
    assert content == " now." and not calls  # "<tool_" may start a marker: held back
    content, calls = s.feed(f"call>{WEATHER}</tool_call>")
    assert content == "" and [c.name for c in calls] == ["get_weather"]


@pytest.mark.parametrize("step", [1, 2, 1000])
@pytest.mark.parametrize(
    "text",
    [
        "<think>\nThe user greets me.\n</think>\n\nHello!",
        # Gemma 4: the thought channel, its name dropped.
        "<|channel>thought\nThe user greets me.\n<channel|>Hello!",
    ],
)
def test_reasoning_split(text: str, step: int) -> None:
    r = ReasoningSplitter()
    reasoning = content = ""
    for i in range(0, len(text), step):
        a, b = r.feed(text[i : i + step])
        reasoning += a
        content += b
    a, b = r.finish()
    assert (reasoning + a, content + b) == ("The user greets me.\n", "Hello!")


def test_reasoning_opened_by_the_template() -> None:
    p = OutputParser(start_in_reasoning=True, tools=["f"])
    d1 = p.feed("\nhmm, call f</think>\n")
    d2 = p.feed('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    d3 = p.finish()
    assert d1.reasoning + d2.reasoning + d3.reasoning == "hmm, call f"
    assert d1.content + d2.content + d3.content == ""
    assert [c.name for c in d1.tool_calls + d2.tool_calls + d3.tool_calls] == ["f"]


def test_reasoning_off_keeps_tags() -> None:
    p = OutputParser(reasoning=False)
    assert p.feed("<think>x</think>y").content == "<think>x</think>y"


@pytest.mark.parametrize("step", [1, 4])
def test_stop_filter(step: int) -> None:
    text = "Hello wor" + "ld. STOP here"
    f = StopFilter(["STOP", "xyz"])
    out = "".join(f.feed(text[i : i + step]) for i in range(0, len(text), step))
    assert out + f.flush() == "Hello world. "
    assert f.stopped


def test_text_stream_joins_split_utf8() -> None:
    t = TextStream([])
    data = "héllo ✓".encode()
    out = "".join(t.feed(data[i : i + 1]) for i in range(len(data)))
    assert out + t.finish() == "héllo ✓"


# -- request validation ---------------------------------------------------------------------


def _err(fn, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        fn(*args)
    assert 400 <= e.value.status < 500
    return e.value


@pytest.mark.parametrize(
    ("raw", "code"),
    [
        (b"{", "invalid_json"),
        (b"\xff\xfe{}", "invalid_utf8"),
        (b"[1]", "invalid_json"),
        (b"", "invalid_json"),
        (b'{"a": NaN}', "invalid_json"),
    ],
)
def test_bad_bodies(raw: bytes, code: str) -> None:
    assert _err(parse_json_body, raw).code == code


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "messages[0].content[0]",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": [{"role": "user", "content": "\ud800"}]}, "messages[0].content"),
        ({"messages": MSG, "max_tokens": -1}, "max_tokens"),
        ({"messages": MSG, "max_tokens": 0}, "max_tokens"),
        ({"messages": MSG, "max_tokens": 10**9}, "max_tokens"),
        ({"messages": MSG, "max_tokens": "5"}, "max_tokens"),
        ({"messages": MSG, "max_completion_tokens": 10**9}, "max_completion_tokens"),
        ({"messages": MSG, "temperature": "hot"}, "temperature"),
        ({"messages": MSG, "temperature": -1}, "temperature"),
        ({"messages": MSG, "top_p": 0}, "top_p"),
        ({"messages": MSG, "n": 2}, "n"),
        ({"messages": MSG, "stream": "yes"}, "stream"),
        ({"messages": MSG, "stop": 5}, "stop"),
        ({"messages": MSG, "seed": 1.5}, "seed"),
        ({"messages": MSG, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": MSG, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"messages": MSG, "tools": {}}, "tools"),
        ({"messages": MSG, "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": MSG, "response_format": {"type": "json_schema"}}, "response_format"),
    ],
)
def test_bad_chat_fields(body: dict, param: str) -> None:
    assert _err(parse_chat, body, 512).param == param


def test_good_chat_fields() -> None:
    req = parse_chat(
        {
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "hi"},
            ],
            "max_tokens": 8.0,
            "temperature": 0,
            "stop": "\n",
            "logprobs": True,
            "top_logprobs": 2,
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
            "stream": True,
            "stream_options": {"include_usage": True},
            "seed": 7,
        },
        512,
    )
    assert req.messages[0] == {"role": "system", "content": "Be brief."}
    assert req.sampling.max_tokens == 8 and req.sampling.stop == ["\n"]
    assert req.sampling.params.greedy and req.sampling.params.seed == 7
    assert req.logprobs == 2 and req.tool_names == ["f"] and req.sampling.include_usage


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": ["a", "b"]}, "prompt"),
        ({"prompt": [1.5]}, "prompt"),
        ({"prompt": "x", "suffix": "y"}, "suffix"),
        ({"prompt": "x", "logprobs": 99}, "logprobs"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
    ],
)
def test_bad_completion_fields(body: dict, param: str) -> None:
    assert _err(parse_completion, body, 512).param == param


class _EchoTemplate:
    """A stand-in tokenizer whose template prints the messages it gets."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tools=None):
        return json.dumps({"messages": messages, "tools": tools})


def test_tools_fallback_for_templates_without_tools() -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    msgs = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
        },
        {"role": "tool", "content": "18C", "tool_call_id": "call_1"},
    ]
    out = json.loads(render_chat(_EchoTemplate(), "{{ messages }}", msgs, tools, "auto"))
    assert out["tools"] is None
    system, _user, assistant, result = out["messages"]
    assert system["role"] == "system" and "<tool_call>" in system["content"]
    assert "get_weather" in system["content"]
    assert json.loads(assistant["content"].split("\n")[1]) == {
        "name": "get_weather",
        "arguments": {"city": "Paris"},
    }
    assert result == {"role": "user", "content": "<tool_response>\n18C\n</tool_response>"}
    # A template that knows tools gets them unchanged.
    out = json.loads(render_chat(_EchoTemplate(), "{% if tools %}{% endif %}", msgs, tools, "auto"))
    assert out["tools"] == tools and out["messages"] == msgs


# -- metrics ----------------------------------------------------------------------------------


def test_prometheus_text() -> None:
    reg = Registry()
    c = reg.add(Counter("x_total", "things"))
    h = reg.add(Histogram("lat_seconds", "latency", [0.1, 1.0]))
    c.inc(2, endpoint="/v1/chat/completions", status="200")
    for v in (0.05, 0.5, 5.0):
        h.observe(v)
    reg.add_source(lambda: [("moe_hits_total", "counter", "hits", 3)])
    text = reg.render()
    assert "# TYPE x_total counter" in text
    assert 'x_total{endpoint="/v1/chat/completions",status="200"} 2' in text
    assert 'lat_seconds_bucket{le="0.1"} 1' in text
    assert 'lat_seconds_bucket{le="1"} 2' in text
    assert 'lat_seconds_bucket{le="+Inf"} 3' in text
    assert "lat_seconds_count 3" in text and "moe_hits_total 3" in text


def test_serve_subcommand_flags() -> None:
    from freetoken.cli import _build_parser

    args = _build_parser().parse_args(
        ["serve", "--alias", "m", "--port", "0", "--api-key", "k", "--parallel", "2", "-c", "512"]
    )
    assert (args.alias, args.port, args.api_key, args.parallel, args.ctx_size) == (
        "m",
        0,
        "k",
        2,
        512,
    )
    assert args.host == "127.0.0.1" and args.func.__module__ == "freetoken.server"


def test_moe_counters_become_metrics() -> None:
    from types import SimpleNamespace

    from freetoken.server import _moe_counters

    fields = ("steps", "routes", "experts", "bytes", "last_routes", "last_experts", "last_bytes")
    rows = [(2, 16, 6, 1000, 8, 3, 500), (2, 16, 5, 900, 8, 4, 400)]
    snap = [SimpleNamespace(**dict(zip(fields, r, strict=True))) for r in rows]
    counters = SimpleNamespace(snapshot=lambda: snap)
    model = SimpleNamespace(moe=SimpleNamespace(collect=lambda: counters))
    reg = Registry()
    reg.add_source(_moe_counters(model))
    text = reg.render()
    assert "# TYPE freetoken_moe_routes_total counter" in text
    assert "freetoken_moe_routes_total 32" in text
    assert "freetoken_moe_expert_bytes_total 1900" in text
    assert "freetoken_moe_last_step_experts 7" in text
    assert _moe_counters(SimpleNamespace(moe=None))() == []
