"""The HTTP bodies of vLLM's server (>= 0.32), the subset realrl speaks (docs/design.md §6).

Read from the vllm 0.32.0 and 0.33.0 wheels (paths under `vllm/`; the two
agree on every body here unless said):

- `POST /inference/v1/generate` (token in, token out; served with
  `--enable-scale-out`): `entrypoints/scale_out/token_in_token_out/
  {api_router,protocol,serving}.py`. One prompt per request (`token_ids`);
  `sampling_params` is vLLM's `SamplingParams` (`sampling_params.py`);
  the answer's one choice holds `token_ids`, `logprobs.content` (one entry
  per token with `logprobs: 0`: the sampled token's) and `weight_versions`,
  spans `[start, end)` of output tokens sampled under one version
  (`outputs.py` `WeightVersionSpan`). The engine's request id is
  `generate-tokens-<request_id>` (`serving.py` `serve_tokens`), and that is
  the id `/inference/v1/abort_requests` ends (`AsyncLLM.abort`, exact ids).
- Dev routes (`VLLM_SERVER_DEV_MODE=1`, `entrypoints/launchers/api_server/
  routers.py`): `POST /pause?mode=abort|wait|keep` -> `{"status": "paused"}`,
  `POST /resume` -> `{"status": "resumed"}`, `POST /update_weight_version
  {"new_version"}` -> `{"success": true, "new_version"}`, `GET /weight_info`
  (`entrypoints/rl/online/api_router.py`); `POST /collective_rpc {"method",
  "args", "kwargs"}` -> `{"results": [...]}`, one per worker
  (`entrypoints/serve/dev/rpc/api_router.py`); `POST /reset_prefix_cache`
  -> `{"success"}` (`entrypoints/serve/dev/cache/api_router.py`).
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` -> 200 with the
  text `Success: LoRA adapter '<name>' added successfully.`, with
  `VLLM_ALLOW_RUNTIME_LORA_UPDATING` (`entrypoints/serve/lora/api_router.py`,
  `entrypoints/openai/models/serving.py:166-230`); a request names its
  adapter in `model`, and one naming an adapter not loaded (or unloaded by
  `POST /v1/unload_lora_adapter {"lora_name"}`) is a 404 "The model `<name>`
  does not exist. Valid aliases: <served model>." (`entrypoints/serve/engine/
  serving.py:49-85` `_check_model`).
- Errors: `{"error": {"message", "type", "param", "code"}}` with `code` the
  HTTP status (`entrypoints/serve/exception_handling/error_response.py`);
  0.33 refuses a generation while paused (modes abort and wait) with 503
  `ServiceUnavailableError` "Generation is paused. Please retry after it
  resumes." (`v1/engine/core.py:1796-1815`, `outputs.py` `RequestError`);
  0.32 queues it until `/resume`.

Parse with `realrl.base.http_body.from_json`, write with `to_json`; None means
"not given" and is left out of the JSON.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from packaging.version import InvalidVersion, Version

from realrl.base.http_body import rule

OLDEST_VLLM = "0.32"  # the first release with /inference/v1/generate's weight_versions and /pause modes read
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."  # v0.33 v1/engine/core.py:1806
REQUEST_ID_PREFIX = "generate-tokens-"  # the engine's id of a /inference/v1/generate request
# `--max-lora-rank` takes one of these (v0.33 config/lora.py:27 `MaxLoRARanks`).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
VLLM_MAX_LORA_RANK = VLLM_LORA_RANKS[-1]


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `--max-lora-rank` vLLM takes that holds adapters of `rank`."""
    return next(r for r in VLLM_LORA_RANKS if r >= rank)


def vllm_release(text: str) -> Version:
    """A vLLM release realrl runs with (and the torch server can emulate);
    ValueError if `text` is no version or one older than 0.32."""
    try:
        version = Version(text)
    except InvalidVersion:
        raise ValueError(f"not a version: {text!r}") from None
    if version < Version(OLDEST_VLLM):
        raise ValueError(f"{text} is older than {OLDEST_VLLM}, the oldest vLLM realrl runs with")
    return version


@dataclasses.dataclass
class VLLMSamplingParams:
    """The fields of vLLM's `SamplingParams` realrl sends (vLLM's defaults:
    `max_tokens` the rest of the context for this route, `temperature` 1,
    `top_p` 1, `top_k` 0 = off (-1 too), `min_p` 0, `min_tokens` 0; `logprobs`
    None = none, 0 = the sampled token's)."""

    UNKNOWN_FIELDS = "ignore"  # vLLM takes many more

    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None  # < 1e-5: greedy
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    logprobs: int | None = None
    detokenize: bool | None = None
    seed: int | None = None


@dataclasses.dataclass
class VLLMGenerateRequest:
    """`POST /inference/v1/generate`: one prompt."""

    UNKNOWN_FIELDS = "ignore"

    token_ids: list[int] = dataclasses.field(metadata=rule(nonempty=True))
    sampling_params: VLLMSamplingParams = dataclasses.field(default_factory=VLLMSamplingParams)
    request_id: str | None = None  # the engine's id is REQUEST_ID_PREFIX + this
    model: str | None = None  # a LoRA adapter's name, or the served model's (or null: the base model)
    stream: bool | None = None


@dataclasses.dataclass
class GenerateLogProb:
    UNKNOWN_FIELDS = "ignore"

    token_id: int
    logprob: float
    rank: int | None = None
    top_logprobs: list[Any] | None = None


@dataclasses.dataclass
class GenerateLogProbs:
    UNKNOWN_FIELDS = "ignore"

    content: list[GenerateLogProb] | None = None


@dataclasses.dataclass
class WeightVersionSpan:
    """Output tokens `[start, end)` were sampled by the weights labelled `version`."""

    UNKNOWN_FIELDS = "ignore"

    version: str
    start: int
    end: int


@dataclasses.dataclass
class GenerateTokensChoice:
    UNKNOWN_FIELDS = "ignore"

    index: int = 0
    finish_reason: str | None = "stop"  # "stop" | "length" | "abort" (| "error")
    stop_reason: int | str | None = None  # the stop token id that ended it; None on EOS, length, abort
    token_ids: list[int] | None = None
    logprobs: GenerateLogProbs | None = None
    weight_versions: list[WeightVersionSpan] | None = None


@dataclasses.dataclass
class UsageInfo:
    UNKNOWN_FIELDS = "ignore"

    prompt_tokens: int = 0
    completion_tokens: int | None = 0
    total_tokens: int = 0


@dataclasses.dataclass
class VLLMGenerateResponse:
    UNKNOWN_FIELDS = "ignore"

    choices: list[GenerateTokensChoice]
    request_id: str | None = None
    model: str | None = None
    usage: UsageInfo | None = None
    output_mode: str | None = "tokens"


@dataclasses.dataclass
class AbortRequests:
    """`POST /inference/v1/abort_requests`: end exactly these (engine) request ids."""

    UNKNOWN_FIELDS = "ignore"

    request_ids: list[str]


@dataclasses.dataclass
class CollectiveRPCRequest:
    """`POST /collective_rpc`: `method` on every worker; args and kwargs are strings."""

    UNKNOWN_FIELDS = "ignore"

    method: str = dataclasses.field(metadata=rule(nonempty=True))
    args: list[str] | None = None
    kwargs: dict[str, str] | None = None
    timeout: float | None = None


@dataclasses.dataclass
class UpdateWeightVersionRequest:
    """`POST /update_weight_version` (vLLM's: no abort flag; it aborts nothing)."""

    UNKNOWN_FIELDS = "ignore"

    new_version: str = dataclasses.field(metadata=rule(nonempty=True))


@dataclasses.dataclass
class LoadLoRAAdapterRequest:
    UNKNOWN_FIELDS = "ignore"

    lora_name: str = dataclasses.field(metadata=rule(nonempty=True))
    lora_path: str = dataclasses.field(metadata=rule(nonempty=True))
    load_inplace: bool = False


@dataclasses.dataclass
class UnloadLoRAAdapterRequest:
    """`POST /v1/unload_lora_adapter` -> 200 text `Success: LoRA adapter '<name>' removed successfully.`;
    a name not loaded is a 404 `NotFoundError` (`entrypoints/openai/models/serving.py:234-300`)."""

    UNKNOWN_FIELDS = "ignore"

    lora_name: str = dataclasses.field(metadata=rule(nonempty=True))


@dataclasses.dataclass
class ModelCard:
    """One entry of `GET /v1/models`: the served model (no `parent`), then one per LoRA adapter loaded,
    whose `parent` is the served model and `root` its path (`entrypoints/openai/models/serving.py:149-165`)."""

    UNKNOWN_FIELDS = "ignore"

    id: str
    root: str | None = None
    parent: str | None = None
    object: str = "model"
    owned_by: str = "vllm"


@dataclasses.dataclass
class ModelList:
    UNKNOWN_FIELDS = "ignore"

    data: list[ModelCard] = dataclasses.field(default_factory=list)
    object: str = "list"


@dataclasses.dataclass
class ErrorInfo:
    UNKNOWN_FIELDS = "ignore"

    message: str
    type: str
    code: int
    param: str | None = None


@dataclasses.dataclass
class ErrorResponse:
    """vLLM's error body."""

    UNKNOWN_FIELDS = "ignore"

    error: ErrorInfo
