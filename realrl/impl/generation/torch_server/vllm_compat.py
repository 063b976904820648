"""vLLM's HTTP server, copied by the torch server for tests (`--emulate-vllm VERSION`).

realrl's tests cannot run vLLM (it needs CUDA), so the torch server answers
vLLM's routes instead of SGLang's, with vLLM's bodies and refusals as its
source shows them (`realrl.api.vllm_api` cites the files):

- `POST /inference/v1/generate` `VLLMGenerateRequest` -> `VLLMGenerateResponse`:
  one choice with `token_ids`, `logprobs.content` (with `logprobs: 0`) and
  `weight_versions` spans; `finish_reason` `stop` (EOS or a stop token, which
  `stop_reason` names; EOS is checked before the length limit), `length` or
  `abort`. The logprobs are vLLM's `processed_logprobs` (after temperature
  and the filters: realrl launches vLLM so), i.e. the torch engine's sampling
  logprobs. `model` names a loaded LoRA adapter or the served model (else 404).
- `POST /pause?mode=abort|wait|keep`: `abort` ends every request, waiting
  ones too; `keep` freezes them in place; `wait` lets them finish. While
  paused in modes abort and wait, 0.33 answers a new generation 503
  (`ErrorResponse`, "Generation is paused. Please retry after it resumes.");
  0.32 holds it until `/resume`.
- `POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path"}}`
  reads the directory and swaps the weights in (the weight version does not
  change); a failure is HTTP 500 with vLLM's error body. Other methods: 500
  (the torch server has no workers to call).
- `POST /reset_prefix_cache` -> `{"success": true}`; `POST
  /update_weight_version {"new_version"}` -> `{"success": true,
  "new_version"}` (also switches to the LoRA adapter loaded last); `GET
  /weight_info`, `GET /is_paused`, `GET /health` (an empty 200).
- `POST /inference/v1/abort_requests {"request_ids"}`: ends exactly those
  engine ids (`generate-tokens-<request_id>`), answered at once (an empty 200).
- `POST /v1/load_lora_adapter {"lora_name", "lora_path"}` -> 200 `Success:
  LoRA adapter '<name>' added successfully.`; an adapter name already loaded
  is a 400 `InvalidUserInput`. `POST /v1/unload_lora_adapter {"lora_name"}`
  -> 200 `Success: LoRA adapter '<name>' removed successfully.`, a 404
  `NotFoundError` for a name not loaded. `GET /v1/models`: the served model,
  then one card per adapter (its `parent` the served model).

What realrl's server adds to vLLM's (docs/design.md §14): with
`--secret-file`, every route but `/health` needs the trial's key (the torch
server's `BearerGate`; vLLM's `--api-key` leaves its dev routes open), and with
`--weights-dir`, `reload_weights` and `/v1/load_lora_adapter` load only from
under that directory (else a 400 `BadRequestError`, counted as `weight_path`).

What the torch engine does not do here: `wait` and `keep` pauses with a
reload (the reload waits until the batch drains), prefix caching (there is
none to reset), data parallelism.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
from typing import Any

from aiohttp import web
from packaging.version import Version

from realrl.api.sglang_api import GenerateRequest, GenerateResponse, SamplingParams
from realrl.api.vllm_api import (
    PAUSED_MESSAGE,
    REQUEST_ID_PREFIX,
    AbortRequests,
    CollectiveRPCRequest,
    GenerateLogProb,
    GenerateLogProbs,
    GenerateTokensChoice,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    UnloadLoRAAdapterRequest,
    UpdateWeightVersionRequest,
    UsageInfo,
    VLLMGenerateRequest,
    VLLMGenerateResponse,
    WeightVersionSpan,
    vllm_release,
)
from realrl.base.http_body import BodyError, from_json, to_json
from realrl.base.logging import getLogger
from realrl.impl.generation.torch_server.protocol import parse_generate

logger = getLogger(__name__)

GREEDY_BELOW = 1e-5  # vLLM samples greedily below this temperature (sampling_params.py _SAMPLING_EPS)
PAUSE_MODES = ("abort", "wait", "keep")


@dataclasses.dataclass(frozen=True)
class VLLMCompat:
    """The behaviours of one vLLM release (see the module docstring)."""

    version: Version

    @classmethod
    def of(cls, version: str) -> VLLMCompat:
        return cls(vllm_release(version))

    @property
    def refuses_while_paused(self) -> bool:
        """503 to a generation while paused (abort, wait) from 0.33; 0.32 queues it."""
        return self.version >= Version("0.33")


def error(status: int, message: str, kind: str) -> web.Response:
    """vLLM's `ErrorResponse` (error_response.py `create_error_response`)."""
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
    )


def _bad_request(e: BodyError) -> web.Response:
    return error(e.status, str(e), "BadRequestError" if e.status == 400 else "NotFoundError")


class VLLMRoutes:
    """vLLM's routes over a `TorchGenerationServer`'s engine."""

    def __init__(self, server: Any, compat: VLLMCompat):
        # `server`: the `http.TorchGenerationServer` whose engine, gate and weight-path rule these
        # routes use (http.py imports this module, so not the other way round).
        self.server = server
        self.engine = server.engine
        self.compat = compat
        self.pause_mode: str | None = None  # None: serving
        self.adapter_paths: dict[str, str] = {}  # LoRA adapter name -> the path it was loaded from
        self._resumed = asyncio.Event()
        self._resumed.set()

    def add_to(self, app: web.Application) -> None:
        r = app.router
        r.add_post("/inference/v1/generate", self.generate)
        r.add_post("/inference/v1/abort_requests", self.abort_requests)
        r.add_post("/abort_requests", self.abort_all)  # the RL dev router's; empty `request_ids`: every request
        r.add_post("/pause", self.pause)
        r.add_post("/resume", self.resume)
        r.add_get("/is_paused", self.is_paused)
        r.add_post("/collective_rpc", self.collective_rpc)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/update_weight_version", self.update_weight_version)
        r.add_get("/weight_info", self.weight_info)
        r.add_post("/v1/load_lora_adapter", self.load_lora_adapter)
        r.add_post("/v1/unload_lora_adapter", self.unload_lora_adapter)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/load", self.load)

    async def _body(self, request: web.Request) -> dict:
        return await self.server._read_json(request)

    # ---- generation

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = from_json(VLLMGenerateRequest, await self._body(request))
        except BodyError as e:  # FastAPI's request validation (handlers/validation.py): 400 "Bad Request"
            self.engine.count_rejection(e.reason)
            return error(400, str(e), "Bad Request")
        try:
            if body.stream:
                raise BodyError("streaming is not supported by the torch backend", reason="unsupported")
            lora = self._adapter(body.model)
            req = self._engine_request(body, lora)
        except BodyError as e:
            self.engine.count_rejection(e.reason)
            return _bad_request(e)
        if self.pause_mode in ("abort", "wait"):
            if self.compat.refuses_while_paused:
                self.engine.count_rejection("paused")
                return error(503, PAUSED_MESSAGE, "ServiceUnavailableError")
            await self._resumed.wait()  # 0.32: the scheduler holds it until /resume
        result = await self.server._run(req)
        if isinstance(result, BodyError):
            return _bad_request(result)
        if isinstance(result, Exception):  # EngineError
            return error(500, "Internal server error", "InternalServerError")
        return web.json_response(to_json(self._response(req.rid, body, result)))

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a request's `model` names (None: the base model)."""
        if model is None or model == self.server.model_path:
            return None
        if model in self.engine.adapters.adapters:
            return model
        # (v0.33 entrypoints/serve/engine/serving.py:49-85 `_check_model`)
        raise BodyError(
            f"The model `{model}` does not exist. Valid aliases: {self.server.model_path}.",
            status=404,
            reason="lora_not_loaded",
        )

    def _engine_request(self, body: VLLMGenerateRequest, lora: str | None):
        sp = body.sampling_params
        limits = self.engine.limits
        max_tokens = sp.max_tokens
        if max_tokens is None and limits.max_positions is not None:  # the rest of the context
            max_tokens = limits.max_positions - len(body.token_ids)
        temperature = sp.temperature
        if temperature is not None and temperature < GREEDY_BELOW:
            temperature = 0.0
        params = SamplingParams(
            max_new_tokens=max_tokens,
            min_new_tokens=sp.min_tokens,
            temperature=temperature,
            top_p=sp.top_p,
            top_k=-1 if sp.top_k in (None, 0, -1) else sp.top_k,
            min_p=sp.min_p,
            stop_token_ids=sp.stop_token_ids,
            ignore_eos=sp.ignore_eos,
        )
        rid = REQUEST_ID_PREFIX + (body.request_id or os.urandom(16).hex())
        sglang = GenerateRequest(
            input_ids=list(body.token_ids),
            sampling_params=params,
            return_logprob=sp.logprobs is not None,
            rid=rid,
            lora_path=lora,
        )
        (req,), _ = parse_generate(sglang, limits)
        return req

    def _response(self, rid: str, body: VLLMGenerateRequest, result: GenerateResponse) -> VLLMGenerateResponse:
        meta = result.meta_info
        ids = list(result.output_ids or [])
        reason = meta.finish_reason
        kind = getattr(reason, "type", reason) or "abort"
        matched = getattr(reason, "matched", None)
        logprobs = None
        if body.sampling_params.logprobs is not None:
            # processed_logprobs: under the distribution the token was drawn from
            processed = meta.output_token_sampling_logprobs or [lp for lp, _, _ in meta.output_token_logprobs or []]
            logprobs = GenerateLogProbs([GenerateLogProb(tok, lp, None, []) for tok, lp in zip(ids, processed)])
        stop_reason = matched if kind == "stop" and matched in (body.sampling_params.stop_token_ids or ()) else None
        spans = meta.weight_versions or ([WeightVersionSpan(str(meta.weight_version), 0, len(ids))] if ids else [])
        prompt = meta.prompt_tokens or len(body.token_ids)
        return VLLMGenerateResponse(
            choices=[GenerateTokensChoice(0, kind, stop_reason, ids, logprobs, spans)],
            request_id=rid,
            model=body.model or self.server.model_path,
            usage=UsageInfo(prompt, len(ids), prompt + len(ids)),
        )

    async def abort_requests(self, request: web.Request) -> web.Response:
        try:
            body = from_json(AbortRequests, await self._body(request))
        except BodyError:
            return error(400, "Missing 'request_ids' in request body", "BadRequestError")
        for rid in body.request_ids:  # in the background, as vLLM does
            self.engine.command("abort", {"rid": rid}, lambda result: None)
        return web.Response(status=200)

    async def abort_all(self, request: web.Request) -> web.Response:
        """The RL dev router's `/abort_requests` (`entrypoints/rl/online/api_router.py`): the ids given, or all."""
        body = await self._body(request)
        ids = body.get("request_ids") if isinstance(body, dict) else None
        if ids:
            for rid in ids:
                self.engine.command("abort", {"rid": rid}, lambda result: None)
            return web.json_response({"status": "aborted", "aborted": len(ids)})
        result = await self.server._call("abort", {"abort_all": True})
        return web.json_response({"status": "aborted", "aborted": result.num_aborted or 0})

    # ---- pauses and weights

    async def pause(self, request: web.Request) -> web.Response:
        mode = request.query.get("mode", "abort")
        if mode not in PAUSE_MODES:  # a query FastAPI validates: 400 "Bad Request" (handlers/validation.py)
            return error(400, f"Input should be 'abort', 'wait' or 'keep': {mode!r}", "Bad Request")
        self.pause_mode = mode
        self._resumed.clear()
        if mode == "abort":
            await self.server._call("abort", {"abort_all": True})
            await self.server._call("pause", {"mode": "in_place"})
        elif mode == "keep":
            await self.server._call("pause", {"mode": "in_place"})
        else:  # wait: what runs finishes
            while self.engine.info().num_running_requests or self.engine.info().num_waiting_requests:
                await asyncio.sleep(0.05)
        return web.json_response({"status": "paused"})

    async def resume(self, request: web.Request) -> web.Response:
        self.pause_mode = None
        await self.server._call("continue")
        self._resumed.set()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, request: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.pause_mode is not None})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        try:
            rpc = from_json(CollectiveRPCRequest, await self._body(request))
        except BodyError:
            return error(400, "Missing 'method' in request body", "BadRequestError")
        if rpc.method != "reload_weights" or not (rpc.kwargs or {}).get("weights_path"):
            return error(500, f"the torch server cannot run {rpc.method!r} on workers", "InternalServerError")
        path = rpc.kwargs["weights_path"]
        if (refused := self._weight_path_refusal(path)) is not None:
            return refused
        async with self.server._lock():
            try:
                tensors = await asyncio.to_thread(self.engine.read_weights, path)
            except Exception as e:  # vLLM: the exception reaches the client as a 500
                self.engine.stats["weight_update_failures"] += 1
                logger.warning("reload_weights from %s failed: %s", path, e)
                return error(500, str(e), "InternalServerError")
            gate = self.server.weight_load_gate  # a test hook: a load as long as a test needs
            while gate and not os.path.exists(gate):
                await asyncio.sleep(0.05)
            result = await self.server._call(
                "update",
                {"tensors": tensors, "weight_version": None, "abort_all_requests": False, "model_path": path},
            )
        if not result.success:
            return error(500, result.message, "InternalServerError")
        return web.json_response({"results": [None]})  # one per worker: reload_weights returns None

    def _weight_path_refusal(self, path: str) -> web.Response | None:
        """realrl's rule, not vLLM's (which loads any path): with `--weights-dir`, weights and
        adapters only from the trial's directory; else 400, counted as `weight_path` (design §14)."""
        try:
            self.server._check_weight_path(path)
        except BodyError as e:
            self.engine.count_rejection(e.reason)
            return _bad_request(e)
        return None

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        return web.json_response({"success": True})  # no prefix cache is kept across requests

    async def update_weight_version(self, request: web.Request) -> web.Response:
        try:
            update = from_json(UpdateWeightVersionRequest, await self._body(request))
        except BodyError as e:
            return error(400, str(e), "Bad Request")
        async with self.server._lock():
            args = {"weight_version": update.new_version, "abort_all_requests": False, "model_path": None}
            result = await self.server._call("update_weight_version", args)
        if not result.success:
            return error(500, result.message, "InternalServerError")
        return web.json_response({"success": True, "new_version": update.new_version})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def load_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            load = from_json(LoadLoRAAdapterRequest, await self._body(request))
        except BodyError:
            return error(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        if load.lora_name in self.engine.adapters.adapters and not load.load_inplace:
            return error(
                400,
                f"The lora adapter '{load.lora_name}' has already been loaded. If you want to load the adapter "
                "in place, set 'load_inplace' to True.",
                "InvalidUserInput",
            )
        if (refused := self._weight_path_refusal(load.lora_path)) is not None:
            return refused
        async with self.server._lock():
            try:
                adapter = await asyncio.to_thread(self.engine.read_adapter, load.lora_path)
            except Exception as e:
                return error(500, str(e), "InternalServerError")
            result = await self.server._call("load_adapter", {"name": load.lora_name, "adapter": adapter})
        if not result.success:
            return error(500, result.error_message or "loading the adapter failed", "InternalServerError")
        self.adapter_paths[load.lora_name] = load.lora_path
        return web.Response(text=f"Success: LoRA adapter '{load.lora_name}' added successfully.")

    async def unload_lora_adapter(self, request: web.Request) -> web.Response:
        try:
            unload = from_json(UnloadLoRAAdapterRequest, await self._body(request))
        except BodyError:
            return error(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        async with self.server._lock():
            result = await self.server._call("unload_adapter", {"name": unload.lora_name})
        if not result.success:  # not loaded
            return error(404, f"The lora adapter '{unload.lora_name}' cannot be found.", "NotFoundError")
        return web.Response(text=f"Success: LoRA adapter '{unload.lora_name}' removed successfully.")

    async def models(self, request: web.Request) -> web.Response:
        base = self.server.model_path
        cards = [ModelCard(base, root=base)]
        names = sorted(self.engine.adapters.adapters)
        cards += [ModelCard(name, root=self.adapter_paths.get(name), parent=base) for name in names]
        return web.json_response(to_json(ModelList(cards)))

    async def load(self, request: web.Request) -> web.Response:
        """Requests being served (vLLM counts the calls of its load-aware routes in flight)."""
        info = self.engine.info()
        return web.json_response({"server_load": info.num_running_requests + info.num_waiting_requests})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.engine.is_alive() else 500)
