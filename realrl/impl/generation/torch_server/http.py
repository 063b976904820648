"""The HTTP face of the torch server: SGLang's native API (docs/design.md §6) on aiohttp.

- `POST /generate` `GenerateRequest` -> `GenerateResponse` (a list of those
  for a batched request): `{"output_ids", "meta_info": {"id", "finish_reason":
  {"type": "stop"|"length"|"abort", "matched"?}, "weight_version",
  "prompt_tokens", "completion_tokens", "output_token_logprobs": [[logprob,
  token_id, null], ...], "weight_versions"?}}` (spans `{"version", "start",
  "end"}` of an answer that went on across a weight update). A request with
  `Accept: application/x-realrl-answers` gets the same answers columnar
  (`realrl.api.generate_answers`), unless the server emulates SGLang.
- `POST /update_weights_from_disk` `{"model_path", "weight_version",
  "abort_all_requests"}` -> `{"success", "message", "num_paused_requests"}`.
- `POST /pause_generation` (`{"mode": "abort"|"in_place"}`, optional),
  `POST /continue_generation`, `POST /abort_request` (`{"rid"}` or
  `{"abort_all": true}`), `GET|POST /flush_cache`, `GET /health`, `GET
  /model_info` (alias `/get_model_info`), `GET /get_server_info`, `GET
  /v1/loads` (SGLang's shape: requests per rank), `GET /get_weight_version`,
  `GET /metrics`.
- LoRA adapters (docs/design.md §8): `POST /load_lora_adapter` `{"lora_name",
  "lora_path"}` and `POST /unload_lora_adapter` `{"lora_name"}` -> `{"success",
  "error_message", "loaded_adapters"}`; `POST /update_weight_version`
  `{"new_version", "abort_all_requests"}` -> `{"success", "message",
  "new_version", "num_paused_requests"}` (here it also switches to the
  adapter loaded last); `/generate` takes `lora_path`, a loaded adapter's name.
- Versions over the wire (docs/design.md §8, "Broadcast"; `weights_group.py`):
  `POST /join_weights_group` (`realrl.api.weights_api`), `POST
  /await_weight_version`, `POST /leave_weights_group` -> `{"success",
  "message", "weight_version"}`.
- `--frozen` (a judge model's server, realrl/impl/judge.py): every weight
  change (`/update_weights_from_disk`, `/update_weight_version`, the LoRA
  routes, `/join_weights_group`) is answered 400 and counted in `rejections` as `frozen`.

With `--secret-file` (the trial's secret, docs/design.md §14), every route
but `/health` needs `Authorization: Bearer <the trial's HTTP key>` (401 and
counted in `realrl_torch_server_unauthorized_requests` otherwise), and with
`--weights-dir` weights and adapters load only from under that directory
(symlinks resolved) or from `--model-path`: any other path is 400, counted in
`rejections` as `weight_path`.

With `compat` (`--emulate-sglang VERSION`) the routes behave as that SGLang
release's do (`sglang_compat`), and SGLang's distributed weight update is
there too (`/init_weights_update_group`, `/update_weights_from_distributed`,
0.5.23's `/begin_weight_update` and `/end_weight_update`,
`/destroy_weights_update_group`: `sglang_distributed`); with `vllm` (`--emulate-vllm VERSION`) the
server answers vLLM's routes instead (`vllm_compat`; the same key gate and
weight-path rule). `weight_load_gate` (`--weight-load-gate FILE`, a test
hook) holds every weight update, once its weights are read, until FILE
exists: a load as long as a test needs.

The bodies are the dataclasses of `realrl.api.sglang_api`. Every body goes
through `realrl.base.http_body` (size, UTF-8, JSON nesting depth, object type,
then the contract): a bad body is answered 400 (413 when too large), never
500, and counted by reason. A request that fails inside the engine is
answered 500. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from typing import Any

import torch
from aiohttp import web

from realrl.api.generate_answers import ANSWERS_MEDIA_TYPE, encode_answers
from realrl.api.sglang_api import (
    AbortRequest,
    BeginWeightUpdateRequest,
    ContinueGenerationRequest,
    DestroyWeightsUpdateGroupRequest,
    EndWeightUpdateRequest,
    FinishReason,
    InitWeightsUpdateGroupRequest,
    LoadLoRAAdapterRequest,
    Loads,
    LoRAUpdateResponse,
    ModelInfo,
    PauseGenerationRequest,
    RankLoad,
    UnloadLoRAAdapterRequest,
    UpdateWeightsFromDiskRequest,
    UpdateWeightsFromDiskResponse,
    UpdateWeightsFromDistributedRequest,
    UpdateWeightVersionRequest,
    UpdateWeightVersionResponse,
    WeightsUpdateResponse,
)
from realrl.api.weights_api import (
    AwaitWeightVersionRequest,
    JoinWeightsGroupRequest,
    LeaveWeightsGroupRequest,
    WeightsGroupResponse,
)
from realrl.base.http_auth import BearerGate
from realrl.base.http_body import BodyError, from_json, read_json, to_json
from realrl.base.logging import getLogger
from realrl.impl.generation.torch_server.answers import Answers
from realrl.impl.generation.torch_server.engine import GenerationEngine
from realrl.impl.generation.torch_server.protocol import parse_generate_body
from realrl.impl.generation.torch_server.sglang_compat import SGLangCompat
from realrl.impl.generation.torch_server.sglang_distributed import SESSION_REQUIRED, DistributedWeightUpdates
from realrl.impl.generation.torch_server.vllm_compat import VLLMCompat, VLLMRoutes
from realrl.impl.generation.torch_server.weights_group import GroupMembership
from realrl.impl.weights.broadcast import GroupSpec

logger = getLogger(__name__)

# Request bodies: large enough for a batched /generate of long prompts.
MAX_BODY_BYTES = 256 * 1024 * 1024
MAX_BODY_DEPTH = 16  # the deepest valid body (batched stop_token_ids) nests 4 levels


def _json(body: Any, status: int = 200) -> web.Response:
    """A contract dataclass (or a list of them) as a JSON response."""
    return web.json_response(to_json(body), status=status)


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


class TorchGenerationServer:
    """The aiohttp application around a `GenerationEngine`."""

    def __init__(
        self,
        engine: GenerationEngine,
        model_path: str,
        device: str,
        dtype: str,
        weight_load_gate: str | None = None,
        frozen: bool = False,
        vllm: VLLMCompat | None = None,
        api_key: str | None = None,
        weights_dir: str = "",
        weights_group: GroupMembership | None = None,
        bind_host: str = "127.0.0.1",
    ):
        self.engine = engine
        self.compat: SGLangCompat | None = engine.compat
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.weight_load_gate = weight_load_gate
        # A judge's server: its weights never change (docs/design.md §11).
        self.frozen = frozen
        self.vllm = vllm  # `--emulate-vllm`: vLLM's routes instead (vllm_compat)
        self._update_lock: asyncio.Lock | None = None
        self._answer_pump: Answers | None = None  # the engine's answers into the event loop
        self._in_flight: set[str] = set()  # rids of the /generate requests being answered
        # SGLang emulation: rids a `retract` pause put back in the queue, until /continue_generation.
        self._retracted: set[str] = set()
        # The trial's key on every route but /health, and weights only from the trial's own
        # directory (or the initial model): docs/design.md §14. None / "": no gate, any path.
        self.gate = BearerGate(api_key)
        self.weights_dir = weights_dir
        # Versions over the wire (docs/design.md §8, "Broadcast"); None: disk only.
        self.weights_group = weights_group
        self.bind_host = bind_host  # where its process groups listen (the HTTP server's host)

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self.gate.middleware])
        if self.vllm is not None:  # vLLM's routes, behind the same gate (only /health is open)
            VLLMRoutes(self, self.vllm).add_to(app)
            app.router.add_get("/metrics", self.metrics)
            return app
        r = app.router
        compat, frozen = self.compat, self.frozen
        r.add_post("/generate", self.generate)
        weight_routes = {
            "/update_weights_from_disk": self.update_weights_from_disk,
            "/load_lora_adapter": self.load_lora_adapter,
            "/unload_lora_adapter": self.unload_lora_adapter,
            "/update_weight_version": self.update_weight_version,
            "/join_weights_group": self.join_weights_group,
        }
        for route, handler in weight_routes.items():
            r.add_post(route, self.refuse_frozen if frozen else handler)
        if compat is not None:  # SGLang's distributed weight update (sglang_distributed)
            self.distributed = DistributedWeightUpdates(
                session_required=compat.since("0.5.23"), device=self.device, bind_host=self.bind_host
            )
            for route, handler in {
                "/init_weights_update_group": self.init_weights_update_group,
                "/update_weights_from_distributed": self.update_weights_from_distributed,
            }.items():
                r.add_post(route, self.refuse_frozen if frozen else handler)
            r.add_post("/destroy_weights_update_group", self.destroy_weights_update_group)
            if compat.since("0.5.23"):
                r.add_post("/begin_weight_update", self.begin_weight_update)
                r.add_post("/end_weight_update", self.end_weight_update)
        r.add_post("/leave_weights_group", self.leave_weights_group)
        r.add_post("/await_weight_version", self.await_weight_version)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        if compat is None or compat.has_model_info:
            r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/v1/loads", self.loads)
        if compat is None or compat.has_weight_version_route:
            r.add_get("/get_weight_version", self.weight_version)
        r.add_get("/metrics", self.metrics)
        return app

    # ---- helpers

    def _answers(self) -> Answers:
        if self._answer_pump is None:
            self._answer_pump = Answers(asyncio.get_running_loop())
        return self._answer_pump

    def _call(self, name: str, args: dict | None = None) -> asyncio.Future:
        fut = asyncio.get_running_loop().create_future()
        self.engine.command(name, args or {}, self._answers().setter(fut))
        return fut

    async def _run(self, req: Any) -> Any:
        """Submits one engine request (`protocol.Request`) and returns its answer; a cancelled caller
        (the client went away) aborts it."""
        fut = asyncio.get_running_loop().create_future()
        req.reply = self._answers().setter(fut)
        self.engine.submit(req)
        try:
            return await fut
        except asyncio.CancelledError:
            self.engine.command("abort", {"rid": req.rid}, lambda result: None)
            raise

    async def _read_json(self, request: web.Request) -> dict:
        return await read_json(request, max_bytes=MAX_BODY_BYTES, max_depth=MAX_BODY_DEPTH)

    def _check_weight_path(self, path: str) -> None:
        """Raises BodyError (400) for a weight or adapter path outside the trial's weights
        directory, symlinks resolved; the initial model (version 0) is the one path outside it."""
        if not self.weights_dir:
            return
        real = os.path.realpath(path)
        root = os.path.realpath(self.weights_dir)
        if real == os.path.realpath(self.model_path) or real.startswith(root + os.sep):
            return
        raise BodyError(f"weights are loaded only from under {self.weights_dir}: {path!r} is not", reason="weight_path")

    def _reject(self, e: BodyError) -> web.Response:
        self.engine.count_rejection(e.reason)
        logger.debug("rejected request: %s", e)
        return _json_error(e.status, str(e))

    # ---- handlers

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            reqs, batched = parse_generate_body(body, self.engine.limits)
        except BodyError as e:
            return self._reject(e)
        if self.compat is not None:  # SGLang refuses the whole request before anything runs
            for req in reqs:
                refusal = (
                    self.compat.sampling_mask_refusal(req.requested_top_k, req.is_greedy)
                    if req.return_sampling_mask
                    else None
                )
                if refusal is not None:
                    self.engine.count_rejection("sampling_mask")
                    return web.json_response({"error": {"message": refusal}}, status=400)
        # One future for the whole body: the engine's answers are collected where they are made and
        # handed to this loop once, when the last one comes (not one loop wake-up per prompt).
        done = asyncio.get_running_loop().create_future()
        for req, reply in zip(reqs, self._answers().all_of(done, len(reqs))):
            req.reply = reply
            self._in_flight.add(req.rid)
            self.engine.submit(req)
        try:
            results = await done
        except asyncio.CancelledError:  # the client went away: stop generating for it
            for req in reqs:
                self.engine.command("abort", {"rid": req.rid}, lambda result: None)
            raise
        finally:
            self._in_flight.difference_update(req.rid for req in reqs)
        for req, result in zip(reqs, results):
            if isinstance(result, BodyError):  # refused by the engine (a rid already running)
                return _json_error(result.status, str(result))
            if isinstance(result, Exception):  # EngineError: this request failed in the engine
                return _json_error(500, str(result))
            if self.compat is not None and not self.compat.reports_sampling_logprobs(req.return_sampling_mask):
                result.meta_info.output_token_sampling_logprobs = None
        if self.compat is not None:  # aborted while retracted: SGLang's waiting-queue abort
            results = [
                self.compat.queued_abort_output(r) if _aborted(r) and req.rid in self._retracted else r
                for req, r in zip(reqs, results)
            ]
        if self.compat is None and ANSWERS_MEDIA_TYPE in request.headers.get("Accept", ""):
            # The columnar answer (docs/design.md §6): the same answers, tokens and logprobs as flat arrays.
            return web.Response(body=encode_answers(results, batched), content_type=ANSWERS_MEDIA_TYPE)
        return _json(results if batched else results[0])

    async def refuse_frozen(self, request: web.Request) -> web.Response:
        """Every weight change to a frozen server: 400, counted as `frozen`."""
        return self._reject(BodyError("this server is frozen (--frozen): its weights never change", reason="frozen"))

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            update = from_json(UpdateWeightsFromDiskRequest, await self._read_json(request))
            if update.load_format not in (None, "auto", "safetensors"):
                raise BodyError("only safetensors weights are supported", reason="unsupported")
            self._check_weight_path(update.model_path)
        except BodyError as e:
            return self._reject(e)
        if self._retracted and update.abort_all_requests:
            # SGLang aborts them in its waiting queue; the batch is empty and the cache flush succeeds.
            await self._call("abort", {"abort_all": True})
        async with self._lock():
            try:
                tensors = await asyncio.to_thread(self.engine.read_weights, update.model_path)
            except Exception as e:  # WeightLoadError, or anything the filesystem throws
                self.engine.stats["weight_update_failures"] += 1
                logger.warning("weight update from %s refused: %s", update.model_path, e)
                return self._update_answer(UpdateWeightsFromDiskResponse(False, f"Failed to update weights: {e}"))
            while self.weight_load_gate and not os.path.exists(self.weight_load_gate):
                await asyncio.sleep(0.05)
            result = await self._call(
                "update",
                {
                    "tensors": tensors,
                    "weight_version": update.weight_version,
                    "abort_all_requests": update.abort_all_requests,
                    "model_path": update.model_path,
                },
            )
        return self._update_answer(result)

    # ---- SGLang's distributed weight update (emulated: sglang_distributed)

    def _sglang_answer(self, success: bool, message: str) -> web.Response:
        return _json(WeightsUpdateResponse(success, message), status=200 if success else 400)

    def _sglang_dp_refusal(self) -> web.Response | None:
        """SGLang asserts one data-parallel rank for a distributed update (v0.5.23
        `managers/tokenizer_control_mixin.py`; an assertion in the handler: 500)."""
        if self.compat.dp == 1:
            return None
        return web.Response(status=500, text="Internal Server Error")

    async def init_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            init = from_json(InitWeightsUpdateGroupRequest, await self._read_json(request))
            if init.backend not in ("gloo", "nccl") or init.rank_offset >= init.world_size:
                raise BodyError(
                    f"backend {init.backend!r} or rank_offset {init.rank_offset} of {init.world_size}", reason="invalid"
                )
        except BodyError as e:
            return self._reject(e)
        if (refusal := self._sglang_dp_refusal()) is not None:
            return refusal
        return self._sglang_answer(*await asyncio.to_thread(self.distributed.init_group, init))

    async def destroy_weights_update_group(self, request: web.Request) -> web.Response:
        try:
            destroy = from_json(DestroyWeightsUpdateGroupRequest, await self._read_json(request))
        except BodyError as e:
            return self._reject(e)
        return self._sglang_answer(*await asyncio.to_thread(self.distributed.destroy_group, destroy.group_name))

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        try:
            from_json(BeginWeightUpdateRequest, await self._read_json(request))
        except BodyError as e:
            return self._reject(e)
        return self._sglang_answer(*self.distributed.begin())

    async def end_weight_update(self, request: web.Request) -> web.Response:
        try:
            from_json(EndWeightUpdateRequest, await self._read_json(request))
        except BodyError as e:
            return self._reject(e)
        return self._sglang_answer(*self.distributed.end())

    async def update_weights_from_distributed(self, request: web.Request) -> web.Response:
        try:
            update = from_json(UpdateWeightsFromDistributedRequest, await self._read_json(request))
            parts = update.names, update.dtypes, update.shapes
            if len({len(p) for p in parts}) != 1:
                raise BodyError("names, dtypes and shapes differ in length", reason="invalid")
            for name, dtype, shape in zip(*parts):
                if not isinstance(getattr(torch, dtype, None), torch.dtype):
                    raise BodyError(f"{name}: no such dtype {dtype!r}", reason="invalid")
                if any(d < 0 for d in shape):
                    raise BodyError(f"{name}: a negative dimension in {shape}", reason="invalid")
            if update.load_format not in (None, "flattened_bucket"):
                raise BodyError(f"load_format {update.load_format!r}: flattened_bucket or none", reason="unsupported")
        except BodyError as e:
            return self._reject(e)
        if (refusal := self._sglang_dp_refusal()) is not None:
            return refusal
        if self.distributed.session_required and not self.distributed.session_open:
            return self._sglang_answer(False, SESSION_REQUIRED)
        if update.abort_all_requests:
            await self._call("abort", {"abort_all": True})
        async with self._lock():
            try:
                tensors = await asyncio.to_thread(self.distributed.receive, update)
            except Exception as e:
                logger.error("Failed to receive weights: %s", e)
                return self._sglang_answer(False, f"Failed to receive weights: {e}")
            try:
                self.engine.check_weights(tensors, complete=False)
            except Exception as e:  # SGLang's load_weights fails on a tensor the model does not have
                self.engine.stats["weight_update_failures"] += 1
                return self._sglang_answer(
                    False,
                    f"Failed to update parameter online: {e}. The full weights of the ModelRunner are partially "
                    "updated. Please discard the whole weights.",
                )
            result = await self._call(
                "update",
                {
                    "tensors": tensors,
                    "weight_version": update.weight_version,
                    "abort_all_requests": False,
                    "model_path": f"weight group {update.group_name}",
                },
            )
        if not result.success:
            return self._sglang_answer(False, result.message)
        message = "Succeeded to update parameter online."
        if update.weight_version is not None:
            message += f" Weight version updated to {update.weight_version}."
        return self._sglang_answer(True, message)

    # ---- weight groups (docs/design.md §8, "Broadcast")

    def _group_answer(self, success: bool, message: str = "") -> web.Response:
        answer = WeightsGroupResponse(success, message, self.engine.weight_version)
        return _json(answer, status=200 if success else 400)

    async def join_weights_group(self, request: web.Request) -> web.Response:
        try:
            join = from_json(JoinWeightsGroupRequest, await self._read_json(request))
            if self.weights_group is None:
                raise BodyError("this server receives weights from disk only", reason="unsupported")
            if join.backend not in ("gloo", "nccl") or join.rank >= join.world_size:
                raise BodyError(f"backend {join.backend!r} or rank {join.rank} of {join.world_size}", reason="invalid")
            if join.member_groups not in ("pairs", "one"):
                raise BodyError(f"member_groups {join.member_groups!r}: pairs or one", reason="invalid")
        except BodyError as e:
            return self._reject(e)
        spec = GroupSpec(
            join.group_name,
            join.store_host,
            join.store_port,
            join.world_size,
            join.backend,
            join.bucket_bytes,
            join.timeout_s,
            join.join_timeout_s,
            member_groups=join.member_groups,
        )
        await asyncio.to_thread(self.weights_group.join, spec, join.rank)
        return self._group_answer(True, f"joining {join.group_name} as rank {join.rank}")

    async def leave_weights_group(self, request: web.Request) -> web.Response:
        try:
            leave = from_json(LeaveWeightsGroupRequest, await self._read_json(request))
        except BodyError as e:
            return self._reject(e)
        left = self.weights_group is not None and await asyncio.to_thread(self.weights_group.leave, leave.group_name)
        return self._group_answer(True, "left" if left else "not a member")

    async def await_weight_version(self, request: web.Request) -> web.Response:
        try:
            wait = from_json(AwaitWeightVersionRequest, await self._read_json(request))
        except BodyError as e:
            return self._reject(e)
        if self.weights_group is None:
            return self._group_answer(False, "this server receives weights from disk only")
        ok, why = await self.weights_group.await_version(wait.weight_version, wait.timeout_s)
        return self._group_answer(ok, why)

    def _update_answer(self, result: UpdateWeightsFromDiskResponse) -> web.Response:
        """HTTP 200 on success, else 400 (both backends); with `compat`,
        SGLang's counts (always 0, one per rank under data parallelism)."""
        if self.compat is not None:
            message = " | ".join([result.message] * self.compat.dp)
            result = UpdateWeightsFromDiskResponse(result.success, message, self.compat.per_rank(0, 0))
        return _json(result, status=200 if result.success else 400)

    async def _control_body(self, request: web.Request, cls: type) -> Any:
        """The body of a pause or continue: optional, except for SGLang 0.5.6+."""
        required = self.compat is not None and self.compat.control_bodies_required
        body = await read_json(request, max_bytes=MAX_BODY_BYTES, max_depth=MAX_BODY_DEPTH, allow_empty=not required)
        return from_json(cls, body)

    def _sglang_status(self, what: str) -> web.Response:
        return web.json_response({"message": f"Generation {what} successfully.", "status": "ok"})

    def _lock(self) -> asyncio.Lock:
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        return self._update_lock

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            load = from_json(LoadLoRAAdapterRequest, await self._read_json(request))
            self._check_weight_path(load.lora_path)
        except BodyError as e:
            return self._reject(e)
        async with self._lock():
            try:
                adapter = await asyncio.to_thread(self.engine.read_adapter, load.lora_path)
            except Exception as e:  # WeightLoadError, or anything the filesystem throws
                self.engine.stats["weight_update_failures"] += 1
                logger.warning("LoRA adapter %s from %s refused: %s", load.lora_name, load.lora_path, e)
                return _json(LoRAUpdateResponse(False, f"Failed to load LoRA adapter: {e}"), status=400)
            result = await self._call("load_adapter", {"name": load.lora_name, "adapter": adapter})
        return _json(result, status=200 if result.success else 400)

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            unload = from_json(UnloadLoRAAdapterRequest, await self._read_json(request))
        except BodyError as e:
            return self._reject(e)
        async with self._lock():
            result = await self._call("unload_adapter", {"name": unload.lora_name})
        return _json(result, status=200 if result.success else 400)

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            update = from_json(UpdateWeightVersionRequest, await self._read_json(request))
        except BodyError as e:
            return self._reject(e)
        version = str(update.new_version)
        async with self._lock():
            args = {"weight_version": version, "abort_all_requests": update.abort_all_requests, "model_path": None}
            result = await self._call("update_weight_version", args)
        answer = UpdateWeightVersionResponse(
            result.success, result.message or "", version if result.success else None, result.num_paused_requests
        )
        return _json(answer, status=200 if result.success else 400)

    async def pause_generation(self, request: web.Request) -> web.Response:
        try:
            pause = await self._control_body(request, PauseGenerationRequest)
            if pause.mode == "retract" and self.compat is None:
                raise BodyError("mode retract is not supported (abort or in_place)", reason="unsupported")
        except BodyError as e:
            return self._reject(e)
        if pause.mode == "retract":  # SGLang: back to the queue; here held in place, marked (sglang_compat)
            self._retracted |= self._in_flight
            result = await self._call("pause", {"mode": "in_place"})
        else:
            result = await self._call("pause", {"mode": pause.mode})
        return self._sglang_status("paused") if self.compat is not None else _json(result)

    async def continue_generation(self, request: web.Request) -> web.Response:
        try:
            await self._control_body(request, ContinueGenerationRequest)
        except BodyError as e:
            return self._reject(e)
        self._retracted.clear()
        result = await self._call("continue")
        return self._sglang_status("continued") if self.compat is not None else _json(result)

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            abort = from_json(AbortRequest, await self._read_json(request))
            if not abort.abort_all and not abort.rid and self.compat is None:
                raise BodyError("give rid (a string) or abort_all: true", reason="type")
        except BodyError as e:
            return self._reject(e)
        result = await self._call("abort", {"rid": abort.rid, "abort_all": abort.abort_all})
        return web.Response(status=200) if self.compat is not None else _json(result)

    async def flush_cache(self, request: web.Request) -> web.Response:
        return _json(await self._call("flush_cache"))

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.is_alive():
            return web.Response(status=503, text="generation loop is not running")
        if self.compat is None or not self.compat.health_generates(request.path):
            return web.Response(status=200)
        # SGLang's check generates one token: it waits behind a pause or a
        # weight update, polls every second and gives up after the timeout.
        deadline = time.monotonic() + self.compat.health_timeout_s
        while time.monotonic() < deadline:
            await asyncio.sleep(1.0)
            updating = self._update_lock is not None and self._update_lock.locked()
            if not updating and not self.engine.info().paused:
                return web.Response(status=200)
        return web.Response(status=503)

    async def model_info(self, request: web.Request) -> web.Response:
        limits = self.engine.limits
        return _json(
            ModelInfo(
                model_path=self.model_path,
                tokenizer_path=self.model_path,
                is_generation=True,
                weight_version=self.engine.weight_version,
                backend="torch",
                vocab_size=limits.vocab_size,
                max_position_embeddings=limits.max_positions,
                eos_token_ids=sorted(limits.eos_token_ids),
                device=self.device,
                dtype=self.dtype,
            )
        )

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.engine.info()
        if self.compat is not None:  # SGLang's: its arguments and internal states, no request counts
            state = {"last_gen_throughput": 0.0, "weight_version": info.weight_version}
            return web.json_response(
                {
                    "model_path": self.model_path,
                    "weight_version": info.weight_version,
                    "dp_size": self.compat.dp,
                    "max_running_requests": info.max_running_requests,
                    "internal_states": [state] * self.compat.dp,
                    "version": str(self.compat.version),
                }
            )
        return _json(
            dataclasses.replace(info, model_path=self.model_path, device=self.device, dtype=self.dtype, backend="torch")
        )

    async def loads(self, request: web.Request) -> web.Response:
        info = self.engine.info()
        dp = 1 if self.compat is None else self.compat.dp
        ranks = [RankLoad(0, info.num_running_requests, info.num_waiting_requests)]
        ranks += [RankLoad(rank) for rank in range(1, dp)]
        version = "torch" if self.compat is None else str(self.compat.version)
        return _json(Loads(loads=ranks, version=version, timestamp=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())))

    async def metrics(self, request: web.Request) -> web.Response:
        info = self.engine.info()
        lines = [f"realrl_torch_server_{k} {float(v)}" for k, v in info.stats.items()]
        lines += [f'realrl_torch_server_rejections{{reason="{k}"}} {v}' for k, v in info.rejections.items()]
        lines.append(f"realrl_torch_server_unauthorized_requests {self.gate.refused}")
        lines += [
            f"realrl_torch_server_num_running_requests {info.num_running_requests}",
            f"realrl_torch_server_num_waiting_requests {info.num_waiting_requests}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _aborted(response: Any) -> bool:
    reason = getattr(getattr(response, "meta_info", None), "finish_reason", None)
    return isinstance(reason, FinishReason) and reason.type == "abort"


async def serve(server: TorchGenerationServer, host: str, port: int) -> None:
    """Serve until SIGTERM / SIGINT, then abort what is in flight and exit."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    runner = web.AppRunner(server.make_app(), access_log=None, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=5.0)
    await site.start()
    logger.info("torch generation server listening on http://%s:%d", host, port)
    await stop.wait()
    logger.info("shutting down")
    await asyncio.to_thread(server.engine.stop)
    await runner.cleanup()
