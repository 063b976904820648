"""Tool calls out of the model's text, and messages in the shapes agents send them."""

from __future__ import annotations

import json

import pytest

from realrl.api.openai_api import Message
from realrl.base.http_body import BodyError, from_json
from realrl.impl.openai_compat.messages import message_key, template_message
from realrl.impl.openai_compat.tool_calls import TOOL_PARSERS, ParsedReply, ParsedToolCall, parse_hermes


@pytest.mark.parametrize(
    "text, expected",
    [
        ("It is 3.", ParsedReply("It is 3.")),
        (
            'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1,"b":2}}\n</tool_call>',
            ParsedReply("Let me add.", [ParsedToolCall("add", '{"a": 1,"b":2}')]),  # exactly as written
        ),
        (
            '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": "{\\"x\\": 1}"}'
            "</tool_call>",
            ParsedReply(None, [ParsedToolCall("a", "{}"), ParsedToolCall("b", '{"x": 1}')]),
        ),
        ('<tool_call>{"name": "a"}</tool_call>', ParsedReply(None, [ParsedToolCall("a", "{}")])),
        # Malformed: the whole text stays content, no call.
        ('<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', None),
        ('<tool_call>{"arguments": {}}</tool_call>', None),
        ('ok <tool_call>{"name": "add"', None),
    ],
)
def test_hermes_tool_calls(text, expected):
    parsed = parse_hermes(text)
    assert parsed == (expected or ParsedReply(text))
    for call in parsed.tool_calls:
        json.loads(call.arguments)  # always a JSON string


def test_tool_parsers_are_found_by_name_or_by_path(tmp_path):
    path = tmp_path / "my_parser.py"
    path.write_text(
        "from realrl.impl.openai_compat.tool_calls import ParsedReply\n\n"
        "def parse(text):\n    return ParsedReply(text.upper())\n"
    )
    assert TOOL_PARSERS.get("qwen") is parse_hermes
    assert TOOL_PARSERS.get(f"{path}:parse")("hi") == ParsedReply("HI")


REPLY = {
    "role": "assistant",
    "content": None,
    "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}],
}


@pytest.mark.parametrize(
    "echo",
    [
        REPLY,  # the message object, serialised by the client
        {**REPLY, "refusal": None, "annotations": None, "audio": None, "function_call": None},  # model_dump()
        {k: v for k, v in REPLY.items() if v is not None},  # model_dump(exclude_none=True)
        {**REPLY, "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},  # by hand
    ],
)
def test_an_echoed_reply_is_the_same_message_in_every_shape(echo):
    assert message_key(from_json(Message, echo)) == message_key(from_json(Message, REPLY))


def test_messages_as_the_chat_template_gets_them():
    parts = from_json(
        Message, {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]}
    )
    assert template_message(parts) == {"role": "system", "content": "Be brief."}
    # Arguments that are a JSON object reach the template as one (HF templates expect that).
    assert template_message(from_json(Message, REPLY))["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    image = from_json(Message, {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]})
    with pytest.raises(BodyError, match=r"messages\[3\].content\[0\]': only text"):
        template_message(image, 3)
