"""Untrusted chat templates: the sandbox refuses escapes to Python internals and mutation of
the caller's values, and bounds a render's loops, sizes, output and time; each refusal is an
InvalidInputError, never a hang, a crash or a process that runs out of memory."""

from __future__ import annotations

import time

import pytest
from freetoken.errors import FreeTokenError, InvalidInputError
from freetoken.tokenizer import sandbox
from freetoken.tokenizer.chat import render_chat_template

MESSAGES = [{"role": "user", "content": "hi"}]

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ joiner.__init__.__globals__.os }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ raise_exception.__globals__ }}",
    "{{ messages.__class__ }}",
    "{{ messages.append(1) }}",
    "{{ messages[0].update({'role': 'x'}) }}",
    "{{ (messages|first).clear() }}",
    "{% set x = messages.pop() %}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_escapes_and_mutation_are_refused(template: str) -> None:
    # A private attribute reads as undefined (empty when printed, an error when used).
    messages = [dict(m) for m in MESSAGES]
    try:
        out = render_chat_template(template, messages)
    except InvalidInputError:
        out = ""
    assert out == ""
    assert messages == MESSAGES


BOMBS = [
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% for a in range(1000) %}{% for b in range(1000) %}{% for c in range(1000) %}"
    "{{ c }}{% endfor %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**9 }}",
    "{{ [1] * 10**9 }}",
    "{{ 7 ** 100000000 }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='x') %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% for i in range(100000) %}{{ 'y' * 4000000 }}{% endfor %}",
]


@pytest.mark.parametrize("template", BOMBS)
def test_runaway_templates_stop_within_the_bounds(template: str) -> None:
    t0 = time.monotonic()
    with pytest.raises(InvalidInputError):
        render_chat_template(template, MESSAGES)
    assert time.monotonic() - t0 < sandbox.MAX_SECONDS + 5


def test_the_bounds_leave_ordinary_templates_alone() -> None:
    template = (
        "{% for m in messages %}{{ loop.index }}/{{ loop.length }} {{ m.role }}: {{ m.content }}"
        "{% if not loop.last %}, {% endif %}{% endfor %}{{ '-' * 3 }}{{ 2 ** 10 }}"
    )
    many = [{"role": "user", "content": f"m{i}"} for i in range(3)]
    assert render_chat_template(template, many) == "1/3 user: m0, 2/3 user: m1, 3/3 user: m2---1024"


def test_a_template_nested_too_deeply_to_compile_is_refused() -> None:
    # Found by fuzz/fuzz_python.py chat_template: the parser's recursion.
    with pytest.raises(FreeTokenError, match="nests too deeply"):
        render_chat_template("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", MESSAGES)


def test_repeating_an_empty_string_a_huge_number_of_times_is_refused() -> None:
    # Found by fuzz/fuzz_python.py chat_template: '' * n with n past an index raised
    # OverflowError out of the renderer.
    with pytest.raises(InvalidInputError):
        render_chat_template("{{ '' * 111111111111111111111111111111 }}", MESSAGES)
    with pytest.raises(InvalidInputError):
        render_chat_template(
            "{{ 'ab'[1:111111111111111111111111111111] ~ (1.5 ** 400) }}", MESSAGES
        )
