"""Chat-template rendering, and the tokens that continue a conversation.

`ChatRenderer.render(messages, tools, kwargs)` is the tokenizer's chat
template with a generation prompt (`apply_chat_template`; control-token text
inside messages is encoded as plain text, so a tool's output cannot close a
turn). That is how a conversation is tokenized the first time.

A later call whose messages extend an earlier turn's conversation is never
rendered again: its prompt is the earlier turn's prompt and sampled tokens,
verbatim, plus `bridge(tail)`: the tokens the template puts after an
assistant turn's end token and around the new messages (tool results, a user
message), up to the next generation prompt. They are found as in verifiers'
token client: render a one-message conversation `[dummy assistant]`, and the
same followed by the tail with a generation prompt; the first must be a
token prefix of the second, and the bridge is what follows its last
turn-end token. A template for which that does not hold (one that rewrites
earlier turns when a message is added, or needs a user message first)
gives None, and the caller renders the whole conversation instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable
from typing import Any

from realrl.base.http_body import BodyError

MAX_CACHED_BASES = 256


@dataclasses.dataclass(frozen=True)
class Bridge:
    turn_end: int  # the token the previous assistant turn must have ended with
    ids: list[int]  # what follows it, through the generation prompt


class ChatRenderer:
    def __init__(self, tokenizer: Any, turn_end_ids: Iterable[int]):
        self.tokenizer = tokenizer
        self.turn_end_ids = frozenset(int(t) for t in turn_end_ids)
        self._bases: dict[str, list[int] | None] = {}  # dummy renders, by tools and template variables

    def render(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        template_kwargs: dict | None = None,
        generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of the conversation; BodyError (400) when the template
        refuses it (or the tokenizer has none)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise BodyError("the model's tokenizer has no chat template: it cannot render chat messages")
        try:
            ids = self.tokenizer.apply_chat_template(
                messages,
                tools=tools or None,
                add_generation_prompt=generation_prompt,
                tokenize=True,
                return_dict=False,
                sanitize_control_tokens=True,
                **(template_kwargs or {}),
            )
        except Exception as e:  # the template's own raise_exception, or a missing variable
            raise BodyError(f"the chat template cannot render these messages: {type(e).__name__}: {e}") from None
        return [int(t) for t in ids]

    def bridge(self, tail: list[dict], tools: list[dict] | None, template_kwargs: dict | None) -> Bridge | None:
        """The tokens between an assistant turn's end and the next generation
        prompt when `tail` (tool results and/or user messages) follows it; None
        when this template cannot be continued that way."""
        dummy = {"role": "assistant", "content": "x"}
        ids = [m["tool_call_id"] for m in tail if m.get("role") == "tool" and m.get("tool_call_id")]
        if ids:
            dummy["tool_calls"] = [
                {"id": i, "type": "function", "function": {"name": "f", "arguments": {}}} for i in ids
            ]
        key = json.dumps([dummy, tools, template_kwargs], sort_keys=True, default=str)
        if key not in self._bases:
            if len(self._bases) >= MAX_CACHED_BASES:  # tool-call ids make many keys
                self._bases.clear()
            try:
                self._bases[key] = self.render([dummy], tools, template_kwargs, generation_prompt=False)
            except BodyError:
                self._bases[key] = None
        base = self._bases[key]
        if base is None:
            return None
        try:
            full = self.render([dummy, *tail], tools, template_kwargs, generation_prompt=True)
        except BodyError:
            return None
        if full[: len(base)] != base:
            return None
        ends = [i for i, t in enumerate(base) if t in self.turn_end_ids]
        if not ends:
            return None
        return Bridge(turn_end=base[ends[-1]], ids=full[ends[-1] + 1 :])
