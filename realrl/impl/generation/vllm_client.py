"""The client of a vLLM server (>= 0.32): `GenerationClient`'s calls over vLLM's routes.

The runtime calls every generation server through `GenerationClient`'s
methods; `VLLMClient` answers the same calls on vLLM's API
(`realrl.api.vllm_api`, where each route is cited from vLLM's source):

- `generate`: `POST /inference/v1/generate`, one prompt per request (token
  in, `logprobs: 0`, `detokenize: false`); `generate_batch` sends one per
  prompt, concurrently. The result's `output_versions` are per token, read
  from the choice's `weight_versions` spans; `weight_version` is the last
  token's. A LoRA request names its adapter in `model` (vLLM's 404 for one
  it no longer holds is raised as the 400 "not loaded" the partial rollout
  schedules again, as on SGLang). vLLM 0.33 refuses a
  generation while paused with 503 "Generation is paused": the request is
  sent again once the pause is over, and never counted as a failure.
- `load_version` (docs/design.md §8), full weights: `/pause?mode=abort` ->
  `/collective_rpc reload_weights {weights_path}` -> `/reset_prefix_cache`
  -> `/update_weight_version` -> `/resume`. The aborted requests come back
  with their partial tokens and logprobs, and the partial rollout resumes
  them as it does on SGLang. A failed reload leaves the weights half
  written (vLLM reloads layer by layer, `model_executor/model_loader/
  reload/inplace.py`): the server stays paused, nothing is served from it,
  and the update raises `ServerWeightsBroken`, on which the manager takes
  the server out of routing and brings it back by loading the current
  version again (which rewrites every weight). LoRA:
  `GenerationClient.load_version`'s steps over vLLM's routes:
  `/v1/load_lora_adapter` under `actor-v<v>`, `/update_weight_version`,
  `/v1/unload_lora_adapter` of the adapters older than the one served
  before (`GET /v1/models` lists them).
- `abort_request`: `/inference/v1/abort_requests` of the exact engine id.
- `weight_version`: `GET /weight_info`; `loads`: `GET /load` (requests
  being served); `prepare`: `/update_weight_version` to the version the
  server starts on, before it joins routing (vLLM has no flag for it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from typing import Any

from realrl.api.sglang_api import (
    FinishReason,
    Loads,
    MetaInfo,
    ModelInfo,
    RankLoad,
    SamplingParams,
    UpdateWeightVersionResponse,
)
from realrl.api.vllm_api import (
    PAUSED_MESSAGE,
    REQUEST_ID_PREFIX,
    AbortRequests,
    CollectiveRPCRequest,
    LoadLoRAAdapterRequest,
    ModelList,
    UnloadLoRAAdapterRequest,
    UpdateWeightVersionRequest,
    VLLMGenerateRequest,
    VLLMGenerateResponse,
    VLLMSamplingParams,
)
from realrl.base.http_body import BodyError, to_json
from realrl.impl.generation.client import (
    GenerateResult,
    GenerationClient,
    GenerationServerError,
    ServerWeightsBroken,
    _read,
    _sampling_params,
    versions_of_spans,
)

PAUSED_RETRY_S = 0.05  # first wait before a generation refused while paused is sent again (doubling, to 1 s)


def vllm_sampling(params: SamplingParams, return_logprob: bool) -> VLLMSamplingParams:
    """SGLang-named sampling parameters as vLLM's (`max_tokens` is
    `max_new_tokens`; top_k -1 = off in both)."""
    return VLLMSamplingParams(
        max_tokens=params.max_new_tokens,
        min_tokens=params.min_new_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
        logprobs=0 if return_logprob else None,
        detokenize=False,
    )


def result_of(answer: VLLMGenerateResponse, rid: str | None) -> GenerateResult:
    """A `GenerateResult` of vLLM's answer: its one choice's tokens, logprobs
    and per-token versions."""
    if len(answer.choices) != 1:
        raise BodyError(f"expected one choice, got {len(answer.choices)}")
    choice = answer.choices[0]
    ids = list(choice.token_ids or [])
    logprobs = [c.logprob for c in (choice.logprobs.content or [])] if choice.logprobs is not None else []
    versions = versions_of_spans(choice.weight_versions, len(ids)) or []
    reason = choice.finish_reason or "stop"
    prompt = answer.usage.prompt_tokens if answer.usage is not None else 0
    matched = choice.stop_reason if isinstance(choice.stop_reason, int) else None
    meta = MetaInfo(id=rid, finish_reason=FinishReason(reason, matched), prompt_tokens=prompt)
    return GenerateResult(
        output_ids=ids,
        output_logprobs=logprobs,
        finish_reason=reason,
        weight_version=versions[-1] if versions else "",
        prompt_tokens=prompt,
        completion_tokens=len(ids),
        rid=rid,
        matched_stop=matched,
        meta_info=meta,
        # processed_logprobs: the logprob under the distribution the token was
        # drawn from; realrl serves only unfiltered sampling on vLLM, where the two agree.
        output_sampling_logprobs=None,
        output_versions=versions or None,
    )


class VLLMClient(GenerationClient):
    """`GenerationClient` over vLLM's routes (see the module docstring)."""

    api = "vllm"

    async def generate(
        self,
        url: str,
        input_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
        timeout_s: float | None = None,
        lora_path: str | None = None,
        priority: int | None = None,  # not sent: vLLM's scheduler is first come, first served by default
    ) -> GenerateResult:
        request = VLLMGenerateRequest(
            token_ids=list(input_ids),
            sampling_params=vllm_sampling(_sampling_params(sampling_params), return_logprob),
            request_id=rid,
            model=lora_path,
        )
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        wait = PAUSED_RETRY_S
        while True:
            try:
                body = await self._request(
                    "POST", url, "/inference/v1/generate", to_json(request), max(0.1, deadline - time.monotonic())
                )
                break
            except GenerationServerError as e:
                if e.status == 404 and lora_path is not None:
                    # vLLM's answer for an adapter it does not hold (unloaded since the request was
                    # scheduled): the refusal the partial rollout schedules again (docs/design.md §8).
                    raise GenerationServerError(
                        400, f"LoRA adapter {lora_path!r} is not loaded ({e.message})", url
                    ) from None
                # 0.33 refuses a generation while a weight update holds the server paused: not a failure.
                if e.status != 503 or PAUSED_MESSAGE not in e.message or time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(wait)
            wait = min(1.0, wait * 2)
        answer = _read(VLLMGenerateResponse, body, url, "/inference/v1/generate")
        try:
            return result_of(answer, rid)
        except BodyError as e:
            raise GenerationServerError(200, f"unexpected /inference/v1/generate response ({e})", url) from None

    async def generate_batch(
        self,
        url: str,
        input_ids: list[list[int]],
        sampling_params: SamplingParams | Mapping[str, Any] | list[SamplingParams | Mapping[str, Any]],
        return_logprob: bool = True,
        rids: list[str] | None = None,
        timeout_s: float | None = None,
        lora_path: str | list[str | None] | None = None,
        priority: int | None = None,  # not sent (see `generate`)
    ) -> list[GenerateResult]:
        """One request per prompt (vLLM's route takes one), concurrently; when one fails, the
        others are cancelled (their connections closed: vLLM aborts them) and the error raised."""
        n = len(input_ids)
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * n
        loras = lora_path if isinstance(lora_path, list) else [lora_path] * n
        calls = [
            asyncio.ensure_future(
                self.generate(url, ids, p, return_logprob, None if rids is None else rids[i], timeout_s, lora)
            )
            for i, (ids, p, lora) in enumerate(zip(input_ids, params, loras))
        ]
        try:
            return list(await asyncio.gather(*calls))
        finally:
            # One failed (or the caller gave up): the others are closed too, which ends them on the
            # server, rather than left generating answers nobody reads.
            for call in calls:
                call.cancel()
            await asyncio.gather(*calls, return_exceptions=True)

    # ---- weights

    async def _post(self, url: str, path: str, body: Any = None, timeout_s: float | None = None) -> Any:
        return await self._request("POST", url, path, body, timeout_s)

    async def load_version(self, url: str, path: str, version: int, lora: bool, timeout_s: float | None = None) -> int:
        if lora:  # GenerationClient's: load, switch, unload the older ones, over vLLM's routes (below)
            return await super().load_version(url, path, version, lora, timeout_s)
        await self._post(url, "/pause?mode=abort", None, timeout_s)
        rpc = CollectiveRPCRequest(method="reload_weights", kwargs={"weights_path": path})
        try:
            await self._post(url, "/collective_rpc", to_json(rpc), timeout_s)
        except GenerationServerError as e:
            # Half-written weights: the server stays paused (nothing served from them) and out of
            # routing until a reload succeeds; vLLM cannot be restarted from here (no such route).
            raise ServerWeightsBroken(
                url,
                f"reload_weights from {path} failed, its weights are half written (paused until a reload "
                f"succeeds): HTTP {e.status}: {e.message}",
            ) from None
        await self._post(url, "/reset_prefix_cache", None, timeout_s)
        await self.update_weight_version(url, version, timeout_s=timeout_s)
        await self._post(url, "/resume", None, timeout_s)
        return 0  # vLLM does not count the requests a pause aborts

    async def load_lora_adapter(self, url: str, name: str, path: str, timeout_s: float | None = None) -> list[str]:
        """`/v1/load_lora_adapter`; a name already loaded counts as loaded (vLLM's 400 says so).
        Returns the adapters loaded now (`lora_adapters`)."""
        try:
            await self._post(url, "/v1/load_lora_adapter", to_json(LoadLoRAAdapterRequest(name, path)), timeout_s)
        except GenerationServerError as e:
            if "has already been loaded" not in e.message:
                raise
        return await self.lora_adapters(url, timeout_s)

    async def unload_lora_adapter(self, url: str, name: str, timeout_s: float | None = None) -> list[str]:
        body = to_json(UnloadLoRAAdapterRequest(name))
        await self._post(url, "/v1/unload_lora_adapter", body, timeout_s)
        return await self.lora_adapters(url, timeout_s)

    async def lora_adapters(self, url: str, timeout_s: float | None = None) -> list[str]:
        """The adapters loaded: `GET /v1/models`' cards that have a `parent` (the served model's has none)."""
        body = await self._request("GET", url, "/v1/models", timeout_s=timeout_s)
        return sorted(card.id for card in _read(ModelList, body, url, "/v1/models").data if card.parent is not None)

    async def update_weight_version(
        self, url: str, version: str | int, abort_all_requests: bool = True, timeout_s: float | None = None
    ) -> UpdateWeightVersionResponse:
        """vLLM's `/update_weight_version` aborts nothing (`abort_all_requests` is SGLang's; a LoRA
        request in flight finishes on the adapter it named)."""
        body = to_json(UpdateWeightVersionRequest(new_version=str(version)))
        await self._post(url, "/update_weight_version", body, timeout_s)
        return UpdateWeightVersionResponse(success=True, new_version=str(version))

    async def prepare(self, url: str, version: int) -> None:
        await self.update_weight_version(url, version)

    async def pause_generation(self, url: str, mode: str = "abort") -> Any:
        return await self._post(url, f"/pause?mode={'keep' if mode == 'in_place' else mode}")

    async def continue_generation(self, url: str) -> Any:
        return await self._post(url, "/resume")

    async def abort_request(self, url: str, rid: str | None = None, abort_all: bool = False) -> Any:
        """Ends exactly request `rid` (vLLM's engine id `generate-tokens-<rid>`), or every request."""
        if abort_all:
            return await self._post(url, "/abort_requests", {})
        if rid is None:
            raise ValueError("give a rid or abort_all=True")
        return await self._post(url, "/inference/v1/abort_requests", to_json(AbortRequests([REQUEST_ID_PREFIX + rid])))

    # ---- status

    async def model_info(self, url: str, timeout_s: float | None = None) -> ModelInfo:
        body = await self._request("GET", url, "/weight_info", timeout_s=timeout_s)
        version = body.get("weight_version") if isinstance(body, dict) else None
        return ModelInfo(weight_version=None if version is None else str(version))

    async def loads(self, url: str, timeout_s: float | None = None) -> Loads:
        body = await self._request("GET", url, "/load", timeout_s=timeout_s)
        load = body.get("server_load", 0) if isinstance(body, dict) else 0
        return Loads(loads=[RankLoad(0, int(load), 0)], version="vllm")
