"""What an agent asks for and gets back when it needs text generated.

`Agent.generate` makes a `GenerationRequest` (one prompt, `group_size`
samples); in training the rollout worker's PartialRolloutManager turns it into
`group_size` server requests (resubmitting chunks and interrupted requests)
and answers with one `GenerationResult`, with per-token logprobs and weight
versions (docs/design.md §5–§6).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, NoReturn

from realrl.api.sglang_api import SamplingParams
from realrl.api.trajectory import Sampling

# Bounds on SGLang-named sampling parameters (docs/design.md §6), shared by
# `GenerationHyperparameters.validate` and the torch server's request check.
#
# Temperature is 0 (greedy) or in [MIN_TEMPERATURE, MAX_TEMPERATURE]. Below
# 1e-5 sampling is greedy in all but name (a logit gap of 1e-3 becomes a
# probability ratio of e^100) while logits / T overflows float32 for tiny T
# (1e-40 turns every logit into inf and the softmax into NaN); vLLM draws its
# greedy line at the same 1e-5. Above 1e6 sampling is uniform to float32 precision.
MIN_TEMPERATURE = 1e-5
MAX_TEMPERATURE = 1e6
# Token counts and top_k must fit the int32 / int64 tensors they end up in;
# the model's context length is the real limit, checked by the server.
MAX_TOKENS = 2**31 - 1


class SamplingParamError(ValueError):
    """An impossible sampling parameter; `kind` is "type" or "range"."""

    def __init__(self, message: str, kind: str = "range"):
        super().__init__(message)
        self.kind = kind


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_sampling_params(params: Mapping[str, Any], prefix: str = "") -> None:
    """Raise `SamplingParamError` ("{prefix}{name} must be ...") for the first
    impossible value among the SGLang-named parameters present in `params`:
    `max_new_tokens`, `min_new_tokens`, `temperature`, `top_p`, `top_k`,
    `min_p`, `stop_token_ids`. Absent keys are not checked; other keys are
    the caller's business."""

    def fail(name: str, message: str, kind: str = "range") -> NoReturn:
        raise SamplingParamError(f"{prefix}{name} {message}, got {params[name]!r}", kind)

    for name in ("max_new_tokens", "min_new_tokens"):
        if name in params:
            if not _is_int(params[name]):
                fail(name, "must be an integer", "type")
            if not 0 <= params[name] <= MAX_TOKENS:
                fail(name, f"must be in [0, {MAX_TOKENS}]")
    if "max_new_tokens" in params and params.get("min_new_tokens", 0) > params["max_new_tokens"]:
        fail("min_new_tokens", f"must be <= max_new_tokens ({params['max_new_tokens']})")
    if "top_k" in params:
        if not _is_int(params["top_k"]):
            fail("top_k", "must be an integer", "type")
        if not (params["top_k"] == -1 or 1 <= params["top_k"] <= MAX_TOKENS):
            fail("top_k", f"must be -1 (off) or in [1, {MAX_TOKENS}]")
    for name in ("temperature", "top_p", "min_p"):
        if name in params:
            value = params[name]
            if not _is_number(value):
                fail(name, "must be a number", "type")
            if not math.isfinite(value):
                fail(name, "must be finite")
    if "temperature" in params:
        t = params["temperature"]
        if t != 0 and not MIN_TEMPERATURE <= t <= MAX_TEMPERATURE:
            fail("temperature", f"must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]")
    if "top_p" in params and not 0 < params["top_p"] <= 1:
        fail("top_p", "must be in (0, 1]")
    if "min_p" in params and not 0 <= params["min_p"] <= 1:
        fail("min_p", "must be in [0, 1]")
    if "stop_token_ids" in params:
        ids = params["stop_token_ids"]
        if not isinstance(ids, (list, tuple)) or not all(_is_int(t) for t in ids):
            fail("stop_token_ids", "must be a list of integers", "type")
        if not all(0 <= t <= MAX_TOKENS for t in ids):
            fail("stop_token_ids", "must hold non-negative token ids")


def needs_sampling_logprobs(params: SamplingParams) -> bool:
    """Whether a request's tokens are drawn from a filtered distribution
    (top-p < 1, a top-k, or min-p > 0, when not greedy), so that their
    sampling logprobs differ from the unfiltered ones (docs/design.md §6)."""
    if params.temperature is not None and params.temperature == 0:
        return False
    top_k = params.top_k if params.top_k is not None else -1
    return (params.top_p is not None and params.top_p < 1) or top_k > 0 or bool(params.min_p)


@dataclasses.dataclass
class GenerationHyperparameters:
    """Sampling parameters of one generation request (SGLang's names, docs/design.md §6)."""

    max_new_tokens: int = 16
    """New tokens per answer at most (`rollout.gconfig`: 0 = sized from the model, 8 for the tiny kit, else 1024
    within half its positions)."""
    min_new_tokens: int = 0
    """EOS and stop tokens do not end an answer before this many new tokens."""
    temperature: float = 1.0
    """Sampling temperature; the trainer's logprobs use the same scaling."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1 = off)."""
    top_k: int = -1
    """Sample among the k most likely tokens; -1 = no top-k filtering (SGLang's convention)."""
    greedy: bool = False
    """Temperature 0: the most likely token."""
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)
    """Token ids that end an answer, besides the tokenizer's EOS."""

    def validate(self, prefix: str = "gconfig") -> None:
        """Raise ValueError ("{prefix}.{field} must be ...") for an impossible
        value; the bounds are `check_sampling_params`'s."""
        if not isinstance(self.greedy, bool):
            raise SamplingParamError(f"{prefix}.greedy must be a boolean, got {self.greedy!r}", "type")
        check_sampling_params(
            {
                "max_new_tokens": self.max_new_tokens,
                "min_new_tokens": self.min_new_tokens,
                "temperature": self.temperature,
                "top_p": self.top_p,
                "top_k": self.top_k,
                "stop_token_ids": self.stop_token_ids,
            },
            prefix=f"{prefix}.",
        )
        if self.max_new_tokens == 0:
            raise SamplingParamError(f"{prefix}.max_new_tokens must be positive, got 0")

    def sampling(self) -> Sampling:
        """What a sequence generated with these parameters records (docs/design.md §5)."""
        return Sampling(temperature=0.0 if self.greedy else self.temperature, top_p=self.top_p, top_k=self.top_k)

    def sampling_params(self, max_new_tokens: int | None = None) -> SamplingParams:
        """SGLang-native `sampling_params` (docs/design.md §6)."""
        return SamplingParams(
            max_new_tokens=self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            min_new_tokens=self.min_new_tokens,
            temperature=0.0 if self.greedy else self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=list(self.stop_token_ids) or None,
        )


@dataclasses.dataclass
class GenerationRequest:
    qid: str
    prompt_ids: list[int]
    group_size: int = 1
    gconfig: GenerationHyperparameters = dataclasses.field(default_factory=GenerationHyperparameters)


@dataclasses.dataclass
class GenerationResult:
    """`group_size` answers to one request; lists are per answer.
    `output_logprobs` are the unfiltered logprobs (what the trainer
    recomputes), `output_sampling_logprobs` those under the distribution each
    token was drawn from (None: the same as `output_logprobs`), `sampling`
    the parameters every answer was drawn with (None: not known), `turn`
    which generation call of its episode asked for it: `Agent.generate`
    numbers an episode's calls 1, 2, ... in the order the agent makes them
    (0: not made through `Agent.generate`). `server_s`: per answer, the
    seconds its servers spent on its requests as they report them (SGLang's
    `meta_info.e2e_latency`, summed over chunks and resubmissions; None: not
    known): a call's wall time minus this is what it spent outside the
    servers (routing, queues, the network, interruptions)."""

    qid: str
    prompt_ids: list[int]
    output_ids: list[list[int]]
    output_logprobs: list[list[float]]
    output_versions: list[list[int]]  # weight version that produced each token
    no_eos: list[bool]  # stopped by length (or never finished), not by eos/stop
    version_start: list[int]
    version_end: list[int]
    output_sampling_logprobs: list[list[float]] | None = None
    sampling: Sampling | None = None
    turn: int = 0
    server_s: list[float] | None = None

    @property
    def group_size(self) -> int:
        return len(self.output_ids)

    def answer(self, i: int) -> GenerationResult:
        """Answer `i` alone, as a result of group size 1."""
        return GenerationResult(
            self.qid,
            list(self.prompt_ids),
            [self.output_ids[i]],
            [self.output_logprobs[i]],
            [self.output_versions[i]],
            [self.no_eos[i]],
            [self.version_start[i]],
            [self.version_end[i]],
            None if self.output_sampling_logprobs is None else [self.output_sampling_logprobs[i]],
            self.sampling,
            self.turn,
            None if self.server_s is None else [self.server_s[i]],
        )
