"""The jinja2 sandbox that renders chat templates, which come from model files and so are
untrusted: values are immutable and private attributes unreachable (jinja2's
``ImmutableSandboxedEnvironment``), and one render is bounded in loop iterations, in the size of
what ``*`` and ``**`` may build, in output and in time. A template past a bound fails with
:class:`jinja2.exceptions.SecurityError`, which the renderer reports as bad input.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, cast

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

__all__ = ["MAX_OUTPUT_CHARS", "MAX_SECONDS", "MAX_STEPS", "LimitedEnvironment", "render"]

#: Loop iterations of one render, all loops together.
MAX_STEPS = 1_000_000
#: Characters one render may produce.
MAX_OUTPUT_CHARS = 1 << 24
#: Seconds one render may take (checked at every loop iteration and output chunk).
MAX_SECONDS = 5.0
#: Items a repetition (``'ab' * n``, ``[x] * n``) may build.
MAX_REPEAT = 1 << 22
#: The largest exponent ``**`` takes with a base other than -1, 0 and 1.
MAX_EXPONENT = 256

_LOOP_BUDGET = "ft_counted"
_SIZE_BOUND = "ft_sized"


class _Budget:
    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise SecurityError(f"the template loops more than {MAX_STEPS} times")
        self.check_time()

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise SecurityError(f"the template ran longer than {MAX_SECONDS:g} s")


_budget: ContextVar[_Budget | None] = ContextVar("freetoken_template_budget", default=None)


def _counted(iterable: Iterable[Any]) -> Iterator[Any]:
    budget = _budget.get()
    for item in iterable:
        if budget is not None:
            budget.step()
        yield item


def _sized(value: Any) -> Any:
    """A ``~`` concatenation's result, refused past the output bound."""
    if isinstance(value, str) and len(value) > MAX_OUTPUT_CHARS:
        raise SecurityError(f"a string of more than {MAX_OUTPUT_CHARS} characters")
    return value


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, str | bytes | list | tuple) else None


class _Bound(NodeTransformer):
    """Passes each loop's iterable through the loop budget and each ``~`` through the size
    bound."""

    def _wrap(self, fn: str, node: nodes.Expr) -> nodes.Expr:
        call = nodes.Call(nodes.Name(fn, "load"), [node], [], None, None)
        call.set_lineno(node.lineno)
        return call

    def visit_For(self, node: nodes.For) -> nodes.Node:  # noqa: N802 (jinja2 visitor name)
        self.generic_visit(node)
        node.iter = self._wrap(_LOOP_BUDGET, cast(nodes.Expr, node.iter))
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:  # noqa: N802 (jinja2 visitor name)
        self.generic_visit(node)
        return self._wrap(_SIZE_BOUND, node)


class LimitedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every ``for`` loop counted and ``~``, ``+``, ``*``, ``**`` bounded."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.globals[_LOOP_BUDGET] = _counted
        self.globals[_SIZE_BOUND] = _sized

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        if operator == "+":
            a, b = _size(left), _size(right)
            if a is not None and b is not None and a + b > MAX_OUTPUT_CHARS:
                raise SecurityError(f"a sum of more than {MAX_OUTPUT_CHARS} items")
        elif operator == "*":
            for seq, n in ((left, right), (right, left)):
                size = _size(seq)
                if size is not None and isinstance(n, int) and max(size, 1) * n > MAX_REPEAT:
                    raise SecurityError(f"a repetition of more than {MAX_REPEAT} items")
        elif (
            isinstance(left, int | float)
            and isinstance(right, int | float)
            and abs(right) > MAX_EXPONENT
            and left not in (-1, 0, 1)
        ):
            raise SecurityError(f"an exponent above {MAX_EXPONENT}")
        return super().call_binop(context, operator, left, right)

    def compile_limited(self, source: str) -> jinja2.Template:
        """``source`` compiled with its loops and concatenations bounded."""
        ast = _Bound().visit(self.parse(source))
        ast.set_environment(self)
        return self.from_string(ast)


@contextmanager
def _limits() -> Iterator[_Budget]:
    token = _budget.set(_Budget())
    try:
        budget = _budget.get()
        assert budget is not None
        yield budget
    finally:
        _budget.reset(token)


def render(template: jinja2.Template, **variables: Any) -> str:
    """Renders ``template`` (from :meth:`LimitedEnvironment.compile_limited`) within the
    bounds; SecurityError past one."""
    out: list[str] = []
    n = 0
    with _limits() as budget:
        for chunk in template.generate(**variables):
            n += len(chunk)
            if n > MAX_OUTPUT_CHARS:
                raise SecurityError(f"the template's output is over {MAX_OUTPUT_CHARS} characters")
            budget.check_time()
            out.append(chunk)
    return "".join(out)
