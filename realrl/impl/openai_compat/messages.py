"""Chat messages as the chat template gets them, and as turns are matched.

An agent sends its conversation back on every call, with earlier replies
echoed in one of three shapes (the `ChatCompletionMessage` itself, its
`model_dump()` with null extras, or `model_dump(exclude_none=True)`), content
as a string or a list of text parts, and tool-call arguments as the JSON
string realrl returned or as an object it built by hand. Two views remove
those differences:

- `template_message(m)`: the dict `apply_chat_template` renders: null keys
  dropped, content a string, `developer` as `system`, tool-call arguments an
  object when they are a JSON object (Hugging Face templates expect that;
  Qwen2.5's would print a string argument JSON-encoded a second time);
- `message_key(m)`: what decides that two messages are the same when a call
  is matched to an earlier turn: role, text (null = ""), reasoning, and each
  tool call's name and arguments compared as parsed JSON. Tool-call ids are
  left out (an agent that rebuilds a message may invent its own).
"""

from __future__ import annotations

import json
from typing import Any

from realrl.api.openai_api import Message, ToolCall
from realrl.base.http_body import BodyError


def text_of(content: Any, where: str = "content") -> str:
    """A message's content as one string; only text parts are supported."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for i, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise BodyError(f"field '{where}[{i}]': only text content parts are supported, got type {part.type!r}")
        texts.append(part.text)
    return "".join(texts)


def _arguments_value(arguments: str | dict) -> Any:
    """The arguments as a JSON value when they parse, else the raw string."""
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _template_tool_call(call: ToolCall) -> dict:
    value = _arguments_value(call.function.arguments)
    out = {
        "type": "function",
        "function": {
            "name": call.function.name,
            "arguments": value if isinstance(value, dict) else call.function.arguments,
        },
    }
    if call.id is not None:
        out["id"] = call.id
    return out


def template_message(message: Message, index: int = 0) -> dict:
    where = f"messages[{index}].content"
    out: dict[str, Any] = {
        "role": "system" if message.role == "developer" else message.role,
        "content": text_of(message.content, where),
    }
    if message.tool_calls:
        out["tool_calls"] = [_template_tool_call(c) for c in message.tool_calls]
    for key in ("name", "tool_call_id", "reasoning_content"):
        value = getattr(message, key)
        if value is not None:
            out[key] = value
    return out


def message_key(message: Message) -> tuple:
    calls = tuple(
        (c.function.name, json.dumps(_arguments_value(c.function.arguments), sort_keys=True, ensure_ascii=False))
        for c in message.tool_calls or ()
    )
    role = "system" if message.role == "developer" else message.role
    return role, text_of(message.content), message.reasoning_content or "", calls
