"""The HTTP bodies of SGLang's native API, the subset realrl speaks (docs/design.md §6).

Both generation backends answer these routes: the torch server
(`realrl.impl.generation.torch_server`) parses its requests with these classes
and builds its responses from them; the client
(`realrl.impl.generation.client`) builds its requests from them and reads the
answers of either backend through them, so a field renamed on one side fails a
test, not a run. Parse with `realrl.base.http_body.from_json`, write with
`to_json`; None always means "not given" and is left out of the JSON.

Requests name what SGLang accepts that a client of realrl may send; the torch
server decides what it supports (penalties only at their neutral value,
text-only options without effect, no `text` prompts: see its `protocol`
module). Responses ignore the fields they do not name: SGLang reports more
than realrl reads.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from packaging.version import InvalidVersion, Version

from realrl.api.vllm_api import WeightVersionSpan
from realrl.base.http_body import rule

OLDEST_EMULATED = "0.4.9"  # the first SGLang release with /pause_generation


def emulated_release(text: str) -> Version:
    """An SGLang release the torch server can emulate
    (`server.torch.emulate_sglang`); ValueError if `text` is no version or
    one older than 0.4.9."""
    try:
        version = Version(text)
    except InvalidVersion:
        raise ValueError(f"not a version: {text!r}") from None
    if version < Version(OLDEST_EMULATED):
        raise ValueError(f"{text} is older than {OLDEST_EMULATED}, the oldest release emulated")
    return version


# --------------------------------------------------------------------------- sampling masks

# `--sampling-mask-max-tokens`'s default (v0.5.23 `arg_groups/fields/exec_.py:182-188`).
SAMPLING_MASK_MAX_TOKENS = 4096
# SGLang's top_k for "off" once normalised (-1, or absent; v0.5.16 and v0.5.23
# `sampling/sampling_params.py`: `TOP_K_ALL = 1 << 30`; a greedy request gets top_k = 1).
TOP_K_ALL = 1 << 30


def sglang_top_k(top_k: int | None, greedy: bool) -> int:
    """The top_k SGLang's scheduler sees: 1 for greedy, TOP_K_ALL for off
    (-1, None; the torch server also takes 0)."""
    if greedy:
        return 1
    return TOP_K_ALL if top_k is None or top_k <= 0 else top_k


def sampling_mask_refusal(
    release: Version, top_k: int | None, greedy: bool, max_tokens: int = SAMPLING_MASK_MAX_TOKENS
) -> str | None:
    """SGLang's message refusing a `return_sampling_mask` request (answered
    HTTP 400 `{"error": {"message": ...}}`, no token generated), else None.

    - 0.5.16 (v0.5.16 `managers/scheduler.py:2225-2234`): refuses top_k off.
    - 0.5.23 (v0.5.23 `managers/scheduler.py:3172-3181`): accepts only top_k
      == 1 or 1 < top_k <= `--sampling-mask-max-tokens`.
    Releases before 0.5.16 have no sampling masks (None: the flag is ignored)."""
    if release < Version("0.5.16"):
        return None
    k = sglang_top_k(top_k, greedy)
    if release < Version("0.5.23"):
        if k != TOP_K_ALL:
            return None
        return (
            "return_sampling_mask requires finite top_k; top_p-only sampling is valid but can return huge "
            "masks in the tail, blowing up metadata, so we need a safety cap."
        )
    if k == 1 or 1 < k <= max_tokens:
        return None
    return (
        f"return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= {max_tokens}; "
        f"got top_k={k}. Lower top_k or increase --sampling-mask-max-tokens."
    )


# --------------------------------------------------------------------------- /generate


@dataclasses.dataclass
class SamplingParams:
    """`sampling_params` of one prompt. A field left None takes the server's
    default (SGLang's: `max_new_tokens` 128, `temperature` 1, `top_p` 1,
    `top_k` -1 = off, `min_p` 0, `min_new_tokens` 0, `ignore_eos` false)."""

    max_new_tokens: int | None = None
    min_new_tokens: int | None = None
    temperature: float | None = None  # 0 = greedy
    top_p: float | None = None
    top_k: int | None = None  # -1 = off (the torch server also takes 0)
    min_p: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    # SGLang parameters the torch server takes only at their neutral value (0,
    # 0, 1, 1), compared with ==, so any JSON value equal to it passes.
    frequency_penalty: Any = None
    presence_penalty: Any = None
    repetition_penalty: Any = None
    n: Any = None
    # Options that only shape detokenised text: accepted, no effect without a tokenizer.
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    stop: Any = None  # stop strings need a tokenizer: the torch server takes only "" or []


@dataclasses.dataclass
class GenerateRequest:
    """`POST /generate`: one prompt (`input_ids` a list of token ids), or
    SGLang's batched form, a list of prompts; then `sampling_params`,
    `return_logprob` and `rid` are each one value for every prompt or a list
    with one entry per prompt. The answer is a `GenerateResponse`, or a list of
    them in prompt order for the batched form."""

    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingParams | list[SamplingParams | None] | None = None
    return_logprob: bool | list[bool | None] | None = None
    # SGLang 0.5.16+: also report each token's logprob under the filtered distribution it was drawn from
    # (`output_token_sampling_logprobs`; SGLang refuses it without a finite top_k). The torch server
    # reports it with every `return_logprob` and ignores this flag.
    return_sampling_mask: bool | list[bool | None] | None = None
    rid: str | list[str | None] | None = None  # the request id (/abort_request); the server makes one if absent
    # The LoRA adapter to generate with, by the name it was loaded under (null: the base model); one for
    # every prompt or one per prompt. The torch server serves one adapter at a time (docs/design.md §8).
    lora_path: str | list[str | None] | None = None
    # Admission order (SGLang's `priority`, one integer for the whole body): lower values are admitted
    # first, as SGLang does with `--enable-priority-scheduling --schedule-low-priority-values-first`
    # (how realrl launches it); a body without one comes after every body with one; equal values in
    # arrival order (docs/design.md §6).
    priority: int | None = None
    text: str | list[str] | None = None  # SGLang's text prompts: the torch server has no tokenizer
    # SGLang options the torch server takes only switched off: `stream` falsy,
    # `top_logprobs_num` 0; the last two have no effect.
    stream: Any = None
    top_logprobs_num: Any = None
    logprob_start_len: Any = None
    return_text_in_logprobs: Any = None


@dataclasses.dataclass
class FinishReason:
    UNKNOWN_FIELDS = "ignore"

    type: str  # "stop" | "length" | "abort"
    matched: int | str | None = None  # the stop token that ended it (SGLang: or stop string)
    message: str | None = None  # why it was aborted


@dataclasses.dataclass
class MetaInfo:
    UNKNOWN_FIELDS = "ignore"

    id: str | None = None  # the rid
    # A bare string in some SGLang versions, null when SGLang aborted the request.
    finish_reason: FinishReason | str | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    weight_version: str | None = None  # the weights that produced the last token
    e2e_latency: float | None = None  # seconds
    # With return_logprob: (logprob, token id, token text or null) per output token.
    output_token_logprobs: list[tuple[float, int, str | None]] | None = None
    # Per output token, its logprob under the distribution it was sampled from (after temperature,
    # top-k, top-p, min-p; renormalised; 0 for greedy): the torch server with return_logprob,
    # SGLang 0.5.16+ with return_sampling_mask (docs/design.md §6).
    output_token_sampling_logprobs: list[float] | None = None
    # The torch server, for an answer that went on across a weight update (docs/design.md §6): output tokens
    # [start, end) were sampled by the weights labelled `version` (vLLM's spans); absent: all `weight_version`.
    weight_versions: list[WeightVersionSpan] | None = None


@dataclasses.dataclass
class GenerateResponse:
    """One prompt's answer. Some SGLang versions leave out `output_ids` and
    send the ids only inside `meta_info.output_token_logprobs`."""

    UNKNOWN_FIELDS = "ignore"

    output_ids: list[int] | None = None
    meta_info: MetaInfo = dataclasses.field(default_factory=MetaInfo)


# --------------------------------------------------------------------------- weights and control


@dataclasses.dataclass
class UpdateWeightsFromDiskRequest:
    """`POST /update_weights_from_disk`: load the HF checkpoint directory
    `model_path` and serve it as `weight_version`."""

    UNKNOWN_FIELDS = "ignore"  # SGLang takes more (flush_cache, is_async, ...); the torch server ignores them

    model_path: str = dataclasses.field(metadata=rule(nonempty=True))
    weight_version: str | int | None = None
    # Running requests end now with `abort` (true), or finish first under the
    # old weights (false). realrl always sends it; SGLang's default is false,
    # the torch server's true.
    abort_all_requests: bool = True
    load_format: str | None = None  # the torch server reads safetensors only ("auto" or "safetensors")


@dataclasses.dataclass
class UpdateWeightsFromDiskResponse:
    """The answer to `/update_weights_from_disk`; `success: false` (HTTP 400)
    leaves the old weights serving on the torch server (SGLang 0.5.23 may have
    swapped them all the same: see `realrl.impl.generation.backends`)."""

    UNKNOWN_FIELDS = "ignore"

    success: bool
    message: str = ""
    # Requests aborted by the update: a list, one entry per rank, from SGLang
    # with data parallelism (its entries are always 0; the torch server counts).
    num_paused_requests: int | list[int] = 0

    @property
    def paused_total(self) -> int:
        n = self.num_paused_requests
        return sum(n) if isinstance(n, list) else n


@dataclasses.dataclass
class PauseGenerationRequest:
    """`POST /pause_generation` (SGLang 0.5.6+ requires this body, `{}` at
    least). `abort`: running and waiting requests end with `abort`; `in_place`:
    they stay, and resume at `/continue_generation`; `retract` (SGLang only):
    running requests go back to the queue."""

    UNKNOWN_FIELDS = "ignore"

    mode: Literal["abort", "retract", "in_place"] = "abort"


@dataclasses.dataclass
class ContinueGenerationRequest:
    """`POST /continue_generation` (SGLang 0.5.6+ requires this body, `{}` at least)."""

    UNKNOWN_FIELDS = "ignore"

    torch_empty_cache: bool | None = None  # SGLang's; the torch server has nothing to empty


@dataclasses.dataclass
class LoadLoRAAdapterRequest:
    """`POST /load_lora_adapter`: read the peft adapter directory `lora_path`
    and serve it to requests that name `lora_name` (a name already loaded is
    refused). The torch server starts serving it at the next
    `/update_weight_version`."""

    UNKNOWN_FIELDS = "ignore"

    lora_name: str = dataclasses.field(metadata=rule(nonempty=True))
    lora_path: str = dataclasses.field(metadata=rule(nonempty=True))
    pinned: bool = False  # SGLang: never evicted (the torch server never evicts)


@dataclasses.dataclass
class UnloadLoRAAdapterRequest:
    """`POST /unload_lora_adapter`: forget the adapter `lora_name`; requests naming it are refused."""

    UNKNOWN_FIELDS = "ignore"

    lora_name: str = dataclasses.field(metadata=rule(nonempty=True))


@dataclasses.dataclass
class LoRAUpdateResponse:
    """The answer to `/load_lora_adapter` and `/unload_lora_adapter` (HTTP 400
    when `success` is false). `loaded_adapters` maps each loaded name to its
    path (SGLang: to a record of it)."""

    UNKNOWN_FIELDS = "ignore"

    success: bool
    error_message: str | None = None
    loaded_adapters: dict[str, Any] | None = None


@dataclasses.dataclass
class UpdateWeightVersionRequest:
    """`POST /update_weight_version`: report `new_version` from now on; with
    `abort_all_requests`, requests in flight end with `abort` first. The torch
    server also switches to the adapter loaded last, between two decode steps."""

    UNKNOWN_FIELDS = "ignore"

    new_version: str | int = dataclasses.field(metadata=rule(nonempty=True))
    abort_all_requests: bool = True


@dataclasses.dataclass
class UpdateWeightVersionResponse:
    UNKNOWN_FIELDS = "ignore"

    success: bool
    message: str = ""
    new_version: str | None = None
    num_paused_requests: int = 0  # the torch server: requests aborted by the switch


@dataclasses.dataclass
class AbortRequest:
    """`POST /abort_request`: end the request `rid`, or every request. SGLang
    ends every live request whose rid *starts with* `rid` (once `rid` itself
    is live), so realrl's rids are never prefixes of one another
    (`realrl.impl.generation.client.new_rid`)."""

    UNKNOWN_FIELDS = "ignore"

    rid: str | None = None
    abort_all: bool = False


@dataclasses.dataclass
class ControlResponse:
    """The torch server's answer to `/pause_generation`, `/continue_generation`,
    `/abort_request` and `/flush_cache` (SGLang answers these with a message
    or an empty body)."""

    success: bool
    message: str | None = None
    num_aborted: int | None = None  # requests ended (abort, pause)


# --------------------------------------------------------------------------- distributed weight updates
# SGLang's own names (v0.5.16 and v0.5.23 `managers/io_struct.py`, routes in
# `entrypoints/http_server.py`): the trainer is rank 0 of a process group that
# the servers join at `rank_offset`; each `/update_weights_from_distributed`
# receives one broadcast. realrl sends `load_format: "flattened_bucket"`: the
# named tensors packed back to back in one uint8 tensor (`FlattenedTensorBucket`).
SGLANG_GROUP_NAME = "weight_update_group"  # SGLang's default group_name


@dataclasses.dataclass
class InitWeightsUpdateGroupRequest:
    """`POST /init_weights_update_group`: join the process group whose store
    is at master_address:master_port as rank `rank_offset` (+ the TP rank);
    answered once the group formed (every rank joined)."""

    UNKNOWN_FIELDS = "ignore"

    master_address: str = dataclasses.field(metadata=rule(nonempty=True))
    master_port: int = dataclasses.field(metadata=rule(min=1, max=65535))
    rank_offset: int = dataclasses.field(metadata=rule(min=1))
    world_size: int = dataclasses.field(metadata=rule(min=2))
    group_name: str = dataclasses.field(default=SGLANG_GROUP_NAME, metadata=rule(nonempty=True))
    backend: str = "nccl"  # SGLang's default; realrl sends what the group uses


@dataclasses.dataclass
class UpdateWeightsFromDistributedRequest:
    """`POST /update_weights_from_distributed`: receive `names` (each of its
    dtype and shape) by one broadcast from rank 0 of `group_name` and load
    them; `weight_version` (realrl: only with a version's last bucket) then
    becomes the server's version. From 0.5.23 only inside a session
    (`/begin_weight_update` ... `/end_weight_update`)."""

    UNKNOWN_FIELDS = "ignore"

    names: list[str] = dataclasses.field(metadata=rule(nonempty=True))
    dtypes: list[str] = dataclasses.field(metadata=rule(nonempty=True))
    shapes: list[list[int]] = dataclasses.field(metadata=rule(nonempty=True))
    group_name: str = SGLANG_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None  # "flattened_bucket": one packed broadcast (realrl always sends it)


@dataclasses.dataclass
class BeginWeightUpdateRequest:
    """`POST /begin_weight_update` (0.5.23): opens a weight-update session."""

    UNKNOWN_FIELDS = "ignore"

    selector: str = "all"  # target | draft | all (SGLang's speculative decoding runners)


@dataclasses.dataclass
class EndWeightUpdateRequest:
    """`POST /end_weight_update` (0.5.23): closes the session."""

    UNKNOWN_FIELDS = "ignore"


@dataclasses.dataclass
class DestroyWeightsUpdateGroupRequest:
    """`POST /destroy_weights_update_group`: leave and destroy the group."""

    UNKNOWN_FIELDS = "ignore"

    group_name: str = SGLANG_GROUP_NAME


@dataclasses.dataclass
class WeightsUpdateResponse:
    """SGLang's answer to the five routes above: HTTP 200 on success, else 400."""

    UNKNOWN_FIELDS = "ignore"

    success: bool
    message: str = ""


# --------------------------------------------------------------------------- status


@dataclasses.dataclass
class ModelInfo:
    """`GET /model_info` (older SGLang: `/get_model_info`): SGLang's fields,
    then the torch server's own."""

    UNKNOWN_FIELDS = "ignore"

    model_path: str | None = None
    tokenizer_path: str | None = None
    is_generation: bool | None = None
    weight_version: str | None = None
    backend: str | None = None  # "torch"
    vocab_size: int | None = None
    max_position_embeddings: int | None = None
    eos_token_ids: list[int] | None = None
    device: str | None = None
    dtype: str | None = None


@dataclasses.dataclass
class RankLoad:
    """One data-parallel rank's requests in `GET /v1/loads`."""

    UNKNOWN_FIELDS = "ignore"

    dp_rank: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0


@dataclasses.dataclass
class Loads:
    """`GET /v1/loads` (SGLang 0.5.10+; `version` is SGLang's, or the torch
    server's backend name): one entry per data-parallel rank. SGLang's
    `/get_server_info` has no request counts; this is where they are."""

    UNKNOWN_FIELDS = "ignore"

    loads: list[RankLoad]
    version: str | None = None
    timestamp: str | None = None


@dataclasses.dataclass
class TorchServerInfo:
    """The torch server's `GET /get_server_info` (SGLang answers with its
    server arguments instead). `stats` are counters since start;
    `rejections` counts refused requests by reason."""

    weight_version: str
    num_running_requests: int
    num_waiting_requests: int
    paused: bool
    max_running_requests: int
    length_before_eos: bool
    avg_decode_batch_size: float
    stats: dict[str, float]
    rejections: dict[str, int]
    model_path: str | None = None
    device: str | None = None
    dtype: str | None = None
    backend: str | None = None
    lora_adapters: list[str] | None = None  # the LoRA adapters loaded, by name
    lora_adapter: str | None = None  # the one merged into the weights now
