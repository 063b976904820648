"""Tool calls out of the model's text: pluggable parsers by name.

A parser takes the decoded text of one sampled answer (special tokens
skipped) and returns a `ParsedReply`: the text left for `message.content`
and the calls found. `arguments` is always a JSON string, the exact text the
model wrote when that is valid JSON, so an agent that echoes the call back
sends what was sampled. A call that does not parse leaves the whole text as
content and no call (as SGLang's and AReaL's parsers do): the episode goes
on, and the reward decides what a malformed call is worth.

Built in: `"hermes"` (also `"qwen"`), the `<tool_call>{"name": ..., "arguments":
{...}}</tool_call>` blocks of Hermes, Qwen2.5 and Qwen3 chat templates.
Register another with `register_tool_parser(name, fn)`, or name a function
by `path.py:fn` / `module:fn` (`rollout.agent.args.tool_parser`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

from realrl.base.registry import Registry


@dataclasses.dataclass
class ParsedToolCall:
    name: str
    arguments: str  # a JSON string


@dataclasses.dataclass
class ParsedReply:
    content: str | None
    tool_calls: list[ParsedToolCall] = dataclasses.field(default_factory=list)


ToolParser = Callable[[str], ParsedReply]
TOOL_PARSERS: Registry[ParsedReply] = Registry("tool-call parser")


def register_tool_parser(name: str, parser: ToolParser) -> None:
    TOOL_PARSERS.register(name, parser)


_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_ARGUMENTS_KEY = re.compile(r'"arguments"\s*:\s*')
_DECODER = json.JSONDecoder()


def _raw_arguments(block: str, value: object) -> str:
    """The arguments exactly as written in `block` when that text decodes to
    `value`, else `value` re-encoded."""
    for match in _ARGUMENTS_KEY.finditer(block):
        try:
            decoded, end = _DECODER.raw_decode(block, match.end())
        except ValueError:
            continue
        if decoded == value:
            return block[match.end() : end]
    return json.dumps(value, ensure_ascii=False)


def parse_hermes(text: str) -> ParsedReply:
    blocks = list(_HERMES_BLOCK.finditer(text))
    if not blocks:
        return ParsedReply(text)
    calls = []
    for block in blocks:
        body = block.group(1).strip()
        try:
            call = json.loads(body)
        except ValueError:
            return ParsedReply(text)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str) or not call["name"]:
            return ParsedReply(text)
        arguments = call.get("arguments", {})
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            raw = arguments
        else:
            raw = _raw_arguments(body, arguments)
        calls.append(ParsedToolCall(call["name"], raw))
    content = _HERMES_BLOCK.sub("", text).strip()
    return ParsedReply(content or None, calls)


register_tool_parser("hermes", parse_hermes)
register_tool_parser("qwen", parse_hermes)
