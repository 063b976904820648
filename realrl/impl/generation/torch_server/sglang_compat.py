"""SGLang's behaviours, copied by the torch server for tests (`--emulate-sglang VERSION`).

realrl's tests cannot run SGLang (it needs CUDA), so they run the torch server
in this mode to meet what SGLang does differently, as its source says it does
(`realrl.impl.generation.backends` cites where each was read):

- `/health` (and `/health_generate`) runs a generation: it answers 200 after
  about a second when the server is serving, and 503 after
  `SGLANG_HEALTH_CHECK_TIMEOUT` seconds (default 20) while a weight update or
  a pause holds generation up. `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false`
  makes `/health` a plain 200 from 0.5.6 on (realrl launches SGLang so).
- Response shapes: `/get_server_info` holds server arguments and
  `internal_states` (one per rank) and no request counts; `/v1/loads` and
  `num_paused_requests` have one entry per rank with `--emulate-sglang-dp N`
  > 1 (a list then), and `num_paused_requests` is always 0; `/model_info` only
  from 0.5.6 (`/get_model_info` always), `/get_weight_version` until 0.5.7;
  `/pause_generation` and `/continue_generation` answer `{"message",
  "status"}`, `/abort_request` an empty 200.
- `/abort_request {rid}` ends every request whose rid starts with `rid`, once
  a request of exactly that rid is live; an empty rid is ignored.
- `/pause_generation` needs a JSON body from 0.5.6; mode `abort` (the
  default) also ends the waiting requests, and so does
  `abort_all_requests` of a weight update; mode `in_place` keeps them.
- A weight update while requests sit in a batch paused in place cannot flush
  SGLang's prefix cache: 0.5.23 swaps the weights and answers `success:
  false` (the weight version unchanged); earlier releases die (an assert in
  the scheduler).
- The length limit is checked before EOS before 0.5.23, after it from
  0.5.23 (`length_before_eos`).
- Sampling logprobs (`output_token_sampling_logprobs`) only from 0.5.16 and
  only for a request with `return_sampling_mask`; such a request with a
  top_k SGLang cannot bound is refused with HTTP 400 and SGLang's message
  (`{"error": {"message"}}`), no token generated: 0.5.16 refuses top_k off,
  0.5.23 also top_k > 4096 (`realrl.api.sglang_api.sampling_mask_refusal`).
- `/pause_generation {"mode": "retract"}` puts the running requests back in
  the queue (here: they stay paused in place, marked retracted until
  `/continue_generation`); a retracted request that is aborted answers as
  SGLang's waiting-queue abort does (`queued_abort_output`): the tokens
  streamed so far, their logprobs, no sampling logprobs. A weight update
  with `abort_all_requests` aborts them first, so its cache flush succeeds.

Data parallelism is emulated in the answers only: one engine serves, its
counts go to rank 0 and the other ranks report nothing running.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

from packaging.version import Version

from realrl.api.sglang_api import (
    SAMPLING_MASK_MAX_TOKENS,
    GenerateResponse,
    emulated_release,
    sampling_mask_refusal,
)

# SGLang's own defaults and names.
HEALTH_TIMEOUT_ENV = "SGLANG_HEALTH_CHECK_TIMEOUT"
HEALTH_GENERATION_ENV = "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"
DEFAULT_HEALTH_TIMEOUT_S = 20
FORCE_STREAM_INTERVAL_ENV = "SGLANG_FORCE_STREAM_INTERVAL"
DEFAULT_FORCE_STREAM_INTERVAL = 50  # v0.5.23 environ.py:688


def _env_bool(value: str | None, default: bool) -> bool:
    if value is None:
        return default
    return value.strip().lower() not in ("0", "false", "no", "off", "")


@dataclasses.dataclass(frozen=True)
class SGLangCompat:
    """The behaviours of one SGLang release (see the module docstring)."""

    version: Version
    dp: int = 1
    health_timeout_s: float = DEFAULT_HEALTH_TIMEOUT_S
    health_generation: bool = True  # SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION
    force_stream_interval: int = DEFAULT_FORCE_STREAM_INTERVAL  # SGLANG_FORCE_STREAM_INTERVAL

    @classmethod
    def from_env(cls, version: str, dp: int = 1, environ: Mapping[str, str] = os.environ) -> SGLangCompat:
        """Reads SGLang's health variables from `environ`, as SGLang does."""
        if dp < 1:
            raise ValueError(f"data-parallel ranks must be >= 1, got {dp}")
        return cls(
            version=emulated_release(version),
            dp=dp,
            health_timeout_s=int(environ.get(HEALTH_TIMEOUT_ENV, DEFAULT_HEALTH_TIMEOUT_S)),
            health_generation=_env_bool(environ.get(HEALTH_GENERATION_ENV), True),
            force_stream_interval=max(1, int(environ.get(FORCE_STREAM_INTERVAL_ENV, DEFAULT_FORCE_STREAM_INTERVAL))),
        )

    def since(self, release: str) -> bool:
        return self.version >= Version(release)

    def health_generates(self, path: str) -> bool:
        """Whether `path` (/health or /health_generate) runs a generation."""
        if not self.since("0.4.10.post2"):  # /health was a plain 200 before
            return path == "/health_generate"
        # The switch exists from 0.5.5.post3 but works from 0.5.6 on.
        return path == "/health_generate" or self.health_generation or not self.since("0.5.6")

    @property
    def has_model_info(self) -> bool:
        return self.since("0.5.6")  # /get_model_info exists in every release

    @property
    def has_weight_version_route(self) -> bool:
        return not self.since("0.5.8")  # a 404 "deprecated" from 0.5.8

    @property
    def control_bodies_required(self) -> bool:
        return self.since("0.5.6")  # PauseGenerationReqInput, ContinueGenerationReqInput

    @property
    def length_before_eos(self) -> bool:
        """The length limit checked before EOS and stop tokens (a last allowed
        token that is EOS reports `length`): v0.5.16
        `managers/schedule_batch.py:1476-1506` `update_finish_state`; from
        0.5.23 EOS first (v0.5.23 `managers/schedule_batch.py:2007-2041`)."""
        return not self.since("0.5.23")

    @property
    def refused_flush_swaps_weights(self) -> bool:
        """True: a refused cache flush answers `success: false` with the new
        weights in place (0.5.23); False: the server dies."""
        return self.since("0.5.23")

    def sampling_mask_refusal(self, top_k: int | None, greedy: bool) -> str | None:
        """SGLang's message refusing a `return_sampling_mask` request (HTTP
        400, `realrl.api.sglang_api.sampling_mask_refusal`), else None."""
        return sampling_mask_refusal(self.version, top_k, greedy, SAMPLING_MASK_MAX_TOKENS)

    def queued_abort_output(self, response: GenerateResponse) -> GenerateResponse:
        """The answer of a request aborted while in SGLang's waiting queue
        (retracted by a pause, or by the scheduler when the KV cache runs
        out), as the tokenizer manager builds it from what it was streamed
        (v0.5.23 `managers/tokenizer_manager.py:3577-3640`
        `_handle_abort_req`): a non-streamed request was streamed every
        SGLANG_FORCE_STREAM_INTERVAL tokens (v0.5.23
        `managers/scheduler_components/output_streamer.py:474-477`), so the
        tokens and logprobs up to the last multiple of it; no
        `output_token_sampling_logprobs`, `prompt_tokens` or
        `cached_tokens`."""
        meta = response.meta_info
        kept = len(response.output_ids or []) // self.force_stream_interval * self.force_stream_interval
        logprobs = None if meta.output_token_logprobs is None else meta.output_token_logprobs[:kept]
        meta = dataclasses.replace(
            meta,
            output_token_logprobs=logprobs,
            output_token_sampling_logprobs=None,
            prompt_tokens=None,
            cached_tokens=None,
            completion_tokens=kept,
        )
        return GenerateResponse(output_ids=list(response.output_ids or [])[:kept], meta_info=meta)

    def reports_sampling_logprobs(self, asked: bool) -> bool:
        return asked and self.since("0.5.16")

    def per_rank(self, value, idle):
        """`value` from rank 0 and `idle` from the others: a plain value
        without data parallelism, a list with it (SGLang's shapes)."""
        return value if self.dp == 1 else [value] + [idle] * (self.dp - 1)
