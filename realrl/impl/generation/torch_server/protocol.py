"""What a `/generate` body may hold, and what each of its prompts becomes.

`parse_generate_body(body, limits)` reads a decoded body through the shared
contract (`realrl.api.sglang_api.GenerateRequest`, checked by
`realrl.base.http_body.from_json`), checks it against the model
(`GenerateLimits`: vocabulary, positions, eos ids) and returns one `Request`
per prompt, the engine's record of it. Every refusal is a `BodyError` (HTTP
400) whose `reason` labels the server's rejection counters.

**Sampling parameters.** `max_new_tokens` (default 128), `min_new_tokens`,
`temperature` (0 = greedy), `top_p`, `top_k` (-1 or 0 = off), `min_p`,
`stop_token_ids`, `ignore_eos`. Text-only options (`skip_special_tokens`, ...)
are accepted and have no effect; penalties and `n` are accepted only at their
neutral values, `stop` only empty, `stream` only off, `top_logprobs_num` only
0; `text` prompts and unknown fields are refused, as is every value the engine
could not sample with (`realrl.api.generation_api.check_sampling_params`:
temperature 0 or in [1e-5, 1e6], top_p in (0, 1], min_p in [0, 1], finite
numbers only, `min_new_tokens <= max_new_tokens`, prompt + max_new_tokens
within the model's positions, and stop tokens that leave something to sample
before `min_new_tokens`).

**Logprobs.** With `return_logprob`, `meta_info` holds two per output token:
`output_token_logprobs` (unfiltered) and `output_token_sampling_logprobs`
(under the distribution the token was drawn from; `sampling`). SGLang reports
the second only with `return_sampling_mask`, which is accepted here and
changes nothing (this server always reports both, and no mask).

`lora_path` (one name for every prompt, or one per prompt) names the LoRA
adapter a prompt asks for; the engine checks that it is loaded.

`priority` (SGLang's: one integer for the whole body, a JSON integer in the
int64 range, else 400 `type` / `range`) orders admission: the engine admits
waiting requests lowest value first, those without one last, equal values in
arrival order (`engine.py`).

`Request.response` builds the answer (`GenerateResponse`) when the engine
finishes a request.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from realrl.api.generation_api import SamplingParamError, check_sampling_params
from realrl.api.sglang_api import FinishReason, GenerateRequest, GenerateResponse, MetaInfo, SamplingParams
from realrl.api.vllm_api import WeightVersionSpan
from realrl.base.http_body import BodyError, from_json

DEFAULT_MAX_NEW_TOKENS = 128

# Sampling parameters with an effect here, with their defaults (SGLang's).
SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
    "min_new_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "ignore_eos": False,
}
# SGLang parameters accepted only at their neutral value.
NEUTRAL_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}


@dataclass
class GenerateLimits:
    """What a request is checked against."""

    vocab_size: int
    max_positions: int | None
    eos_token_ids: frozenset[int]


@dataclass
class Request:
    """One prompt in the engine: its checked parameters, the tokens and
    logprobs generated so far, and where its answer goes (`reply`, called once
    with a `GenerateResponse`, a `BodyError` or an `EngineError`)."""

    rid: str
    input_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_p: float
    top_k: int  # <= 0: off
    min_p: float
    stop_ids: frozenset[int]
    return_logprob: bool
    return_sampling_mask: bool = False  # asked for SGLang's sampling logprobs (used when emulating it)
    requested_top_k: int | None = None  # top_k as sent (`top_k` is -1 when it keeps the whole vocabulary)
    lora_name: str | None = None  # the LoRA adapter named by `lora_path` (checked by the engine)
    priority: int | None = None  # the body's `priority`: lower is admitted first, None after every value
    reply: Callable[[Any], None] = field(repr=False, default=lambda result: None)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_sampling_logprobs: list[float] = field(default_factory=list)  # under the filtered distribution
    arrival_time: float = field(default_factory=time.monotonic)
    # Spans of outputs sampled before a weight update it went on across (the engine): (end, version), in order.
    earlier_versions: list[tuple[int, str]] = field(default_factory=list)

    def switch_version(self, old: str) -> None:
        """The weights change from `old` while this request runs: its outputs so far are `old`'s."""
        n = len(self.output_ids)
        if self.earlier_versions and self.earlier_versions[-1][1] == old:
            self.earlier_versions[-1] = (n, old)  # the same version goes on (e.g. an update that failed)
        elif n > (self.earlier_versions[-1][0] if self.earlier_versions else 0):
            self.earlier_versions.append((n, old))

    def version_spans(self, weight_version: str) -> list[WeightVersionSpan] | None:
        """Per-version spans of the outputs, the last under `weight_version`; None if that one made them all."""
        if not self.earlier_versions:
            return None
        spans, start = [], 0
        for end, version in [*self.earlier_versions, (len(self.output_ids), weight_version)]:
            if end > start:
                if spans and spans[-1].version == version:
                    spans[-1].end = end
                else:
                    spans.append(WeightVersionSpan(version, start, end))
                start = end
        return None if len(spans) == 1 and spans[0].version == weight_version else spans

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_filter(self) -> bool:
        return not self.is_greedy and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0)

    def response(self, reason: FinishReason, weight_version: str) -> GenerateResponse:
        """The answer, as it stands now; `weight_version`: the weights serving now."""
        spans = self.version_spans(weight_version)
        if spans:  # the version of the last token (one aborted before it went on has none of the new)
            weight_version = spans[-1].version
        logprobs = sampling_logprobs = None
        if self.return_logprob:
            logprobs = [(lp, tok, None) for lp, tok in zip(self.output_logprobs, self.output_ids)]
            sampling_logprobs = list(self.output_sampling_logprobs)
        meta = MetaInfo(
            id=self.rid,
            finish_reason=reason,
            prompt_tokens=len(self.input_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=0,
            weight_version=weight_version,
            e2e_latency=time.monotonic() - self.arrival_time,
            output_token_logprobs=logprobs,
            output_token_sampling_logprobs=sampling_logprobs,
            weight_versions=spans,
        )
        return GenerateResponse(output_ids=list(self.output_ids), meta_info=meta)


def parse_generate_body(body: Any, limits: GenerateLimits) -> tuple[list[Request], bool]:
    """Check a decoded /generate body; returns the requests and whether it was batched."""
    return parse_generate(from_json(GenerateRequest, body), limits)


def parse_generate(body: GenerateRequest, limits: GenerateLimits) -> tuple[list[Request], bool]:
    """`parse_generate_body` of a body already read into its contract."""
    if body.text is not None:
        raise BodyError("this server takes input_ids only (it has no tokenizer)", reason="unsupported")
    if body.stream:
        raise BodyError("streaming is not supported by the torch backend", reason="unsupported")
    if body.top_logprobs_num not in (None, 0):
        raise BodyError("top_logprobs_num is not supported by the torch backend", reason="unsupported")
    if not body.input_ids:
        raise BodyError("input_ids must be a non-empty list of token ids (or a list of such lists)", reason="empty")
    batched = isinstance(body.input_ids[0], list)
    prompts: list[list[int]] = body.input_ids if batched else [body.input_ids]
    n = len(prompts)
    if batched and body.rid is not None and not isinstance(body.rid, list):
        raise BodyError("rid must be a list of strings for a batched request", reason="type")
    sampling = _per_prompt("sampling_params", body.sampling_params, batched, n)
    return_logprob = _per_prompt("return_logprob", body.return_logprob, batched, n)
    rids = _per_prompt("rid", body.rid, batched, n)
    lora_names = _per_prompt("lora_path", body.lora_path, batched, n)
    sampling_masks = _per_prompt("return_sampling_mask", body.return_sampling_mask, batched, n)

    requests = []
    checked: dict[int, dict[str, Any]] = {}  # id(params) -> its checked values: one value for all is checked once
    for prompt, params, want_logprob, rid, lora_name, want_mask in zip(
        prompts, sampling, return_logprob, rids, lora_names, sampling_masks
    ):
        if not prompt:
            raise BodyError("every prompt must be a non-empty list of token ids", reason="empty")
        _check_vocabulary(prompt, "input_ids", limits.vocab_size)
        if (p := checked.get(id(params))) is None:
            p = checked[id(params)] = _sampling(params or SamplingParams(), limits)
        p = dict(p)
        if rid is None:
            rid = uuid.uuid4().hex
        elif not rid:
            raise BodyError("rid must be a non-empty string", reason="type")
        if limits.max_positions is not None and len(prompt) + p["max_new_tokens"] > limits.max_positions:
            raise BodyError(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({p['max_new_tokens']}) exceeds the "
                f"model's {limits.max_positions} positions",
                reason="too_long",
            )
        stop_ids = set(p.pop("stop_token_ids"))
        if not p.pop("ignore_eos"):
            stop_ids |= limits.eos_token_ids
        if p["min_new_tokens"] > 0 and sum(t < limits.vocab_size for t in stop_ids) >= limits.vocab_size:
            # Every token is banned until min_new_tokens: nothing could be sampled.
            raise BodyError(
                "min_new_tokens > 0 but the stop tokens (with eos) cover the whole vocabulary", reason="range"
            )
        requests.append(
            Request(
                rid=rid,
                input_ids=list(prompt),
                stop_ids=frozenset(stop_ids),
                return_logprob=bool(want_logprob),
                return_sampling_mask=bool(want_mask),
                requested_top_k=(params or SamplingParams()).top_k,
                lora_name=lora_name or None,
                priority=body.priority,
                **p,
            )
        )
    if len({r.rid for r in requests}) != len(requests):
        raise BodyError("duplicate rid in a batched request", reason="duplicate_rid")
    return requests, batched


def _per_prompt(name: str, value: Any, batched: bool, n: int) -> list[Any]:
    """A field's value for each prompt: one for all, or (batched) a list of one per prompt."""
    if not isinstance(value, list):
        return [value] * n
    if not batched:
        raise BodyError(f"{name} is a list, but input_ids holds a single prompt", reason="type")
    if len(value) != n:
        raise BodyError(f"{name} has {len(value)} entries for {n} prompts", reason="type")
    return value


def _sampling(params: SamplingParams, limits: GenerateLimits) -> dict[str, Any]:
    """The parameters the engine uses, defaults filled in; refuses what it cannot honour."""
    for name, neutral in NEUTRAL_SAMPLING.items():
        value = getattr(params, name)
        if value is not None and value != neutral:
            raise BodyError(
                f"sampling parameter {name}={value!r} is not supported by the torch backend", reason="unsupported"
            )
    if params.stop not in (None, "", []):
        raise BodyError("stop strings need a tokenizer; use stop_token_ids", reason="unsupported")
    out = {name: default if (v := getattr(params, name)) is None else v for name, default in SAMPLING_DEFAULTS.items()}
    if out["top_k"] == 0:
        out["top_k"] = -1  # this server also takes 0 for off
    try:
        check_sampling_params(out)
    except SamplingParamError as e:
        raise BodyError(str(e), reason=e.kind) from None
    if out["top_k"] >= limits.vocab_size:
        out["top_k"] = -1  # keeps every token anyway
    out["stop_token_ids"] = params.stop_token_ids or []
    _check_vocabulary(out["stop_token_ids"], "stop_token_ids", limits.vocab_size)
    return out


def _check_vocabulary(ids: list[int], name: str, vocab_size: int) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab_size):  # at C speed; the loop below names the bad one
        return
    for tok in ids:
        if not 0 <= tok < vocab_size:
            raise BodyError(f"token id {tok} in {name} is outside the vocabulary [0, {vocab_size})", reason="vocab")
