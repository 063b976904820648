"""One episode's chat calls: request in, recorded turns and OpenAI's answer out.

`ChatSession.complete(request)` is everything the endpoint does for one
`chat.completions` call, without HTTP:

1. check what the request asks for (`check_request`: 400 for what realrl
   cannot honour, naming the field);
2. the prompt ids (`EpisodeRecorder.plan`: the earlier turns' tokens
   verbatim where the conversation continues one, else the chat template);
3. `n` answers through the episode's `generate` (the rollout worker's
   partial rollouts: interruptible, per-token weight versions, behaviour
   logprobs), at most `max_completion_tokens` each and within the model's
   context;
4. per answer: cut at the first stop string (the tokens through the one that
   completes it are kept; the text before it is the content), tool calls
   parsed from the text, the answer recorded as a turn, and a choice in
   OpenAI's shape: `finish_reason` is `tool_calls` when a call was parsed,
   `length` when the budget ended it, `stop` otherwise.

A generation failure is kept on the session (`failure`): the agent's call
gets a 500 (the episode then fails with the original error, as any agent's
generation failure does).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

from realrl.api.generation_api import (
    MIN_TEMPERATURE,
    GenerationHyperparameters,
    GenerationResult,
    SamplingParamError,
)
from realrl.api.openai_api import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    FunctionCall,
    Message,
    ReplyFunction,
    ReplyMessage,
    ReplyToolCall,
    TokenLogprob,
    ToolCall,
    Usage,
)
from realrl.api.served_sampling import SamplingRefused, ServedSampling
from realrl.base.http_body import BodyError, to_json
from realrl.impl.openai_compat.messages import template_message
from realrl.impl.openai_compat.rendering import ChatRenderer
from realrl.impl.openai_compat.tool_calls import ParsedReply, ToolParser
from realrl.impl.openai_compat.turns import EpisodeRecorder

# (prompt ids, n, sampling parameters) -> n answers; see `ChatSession`.
Generate = Callable[[list[int], int, GenerationHyperparameters], Awaitable[GenerationResult]]


class ContextLengthExceeded(BodyError):
    """The prompt leaves no room for a new token (OpenAI's `context_length_exceeded`)."""

    def __init__(self, message: str):
        super().__init__(message, reason="context_length_exceeded")


@dataclasses.dataclass
class ChatConfig:
    """What every episode of one agent shares."""

    tokenizer: Any
    renderer: ChatRenderer
    gconfig: GenerationHyperparameters  # the run's sampling parameters (defaults for a call)
    tool_parser: ToolParser
    max_context_tokens: int | None = None  # prompt + new tokens at most (None: no limit known)
    # What the generation backend serves (`_check_sampling`: what it refuses is a 400), per release.
    served: ServedSampling = dataclasses.field(default_factory=ServedSampling)


def check_request(request: ChatCompletionRequest, config: ChatConfig) -> None:
    """BodyError (400) for what the endpoint cannot honour."""

    def refuse(field: str, message: str) -> None:
        raise BodyError(f"field {field!r}: {message}", reason="unsupported")

    if request.stream is not True and request.stream_options is not None:
        refuse("stream_options", "only with stream=true")
    if request.top_logprobs:
        refuse("top_logprobs", "alternatives to the sampled token are not reported; use 0")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):
            refuse(name, "penalties are not supported; use 0")
    if request.logit_bias:
        refuse("logit_bias", "not supported")
    if request.response_format is not None and request.response_format.type != "text":
        refuse("response_format", f"{request.response_format.type!r} is not supported (text only)")
    if request.tool_choice == "required" or not isinstance(request.tool_choice, (str, type(None))):
        refuse("tool_choice", "sampling is not constrained to a tool call; use 'auto' or 'none'")
    if request.top_p is not None and not 0 < request.top_p <= 1:
        refuse("top_p", f"must be in (0, 1], got {request.top_p}")
    if request.top_k is not None and not (request.top_k == -1 or request.top_k >= 1):
        refuse("top_k", f"must be -1 (off) or >= 1, got {request.top_k}")
    if request.max_tokens is not None and request.max_completion_tokens is not None:
        if request.max_tokens != request.max_completion_tokens:
            refuse("max_tokens", "differs from max_completion_tokens; give one of them")
    # A call's own temperature is fine: each turn records what it was sampled
    # with, and the trainer recomputes its logprobs at that temperature.
    if request.stop is not None and any(not s for s in _stop_strings(request)):
        refuse("stop", "stop strings must be non-empty")


def _stop_strings(request: ChatCompletionRequest) -> list[str]:
    if request.stop is None:
        return []
    return [request.stop] if isinstance(request.stop, str) else list(request.stop)


@dataclasses.dataclass
class _Answer:
    """One choice: the recorded answer and its reply."""

    result: GenerationResult  # group size 1, cut at a stop string
    text: str
    parsed: ParsedReply
    finish_reason: str


class ChatSession:
    """One episode's endpoint state. `generate(prompt_ids, n, gconfig)` is the
    episode's generation path; `qid` and `row` describe its prompt (an
    external agent gets them when it opens the episode)."""

    def __init__(self, config: ChatConfig, generate: Generate, qid: str = "", row: dict | None = None):
        self.config = config
        self.generate = generate
        self.qid = qid
        self.row = row or {}
        self.key = secrets.token_urlsafe(18)  # the episode's part of its base URL
        self.recorder = EpisodeRecorder(config.renderer)
        self.failure: BaseException | None = None  # a generation error the agent saw as a 500
        self.calls = 0
        self.closed: asyncio.Future | None = None  # external agents: resolved with the reward at close

    async def complete(
        self, request: ChatCompletionRequest, deliver: Callable[[ChatCompletion], Awaitable[None]] | None = None
    ) -> ChatCompletion:
        """The answer to one call, its turns recorded once `deliver(answer)`
        (the endpoint: sending it) returned: a reply the agent never got
        (it gave up, the connection is gone) is not trained on."""
        config = self.config
        check_request(request, config)
        rendered = [template_message(m, i) for i, m in enumerate(request.messages)]
        tools = [to_json(t) for t in request.tools] if request.tools else None
        kwargs = dict(request.chat_template_kwargs or {})
        context = json.dumps([tools, kwargs], sort_keys=True, default=str)
        plan = self.recorder.plan(request.messages, rendered, tools, kwargs, context)
        gconfig = self._gconfig(request, len(plan.prompt_ids))
        self.calls += 1
        try:
            result = await self.generate(plan.prompt_ids, request.n, gconfig)
        except (asyncio.CancelledError, BodyError):  # a call refused (400, e.g. SamplingRefused): not a failure
            raise
        except Exception as e:
            self.failure = e
            raise
        stops = _stop_strings(request)
        choices, n_completion, turns = [], 0, []
        for i in range(result.group_size):
            answer = self._answer(result.answer(i), stops, parse_tools=request.tool_choice != "none")
            reply = _reply_message(
                answer.parsed, call_ids=[f"call_{secrets.token_hex(12)}" for _ in answer.parsed.tool_calls]
            )
            turns.append((plan, answer.result, _as_request_message(reply), _sampling(gconfig)))
            ids = answer.result.output_ids[0]
            n_completion += len(ids)
            choices.append(
                Choice(
                    index=i,
                    message=reply,
                    finish_reason=answer.finish_reason,
                    logprobs=self._logprobs(answer.result) if request.logprobs else None,
                    token_ids=list(ids) if request.return_token_ids else None,
                )
            )
        n_prompt = len(plan.prompt_ids)
        completion = ChatCompletion(
            id=f"chatcmpl-{secrets.token_hex(14)}",
            created=int(time.time()),
            model=request.model,
            choices=choices,
            usage=Usage(n_prompt, n_completion, n_prompt + n_completion),
            prompt_token_ids=list(plan.prompt_ids) if request.return_token_ids else None,
        )
        if deliver is not None:
            await deliver(completion)
        for turn in turns:
            self.recorder.add(*turn)
        return completion

    def _gconfig(self, request: ChatCompletionRequest, prompt_len: int) -> GenerationHyperparameters:
        run = self.config.gconfig
        wanted = request.max_completion_tokens or request.max_tokens or run.max_new_tokens
        limit = self.config.max_context_tokens
        if limit is not None:
            if prompt_len >= limit:
                raise ContextLengthExceeded(
                    f"the prompt has {prompt_len} tokens; this model's context is {limit} tokens"
                )
            wanted = min(wanted, limit - prompt_len)
        stop_ids = list(run.stop_token_ids)
        for s in _stop_strings(request):  # a stop string that is one token also stops generation early
            ids = self.config.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1 and ids[0] not in stop_ids:
                stop_ids.append(ids[0])
        # A temperature below the servers' least (MIN_TEMPERATURE) is greedy, as
        # SGLang itself treats one under its epsilon: the answer is the same.
        greedy_call = request.temperature is not None and request.temperature < MIN_TEMPERATURE
        gconfig = dataclasses.replace(
            run,
            max_new_tokens=wanted,
            min_new_tokens=min(run.min_new_tokens, wanted),
            temperature=run.temperature if request.temperature is None or greedy_call else request.temperature,
            greedy=run.greedy or greedy_call,
            top_p=run.top_p if request.top_p is None else request.top_p,
            top_k=run.top_k if request.top_k is None else request.top_k,
            stop_token_ids=stop_ids,
        )
        _check_sampling(gconfig, self.config.served)
        return gconfig

    def _answer(self, result: GenerationResult, stops: list[str], parse_tools: bool) -> _Answer:
        decode = self.config.tokenizer.decode
        ids = result.output_ids[0]
        text = decode(ids, skip_special_tokens=True)
        cut = _first_stop(text, stops)
        if cut is not None:
            # The fewest tokens whose text holds the stop string: binary search
            # (the decoded text of a longer prefix holds what a shorter one does).
            lo, hi = 1, len(ids)
            while lo < hi:
                mid = (lo + hi) // 2
                if _first_stop(decode(ids[:mid], skip_special_tokens=True), stops) is not None:
                    hi = mid
                else:
                    lo = mid + 1
            result = _truncated(result, lo)
            text = text[:cut]
        parsed = self.config.tool_parser(text) if parse_tools else ParsedReply(text)
        if parsed.tool_calls:
            finish = "tool_calls"
        elif result.no_eos[0] and cut is None:
            finish = "length"
        else:
            finish = "stop"
        return _Answer(result, text, parsed, finish)

    def _logprobs(self, result: GenerationResult) -> ChoiceLogprobs:
        tokens = []
        for token_id, logprob in zip(result.output_ids[0], result.output_logprobs[0]):
            text = self.config.tokenizer.decode([token_id])
            tokens.append(TokenLogprob(token=text, logprob=float(logprob), bytes=list(text.encode("utf-8"))))
        return ChoiceLogprobs(content=tokens)


def _check_sampling(gconfig: GenerationHyperparameters, served: ServedSampling) -> None:
    """BodyError (400) for a call's sampling the servers would refuse: its
    refusal would reach the agent as a failed generation (a 500) and fail
    the rollout worker, for what is the agent's choice of values. What the
    backend cannot serve is `ServedSampling`'s rule (the one `Agent.generate`
    and the config check apply): a `SamplingRefused`."""
    try:
        gconfig.validate("")
    except SamplingParamError as e:
        raise BodyError(f"field {str(e).lstrip('.')}", reason="unsupported") from None
    if (refused := served.refusal(gconfig.sampling_params())) is not None:
        raise SamplingRefused(refused)


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _truncated(result: GenerationResult, n: int) -> GenerationResult:
    """The answer's first `n` tokens, ended by a stop string (not by length)."""
    versions = result.output_versions[0][:n]
    return dataclasses.replace(
        result,
        output_ids=[result.output_ids[0][:n]],
        output_logprobs=[result.output_logprobs[0][:n]],
        output_sampling_logprobs=(
            None if result.output_sampling_logprobs is None else [result.output_sampling_logprobs[0][:n]]
        ),
        output_versions=[versions],
        no_eos=[False],
        version_end=[versions[-1] if versions else result.version_end[0]],
    )


def _sampling(gconfig: GenerationHyperparameters) -> tuple:
    return (0.0 if gconfig.greedy else gconfig.temperature, gconfig.top_p, gconfig.top_k)


def _reply_message(parsed: ParsedReply, call_ids: list[str]) -> ReplyMessage:
    calls = [
        ReplyToolCall(id=call_id, function=ReplyFunction(call.name, call.arguments))
        for call_id, call in zip(call_ids, parsed.tool_calls)
    ]
    return ReplyMessage(content=parsed.content, tool_calls=calls or None)


def _as_request_message(reply: ReplyMessage) -> Message:
    """The reply as the agent will echo it in its next call."""
    calls = [ToolCall(FunctionCall(c.function.name, c.function.arguments), c.id) for c in reply.tool_calls or ()]
    return Message(role="assistant", content=reply.content, tool_calls=calls or None)


def completion_chunks(completion: ChatCompletion, include_usage: bool) -> list[ChatCompletionChunk]:
    """A finished completion as the frames of a streamed answer: the whole
    message in one delta per choice, then each choice's finish reason, then
    (if asked) the usage."""

    def chunk(choices: list[ChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(completion.id, completion.created, completion.model, choices, usage)

    first, last = [], []
    for c in completion.choices:
        calls = [
            {"index": k, "id": t.id, "type": "function", "function": to_json(t.function)}
            for k, t in enumerate(c.message.tool_calls or ())
        ]
        delta = ChunkDelta(role="assistant", content=c.message.content, tool_calls=calls or None)
        first.append(ChunkChoice(c.index, delta, None, c.logprobs))
        last.append(ChunkChoice(c.index, ChunkDelta(), c.finish_reason))
    frames = [chunk(first), chunk(last)]
    if include_usage:
        frames.append(chunk([], completion.usage))
    return frames
