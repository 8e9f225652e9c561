"""Chat templates: ``tokenizer.chat_template`` rendered with jinja2 the way transformers does.

The environment matches transformers' choices: a sandbox whose values are immutable (bounded
in loops, output and time as well: tokenizer/sandbox.py),
``trim_blocks`` and ``lstrip_blocks``, the loop-controls extension, a ``{% generation %}`` block
(rendered as its body), a ``tojson`` filter that keeps non-ASCII text and takes ``indent``, and
the ``raise_exception`` and ``strftime_now`` globals.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, Protocol

from freetoken.errors import GGUFError, InvalidInputError

if TYPE_CHECKING:
    import jinja2

    from freetoken.tokenizer.sandbox import LimitedEnvironment

__all__ = [
    "CHATML_TEMPLATE",
    "GEMMA_TEMPLATE",
    "TokenIds",
    "fallback_template",
    "render_chat_template",
]

#: ChatML: what llama.cpp uses for a file without a chat template.
CHATML_TEMPLATE = (
    "{%- for message in messages -%}\n"
    "  {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<|im_start|>assistant\\n' -}}\n"
    "{%- endif -%}"
)

#: Gemma's turn format, for Gemma files that carry no template (the Gemma 3 270M GGUF has
#: none): ``<start_of_turn>{user|model}\n{content}<end_of_turn>\n``, the assistant role named
#: ``model``, system text (trimmed, as llama.cpp's built-in ``gemma`` format does) put in front
#: of the next user turn, and BOS text first as in the released templates.
GEMMA_TEMPLATE = """{{- bos_token -}}
{%- set ns = namespace(system='') -%}
{%- for message in messages -%}
    {%- if message['content'] is string -%}
        {%- set content = message['content'] | trim -%}
    {%- else -%}
        {%- set content = namespace(text='') -%}
        {%- for part in message['content'] -%}
            {%- if part['type'] == 'text' -%}
                {%- set content.text = content.text ~ (part['text'] | trim) -%}
            {%- endif -%}
        {%- endfor -%}
        {%- set content = content.text -%}
    {%- endif -%}
    {%- if message['role'] == 'system' -%}
        {%- set ns.system = ns.system ~ content -%}
    {%- else -%}
        {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}
        {{- '<start_of_turn>' ~ role ~ '\n' -}}
        {%- if ns.system and role != 'model' -%}
            {{- ns.system ~ '\n\n' -}}
            {%- set ns.system = '' -%}
        {%- endif -%}
        {{- content ~ '<end_of_turn>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<start_of_turn>model\n' -}}
{%- endif -%}"""


class TokenIds(Protocol):
    """A vocabulary's lookup of a token's id (``Tokenizer`` has it)."""

    def token_to_id(self, text: str) -> int | None: ...


def fallback_template(tokenizer: TokenIds) -> str:
    """The template for a file without ``tokenizer.chat_template``: Gemma's format when the
    vocabulary has Gemma's turn tokens, else ChatML (as llama.cpp)."""
    if (
        tokenizer.token_to_id("<start_of_turn>") is not None
        and tokenizer.token_to_id("<end_of_turn>") is not None
    ):
        return GEMMA_TEMPLATE
    return CHATML_TEMPLATE


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own tojson escapes HTML characters and always sorts keys; templates expect
    # plain JSON. Filters such as ``map`` yield generators: dump those as lists.
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_json_default,
    )


def _json_default(value: Any) -> Any:
    if isinstance(value, Iterator):
        return list(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment() -> LimitedEnvironment:
    import jinja2
    import jinja2.ext
    from jinja2 import nodes

    from freetoken.tokenizer.sandbox import LimitedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """``{% generation %}...{% endgeneration %}`` (marks assistant text for training
        masks in transformers): rendered as its body."""

        tags = {"generation"}  # noqa: RUF012 (jinja2 declares it a plain set attribute)

        def parse(self, parser: Any) -> list[nodes.Node]:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    env = LimitedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    import jinja2

    try:
        return _environment().compile_limited(template)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise GGUFError(f"the chat template does not compile: {e} (line {e.lineno})") from None
    except RecursionError:
        raise GGUFError("the chat template does not compile: it nests too deeply") from None


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    documents: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """Renders ``template`` for ``messages``, as transformers' ``apply_chat_template`` does
    (``tokenize=False``). Raises :class:`~freetoken.errors.InvalidInputError` when the template
    rejects the conversation (``raise_exception``) or fails on it."""
    import jinja2

    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidInputError("messages must be a list of {'role': ..., 'content': ...} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise InvalidInputError(f"messages[{i}] must be a dict with a 'role'")
    from freetoken.tokenizer.sandbox import render

    compiled = _compile(template)
    try:
        return render(
            compiled,
            messages=[dict(m) for m in messages],
            tools=list(tools) if tools is not None else None,
            documents=list(documents) if documents is not None else None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as e:
        raise InvalidInputError(f"chat template: {e}") from None
    except (
        TypeError,
        ValueError,
        KeyError,
        AttributeError,
        IndexError,
        RecursionError,
        OverflowError,
    ) as e:
        raise InvalidInputError(f"chat template failed on this conversation: {e}") from None
