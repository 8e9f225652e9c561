"""Chat messages to prompt text through the model's template, tools included.

A template that knows tools (it mentions ``tools``) gets them as they are. For one that does
not (Gemma 3's, for instance) the tools are described in the system message with the Hermes
``<tool_call>`` convention, earlier calls are written back in that form and tool results
become user turns, so any chat model can take part in a tool conversation and its calls are
parsed by :mod:`freetoken.server.toolcalls`.
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from freetoken.errors import RequestError
from freetoken.server.toolcalls import HERMES_CLOSE, HERMES_OPEN, THINK_OPEN

__all__ = ["ChatTokenizer", "render_chat", "starts_in_reasoning"]

TOOLS_PREAMBLE = (
    "You can call functions. To call one, reply with a block of this exact form, one per "
    "call:\n"
    f'{HERMES_OPEN}\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    f"{HERMES_CLOSE}\n\nThe functions:\n"
)


class ChatTokenizer(Protocol):
    """What rendering needs of a tokenizer."""

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str: ...


def _call_text(call: dict[str, Any]) -> str:
    fn = call["function"]
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"


def _tool_instructions(tools: list[dict[str, Any]], choice: str | dict[str, Any]) -> str:
    lines = [json.dumps(t["function"], ensure_ascii=False) for t in tools]
    text = TOOLS_PREAMBLE + "\n".join(lines)
    if choice == "required":
        text += "\n\nCall at least one function now."
    elif isinstance(choice, dict):
        text += f"\n\nCall the function {choice['function']['name']} now."
    return text


def _fallback(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    choice: str | dict[str, Any],
) -> list[dict[str, Any]]:
    """Messages rewritten for a template without tool support."""
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        elif role == "tool":
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        if out and out[-1]["role"] == role == "user":
            # Tool results after one another: templates that require alternation need one turn.
            out[-1]["content"] += "\n" + content
        else:
            out.append({"role": role, "content": content})
    if tools and choice != "none":
        text = _tool_instructions(tools, choice)
        if out and out[0]["role"] == "system":
            out[0]["content"] = f"{out[0]['content']}\n\n{text}"
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def render_chat(
    tokenizer: ChatTokenizer,
    template: str | None,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    tool_choice: str | dict[str, Any],
) -> str:
    """The prompt text of a conversation, ending with the assistant's turn opened."""
    native = template is not None and "tools" in template
    if native:
        msgs, tpl_tools = messages, (tools if tool_choice != "none" else None)
    else:
        msgs, tpl_tools = _fallback(messages, tools, tool_choice), None
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tools=tpl_tools)
    except RequestError:
        raise
    except Exception as e:  # the template's own raise_exception, or a malformed conversation
        raise RequestError(
            f"the chat template rejected the conversation: {e}",
            param="messages",
            code="invalid_conversation",
        ) from None


def starts_in_reasoning(prompt: str) -> bool:
    """True when the template opened a think block for the reply (Qwen 3 style)."""
    return prompt.rstrip().endswith(THINK_OPEN)
