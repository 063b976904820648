"""Token-in, token-out: every chat call of an episode recorded as the exact
tokens the policy saw and sampled (docs/design.md §5, §11).

`EpisodeRecorder.plan(...)` decides a call's prompt ids. When the call's
messages extend an earlier turn's conversation (its messages, then the reply
realrl returned, then only tool results and user messages), the prompt is
that turn's prompt ids and sampled ids, verbatim, plus the template's bridge
to the new messages (`ChatRenderer.bridge`). The earlier tokens are never
decoded and encoded again, so what was sampled stays what is trained: no BPE
re-split, no re-formatted tool-call JSON, no whitespace the agent trimmed,
no reasoning a template strips from history. Otherwise (the first call, a
conversation the agent rewrote, other tools, a previous turn that ended by
length or a stop string and so has no turn-end token) the messages are
rendered from scratch, and the turn starts a sequence of its own.

`add(...)` records each sampled answer as a `Turn` (prompt ids, sampled ids,
behaviour logprobs, per-token weight versions, sampling parameters), and
`sequences(style)` exports them:

- `"chains"`: one sequence per maximal chain of turns that extend each other
  token for token (turn j extends turn i when j's prompt starts with i's
  prompt + sampled ids) and share their sampling parameters. The sequence is
  the last turn's prompt + sampled ids; `prompt_len` is the first turn's
  prompt; `loss_mask` marks the sampled tokens of every turn of the chain
  (tool results, user turns and template tokens between them are context:
  mask 0, logprob 0, version -1). Each turn belongs to one chain: when two
  turns extend the same one (an agent forked its conversation), the first
  continues the chain and the other starts its own sequence.
- `"turns"`: one sequence per turn (its prompt + its sampled ids).

Decisions are on tokens, not on messages, so whatever the agent did to its
messages, a chain is exactly what was sampled in that order.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Literal

import numpy as np

from realrl.api.generation_api import GenerationResult
from realrl.api.openai_api import Message
from realrl.api.trajectory import Sampling
from realrl.impl.openai_compat.messages import message_key
from realrl.impl.openai_compat.rendering import ChatRenderer

CONTEXT_VERSION = -1  # the weight version recorded for a context token inside a completion


@dataclasses.dataclass
class Turn:
    """One sampled answer of one chat call."""

    prompt_ids: list[int]
    result: GenerationResult  # this answer alone (group size 1)
    messages: tuple  # message_key of each request message
    reply: tuple  # message_key of the assistant message realrl returned
    context: str  # the tools and template variables it was rendered with
    sampling: tuple  # (temperature, top_p, top_k) it was drawn with
    stitched_onto: int | None  # the turn whose tokens its prompt reuses; None: rendered

    @property
    def output_ids(self) -> list[int]:
        return self.result.output_ids[0]


@dataclasses.dataclass
class PromptPlan:
    """A call's prompt ids and where they came from."""

    prompt_ids: list[int]
    messages: tuple  # message_key of each request message
    context: str
    parent: int | None  # the turn whose prompt and sampled ids it starts with; None: rendered
    how: str  # "stitched", or why the messages were rendered from scratch


@dataclasses.dataclass
class RecordedSequence:
    """One trainable sequence: `input_ids` = prompt + completion; per
    completion token its loss mask, behaviour logprob and weight version."""

    input_ids: np.ndarray  # int32
    prompt_len: int
    loss_mask: np.ndarray  # bool, one per completion token
    logprobs: np.ndarray  # float32, 0 on context tokens
    sampling_logprobs: np.ndarray  # float32, under the distribution each token was drawn from; 0 on context tokens
    versions: np.ndarray  # int32, CONTEXT_VERSION on context tokens
    no_eos: bool  # its last turn ended by the length budget
    version_start: int
    version_end: int
    turns: list[int]  # the recorded turns it holds, in order
    sampling: Sampling | None = None  # what its turns were drawn with (a chain's turns share it)


class EpisodeRecorder:
    def __init__(self, renderer: ChatRenderer):
        self.renderer = renderer
        self.turns: list[Turn] = []
        self.prompts: collections.Counter = collections.Counter()  # how prompts were made: stitched / rendered (why)

    # ---- while the episode runs -------------------------------------------------
    def plan(
        self,
        messages: list[Message],
        rendered_messages: list[dict],
        tools: list[dict] | None,
        template_kwargs: dict[str, Any] | None,
        context: str,
    ) -> PromptPlan:
        """The prompt ids for a call (see the module docstring). `messages`
        are the request's, `rendered_messages` the same as the template gets
        them (`messages.template_message`); `context` names the tools and
        template variables (a turn rendered with others is never extended)."""
        keys = tuple(message_key(m) for m in messages)
        parent, how = self._parent(keys, rendered_messages, context)
        if parent is not None:
            turn = self.turns[parent]
            bridge = self.renderer.bridge(rendered_messages[len(turn.messages) + 1 :], tools, template_kwargs)
            if bridge is None:
                parent, how = None, "the chat template cannot be continued without rendering earlier turns"
            elif turn.output_ids[-1] != bridge.turn_end:
                parent, how = None, "the previous turn did not end with the template's turn-end token"
            else:
                self.prompts["stitched"] += 1
                return PromptPlan(turn.prompt_ids + turn.output_ids + bridge.ids, keys, context, parent, "stitched")
        self.prompts[f"rendered: {how}"] += 1
        ids = self.renderer.render(rendered_messages, tools, template_kwargs)
        return PromptPlan(ids, keys, context, None, how)

    def _parent(self, keys: tuple, rendered: list[dict], context: str) -> tuple[int | None, str]:
        """The recorded turn whose conversation, reply included, the call
        continues with new tool or user messages (the longest; the latest of
        equals), or None and why not."""
        best, how = None, "first call" if not self.turns else "no earlier turn's conversation and reply start it"
        for i, turn in enumerate(self.turns):
            k = len(turn.messages)
            if k + 1 >= len(keys) or turn.messages != keys[:k] or turn.reply != keys[k]:
                continue
            if turn.context != context:
                how = "other tools or template variables than the turn it continues"
                continue
            if best is None or k >= len(self.turns[best].messages):
                best = i
        if best is None:
            return None, how
        turn = self.turns[best]
        if any(m["role"] in ("assistant", "system") for m in rendered[len(turn.messages) + 1 :]):
            return None, "the new messages hold an assistant or system message"
        if turn.result.no_eos[0] or not turn.output_ids:
            return None, "the previous turn ended by length"
        return best, "stitched"

    def add(self, plan: PromptPlan, answer: GenerationResult, reply: Message, sampling: tuple) -> int:
        """Records one sampled answer (a group-size-1 result) of the call
        `plan` was made for, and the reply returned for it; its index."""
        self.turns.append(
            Turn(
                prompt_ids=list(plan.prompt_ids),
                result=answer,
                messages=plan.messages,
                reply=message_key(reply),
                context=plan.context,
                sampling=sampling,
                stitched_onto=plan.parent,
            )
        )
        return len(self.turns) - 1

    # ---- at the episode's end -------------------------------------------------------
    def chains(self) -> list[list[int]]:
        """Turn indices of each maximal chain (see the module docstring)."""
        chains: list[list[int]] = []
        tail_of: dict[int, int] = {}  # last turn of a chain -> the chain's index
        for j, turn in enumerate(self.turns):
            best = None
            for i in tail_of:
                if i < j and self._extends(turn, self.turns[i]):
                    if best is None or _length(self.turns[i]) > _length(self.turns[best]):
                        best = i
            if best is None:
                chains.append([j])
                tail_of[j] = len(chains) - 1
            else:
                chain = tail_of.pop(best)
                chains[chain].append(j)
                tail_of[j] = chain
        return chains

    @staticmethod
    def _extends(turn: Turn, earlier: Turn) -> bool:
        n = len(earlier.prompt_ids)
        m = n + len(earlier.output_ids)
        return (
            turn.sampling == earlier.sampling
            and len(turn.prompt_ids) >= m
            and turn.prompt_ids[:n] == earlier.prompt_ids
            and turn.prompt_ids[n:m] == earlier.output_ids
        )

    def sequences(self, style: Literal["chains", "turns"] = "chains") -> list[RecordedSequence]:
        groups = self.chains() if style == "chains" else [[j] for j in range(len(self.turns))]
        return [self._sequence(chain) for chain in groups]

    def _sequence(self, chain: list[int]) -> RecordedSequence:
        first, last = self.turns[chain[0]], self.turns[chain[-1]]
        input_ids = np.asarray(last.prompt_ids + last.output_ids, dtype=np.int32)
        prompt_len = len(first.prompt_ids)
        n = len(input_ids) - prompt_len
        loss_mask = np.zeros(n, dtype=np.bool_)
        logprobs = np.zeros(n, dtype=np.float32)
        sampling_logprobs = np.zeros(n, dtype=np.float32)
        versions = np.full(n, CONTEXT_VERSION, dtype=np.int32)
        for j in chain:
            turn = self.turns[j]
            start = len(turn.prompt_ids) - prompt_len
            span = slice(start, start + len(turn.output_ids))
            loss_mask[span] = True
            logprobs[span] = turn.result.output_logprobs[0]
            filtered = turn.result.output_sampling_logprobs
            sampling_logprobs[span] = turn.result.output_logprobs[0] if filtered is None else filtered[0]
            versions[span] = turn.result.output_versions[0]
        return RecordedSequence(
            input_ids=input_ids,
            prompt_len=prompt_len,
            loss_mask=loss_mask,
            logprobs=logprobs,
            sampling_logprobs=sampling_logprobs,
            versions=versions,
            no_eos=bool(last.result.no_eos[0]),
            version_start=min(self.turns[j].result.version_start[0] for j in chain),
            version_end=max(self.turns[j].result.version_end[0] for j in chain),
            turns=list(chain),
            sampling=last.result.sampling,
        )


def _length(turn: Turn) -> int:
    return len(turn.prompt_ids) + len(turn.output_ids)
