"""The HTTP bodies of realrl's OpenAI-compatible endpoint (docs/design.md §11).

Agents talk to realrl through the `openai` client's `chat.completions` API;
the endpoint (`realrl.impl.openai_compat.endpoint`) parses each request with
these classes (`realrl.base.http_body.from_json`) and answers `to_json` of a
`ChatCompletion`, the exact shape the client parses (required fields always
present, tool-call `arguments` always a string). Every episode has its own
base URL, `<endpoint>/episodes/<key>/v1`, so the client needs no extra
header or field to say which episode a call belongs to.

    POST /episodes/<key>/v1/chat/completions   ChatCompletionRequest -> ChatCompletion (or SSE chunks)
    GET  /episodes/<key>/v1/models                                    -> ModelList
    POST /rl/episodes                           OpenEpisodeRequest    -> OpenEpisodeReply   (external agents)
    POST /rl/episodes/<key>/close               CloseEpisodeRequest   -> CloseEpisodeReply
    GET  /health
    a refused request                                                 -> ErrorReply (400, 404, 413, 500)

What the request may hold is OpenAI's, plus vLLM's `extra_body` fields that
agent frameworks send (`top_k`, `return_token_ids`, `chat_template_kwargs`).
Fields that would change sampling in a way realrl cannot honour (penalties,
`logit_bias`, a JSON `response_format`, alternatives in `top_logprobs`) are
accepted only at their neutral value; unknown fields are refused (400 naming
them), never silently dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from realrl.base.http_body import rule

_field = dataclasses.field

MAX_CHOICES = 64  # `n` at most

# --------------------------------------------------------------------------- messages


@dataclasses.dataclass
class ContentPart:
    """One part of a list-valued `content`; only text parts are supported."""

    UNKNOWN_FIELDS = "ignore"

    type: str
    text: str | None = None


@dataclasses.dataclass
class FunctionCall:
    """What a tool call calls. `arguments` is a JSON string in OpenAI's API;
    an agent that builds the message by hand may give an object."""

    UNKNOWN_FIELDS = "ignore"

    name: str
    arguments: str | dict[str, Any] = ""


@dataclasses.dataclass
class ToolCall:
    UNKNOWN_FIELDS = "ignore"

    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


@dataclasses.dataclass
class Message:
    """One message of `messages`. Agents echo the assistant's reply in three
    shapes (the message object, `model_dump()` with null extras, or without
    them), so null values mean absent and unknown keys are ignored."""

    UNKNOWN_FIELDS = "ignore"

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # Qwen3-style templates render it


# --------------------------------------------------------------------------- tools


@dataclasses.dataclass
class FunctionDefinition:
    name: str = _field(metadata=rule(nonempty=True))
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None


@dataclasses.dataclass
class Tool:
    function: FunctionDefinition
    type: Literal["function"] = "function"


@dataclasses.dataclass
class NamedToolChoice:
    UNKNOWN_FIELDS = "ignore"

    type: Literal["function"]
    function: dict[str, Any]


@dataclasses.dataclass
class StreamOptions:
    UNKNOWN_FIELDS = "ignore"

    include_usage: bool | None = None


@dataclasses.dataclass
class ResponseFormat:
    UNKNOWN_FIELDS = "ignore"

    type: str


# --------------------------------------------------------------------------- the request


@dataclasses.dataclass
class ChatCompletionRequest:
    """`POST .../chat/completions`. Sampling fields left out take the run's
    (`rollout.gconfig`); `max_completion_tokens` (or the older `max_tokens`)
    caps each choice's new tokens."""

    messages: list[Message] = _field(metadata=rule(nonempty=True))
    model: str = ""  # any name; echoed back
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # every call the model writes is returned
    n: int = _field(default=1, metadata=rule(min=1, max=MAX_CHOICES))
    max_tokens: int | None = _field(default=None, metadata=rule(min=1))
    max_completion_tokens: int | None = _field(default=None, metadata=rule(min=1))
    temperature: float | None = _field(default=None, metadata=rule(min=0))
    top_p: float | None = None
    top_k: int | None = None  # vLLM's extra_body field; -1 = off
    stop: str | list[str] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = None  # vLLM's: prompt_token_ids and choices[i].token_ids in the answer
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (e.g. enable_thinking)
    # Accepted and without effect (the endpoint keeps no state beyond the episode).
    seed: int | None = None
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    reasoning_effort: str | None = None
    # Accepted only at their neutral value (sampling cannot honour anything else).
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None


# --------------------------------------------------------------------------- the answer


@dataclasses.dataclass
class ReplyFunction:
    name: str
    arguments: str  # always a JSON string (the client hands it to json.loads)


@dataclasses.dataclass
class ReplyToolCall:
    id: str
    function: ReplyFunction
    type: str = "function"


@dataclasses.dataclass
class ReplyMessage:
    content: str | None = _field(default=None, metadata=rule(keep_null=True))
    tool_calls: list[ReplyToolCall] | None = None
    role: str = "assistant"


@dataclasses.dataclass
class TokenLogprob:
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[Any] = _field(default_factory=list)


@dataclasses.dataclass
class ChoiceLogprobs:
    content: list[TokenLogprob] | None = _field(default=None, metadata=rule(keep_null=True))


@dataclasses.dataclass
class Choice:
    index: int
    message: ReplyMessage
    finish_reason: Literal["stop", "length", "tool_calls"]
    logprobs: ChoiceLogprobs | None = _field(default=None, metadata=rule(keep_null=True))
    token_ids: list[int] | None = None  # with return_token_ids


@dataclasses.dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


@dataclasses.dataclass
class ChatCompletion:
    id: str
    created: int
    model: str
    choices: list[Choice]
    usage: Usage
    object: str = "chat.completion"
    prompt_token_ids: list[int] | None = None  # with return_token_ids


@dataclasses.dataclass
class ChunkDelta:
    role: str | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # each with its `index` (the streaming shape)


@dataclasses.dataclass
class ChunkChoice:
    index: int
    delta: ChunkDelta
    finish_reason: str | None = _field(default=None, metadata=rule(keep_null=True))
    logprobs: ChoiceLogprobs | None = None


@dataclasses.dataclass
class ChatCompletionChunk:
    """One `data:` frame of a streamed answer (`stream=true`)."""

    id: str
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    object: str = "chat.completion.chunk"


@dataclasses.dataclass
class ModelCard:
    id: str
    created: int = 0
    owned_by: str = "realrl"
    object: str = "model"


@dataclasses.dataclass
class ModelList:
    data: list[ModelCard]
    object: str = "list"


@dataclasses.dataclass
class ErrorDetail:
    message: str
    type: str = "invalid_request_error"
    param: str | None = _field(default=None, metadata=rule(keep_null=True))
    code: str | None = _field(default=None, metadata=rule(keep_null=True))


@dataclasses.dataclass
class ErrorReply:
    """OpenAI's error body: the client raises `BadRequestError` (400),
    `NotFoundError` (404), ... with `error.message` in its message."""

    error: ErrorDetail


# --------------------------------------------------------------------------- external agents


@dataclasses.dataclass
class OpenEpisodeRequest:
    """`POST /rl/episodes`: take the next episode waiting for an external
    agent, waiting up to `wait_s` seconds for one."""

    wait_s: float = _field(default=0.0, metadata=rule(min=0, max=60))


@dataclasses.dataclass
class OpenEpisodeReply:
    """`episode_id` null: none was waiting. Else the agent calls the chat API at
    `base_url` (with its own `/chat/completions` path) and closes the episode
    at `/rl/episodes/<episode_id>/close`. `row` is the dataset row, `messages`
    always set."""

    episode_id: str | None = _field(default=None, metadata=rule(keep_null=True))
    base_url: str | None = None
    qid: str | None = None
    row: dict[str, Any] | None = None


@dataclasses.dataclass
class CloseEpisodeRequest:
    """The episode's reward: a number (the raw task score; 1 = full credit),
    or `{"reward": number, "<name>": number, ...}` (the other numbers go to
    the rollout worker's stats)."""

    reward: float | dict[str, float]


@dataclasses.dataclass
class CloseEpisodeReply:
    success: bool
    turns: int  # chat calls the episode recorded
