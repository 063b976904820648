"""The generation engine: one thread that owns the model and runs the loop.

Requests and commands reach the loop through a queue and are handled between two decode steps; answers go back
through each request's `reply` callback. Per iteration the loop admits waiting requests (one prefill forward per
group, bounded by `--max-prefill-tokens` padded tokens), samples their first token and joins their rows to the
running batch (`batch.RunningBatch`), then runs one decode step for the whole batch. Finished rows leave at once,
and their answer is sent immediately. Identical prompts prefilled together (the answers of one GRPO group) are
computed once and their rows copied.

**Errors.** A failure inside the engine fails only the request(s) that cause it: when a batched prefill or decode
step raises, each of its requests is retried alone (prefill) or stepped alone on a copy of its row (decode); those
that fail alone are answered with an `EngineError` (HTTP 500) and counted (`requests_failed`), the others go on. If
no single request reproduces the fault, the whole batch is failed. Non-finite logits (NaN/inf, e.g. from broken
weights) are such a fault, caught before sampling. Every admitted request is answered, also when the loop stops; a
request submitted after that is refused at once. Generation stops at the model's eos token(s) (config and
generation_config) unless `ignore_eos`, and at `stop_token_ids`; the stop token is part of `output_ids`. A request
whose last allowed token is a stop token reports `stop` (SGLang would report `length`); `length_before_eos`
(`--length-before-eos`) reproduces SGLang's order (the length limit is checked first, so it reports `length`), for
testing clients against it. `compat` (`--emulate-sglang`, `sglang_compat`) copies SGLang's order of finish checks
(per release), its aborts: by rid prefix, waiting requests included, and weight updates into a batch paused in place.

**Admission order.** Waiting requests are admitted lowest `priority` first (SGLang's field, as SGLang orders
them with `--schedule-low-priority-values-first`), those without one last, equal ones in arrival order; requests
a weight update sends back go to the head. Nothing running is preempted for a better one (SGLang may).

**Pauses.** `pause` in mode `abort` ends the running requests (and with `compat` the waiting ones) and admits none
until `continue`; mode `in_place` keeps them where they are, decoding nothing until `continue`.

**Weight updates.** New weights are read and checked off the loop (`weights`). Then, between two decode steps,
the running requests go back to the head of the queue with their outputs (their keys/values, the old weights',
are dropped), the tensors are copied into the existing parameters in place (a weight group's version, whose buffer
the caller gives up, `swap`: the parameters take its storage instead, no copy), and `weight_version` changes; the next
step prefills them again from prompt + outputs under the new weights and they go on, their answers naming each
output span's version (`Request.switch_version`). Nothing runs on under the old weights, and nothing made is sent
back to be sent again. `abort_all_requests=false` instead lets them finish while no new request starts. With
`compat` (SGLang aborts them) and for a LoRA switch (`update_weight_version`: a request named its adapter) in-flight
requests are aborted instead: they return their partial output, its logprobs and the *old* weight version. Queued
requests that had not started yet run under the new weights.

**LoRA adapters** (docs/design.md §8). `load_adapter` registers an adapter under a name (read and checked off the
loop); `update_weight_version` is a weight update whose new weights are the adapter loaded last, merged into the
adapted matrices (`weights.AdapterTargets`), or none when no new adapter came. One adapter is served at a time: a
request must name a loaded adapter (or none) in `lora_path`, and runs on the one being served, whose version it
reports.

Over 700 lines on purpose: everything here runs on the one thread that owns the model and the running batch,
between two decode steps, and each command (pause, weight update, adapter switch, abort) changes the batch and
the queue that the prefill and decode paths read; kept in one file, the order of those changes reads top to
bottom. What does not touch that state already lives in its own module (`batch`, `scheduler`, `weights`,
`sampling`, `protocol`)."""

from __future__ import annotations

import math
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from realrl.api.sglang_api import (
    ControlResponse,
    FinishReason,
    LoRAUpdateResponse,
    TorchServerInfo,
    UpdateWeightsFromDiskResponse,
)
from realrl.base.http_body import BodyError
from realrl.base.logging import getLogger
from realrl.impl.generation.torch_server.batch import Rows, RunningBatch
from realrl.impl.generation.torch_server.lean_decode import lean_decoder
from realrl.impl.generation.torch_server.model import attention_layout
from realrl.impl.generation.torch_server.protocol import GenerateLimits, Request
from realrl.impl.generation.torch_server.sampling import RowParams, sample_tokens
from realrl.impl.generation.torch_server.sglang_compat import SGLangCompat
from realrl.impl.generation.torch_server.weights import (
    AdapterSlots,
    AdapterTargets,
    LoraAdapter,
    WeightTargets,
    read_adapter,
    read_weights_converted,
    read_weights_dir,
)

logger = getLogger(__name__)


class EngineError(RuntimeError):
    """Generation failed inside the engine: answered with HTTP 500 and counted."""


def _failure(
    name: str, message: str
) -> EngineError | UpdateWeightsFromDiskResponse | LoRAUpdateResponse | ControlResponse:
    """The answer to an inbox item (`name`) that failed or will never be handled."""
    if name == "generate":
        return EngineError(message)
    if name in ("update", "update_weight_version"):
        return UpdateWeightsFromDiskResponse(success=False, message=message)
    if name in ("load_adapter", "unload_adapter"):
        return LoRAUpdateResponse(success=False, error_message=message)
    return ControlResponse(success=False, message=message)


def _priority(req: Request) -> float:
    """A request's place in the admission order: its `priority`, none after every value."""
    return math.inf if req.priority is None else req.priority


def _refuse(item: tuple, message: str) -> None:
    """Answer an inbox item the loop will never handle."""
    name, args, reply = item
    if name == "generate":
        reply = args.reply
    if reply is not None:
        reply(_failure(name, message))


class GenerationEngine:
    """Owns the model; runs the continuous-batching loop on its own thread.

    Every method except the ones the loop calls is safe to call from another
    thread: requests and commands go through a queue and are handled between
    two decode steps; results come back through `reply` callbacks.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        device: torch.device,
        seed: int = 1,
        max_running_requests: int = 64,
        max_prefill_tokens: int = 8192,
        weight_version: str = "0",
        eos_token_ids: frozenset[int] = frozenset(),
        length_before_eos: bool = False,
        compat: SGLangCompat | None = None,
    ):
        self.model = model
        self.length_before_eos = length_before_eos or (compat is not None and compat.length_before_eos)
        self.compat = compat
        self.config = model.config
        self.device = device
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = str(weight_version)
        text_config = self.config.get_text_config(decoder=True)
        self.n_layers = int(text_config.num_hidden_layers)
        self.limits = GenerateLimits(
            vocab_size=model.get_input_embeddings().num_embeddings,
            max_positions=getattr(text_config, "max_position_embeddings", None),
            eos_token_ids=eos_token_ids,
        )
        # Refuses attention it cannot serve exactly; the masks of a decode step (model.py).
        self.layout = attention_layout(self.config)
        # A decode step's forward without transformers' module dispatch, HF's ops exactly (Llama); else None
        self._lean = lean_decoder(model) if self.layout.window is None else None
        self._targets = WeightTargets(model)
        # LoRA adapters (docs/design.md §8): those loaded, by name; one at a time is merged into the weights.
        self._adapter_targets = AdapterTargets(model)
        self.adapters = AdapterSlots()  # LoRA adapters by name, and which one serves
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[Request] = deque()
        self._batch: RunningBatch | None = None
        # The last batch that ended normally (emptied, or sent back at a weight update): the next one
        # takes over its buffers when they are large enough (batch.RunningBatch).
        self._spare: RunningBatch | None = None
        self._live: dict[str, Request] = {}  # rid -> request, waiting or running
        self._paused = False
        self._pending_update: dict | None = None  # an update waiting for the batch to drain
        self._stopping = False
        self.stats: dict[str, float] = {
            "requests_received": 0,
            "requests_rejected": 0,
            "requests_finished": 0,
            "finish_stop": 0,
            "finish_length": 0,
            "finish_abort": 0,
            "prompt_tokens": 0,
            "prompt_tokens_shared": 0,  # prompt tokens not computed again: same prompt in one prefill
            "generated_tokens": 0,
            "prefill_batches": 0,
            "decode_steps": 0,
            "decode_rows": 0,
            "weight_updates": 0,
            "weight_updates_swapped": 0,  # of those, taken by pointer (a weight group's buffer), not copied
            "requests_resumed": 0,  # running requests a weight update sent back to be prefilled again
            "weight_update_failures": 0,
            "lora_adapters_loaded": 0,
            "engine_errors": 0,  # failed engine steps (batched prefill / decode, commands)
            "requests_failed": 0,  # requests answered with an engine error (HTTP 500)
        }
        self.rejections: dict[str, int] = {}
        self._stats_lock = threading.Lock()
        self._prefilling: list[Request] = []  # taken off the queue, not yet in the batch
        self._closed = False  # the loop has ended: submissions are refused at once
        self._closed_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="generation-loop", daemon=True)

    # ---- thread-safe API

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight and end the loop."""
        self._put(("stop", None, None))
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: Request) -> None:
        self.stats["requests_received"] += 1
        self._put(("generate", request, None))

    def command(self, name: str, args: dict, reply: Callable[[Any], None]) -> None:
        self._put((name, args, reply))

    def _put(self, item: tuple) -> None:
        # Under the lock: the loop drains the inbox after closing it, so nothing
        # put here can be left unanswered.
        with self._closed_lock:
            if not self._closed:
                self._inbox.put(item)
                return
        _refuse(item, "the generation loop is not running")

    def count_rejection(self, reason: str) -> None:
        with self._stats_lock:  # called from the HTTP thread and the loop
            self.stats["requests_rejected"] += 1
            self.rejections[reason] = self.rejections.get(reason, 0) + 1

    def read_weights(self, path: str) -> dict[str, torch.Tensor]:
        """Read and check new weights (any thread; the model is not touched)."""
        tensors = read_weights_dir(path)
        if self._targets.needs_conversion(tensors) and os.path.isfile(os.path.join(path, "config.json")):
            # A checkpoint layout that differs from the loaded model's (transformers 5 fuses
            # MoE experts on load): transformers' own loading converts it.
            tensors = read_weights_converted(path, type(self.model))
        self._targets.check(tensors)
        return tensors

    def check_weights(self, tensors: dict[str, torch.Tensor], complete: bool = True) -> None:
        """Names and shapes of weights to come against the model (any thread;
        meta tensors will do): WeightLoadError on a mismatch. `complete`:
        all of the model's tensors (else a part: an SGLang bucket)."""
        self._targets.check(tensors, complete)

    def read_adapter(self, path: str) -> LoraAdapter:
        """Read and check a LoRA adapter (any thread; the model is not touched)."""
        adapter = read_adapter(path)
        self._adapter_targets.check(adapter)
        return adapter

    def info(self) -> TorchServerInfo:
        batch = self._batch
        steps = max(1, self.stats["decode_steps"])
        return TorchServerInfo(
            weight_version=self.weight_version,
            num_running_requests=batch.size if batch is not None else 0,
            num_waiting_requests=len(self._waiting),
            paused=self._paused,
            max_running_requests=self.max_running_requests,
            length_before_eos=self.length_before_eos,
            avg_decode_batch_size=self.stats["decode_rows"] / steps,
            stats=dict(self.stats),
            rejections=dict(self.rejections),
            lora_adapters=sorted(self.adapters.adapters),
            lora_adapter=self.adapters.serving,
        )

    # ---- the loop (generation thread only below this line)

    def _run(self) -> None:
        try:
            with torch.inference_mode():
                while not self._stopping:
                    self._process_inbox(block=self._is_idle())
                    if self._stopping:
                        break
                    try:
                        if self._pending_update is not None and self._batch is None:
                            update, self._pending_update = self._pending_update, None
                            self._apply_update(update, num_aborted=0)
                        self._admit()
                        if self._batch is not None and not self._paused:
                            self._decode_step()
                    except Exception as e:  # not isolated to a request: fail what is in flight, keep serving
                        logger.exception("generation step failed")
                        self.stats["engine_errors"] += 1
                        self._fail_in_flight(e)
        finally:
            self._close()

    def _close(self) -> None:
        """Answer everything: running and queued requests end with abort, then
        the inbox is closed and whatever is still in it is refused."""
        try:
            self._abort_all("server shutting down")
        except Exception:
            logger.exception("aborting requests at shutdown failed")
        for req in list(self._live.values()):  # only if aborting failed half-way
            self._fail_request(req, EngineError("server shutting down"))
        if self._pending_update is not None:
            self._pending_update["reply"](_failure("update", "server shutting down"))
            self._pending_update = None
        with self._closed_lock:
            self._closed = True
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                break
            _refuse(item, "server shutting down")

    def _is_idle(self) -> bool:
        if self._pending_update is not None and self._batch is None:
            return False  # applied now
        if self._batch is not None and not self._paused:
            return False
        return not self._waiting or self._paused

    def _process_inbox(self, block: bool) -> None:
        items = []
        if block:
            try:
                items.append(self._inbox.get(timeout=0.5))
            except queue.Empty:
                return
        while True:
            try:
                items.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        for name, args, reply in items:
            try:
                self._handle(name, args, reply)
            except Exception as e:  # keep serving: answer the command with the error
                logger.exception("command %s failed", name)
                self.stats["engine_errors"] += 1
                failure = _failure(name, f"{name} failed: {e}")
                if name == "generate":
                    self.stats["requests_failed"] += 1
                    args.reply(failure)
                elif reply is not None:
                    reply(failure)

    def _handle(self, name: str, args: Any, reply: Callable[[Any], None] | None) -> None:
        if name == "generate":
            req: Request = args
            if req.rid in self._live:
                self.count_rejection("duplicate_rid")
                req.reply(BodyError(f"a request with rid {req.rid!r} is already running", reason="duplicate_rid"))
                return
            if req.lora_name is not None and req.lora_name not in self.adapters.adapters:
                self.count_rejection("lora_not_loaded")
                req.reply(BodyError(f"LoRA adapter {req.lora_name!r} is not loaded", reason="lora_not_loaded"))
                return
            self._live[req.rid] = req
            self._enqueue(req)
        elif name == "stop":
            self._stopping = True
        elif name == "abort":
            reply(ControlResponse(success=True, num_aborted=self._abort(self._abort_match(args), include_waiting=True)))
        elif name == "pause":
            n = 0
            if args.get("mode", "abort") == "abort":
                n = self._abort(lambda r: True, include_waiting=self.compat is not None)
            self._paused = True
            reply(ControlResponse(success=True, num_aborted=n))
        elif name == "continue":
            self._paused = False
            reply(ControlResponse(success=True))
        elif name == "flush_cache":
            # No prefix cache is kept across requests; nothing to drop.
            reply(ControlResponse(success=True, message="no cached prefixes to flush"))
        elif name == "load_adapter":
            if (message := self.adapters.load(args["name"], args["adapter"])) is not None:
                reply(LoRAUpdateResponse(success=False, error_message=message, loaded_adapters=self.adapters.paths()))
                return
            self.stats["lora_adapters_loaded"] += 1
            reply(LoRAUpdateResponse(success=True, loaded_adapters=self.adapters.paths()))
        elif name == "unload_adapter":
            if (message := self.adapters.unload(args["name"])) is not None:
                reply(_failure(name, message))
                return
            reply(LoRAUpdateResponse(success=True, loaded_adapters=self.adapters.paths()))
        elif name in ("update", "update_weight_version"):
            if name == "update_weight_version" and (switch := self.adapters.to_switch_to()) is not None:
                args = dict(args, adapter=switch)  # the adapter loaded last, if it is new
            if name == "update" and self.compat is not None and self._paused and self._batch is not None:
                # SGLang cannot flush the prefix cache of a batch paused in place.
                self._apply_update(dict(args, reply=reply), num_aborted=0, flush_refused=True)
            elif args["abort_all_requests"] and name == "update" and self.compat is None:
                # Nothing runs on under the old weights, and nothing made is thrown away: the running
                # requests are prefilled again from all their tokens under the new weights and go on.
                n = self._requeue_running()
                for req in self._live.values():
                    req.switch_version(self.weight_version)
                self.stats["requests_resumed"] += n
                self._apply_update(dict(args, reply=reply), num_aborted=n, resumed=True)
            elif args["abort_all_requests"]:
                n = self._abort(lambda r: True, include_waiting=self.compat is not None)
                self._apply_update(dict(args, reply=reply), num_aborted=n)
            else:
                self._pending_update = dict(args, reply=reply)
        else:
            reply(_failure(name, f"unknown command {name!r}"))

    def _enqueue(self, req: Request) -> None:
        """Into the waiting queue by `priority` (lower first, none last), after its equals; admission
        takes the head. Requests a weight update sends back go to the head (`_requeue_running`)."""
        waiting, key = self._waiting, _priority(req)
        i = len(waiting)
        while i > 0 and _priority(waiting[i - 1]) > key:
            i -= 1
        waiting.insert(i, req)

    def _abort_match(self, args: dict) -> Callable[[Request], bool]:
        if args.get("abort_all"):
            return lambda r: True
        rid = args.get("rid")
        if self.compat is None:
            return lambda r: r.rid == rid
        # SGLang forwards only a rid it knows, then ends every rid it prefixes.
        if not rid or rid not in self._live:
            return lambda r: False
        return lambda r: r.rid.startswith(rid)

    def _requeue_running(self) -> int:
        """The running requests go back to the head of the queue, outputs kept and their keys/values
        dropped, to be prefilled again from all their tokens; how many."""
        if self._batch is None:
            return 0
        requests = list(self._batch.requests)
        self._spare, self._batch = self._batch, None  # its buffers serve the next batch
        self._waiting.extendleft(reversed(requests))
        return len(requests)

    def _apply_update(self, update: dict, num_aborted: int, flush_refused: bool = False, resumed: bool = False) -> None:
        """New weights: full tensors copied in (`tensors`; with `swap`, taken
        as the model's own when `WeightTargets.swappable`), or a LoRA adapter
        merged (`adapter`: (name, LoraAdapter)), or neither (a new version
        number only); then the version switches and the caller is answered.
        `flush_refused` (SGLang emulation): 0.5.23 keeps the new weights but
        answers `success: false` and leaves the version; earlier releases die."""
        if flush_refused and not self.compat.refused_flush_swaps_weights:
            logger.error("SGLang %s: a refused cache flush after a weight update kills the server", self.compat.version)
            os._exit(1)
        source = update.get("model_path")
        timing = update.get("timing", {})  # (filled in for the caller: a weight group's member logs it)
        timing["taken"] = time.monotonic()
        try:
            if "tensors" in update and update.get("swap") and self._targets.swappable(update["tensors"]):
                self._targets.swap_in(update["tensors"])  # the caller's buffer is the model's now
                timing["swapped"] = True
                self.stats["weight_updates_swapped"] += 1
            elif "tensors" in update:
                self._targets.copy_in(update["tensors"])
                timing["copy_s"] = time.monotonic() - timing["taken"]
            elif "adapter" in update:
                name, adapter = update["adapter"]
                self._adapter_targets.apply(adapter)  # all or nothing
                self.adapters.serving = name  # only once it is merged: a retry applies it again
                source = f"LoRA adapter {name} ({adapter.path})"
        except Exception as e:  # the caller gets an answer; full tensors may be half-copied
            logger.exception("copying new weights failed")
            self.stats["weight_update_failures"] += 1
            kept = (
                f"; still serving LoRA adapter {self.adapters.serving} at version {self.weight_version}"
                if "adapter" in update
                else ""
            )
            update["reply"](_failure("update", f"copying the weights failed: {e}{kept}"))
            return
        if flush_refused:
            self.stats["weight_update_failures"] += 1
            logger.warning(
                "weights updated from %s, version %s unchanged: flush refused",
                update["model_path"],
                self.weight_version,
            )
            update["reply"](
                _failure(
                    "update",
                    "Weights were updated, but the cache was not flushed because requests are still running or "
                    "queued. Retract or finish them, then call /flush_cache.",
                )
            )
            return
        old = self.weight_version
        if update["weight_version"] is not None:
            self.weight_version = str(update["weight_version"])
        self.stats["weight_updates"] += 1
        logger.info(
            "weights updated from %s: version %s -> %s (%d requests %s)",
            source or "the same weights",
            old,
            self.weight_version,
            num_aborted,
            "going on under the new weights" if resumed else "aborted",
        )
        update["reply"](
            UpdateWeightsFromDiskResponse(
                success=True,
                message=f"Succeeded to update model weights (version {self.weight_version}).",
                num_paused_requests=num_aborted,
            )
        )

    # ---- finishing

    def _finish(self, req: Request, reason: FinishReason) -> None:
        self._live.pop(req.rid, None)
        self.stats["requests_finished"] += 1
        self.stats[f"finish_{reason.type}"] += 1
        req.reply(req.response(reason, self.weight_version))

    def _abort(self, match: Callable[[Request], bool], include_waiting: bool, message: str = "aborted") -> int:
        n = 0
        if include_waiting and self._waiting:
            kept = deque()
            for req in self._waiting:
                if match(req):
                    self._finish(req, FinishReason("abort", message=message))
                    n += 1
                else:
                    kept.append(req)
            self._waiting.clear()  # in place: the paged scheduler holds this queue too
            self._waiting.extend(kept)
        if self._batch is not None:
            drop = []
            for i, req in enumerate(self._batch.requests):
                if match(req):
                    self._finish(req, FinishReason("abort", message=message))
                    drop.append(i)
            self._drop_rows(drop)
            n += len(drop)
        return n

    def _drop_rows(self, drop: list[int]) -> None:
        if drop and not self._batch.remove(drop):
            self._spare, self._batch = self._batch, None

    def _abort_all(self, message: str) -> None:
        self._abort(lambda r: True, include_waiting=True, message=message)

    def _fail_request(self, req: Request, error: Exception) -> None:
        """Answer `req` with an engine error (once: a request already answered
        is left alone)."""
        if self._live.get(req.rid) is not req:
            return
        del self._live[req.rid]
        self.stats["requests_failed"] += 1
        message = error if isinstance(error, EngineError) else f"{type(error).__name__}: {error}"
        req.reply(EngineError(f"generation of request {req.rid} failed: {message}"))

    def _fail_in_flight(self, error: Exception) -> None:
        """Fail the running batch and the group being prefilled (queued
        requests were not touched and stay queued)."""
        in_flight = (self._batch.requests if self._batch is not None else []) + self._prefilling
        self._batch, self._prefilling = None, []
        for req in in_flight:
            self._fail_request(req, error)

    # ---- prefill and decode

    def _admit(self) -> None:
        if self._paused or self._pending_update is not None or not self._waiting:
            return
        free = self.max_running_requests - (self._batch.size if self._batch is not None else 0)
        while free > 0 and self._waiting:
            # One prefill forward per group, bounded by padded tokens.
            group: list[Request] = []
            longest = 0
            while self._waiting and len(group) < free:
                req = self._waiting[0]
                if req.max_new_tokens == 0:
                    self._waiting.popleft()
                    self._finish(req, FinishReason("length"))
                    continue
                new_longest = max(longest, len(req.input_ids) + len(req.output_ids))
                if group and new_longest * (len(group) + 1) > self.max_prefill_tokens:
                    break
                group.append(self._waiting.popleft())
                longest = new_longest
            if not group:
                break
            free -= len(group)
            self._prefilling = group
            for requests, rows in self._prefill_isolated(group):
                if self._batch is None:
                    self._batch = RunningBatch(
                        requests, rows, self.config, self.max_running_requests, spare=self._spare
                    )
                    self._spare = None
                else:
                    self._batch.add(requests, rows)
            self._prefilling = []

    def _prefill_isolated(self, group: list[Request]) -> list[tuple[list[Request], Rows]]:
        """Prefill `group` in one forward; if that fails, prefill each request
        alone and fail only the ones that fail alone."""
        produced = [len(r.output_ids) for r in group]
        try:
            joined = self._prefill(group)
            return [joined] if joined is not None else []
        except Exception as e:
            self.stats["engine_errors"] += 1
            if len(group) == 1:
                logger.warning("prefill of request %s failed: %s: %s", group[0].rid, type(e).__name__, e)
                self._fail_request(group[0], e)
                return []
            logger.warning(
                "prefill of %d requests failed (%s: %s); retrying them one by one", len(group), type(e).__name__, e
            )
        out = []
        for req, n in zip(group, produced):
            if self._live.get(req.rid) is not req:
                continue  # answered before the failure (finished at its first token)
            # a token recorded before the failure
            del req.output_ids[n:], req.output_logprobs[n:], req.output_sampling_logprobs[n:]
            try:
                joined = self._prefill([req])
            except Exception as e:
                logger.warning("prefill of request %s failed: %s: %s", req.rid, type(e).__name__, e)
                self._fail_request(req, e)
                continue
            if joined is not None:
                out.append(joined)
        return out

    def _prefill(self, group: list[Request]) -> tuple[list[Request], Rows] | None:
        """One forward over the group's prompts (left-padded); samples each first
        token; returns the rows that go on with their keys/values and mask."""
        self.stats["prefill_batches"] += 1
        # Identical prompts (a GRPO group's answers) are computed once; their
        # rows are copied out of the one forward (`source`: request -> row).
        # A request resumed after a weight update is prefilled from its prompt and its outputs so far.
        unique: dict[tuple[int, ...], int] = {}
        source = [unique.setdefault(tuple(r.input_ids + r.output_ids), len(unique)) for r in group]
        prompts = list(unique)
        length = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), length), dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, length - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, length - len(p) :] = True
        self.stats["prompt_tokens"] += sum(len(r.input_ids) for r in group)
        tokens = sum(len(r.input_ids) + len(r.output_ids) for r in group)
        self.stats["prompt_tokens_shared"] += tokens - sum(len(p) for p in prompts)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        # Full layers also for sliding ones: the running batch keeps every column
        # and windows by mask (model.py), so nothing may be dropped here.
        cache = DynamicCache()
        cache.layers = [DynamicLayer() for _ in range(self.n_layers)]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        params = RowParams.from_requests(group, self.device)
        source_rows = torch.tensor(source, dtype=torch.long, device=self.device)
        last_logits = out.logits[:, -1, :].index_select(0, source_rows)
        tokens, logprobs, sampling_logprobs = sample_tokens(last_logits, params, self._generator, self._banned(group))
        done = set(self._record(group, tokens.tolist(), logprobs.tolist(), sampling_logprobs.tolist()))
        keep = [i for i in range(len(group)) if i not in done]
        if not keep:
            return None
        rows = source_rows[torch.tensor(keep, dtype=torch.long, device=self.device)]
        row_mask = mask.index_select(0, rows)
        first = int(row_mask.any(dim=0).int().argmax())
        # Each distinct prompt's columns from `first` on, its padded positions zeroed in place (their
        # keys/values are never attended, but they must be finite); the batch copies them into the kept
        # rows (`rows`: each row's prompt) with one indexed copy per tensor, no copy of the rows before.
        kv = [(layer.keys[:, :, first:], layer.values[:, :, first:]) for layer in cache.layers]
        prompt_mask = mask[:, first:]
        if not bool(prompt_mask.all()):
            pad = ~prompt_mask[:, None, :, None]
            for k, v in kv:
                k.masked_fill_(pad, 0)
                v.masked_fill_(pad, 0)
        return [group[i] for i in keep], Rows(kv, row_mask[:, first:], rows)

    def _banned(self, requests: list[Request]) -> list[tuple[int, list[int]]] | None:
        banned = [
            (i, sorted(r.stop_ids))
            for i, r in enumerate(requests)
            if r.stop_ids and len(r.output_ids) < r.min_new_tokens
        ]
        return banned or None

    def _record(
        self, requests: list[Request], tokens: list[int], logprobs: list[float], sampling_logprobs: list[float]
    ) -> list[int]:
        """Append each row's new token; finish the rows that are done and return
        their indices."""
        done = []
        for i, (req, tok, lp, slp) in enumerate(zip(requests, tokens, logprobs, sampling_logprobs)):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            req.output_sampling_logprobs.append(slp)
            n = len(req.output_ids)
            at_stop = tok in req.stop_ids and n >= req.min_new_tokens
            at_limit = n >= req.max_new_tokens
            if at_limit and (self.length_before_eos or not at_stop):
                self._finish(req, FinishReason("length"))
                done.append(i)
            elif at_stop:
                self._finish(req, FinishReason("stop", matched=tok))
                done.append(i)
        self.stats["generated_tokens"] += len(tokens)
        return done

    def _step(self, batch: RunningBatch) -> tuple[torch.Tensor, list[int], list[float], list[float]]:
        """One decode forward and sampling. The new keys/values are written at
        column `end`, but the window does not advance: a step that raises can
        be run again."""
        batch.reserve(1)
        if self._lean is not None:
            logits = self._lean(batch.last_tokens[:, None], batch.decode_mask(), batch.positions[:, None], batch.cache)
        else:
            logits = self.model(
                input_ids=batch.last_tokens[:, None],
                attention_mask=self.layout.decode_masks(batch.decode_mask()),
                position_ids=batch.positions[:, None],
                past_key_values=batch.cache,
                use_cache=True,
            ).logits[:, -1, :]
        tokens, logprobs, sampling_logprobs = sample_tokens(
            logits, batch.params, self._generator, self._banned(batch.requests)
        )
        return tokens, tokens.tolist(), logprobs.tolist(), sampling_logprobs.tolist()

    def _decode_step(self) -> None:
        batch = self._batch
        try:
            tokens, token_list, logprob_list, sampling_list = self._step(batch)
        except Exception as e:
            self.stats["engine_errors"] += 1
            self._isolate_decode_fault(e)
            return
        batch.window.end += 1
        batch.last_tokens = tokens
        batch.positions += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += batch.size
        self._drop_rows(self._record(batch.requests, token_list, logprob_list, sampling_list))

    def _isolate_decode_fault(self, error: Exception) -> None:
        """A decode step raised: step each row alone, on a copy of its keys and
        values (the result is thrown away), and fail the rows that fail alone;
        the others decode on with the batch. If no row fails alone the fault
        is the batch's (e.g. out of memory) and all its requests fail."""
        batch = self._batch
        culprits: list[int] = []
        if batch.size > 1:
            logger.warning(
                "decode step of %d requests failed (%s: %s); stepping them one by one",
                batch.size,
                type(error).__name__,
                error,
            )
            kv, mask, _ = batch.live()
            for i, req in enumerate(batch.requests):
                row = Rows([(k[i : i + 1], v[i : i + 1]) for k, v in kv], mask[i : i + 1])
                try:
                    self._step(RunningBatch([req], row, self.config, max_rows=1))
                except Exception as e:
                    logger.warning("decode of request %s failed: %s: %s", req.rid, type(e).__name__, e)
                    culprits.append(i)
                    self._fail_request(req, e)
        if not culprits:
            logger.warning("decode step failed for the whole batch: %s: %s", type(error).__name__, error)
            self._fail_in_flight(error)
            return
        batch.clear(culprits)
        self._drop_rows(culprits)
