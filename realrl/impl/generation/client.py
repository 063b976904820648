"""One async HTTP client for every generation server (the torch server and SGLang).

Every caller of a generation server (the partial-rollout manager, the gserver
manager, tests, benchmarks) goes through `GenerationClient`. It keeps one
`aiohttp.ClientSession` (one connection pool) per client object; a client is
bound to the event loop it is first used on, and must be closed explicitly
(`await client.close()` or `async with GenerationClient() as client:`).

It builds its requests from, and reads the answers through, the dataclasses of
`realrl.api.sglang_api` (SGLang's native field names, docs/design.md §6), the
same ones the torch server parses, so it drives a real SGLang server unchanged:

    async with GenerationClient(timeout_s=600) as client:
        await client.wait_healthy(url, timeout_s=120)
        result = await client.generate(url, prompt_ids, {"max_new_tokens": 64, "temperature": 1.0})
        result.output_ids, result.output_logprobs, result.finish_reason, result.weight_version

`sampling_params` is a `SamplingParams` or a dict of its fields.

Errors: an HTTP error status raises `GenerationServerError(status, message, url)`;
so does an answer that does not fit its contract (status 200). A server that
cannot be reached (refused, reset, timed out) raises
`GenerationServerUnavailable(url, reason)`. A failed weight update (`success:
false`) raises `GenerationServerError` too: it must never pass silently.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import aiohttp

from realrl.api.generate_answers import ANSWERS_MEDIA_TYPE, decode_answers
from realrl.api.generation_api import needs_sampling_logprobs
from realrl.api.sglang_api import (
    AbortRequest,
    BeginWeightUpdateRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    FinishReason,
    GenerateRequest,
    GenerateResponse,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    Loads,
    LoRAUpdateResponse,
    MetaInfo,
    ModelInfo,
    PauseGenerationRequest,
    SamplingParams,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
    UpdateWeightVersionResponse,
    WeightsUpdateResponse,
)
from realrl.api.vllm_api import WeightVersionSpan
from realrl.api.weights_api import (
    AwaitWeightVersionRequest,
    JoinWeightsGroupRequest,
    LeaveWeightsGroupRequest,
    WeightsGroupResponse,
)
from realrl.base import trial_secret
from realrl.base.http_body import BodyError, from_json, to_json
from realrl.base.logging import getLogger

if TYPE_CHECKING:  # (the client itself needs no torch)
    from realrl.impl.weights.broadcast import GroupSpec

logger = getLogger(__name__)


class GenerationServerError(RuntimeError):
    """The server answered with an error status (or refused an operation)."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.url = url


class GenerationServerUnavailable(ConnectionError):
    """The server could not be reached or did not answer in time."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"generation server {url} unavailable: {reason}")
        self.url = url
        self.reason = reason


class MalformedAnswer(GenerationServerError):
    """A columnar `/generate` answer that does not decode (docs/design.md §6):
    the server said it sent one and sent something else. HTTP 502 as a
    proxy would say it: retried like a server error, and counted
    (`PartialRolloutStats.malformed_answers`)."""

    def __init__(self, message: str, url: str):
        super().__init__(502, message, url)


class ServerWeightsBroken(GenerationServerUnavailable):
    """The server answers but must not serve: a weight load failed part way
    and left its weights half written (vLLM reloads layer by layer). Only a
    load that succeeds makes it serve again; the manager takes it out of
    routing as it does an unavailable server, and brings it back by loading
    the current version (docs/design.md §6)."""


@dataclass
class GenerateResult:
    """One completion. `output_logprobs[i]` is the unfiltered logprob of
    `output_ids[i]` (empty if logprobs were not requested),
    `output_sampling_logprobs[i]` its logprob under the distribution it was
    drawn from (None: the server did not report them; docs/design.md §6)."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    rid: str | None = None
    matched_stop: int | None = None
    meta_info: MetaInfo = field(default_factory=MetaInfo, repr=False)
    output_sampling_logprobs: list[float] | None = None
    # Per token, the version of the weights that sampled it (vLLM's `weight_versions`); None: all `weight_version`.
    output_versions: list[str] | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @classmethod
    def from_response(cls, response: GenerateResponse | Mapping[str, Any]) -> GenerateResult:
        """From one /generate answer (a dict is read through `GenerateResponse`;
        BodyError if it does not fit)."""
        if not isinstance(response, GenerateResponse):
            response = from_json(GenerateResponse, response)
        meta = response.meta_info
        triples = meta.output_token_logprobs or []
        output_ids = response.output_ids
        if output_ids is None:  # some SGLang versions only return the ids with the logprobs
            output_ids = [tok for _, tok, _ in triples]
        reason = meta.finish_reason
        if isinstance(reason, FinishReason):
            reason_type, matched = reason.type, reason.matched
        else:  # None (SGLang, aborted) or a bare string
            reason_type, matched = reason, None
        return cls(
            output_ids=output_ids,
            output_logprobs=[lp for lp, _, _ in triples],
            finish_reason=reason_type or "abort",
            weight_version=meta.weight_version or "",
            prompt_tokens=meta.prompt_tokens or 0,
            completion_tokens=len(output_ids) if meta.completion_tokens is None else meta.completion_tokens,
            rid=meta.id,
            matched_stop=matched if isinstance(matched, int) else None,
            meta_info=meta,
            output_sampling_logprobs=meta.output_token_sampling_logprobs,
            output_versions=versions_of_spans(meta.weight_versions, len(output_ids)),
        )


def versions_of_spans(spans: list[WeightVersionSpan] | None, n_tokens: int) -> list[str] | None:
    """Per output token, the version of its span (`[start, end)`, in order, covering all `n_tokens`);
    None without spans. BodyError if they do not cover the tokens exactly."""
    if spans is None:
        return None
    versions: list[str] = []
    for span in spans:
        if span.start != len(versions) or span.end < span.start:
            raise BodyError(f"weight_versions: span [{span.start}, {span.end}) does not follow token {len(versions)}")
        versions += [span.version] * (span.end - span.start)
    if len(versions) != n_tokens:
        raise BodyError(f"weight_versions cover {len(versions)} of {n_tokens} tokens")
    return versions


@dataclass
class HealthProbe:
    """What one `GenerationClient.probe` found: `ok`, else `reason`, and
    `gone` when nothing answers at that address any more."""

    ok: bool
    reason: str = ""
    gone: bool = False


def new_rid(qid: str, index: int) -> str:
    """A fresh request id for one `/generate` of answer `index` of episode
    `qid`: `<32 hex digits>/<qid>/<index>`. SGLang's `/abort_request` ends
    every live request whose rid starts with the one given (docs/design.md
    §6); a random head of fixed length makes sure no rid is a prefix of
    another, whatever the qids look like."""
    return f"{uuid.uuid4().hex}/{qid}/{index}"


LORA_ADAPTER_PREFIX = "actor-v"


def lora_adapter_name(version: int) -> str | None:
    """The name version `version` of a LoRA run is loaded under on a server
    (`lora_path` of its requests); None for version 0, the base model."""
    return f"{LORA_ADAPTER_PREFIX}{version}" if version > 0 else None


def _lora_adapter_version(name: str) -> int | None:
    suffix = name[len(LORA_ADAPTER_PREFIX) :] if name.startswith(LORA_ADAPTER_PREFIX) else ""
    return int(suffix) if suffix.isdigit() else None


def _normalise(url: str) -> str:
    url = url.rstrip("/")
    return url if "://" in url else f"http://{url}"


T = TypeVar("T")


def _sampling_params(params: SamplingParams | Mapping[str, Any]) -> SamplingParams:
    # A dict key that is no field of SamplingParams raises TypeError here, in the caller.
    return params if isinstance(params, SamplingParams) else SamplingParams(**params)


def _sampling_mask(return_logprob: bool, params: list[SamplingParams]) -> bool | None:
    """`return_sampling_mask` of a request: asked only where some prompt's
    sampling filters (SGLang refuses it without a finite top_k)."""
    return True if return_logprob and any(needs_sampling_logprobs(p) for p in params) else None


# `/generate` asks for the columnar answer (docs/design.md §6); SGLang and vLLM answer JSON whatever it asks.
_ACCEPT_ANSWERS = {"Accept": f"{ANSWERS_MEDIA_TYPE}, application/json;q=0.9"}


@dataclass
class _Answers:
    """A columnar `/generate` answer, decoded."""

    responses: list[GenerateResponse]
    batched: bool

    def results(self, url: str) -> list[GenerateResult]:
        try:
            return [GenerateResult.from_response(r) for r in self.responses]
        except BodyError as e:  # e.g. weight_versions that do not cover the tokens
            raise MalformedAnswer(f"malformed columnar /generate answer ({e})", url) from None


def _read(cls: type[T], body: Any, url: str, route: str) -> T:
    """An answer read through its contract; one that does not fit is the server's error."""
    try:
        return from_json(cls, body)
    except BodyError as e:
        raise GenerationServerError(200, f"unexpected {route} response ({e}): {str(body)[:200]}", url) from None


class GenerationClient:
    """Async client with a shared connection pool; see the module docstring.
    Speaks SGLang's API (SGLang, the torch server); `VLLMClient`
    (`realrl.impl.generation.vllm_client`) the same calls over vLLM's."""

    api = "sglang"

    def __init__(self, timeout_s: float = 3600.0, max_connections: int = 0, connect_timeout_s: float = 10.0):
        # max_connections=0: no pool limit (long generations hold connections for minutes).
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed:
            if loop is not self._loop:
                raise RuntimeError(
                    "this GenerationClient belongs to another event loop; create one client per event loop"
                )
            return self._session
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
        # The trial's key on every request (docs/design.md §14; nothing when security is off).
        self._session = aiohttp.ClientSession(connector=connector, headers=trial_secret.http_headers())
        self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
        self._loop = None

    async def _request(
        self,
        method: str,
        url: str,
        path: str,
        payload: Any = None,
        timeout_s: float | None = None,
        ok_statuses: tuple[int, ...] = (),
        answers: bool = False,
    ) -> Any:
        """Send one request; return the decoded JSON body (None if empty).
        `answers` (`/generate`): ask for the columnar answer too, and return
        one that comes as `_Answers` (`MalformedAnswer` if it does not decode)."""
        full = f"{_normalise(url)}{path}"
        timeout = aiohttp.ClientTimeout(
            total=self.timeout_s if timeout_s is None else timeout_s, sock_connect=self.connect_timeout_s
        )
        session = self._get_session()
        headers = _ACCEPT_ANSWERS if answers else None
        try:
            async with session.request(method, full, json=payload, timeout=timeout, headers=headers) as resp:
                status = resp.status
                if answers and status == 200 and resp.content_type == ANSWERS_MEDIA_TYPE:
                    raw = await resp.read()
                else:
                    raw = None
                    text = await resp.text()
        except asyncio.TimeoutError as e:
            raise GenerationServerUnavailable(url, f"{method} {path} timed out") from e
        except aiohttp.ClientError as e:
            raise GenerationServerUnavailable(url, f"{method} {path}: {type(e).__name__}: {e}") from e
        if raw is not None:
            try:
                decoded = await asyncio.to_thread(decode_answers, raw) if len(raw) > 1 << 20 else decode_answers(raw)
            except BodyError as e:
                raise MalformedAnswer(f"malformed columnar {path} answer ({e})", url) from None
            return _Answers(*decoded)
        body: Any = None
        if text.strip():
            try:
                body = await asyncio.to_thread(_loads, text) if len(text) > 1 << 20 else _loads(text)
            except ValueError:
                body = text
        if status >= 400 and status not in ok_statuses:
            raise GenerationServerError(status, _error_message(body) or text, url)
        return body

    # ---- generation

    async def generate(
        self,
        url: str,
        input_ids: list[int],
        sampling_params: SamplingParams | Mapping[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
        timeout_s: float | None = None,
        lora_path: str | None = None,
        priority: int | None = None,
    ) -> GenerateResult:
        """`lora_path`: the name of the LoRA adapter to generate with (None:
        the base model). With `return_logprob` and filtered sampling, also
        asks for the sampling logprobs (`return_sampling_mask`). `priority`:
        the server admits lower values first (SGLang's field)."""
        params = _sampling_params(sampling_params)
        request = GenerateRequest(
            input_ids=list(input_ids),
            sampling_params=params,
            return_logprob=return_logprob,
            return_sampling_mask=_sampling_mask(return_logprob, [params]),
            rid=rid,
            lora_path=lora_path,
            priority=priority,
        )
        body = await self._request("POST", url, "/generate", to_json(request), timeout_s, answers=True)
        if isinstance(body, _Answers):
            if body.batched or len(body.responses) != 1:
                raise MalformedAnswer(f"{len(body.responses)} columnar answers to one prompt", url)
            return body.results(url)[0]
        return GenerateResult.from_response(_read(GenerateResponse, body, url, "/generate"))

    async def generate_batch(
        self,
        url: str,
        input_ids: list[list[int]],
        sampling_params: SamplingParams | Mapping[str, Any] | list[SamplingParams | Mapping[str, Any]],
        return_logprob: bool = True,
        rids: list[str] | None = None,
        timeout_s: float | None = None,
        lora_path: str | list[str | None] | None = None,
        priority: int | None = None,
    ) -> list[GenerateResult]:
        """One batched `/generate` (SGLang's list-of-prompts form): one result
        per prompt, in order; the response comes when every prompt is done.
        `sampling_params` and `lora_path` (an adapter name): one for all, or
        one per prompt; `priority` one for the body (SGLang's: lower values
        are admitted first)."""
        params = (
            [_sampling_params(p) for p in sampling_params]
            if isinstance(sampling_params, list)
            else _sampling_params(sampling_params)
        )
        if isinstance(params, list) and params and all(p == params[0] for p in params):
            params = params[0]  # one for every prompt: the body carries it once, the server reads it once
        request = GenerateRequest(
            lora_path=lora_path,
            input_ids=[list(p) for p in input_ids],
            sampling_params=params,
            return_logprob=return_logprob,
            return_sampling_mask=_sampling_mask(return_logprob, params if isinstance(params, list) else [params]),
            rid=None if rids is None else list(rids),
            priority=priority,
        )
        body = await self._request("POST", url, "/generate", to_json(request), timeout_s, answers=True)
        if isinstance(body, _Answers):
            if not body.batched or len(body.responses) != len(input_ids):
                raise MalformedAnswer(f"{len(body.responses)} columnar answers to {len(input_ids)} prompts", url)
            return body.results(url)
        if not isinstance(body, list) or len(body) != len(input_ids):
            raise GenerationServerError(200, f"unexpected batched /generate response: {str(body)[:200]}", url)
        return [GenerateResult.from_response(_read(GenerateResponse, b, url, "/generate")) for b in body]

    # ---- control

    async def update_weights_from_disk(
        self,
        url: str,
        model_path: str,
        weight_version: str | int | None,
        abort_all_requests: bool = True,
        timeout_s: float | None = None,
    ) -> UpdateWeightsFromDiskResponse:
        """Load new weights on the server; returns its answer (`paused_total`:
        the requests it aborted); raises GenerationServerError if it failed
        (`success: false`, HTTP 400)."""
        request = UpdateWeightsFromDiskRequest(
            model_path=model_path,
            weight_version=None if weight_version is None else str(weight_version),
            abort_all_requests=abort_all_requests,
        )
        answer = await self._post_answer(
            url, "/update_weights_from_disk", request, timeout_s, UpdateWeightsFromDiskResponse
        )
        if not answer.success:
            raise GenerationServerError(400, f"weight update failed: {answer.message}", url)
        return answer

    async def load_lora_adapter(self, url: str, name: str, path: str, timeout_s: float | None = None) -> list[str]:
        """Load the peft adapter directory `path` under `name`; returns the
        names loaded now. A name that is already loaded counts as loaded
        (version names are never reused for other weights)."""
        body = await self._request(
            "POST",
            url,
            "/load_lora_adapter",
            to_json(LoadLoRAAdapterRequest(lora_name=name, lora_path=path)),
            timeout_s,
            ok_statuses=(400,),
        )
        answer = self._lora_answer(body)
        if not answer.success and "already" not in (answer.error_message or ""):
            raise GenerationServerError(400, f"loading LoRA adapter {name} failed: {answer.error_message}", url)
        return sorted(answer.loaded_adapters or {name: path})

    async def unload_lora_adapter(self, url: str, name: str, timeout_s: float | None = None) -> list[str]:
        """Forget the adapter `name`; returns the names still loaded."""
        body = await self._request(
            "POST",
            url,
            "/unload_lora_adapter",
            to_json(UnloadLoRAAdapterRequest(lora_name=name)),
            timeout_s,
            ok_statuses=(400,),
        )
        answer = self._lora_answer(body)
        if not answer.success:
            raise GenerationServerError(400, f"unloading LoRA adapter {name} failed: {answer.error_message}", url)
        return sorted(answer.loaded_adapters or {})

    @staticmethod
    def _lora_answer(body: Any) -> LoRAUpdateResponse:
        try:
            return from_json(LoRAUpdateResponse, body)
        except BodyError:
            return LoRAUpdateResponse(success=False, error_message=str(body))

    async def update_weight_version(
        self, url: str, version: str | int, abort_all_requests: bool = True, timeout_s: float | None = None
    ) -> UpdateWeightVersionResponse:
        """Report `version` from now on (requests in flight aborted first when
        asked); the torch server switches to the adapter loaded last."""
        request = UpdateWeightVersionRequest(new_version=str(version), abort_all_requests=abort_all_requests)
        answer = await self._post_answer(url, "/update_weight_version", request, timeout_s, UpdateWeightVersionResponse)
        if not answer.success:
            raise GenerationServerError(400, f"weight version update failed: {answer.message}", url)
        return answer

    async def load_version(self, url: str, path: str, version: int, lora: bool, timeout_s: float | None = None) -> int:
        """Brings a server to weight `version`, published in directory `path`
        (docs/design.md §8), aborting the requests in flight; returns how many
        it aborted. Full weights: `/update_weights_from_disk`. A LoRA adapter:
        `/load_lora_adapter` under `lora_adapter_name(version)`,
        `/update_weight_version`, then `/unload_lora_adapter` of the versions
        before the newest one the server held before (the one it served,
        kept for requests scheduled on it just before the switch, also when
        the server skips versions: 5 -> 7 keeps 5)."""
        if not lora:
            return (await self.update_weights_from_disk(url, path, version, True, timeout_s)).paused_total
        loaded = await self.load_lora_adapter(url, lora_adapter_name(version), path, timeout_s)
        switched = await self.update_weight_version(url, version, True, timeout_s)
        older = [v for v in map(_lora_adapter_version, loaded) if v is not None and v < version]
        for old in older:
            if old < max(older):
                await self.unload_lora_adapter(url, lora_adapter_name(old), timeout_s)
        return switched.num_paused_requests

    # ---- weight groups (docs/design.md §8, "Broadcast"; torch servers)

    async def _post_answer(self, url: str, route: str, body: Any, timeout_s: float | None, answer_cls: type[T]) -> T:
        """POSTs `body` to `route`; the server's answer as `answer_cls`, a 400 included (a
        body that does not decode is a failed answer whose message is that body)."""
        raw = await self._request("POST", url, route, to_json(body), timeout_s, ok_statuses=(400,))
        try:
            return from_json(answer_cls, raw)
        except BodyError:
            return answer_cls(success=False, message=str(raw))

    async def _group_call(self, url: str, route: str, body: Any, timeout_s: float | None) -> WeightsGroupResponse:
        return await self._post_answer(url, route, body, timeout_s, WeightsGroupResponse)

    async def join_weights_group(self, url: str, spec: GroupSpec, rank: int, timeout_s: float | None = None) -> None:
        """Puts the server into group `spec` at `rank` (it starts joining; the
        group forms once every rank joined); GenerationServerError if refused."""
        request = JoinWeightsGroupRequest(
            group_name=spec.name,
            store_host=spec.store_host,
            store_port=spec.store_port,
            world_size=spec.world_size,
            rank=rank,
            backend=spec.backend,
            bucket_bytes=spec.bucket_bytes,
            timeout_s=spec.timeout_s,
            join_timeout_s=spec.join_timeout_s,
            member_groups=spec.member_groups,
        )
        answer = await self._group_call(url, "/join_weights_group", request, timeout_s)
        if not answer.success:
            raise GenerationServerError(400, f"joining weight group {spec.name} failed: {answer.message}", url)

    async def leave_weights_group(
        self, url: str, group_name: str | None = None, timeout_s: float | None = None
    ) -> None:
        await self._group_call(url, "/leave_weights_group", LeaveWeightsGroupRequest(group_name), timeout_s)

    async def await_weight_version(self, url: str, version: int, timeout_s: float) -> WeightsGroupResponse:
        """The server's answer once it holds `version` (or newer) through its
        group, or `success: false` (its membership failed or ended, or
        `timeout_s` passed): then the caller loads the version from disk."""
        request = AwaitWeightVersionRequest(weight_version=version, timeout_s=timeout_s)
        return await self._group_call(url, "/await_weight_version", request, timeout_s + 10.0)

    # ---- SGLang's distributed weight update (docs/design.md §8, "Broadcast"; SGLang servers)

    async def _sglang_group_call(self, url: str, route: str, body: Any, timeout_s: float | None) -> None:
        """One of SGLang's group routes; GenerationServerError unless it succeeded."""
        result = await self._post_answer(url, route, body, timeout_s, WeightsUpdateResponse)
        if not result.success:
            raise GenerationServerError(400, f"{route}: {result.message}", url)

    async def init_weights_update_group(
        self, url: str, spec: GroupSpec, rank: int, timeout_s: float | None = None
    ) -> None:
        """Joins SGLang server `url` into group `spec` at `rank`: answered once
        the group formed (the sender is there), or GenerationServerError."""
        name, world_size, rank = spec.member_group(rank)  # (a group of two with the sender, or the epoch's one)
        request = InitWeightsUpdateGroupRequest(spec.store_host, spec.store_port, rank, world_size, name, spec.backend)
        await self._sglang_group_call(url, "/init_weights_update_group", request, timeout_s)

    async def update_weights_from_distributed(
        self,
        url: str,
        group_name: str,
        entries: Sequence[Any],
        weight_version: str | None,
        timeout_s: float | None = None,
    ) -> None:
        """Receives one bucket (`entries`: `TensorEntry`s, packed) by the
        group's broadcast; `weight_version` with a version's last bucket."""
        request = UpdateWeightsFromDistributedRequest(
            names=[e.name for e in entries],
            dtypes=[e.dtype for e in entries],
            shapes=[list(e.shape) for e in entries],
            group_name=group_name,
            flush_cache=weight_version is not None,
            weight_version=weight_version,
            load_format="flattened_bucket",
        )
        await self._sglang_group_call(url, "/update_weights_from_distributed", request, timeout_s)

    async def begin_weight_update(self, url: str, timeout_s: float | None = None) -> None:
        await self._sglang_group_call(url, "/begin_weight_update", BeginWeightUpdateRequest(), timeout_s)

    async def end_weight_update(self, url: str, timeout_s: float | None = None) -> None:
        await self._sglang_group_call(url, "/end_weight_update", EndWeightUpdateRequest(), timeout_s)

    async def destroy_weights_update_group(self, url: str, group_name: str, timeout_s: float | None = None) -> None:
        request = DestroyWeightsUpdateGroupRequest(group_name)
        await self._sglang_group_call(url, "/destroy_weights_update_group", request, timeout_s)

    async def prepare(self, url: str, version: int) -> None:
        """Readies a started server for routing at weight `version` (SGLang
        and the torch server start on it: `--weight-version`)."""

    async def pause_generation(self, url: str, mode: str = "abort") -> Any:
        """`abort`: every running and waiting request ends with `abort`;
        `in_place`: they wait for `continue_generation`."""
        return await self._request("POST", url, "/pause_generation", to_json(PauseGenerationRequest(mode=mode)))

    async def continue_generation(self, url: str) -> Any:
        return await self._request("POST", url, "/continue_generation", to_json(ContinueGenerationRequest()))

    async def abort_request(self, url: str, rid: str | None = None, abort_all: bool = False) -> Any:
        """Ends request `rid` (on SGLang also every live request whose rid
        starts with it), or every request."""
        if rid is None and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        return await self._request("POST", url, "/abort_request", to_json(AbortRequest(rid=rid, abort_all=abort_all)))

    async def flush_cache(self, url: str) -> Any:
        return await self._request("POST", url, "/flush_cache")

    # ---- status

    async def health(self, url: str, timeout_s: float = 5.0) -> bool:
        """True if /health answers 200; False on any error."""
        try:
            await self._request("GET", url, "/health", timeout_s=timeout_s)
            return True
        except (GenerationServerError, GenerationServerUnavailable):
            return False

    async def probe(self, url: str, timeout_s: float = 5.0) -> HealthProbe:
        """One /health check that says why it failed, and whether the server
        is gone (connection refused or dropped: nothing listens there) rather
        than slow or unhealthy."""
        full = f"{_normalise(url)}/health"
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, self.connect_timeout_s))
        try:
            async with self._get_session().get(full, timeout=timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    return HealthProbe(True)
                return HealthProbe(False, f"/health answered HTTP {resp.status}")
        except asyncio.TimeoutError:
            return HealthProbe(False, f"/health did not answer within {timeout_s:g}s")
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError) as e:
            return HealthProbe(False, f"{type(e).__name__}: {e}", gone=True)
        except aiohttp.ClientError as e:
            return HealthProbe(False, f"{type(e).__name__}: {e}")

    async def model_info(self, url: str, timeout_s: float | None = None) -> ModelInfo:
        try:
            body = await self._request("GET", url, "/model_info", timeout_s=timeout_s)
        except GenerationServerError as e:
            if e.status != 404:
                raise
            body = await self._request("GET", url, "/get_model_info", timeout_s=timeout_s)  # SGLang before 0.5.6
        return _read(ModelInfo, body, url, "/model_info")

    async def weight_version(self, url: str, timeout_s: float | None = None) -> str:
        return (await self.model_info(url, timeout_s)).weight_version or ""

    async def loads(self, url: str, timeout_s: float | None = None) -> Loads:
        """`GET /v1/loads`: running and waiting requests per data-parallel rank."""
        body = await self._request("GET", url, "/v1/loads?include=core", timeout_s=timeout_s)
        return _read(Loads, body, url, "/v1/loads")

    async def server_info(self, url: str) -> dict[str, Any]:
        """The decoded `/get_server_info` answer: the torch server's is a
        `TorchServerInfo`, SGLang's its server arguments."""
        return await self._request("GET", url, "/get_server_info")

    async def wait_healthy(self, url: str, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll /health until it answers 200; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            if await self.health(url, timeout_s=max(0.5, min(5.0, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"generation server {url} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)


def _error_message(body: Any) -> str:
    """The message of an error answer: `{"error": "..."}` (the torch server),
    `{"error": {"message": "..."}}` (SGLang's `/generate`), `{"message": ...}`
    or `{"detail": ...}` (FastAPI's HTTPException), else the body itself."""
    if not isinstance(body, dict):
        return str(body or "")
    error = body.get("error")
    if isinstance(error, dict):
        error = error.get("message")
    return str(error or body.get("message") or body.get("detail") or "")


def _loads(text: str) -> Any:
    import json

    return json.loads(text)
