"""Simulated generation servers: the torch server's HTTP API with no model (docs/design.md §6).

For measuring the control plane at the scale of real clusters (hundreds of
servers, thousands of episodes) on one machine: `SimServerHost` runs many
simulated servers in one asyncio event loop, each a real HTTP endpoint on its
own port. Each is the torch server's own aiohttp application
(`torch_server.http.TorchGenerationServer`: same routes, same bodies from
`realrl.api.sglang_api`, same body checks and rejection counters, and any
middleware added to its `make_app`), over a `SimEngine` in place of the
model's `GenerationEngine`. Registered under `names.gen_server`, a simulated
server is indistinguishable from a real one to the manager and the rollout
workers.

`SimEngine` answers `/generate` after `token_latency_s` per generated token
(every request of a server runs at once, as under continuous batching with
no limit): an answer is `output_tokens` random tokens ending with EOS, or
`max_new_tokens` tokens (`length`) when that is less, or when the request
ignores EOS or has no stop token. Logprobs are random, versions are the
weight version loaded at the time the answer ends. A weight update
(`/update_weights_from_disk`) reads the directory it names for real (the
torch server's `read_weights_dir`: safetensors, checked non-empty), aborts the
requests in flight (`abort_all_requests`) with the tokens they had generated
by then, and switches the version. Pause (modes `abort` and `in_place`: the
answers in flight stop where they are until `continue`), continue, abort and
flush behave as the torch engine's. LoRA adapters (docs/design.md §8) are read
for real (`read_adapter`; no model to check them against) and switched to by
`/update_weight_version` as the torch engine does; a request naming an adapter
that is not loaded is refused. The simulation has no SGLang emulation
(`compat` is None).

`SimServerHost.stats()` counts the requests of every route (health checks
included) and, per weight version, how many servers loaded it and when the
first and the last finished (wall clock), for the control-plane benchmark
(`benchmarks/control_plane.py`).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import random
import socket
import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from realrl.api.sglang_api import (
    ControlResponse,
    FinishReason,
    LoRAUpdateResponse,
    TorchServerInfo,
    UpdateWeightsFromDiskResponse,
)
from realrl.base import trial_secret
from realrl.base.http_body import BodyError
from realrl.impl.generation.torch_server.http import TorchGenerationServer
from realrl.impl.generation.torch_server.protocol import GenerateLimits, Request
from realrl.impl.generation.torch_server.weights import (
    AdapterSlots,
    LoraAdapter,
    WeightLoadError,
    read_adapter,
    read_weights_dir,
)


@dataclasses.dataclass
class SimServerConfig:
    token_latency_s: float = 0.01  # per generated token
    output_tokens: int = 32  # an answer's natural length, its last token EOS
    vocab_size: int = 1000
    eos_token_ids: list[int] = dataclasses.field(default_factory=lambda: [1])
    max_positions: int = 1 << 20  # prompt + max_new_tokens must fit
    seed: int = 1


@dataclasses.dataclass
class _Running:
    req: Request
    tokens: list[int]  # the whole answer, revealed as time passes
    reason: FinishReason  # how it ends if nothing interrupts it
    started: float  # when its first token would have begun (shifted by pauses in place)
    timer: asyncio.TimerHandle | None = None  # None while paused in place
    frozen_at: int = 0  # tokens generated when a pause in place stopped it


class SimEngine:
    """What `TorchGenerationServer` needs of an engine, without a model. It
    lives on the event loop's thread: `submit` and `command` act at once."""

    compat = None  # no SGLang emulation: the torch server's own behaviour

    def __init__(
        self,
        config: SimServerConfig,
        weight_version: str = "0",
        on_update: Callable[[str, int], None] | None = None,
    ):
        self.config = config
        self.weight_version = str(weight_version)
        self.limits = GenerateLimits(config.vocab_size, config.max_positions, frozenset(config.eos_token_ids))
        self._on_update = on_update  # (new version, bytes read) after every weight update
        self._rng = random.Random(config.seed)
        self._running: dict[str, _Running] = {}
        self._waiting: collections.deque[Request] = collections.deque()  # while paused or an update waits
        self._paused = False
        self._pending_update: dict | None = None  # abort_all_requests=false: applied once nothing runs
        self._stopped = False
        self.adapters = AdapterSlots()  # LoRA adapters by name, and which one serves
        self.stats: collections.Counter[str] = collections.Counter()
        self.rejections: dict[str, int] = {}

    # ---- the engine interface of torch_server.http

    def is_alive(self) -> bool:
        return not self._stopped

    def stop(self) -> None:
        self._abort(lambda r: True, include_waiting=True, message="server shutting down")
        self._stopped = True

    def count_rejection(self, reason: str) -> None:
        self.stats["requests_rejected"] += 1
        self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def read_weights(self, path: str) -> dict[str, Any]:
        """Reads the checkpoint for real (any thread), as the torch server does."""
        tensors = read_weights_dir(path)
        if not tensors:
            raise WeightLoadError(f"no tensors in {path!r}")
        return tensors

    def read_adapter(self, path: str) -> LoraAdapter:
        """Reads a LoRA adapter for real (any thread); there is no model to check it against."""
        return read_adapter(path)

    def submit(self, req: Request) -> None:
        self.stats["requests_received"] += 1
        if self._stopped:
            req.reply(RuntimeError("the server is shutting down"))  # HTTP 500, as the torch engine answers
        elif req.rid in self._running or any(w.rid == req.rid for w in self._waiting):
            self.count_rejection("duplicate_rid")
            req.reply(BodyError(f"a request with rid {req.rid!r} is already running", reason="duplicate_rid"))
        elif req.lora_name is not None and req.lora_name not in self.adapters.adapters:
            self.count_rejection("lora_not_loaded")
            req.reply(BodyError(f"LoRA adapter {req.lora_name!r} is not loaded", reason="lora_not_loaded"))
        elif self._paused or self._pending_update is not None:
            self._waiting.append(req)
        else:
            self._start(req)

    def command(self, name: str, args: dict, reply: Callable[[Any], None]) -> None:
        if name == "abort":
            rid = args.get("rid")
            n = self._abort(lambda r: args.get("abort_all") or r.rid == rid, include_waiting=True)
            reply(ControlResponse(success=True, num_aborted=n))
        elif name == "pause":
            n = 0
            if args.get("mode", "abort") == "abort":
                n = self._abort(lambda r: True, include_waiting=False)
            else:  # in_place: what runs stops where it is
                self._freeze()
            self._paused = True
            reply(ControlResponse(success=True, num_aborted=n))
        elif name == "continue":
            self._paused = False
            self._thaw()
            self._start_waiting()
            reply(ControlResponse(success=True))
        elif name == "flush_cache":
            reply(ControlResponse(success=True, message="no cached prefixes to flush"))
        elif name == "load_adapter":
            if (message := self.adapters.load(args["name"], args["adapter"])) is not None:
                reply(LoRAUpdateResponse(success=False, error_message=message, loaded_adapters=self.adapters.paths()))
                return
            self.stats["lora_adapters_loaded"] += 1
            reply(LoRAUpdateResponse(success=True, loaded_adapters=self.adapters.paths()))
        elif name == "unload_adapter":
            if (message := self.adapters.unload(args["name"])) is not None:
                reply(LoRAUpdateResponse(success=False, error_message=message))
                return
            reply(LoRAUpdateResponse(success=True, loaded_adapters=self.adapters.paths()))
        elif name in ("update", "update_weight_version"):
            update = dict(args, reply=reply)
            if name == "update_weight_version" and (switch := self.adapters.to_switch_to()) is not None:
                update["adapter"] = switch
            if args["abort_all_requests"]:
                self._apply_update(update, self._abort(lambda r: True, include_waiting=False))
            elif self._running:
                self._pending_update = update  # running requests finish first; new ones wait
            else:
                self._apply_update(update, 0)
        else:
            reply(ControlResponse(success=False, message=f"unknown command {name!r}"))

    def info(self) -> TorchServerInfo:
        return TorchServerInfo(
            weight_version=self.weight_version,
            num_running_requests=len(self._running),
            num_waiting_requests=len(self._waiting),
            paused=self._paused,
            max_running_requests=0,  # no limit
            length_before_eos=False,
            avg_decode_batch_size=0.0,
            stats=dict(self.stats),
            rejections=dict(self.rejections),
            lora_adapters=sorted(self.adapters.adapters),
            lora_adapter=self.adapters.serving,
        )

    # ---- requests

    def _plan(self, req: Request) -> tuple[list[int], FinishReason]:
        """The whole answer and how it ends (as the torch engine would end it)."""
        stop_ids = req.stop_ids
        natural = max(self.config.output_tokens, req.min_new_tokens, 1)
        ends_on_stop = bool(stop_ids) and natural <= req.max_new_tokens
        n = natural if ends_on_stop else req.max_new_tokens
        tokens = []
        while len(tokens) < n - ends_on_stop:
            tok = self._rng.randrange(self.config.vocab_size)
            if tok not in stop_ids:
                tokens.append(tok)
        if not ends_on_stop:
            return tokens, FinishReason("length")
        eos = sorted(stop_ids & self.limits.eos_token_ids) or sorted(stop_ids)
        tokens.append(eos[0])
        return tokens, FinishReason("stop", matched=eos[0])

    def _start(self, req: Request) -> None:
        tokens, reason = self._plan(req)
        loop = asyncio.get_running_loop()
        running = self._running[req.rid] = _Running(req, tokens, reason, loop.time())
        running.timer = loop.call_later(len(tokens) * self.config.token_latency_s, self._complete, req.rid)

    def _generated(self, running: _Running, now: float) -> int:
        """How many of its tokens `running` has generated by `now`."""
        if running.timer is None:
            return running.frozen_at
        return min(len(running.tokens), int((now - running.started) / self.config.token_latency_s))

    def _freeze(self) -> None:
        now = asyncio.get_running_loop().time()
        for running in self._running.values():
            if running.timer is not None:
                running.frozen_at = self._generated(running, now)
                running.timer.cancel()
                running.timer = None

    def _thaw(self) -> None:
        loop = asyncio.get_running_loop()
        latency = self.config.token_latency_s
        for rid, running in self._running.items():
            if running.timer is None:
                running.started = loop.time() - running.frozen_at * latency
                left = len(running.tokens) - running.frozen_at
                running.timer = loop.call_later(left * latency, self._complete, rid)

    def _start_waiting(self) -> None:
        while self._waiting and not self._paused and self._pending_update is None:
            self._start(self._waiting.popleft())

    def _complete(self, rid: str) -> None:
        running = self._running.pop(rid)
        self._finish(running.req, running.tokens, running.reason)
        if self._pending_update is not None and not self._running:
            update, self._pending_update = self._pending_update, None
            self._apply_update(update, 0)

    def _finish(self, req: Request, tokens: list[int], reason: FinishReason) -> None:
        req.output_ids = tokens
        req.output_logprobs = [-2.0 * self._rng.random() for _ in tokens]
        req.output_sampling_logprobs = list(req.output_logprobs)  # nothing is filtered here
        self.stats["requests_finished"] += 1
        self.stats[f"finish_{reason.type}"] += 1
        self.stats["generated_tokens"] += len(tokens)
        req.reply(req.response(reason, self.weight_version))

    def _abort(self, match: Callable[[Request], bool], include_waiting: bool, message: str = "aborted") -> int:
        """Ends the matching requests now with the tokens generated so far."""
        now = asyncio.get_running_loop().time()
        aborted = [r for r in self._running.values() if match(r.req)]
        for running in aborted:
            del self._running[running.req.rid]
            done = self._generated(running, now)
            if running.timer is not None:
                running.timer.cancel()
            self._finish(running.req, running.tokens[:done], FinishReason("abort", message=message))
        n = len(aborted)
        if include_waiting:
            kept = collections.deque()
            for req in self._waiting:
                if match(req):
                    self._finish(req, [], FinishReason("abort", message=message))
                    n += 1
                else:
                    kept.append(req)
            self._waiting = kept
        return n

    def _apply_update(self, update: dict, num_aborted: int) -> None:
        if update["weight_version"] is not None:
            self.weight_version = str(update["weight_version"])
        if "adapter" in update:
            self.adapters.serving, adapter = update["adapter"]
            tensors = [t for pair in adapter.modules.values() for t in pair]
        else:
            tensors = list(update.get("tensors", {}).values())  # none: a new version number only
        self.stats["weight_updates"] += 1
        if self._on_update is not None:
            self._on_update(self.weight_version, sum(t.numel() * t.element_size() for t in tensors))
        update["reply"](
            UpdateWeightsFromDiskResponse(
                success=True,
                message=f"Succeeded to update model weights (version {self.weight_version}).",
                num_paused_requests=num_aborted,
            )
        )
        self._start_waiting()


@dataclasses.dataclass
class _VersionLoads:
    servers: int = 0  # servers that loaded this version
    first: float = 0.0  # wall clock of the first and the last load
    last: float = 0.0
    bytes: int = 0


class SimServerHost:
    """Many simulated servers in the running event loop, each on its own port of `host`."""

    def __init__(self, config: SimServerConfig, host: str = "127.0.0.1"):
        self.config = config
        self.host = host
        self.engines: list[SimEngine] = []
        self.urls: list[str] = []
        self._runners: list[web.AppRunner] = []
        self.requests: collections.Counter[str] = collections.Counter()  # route -> requests served
        # server URL -> route -> requests served
        self.by_server: collections.defaultdict[str, collections.Counter[str]] = collections.defaultdict(
            collections.Counter
        )
        self.loads: dict[str, _VersionLoads] = {}

    async def start(self, n: int) -> list[str]:
        """Starts `n` more servers; returns their URLs."""
        urls = []
        for _ in range(n):
            engine = SimEngine(self.config, on_update=self._loaded)
            server = TorchGenerationServer(
                engine, model_path="simulated", device="sim", dtype="none", api_key=trial_secret.http_api_key()
            )
            app = server.make_app()
            app.middlewares.append(self._count)
            runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
            await runner.setup()
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((self.host, 0))  # the kernel's free port, held from here on
            await web.SockSite(runner, sock).start()
            self.engines.append(engine)
            self._runners.append(runner)
            urls.append(f"http://{self.host}:{sock.getsockname()[1]}")
        self.urls += urls
        return urls

    async def close(self) -> None:
        for engine in self.engines:
            engine.stop()
        await asyncio.gather(*(runner.cleanup() for runner in self._runners), return_exceptions=True)
        self._runners.clear()

    @web.middleware
    async def _count(self, request: web.Request, handler):
        self.requests[request.path] += 1
        self.by_server[f"http://{request.host}"][request.path] += 1
        return await handler(request)

    def _loaded(self, version: str, nbytes: int) -> None:
        now = time.time()
        loads = self.loads.get(version)
        if loads is None:
            loads = self.loads[version] = _VersionLoads(first=now)
        loads.servers += 1
        loads.last = now
        loads.bytes += nbytes

    def stats(self) -> dict[str, Any]:
        """Requests per route, generation counters summed over the servers, and per weight version
        `{servers, first, last, bytes}` (wall-clock times of the first and the last load)."""
        totals: collections.Counter[str] = collections.Counter()
        for engine in self.engines:
            totals.update(engine.stats)
        return {
            "servers": len(self.engines),
            "requests": dict(self.requests),
            "engine": dict(totals),
            "loads": {v: dataclasses.asdict(loads) for v, loads in self.loads.items()},
        }
