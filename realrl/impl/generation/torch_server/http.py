"""The HTTP face of the torch server: SGLang's native API (docs/design.md §6) on aiohttp.

- `POST /generate` `GenerateRequest` -> `GenerateResponse` (a list of those
  for a batched request): `{"output_ids", "meta_info": {"id", "finish_reason":
  {"type": "stop"|"length"|"abort", "matched"?}, "weight_version",
  "prompt_tokens", "completion_tokens", "output_token_logprobs": [[logprob,
  token_id, null], ...]}}`.
- `POST /update_weights_from_disk` `{"model_path", "weight_version",
  "abort_all_requests"}` -> `{"success", "message", "num_paused_requests"}`.
- `POST /pause_generation`, `POST /continue_generation`, `POST /abort_request`
  (`{"rid"}` or `{"abort_all": true}`), `GET|POST /flush_cache`, `GET /health`,
  `GET /model_info` (alias `/get_model_info`), `GET /get_server_info`,
  `GET /get_weight_version`, `GET /metrics`.

The bodies are the dataclasses of `realrl.api.sglang_api`. Every body goes
through `realrl.base.http_body` (size, UTF-8, JSON nesting depth, object type,
then the contract): a bad body is answered 400 (413 when too large), never
500, and counted by reason. A request that fails inside the engine is
answered 500. A client that goes away aborts its requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web

from realrl.api.sglang_api import AbortRequest, ModelInfo, UpdateWeightsFromDiskRequest, UpdateWeightsFromDiskResponse
from realrl.base.http_body import BodyError, from_json, read_json, to_json
from realrl.base.logging import getLogger
from realrl.impl.generation.torch_server.engine import GenerationEngine
from realrl.impl.generation.torch_server.protocol import parse_generate_body

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

    def __init__(self, engine: GenerationEngine, model_path: str, device: str, dtype: str):
        self.engine = engine
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self._update_lock: asyncio.Lock | None = None

    def make_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/generate", self.generate)
        r.add_post("/update_weights_from_disk", self.update_weights_from_disk)
        r.add_post("/pause_generation", self.pause_generation)
        r.add_post("/continue_generation", self.continue_generation)
        r.add_post("/abort_request", self.abort_request)
        r.add_route("*", "/flush_cache", self.flush_cache)
        r.add_get("/health", self.health)
        r.add_get("/health_generate", self.health)
        r.add_get("/model_info", self.model_info)
        r.add_get("/get_model_info", self.model_info)
        r.add_get("/get_server_info", self.server_info)
        r.add_get("/get_weight_version", self.weight_version)
        r.add_get("/metrics", self.metrics)
        return app

    # ---- helpers

    def _call(self, name: str, args: dict | None = None) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.engine.command(name, args or {}, threadsafe_setter(loop, fut))
        return fut

    async def _read_json(self, request: web.Request) -> dict:
        return await read_json(request, max_bytes=MAX_BODY_BYTES, max_depth=MAX_BODY_DEPTH)

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
        loop = asyncio.get_running_loop()
        futures = []
        for req in reqs:
            fut = loop.create_future()
            req.reply = threadsafe_setter(loop, fut)
            futures.append(fut)
            self.engine.submit(req)
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # the client went away: stop generating for it
            for req in reqs:
                self.engine.command("abort", {"rid": req.rid}, lambda result: None)
            raise
        for result in results:
            if isinstance(result, BodyError):  # refused by the engine (a rid already running)
                return _json_error(result.status, str(result))
            if isinstance(result, Exception):  # EngineError: this request failed in the engine
                return _json_error(500, str(result))
        return _json(results if batched else results[0])

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            update = from_json(UpdateWeightsFromDiskRequest, await self._read_json(request))
            if update.load_format not in (None, "auto", "safetensors"):
                raise BodyError("only safetensors weights are supported", reason="unsupported")
        except BodyError as e:
            return self._reject(e)
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            try:
                tensors = await asyncio.to_thread(self.engine.read_weights, update.model_path)
            except Exception as e:  # WeightLoadError, or anything the filesystem throws
                self.engine.stats["weight_update_failures"] += 1
                logger.warning("weight update from %s refused: %s", update.model_path, e)
                return _json(UpdateWeightsFromDiskResponse(False, f"Failed to update weights: {e}"), status=400)
            result = await self._call(
                "update",
                {
                    "tensors": tensors,
                    "weight_version": update.weight_version,
                    "abort_all_requests": update.abort_all_requests,
                    "model_path": update.model_path,
                },
            )
        if not result.success:
            return _json(UpdateWeightsFromDiskResponse(False, result.message or ""), status=400)
        return _json(result)

    async def pause_generation(self, request: web.Request) -> web.Response:
        return _json(await self._call("pause"))

    async def continue_generation(self, request: web.Request) -> web.Response:
        return _json(await self._call("continue"))

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            abort = from_json(AbortRequest, await self._read_json(request))
            if not abort.abort_all and not abort.rid:
                raise BodyError("give rid (a string) or abort_all: true", reason="type")
        except BodyError as e:
            return self._reject(e)
        return _json(await self._call("abort", {"rid": abort.rid, "abort_all": abort.abort_all}))

    async def flush_cache(self, request: web.Request) -> web.Response:
        return _json(await self._call("flush_cache"))

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.is_alive():
            return web.Response(status=503, text="generation loop is not running")
        return web.Response(status=200)

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
        return _json(
            dataclasses.replace(info, model_path=self.model_path, device=self.device, dtype=self.dtype, backend="torch")
        )

    async def metrics(self, request: web.Request) -> web.Response:
        info = self.engine.info()
        lines = [f"realrl_torch_server_{k} {float(v)}" for k, v in info.stats.items()]
        lines += [f'realrl_torch_server_rejections{{reason="{k}"}} {v}' for k, v in info.rejections.items()]
        lines += [
            f"realrl_torch_server_num_running_requests {info.num_running_requests}",
            f"realrl_torch_server_num_waiting_requests {info.num_waiting_requests}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def threadsafe_setter(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> Callable[[Any], None]:
    def set_result(result: Any) -> None:
        if not fut.done():
            fut.set_result(result)

    def reply(result: Any) -> None:
        try:
            loop.call_soon_threadsafe(set_result, result)
        except RuntimeError:  # the event loop is already closed (shutdown)
            pass

    return reply


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
