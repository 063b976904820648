"""The built-in torch generation server: SGLang's native HTTP API on an HF causal LM.

    python -m realrl.impl.generation.torch_server --model-path DIR --port N \
        [--host 127.0.0.1] [--device cpu|cuda] [--dtype float32|bfloat16|float16] \
        [--max-running-requests 64] [--seed 1] [--weight-version 0] [--num-threads K] \
        [--length-before-eos]

It speaks the subset of SGLang's native API that realrl uses (docs/design.md §6), so the
same `GenerationClient` drives it and a real SGLang server:

- `POST /generate` `{"input_ids": [...] | [[...], ...], "sampling_params": {...},
  "return_logprob": bool, "rid": str}` -> `{"output_ids", "meta_info": {"id",
  "finish_reason": {"type": "stop"|"length"|"abort", "matched"?}, "weight_version",
  "prompt_tokens", "completion_tokens", "output_token_logprobs": [[logprob,
  token_id, null], ...]}}` (a list of those for a batched request).
- `POST /update_weights_from_disk` `{"model_path", "weight_version",
  "abort_all_requests"}` -> `{"success", "message", "num_paused_requests"}`.
- `POST /pause_generation`, `POST /continue_generation`, `POST /abort_request`
  (`{"rid"}` or `{"abort_all": true}`), `GET|POST /flush_cache`, `GET /health`,
  `GET /model_info` (alias `/get_model_info`), `GET /get_server_info`, `GET /metrics`.

Sampling parameters: `max_new_tokens` (default 128), `min_new_tokens`,
`temperature` (0 = greedy), `top_p`, `top_k` (-1 or 0 = off), `min_p`,
`stop_token_ids`, `ignore_eos`. Text-only options (`skip_special_tokens`, ...)
are accepted and have no effect; penalties and `n` are accepted only at their
neutral values; anything else is rejected with HTTP 400, as is every value the
engine could not sample with (`realrl.api.generation_api.check_sampling_params`:
temperature 0 or in [1e-5, 1e6], top_p in (0, 1], min_p in [0, 1], finite
numbers only, `min_new_tokens <= max_new_tokens`, prompt + max_new_tokens within
the model's positions). Bodies go through `realrl.base.http_body` (size, UTF-8,
JSON nesting depth, object type): a bad body is a 400 too, never a 500.

**Errors.** A failure inside the engine fails only the request(s) that cause
it: when a batched prefill or decode step raises, each of its requests is
retried alone (prefill) or stepped alone on a copy of its row (decode); those
that fail alone are answered with HTTP 500 and counted (`requests_failed`), the
others go on. If no single request reproduces the fault, the whole batch is
failed. Non-finite logits (NaN/inf, e.g. from broken weights) are such a fault,
caught before sampling. Every admitted request is answered, also when the loop
stops; a request submitted after that is refused at once. Generation stops at the
model's eos token(s) (config and generation_config) unless `ignore_eos`, and at
`stop_token_ids`; the stop token is part of `output_ids`. A request whose last
allowed token is a stop token reports `stop` (SGLang would report `length`);
`--length-before-eos` reproduces SGLang's order (the length limit is checked
first, so it reports `length`), for testing clients against it.

**Logprobs.** The logprob returned for each generated token is
`log_softmax(logits / T)[token]` computed in float32, where T is the request's
temperature (T = 0, greedy, uses T = 1, i.e. plain `log_softmax(logits)`). It is
taken *before* top-p / top-k / min-p filtering and before the `min_new_tokens`
stop-token mask, so the trainer reproduces it exactly from a forward pass of the
same weights with the same temperature scaling.

**Batching.** One thread owns the model and runs the generation loop. It keeps a
running batch whose KV cache is left-padded: row i holds its tokens right-aligned
in columns [start, end) of a preallocated buffer per layer, with a boolean
attention mask and an explicit position id per row. A decode step writes the new
keys/values in place at column `end` (no re-allocation per step). New requests
are prefilled together (left-padded, one forward), their first token sampled,
and their rows written into free rows of the buffers, right-aligned at `end`
(the window widens to the left if they are longer), before the next step.
Finished rows leave at once (their HTTP response is sent immediately): the last
rows move into their slots with one indexed copy per layer, and leading columns
that became padding in every row drop out of the window. Buffers are
re-allocated only when rows or columns run out. Decode steps pass a ready 4D
boolean mask, so HF builds no mask per step. Identical prompts prefilled
together (the answers of one GRPO group) are computed once and their rows
copied. Sampling is vectorised over the batch with per-row temperature /
top-p / top-k / min-p tensors and a per-server `torch.Generator` seeded from
`--seed`.

**Weight updates.** `update_weights_from_disk` reads the safetensors of an HF
directory (single file or sharded with an index) on a helper thread and checks
names and shapes against the model; a bad path or mismatch answers
`success: false` and the old weights keep serving. Then, between two decode
steps, in-flight requests are aborted (they return their partial output, its
logprobs and the *old* weight version; `abort_all_requests=false` instead lets
them finish while no new request starts), the tensors are copied into the
existing parameters in place, and `weight_version` changes. Queued requests
that had not started yet run under the new weights.

Only full-attention decoder models (Llama, Qwen2, Mistral without sliding
window, ...) are supported; the server refuses to start otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from aiohttp import web
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from realrl.api.generation_api import SamplingParamError, check_sampling_params
from realrl.base.http_body import BodyError, read_json
from realrl.base.logging import configure, getLogger
from realrl.impl.generation.eos import token_ids

logger = getLogger(__name__)

# KV columns reserved past the current length when a cache buffer is (re)allocated:
# enough for the longest remaining request, but at most this many (then it grows).
_MAX_HEADROOM = 1024
_DEFAULT_MAX_NEW_TOKENS = 128
# Request bodies: large enough for a batched /generate of long prompts.
_MAX_BODY_BYTES = 256 * 1024 * 1024
_MAX_BODY_DEPTH = 16  # the deepest valid body (batched stop_token_ids) nests 4 levels

# Sampling parameters with an effect here, with their defaults (SGLang's names).
_SAMPLING_DEFAULTS: dict[str, Any] = {
    "max_new_tokens": _DEFAULT_MAX_NEW_TOKENS,
    "min_new_tokens": 0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "stop_token_ids": None,
    "ignore_eos": False,
}
# SGLang parameters accepted only at their neutral value.
_NEUTRAL_SAMPLING = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0, "n": 1}
# SGLang parameters that only shape detokenised text: accepted (as bools), no effect.
_TEXT_ONLY_SAMPLING = {"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"}
_GENERATE_FIELDS = {
    "input_ids",
    "sampling_params",
    "return_logprob",
    "rid",
    "stream",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
}


class BadRequest(ValueError):
    """A client error: answered with HTTP 400 (413 for an oversized body) and counted."""

    def __init__(self, message: str, reason: str = "invalid", status: int = 400):
        super().__init__(message)
        self.reason = reason
        self.status = status


class EngineError(RuntimeError):
    """Generation failed inside the engine: answered with HTTP 500 and counted."""


class WeightLoadError(RuntimeError):
    """The weights at a path cannot be loaded into this model."""


# --------------------------------------------------------------------------- requests


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    min_new_tokens: int
    temperature: float
    top_p: float
    top_k: int  # <= 0: off
    min_p: float
    stop_ids: frozenset[int]
    return_logprob: bool
    reply: Callable[[Any], None] = field(repr=False, default=lambda result: None)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def needs_filter(self) -> bool:
        return not self.is_greedy and (self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0)


@dataclass
class GenerateLimits:
    """What a request is checked against."""

    vocab_size: int
    max_positions: int | None
    eos_token_ids: frozenset[int]


def _check_token_ids(ids: Any, name: str, vocab_size: int) -> list[int]:
    if not isinstance(ids, list):
        raise BadRequest(f"{name} must be a list of token ids", "type")
    for tok in ids:
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise BadRequest(f"{name} must hold integers, got {tok!r}", "type")
        if not 0 <= tok < vocab_size:
            raise BadRequest(f"token id {tok} in {name} is outside the vocabulary [0, {vocab_size})", "vocab")
    return ids


def _parse_sampling_params(params: Any, limits: GenerateLimits) -> dict[str, Any]:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be an object", "type")
    out = dict(_SAMPLING_DEFAULTS)
    for key, value in params.items():
        if key in _SAMPLING_DEFAULTS:
            if value is not None or key == "stop_token_ids":
                out[key] = value
        elif key in _NEUTRAL_SAMPLING:
            if value is not None and value != _NEUTRAL_SAMPLING[key]:
                raise BadRequest(
                    f"sampling parameter {key}={value!r} is not supported by the torch backend", "unsupported"
                )
        elif key in _TEXT_ONLY_SAMPLING:
            if value is not None and not isinstance(value, bool):
                raise BadRequest(f"{key} must be a boolean", "type")
        elif key == "stop":
            if value not in (None, "", []):
                raise BadRequest("stop strings need a tokenizer; use stop_token_ids", "unsupported")
        else:
            raise BadRequest(f"unknown sampling parameter {key!r}", "unknown_param")
    if not isinstance(out["ignore_eos"], bool):
        raise BadRequest("ignore_eos must be a boolean", "type")
    if type(out["top_k"]) is int and out["top_k"] == 0:
        out["top_k"] = -1  # this server also takes 0 for off
    stop = out.pop("stop_token_ids")
    try:
        check_sampling_params(out)
    except SamplingParamError as e:
        raise BadRequest(str(e), e.kind) from None
    for name in ("temperature", "top_p", "min_p"):
        out[name] = float(out[name])
    if out["top_k"] >= limits.vocab_size:
        out["top_k"] = -1  # keeps every token anyway
    out["stop_token_ids"] = [] if stop is None else _check_token_ids(stop, "stop_token_ids", limits.vocab_size)
    return out


def parse_generate_body(body: Any, limits: GenerateLimits) -> tuple[list[_Request], bool]:
    """Validate a /generate body; returns the requests and whether it was batched."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object", "type")
    unknown = set(body) - _GENERATE_FIELDS
    if "text" in unknown:
        raise BadRequest("this server takes input_ids only (it has no tokenizer)", "unsupported")
    if unknown:
        raise BadRequest(f"unknown field(s) {sorted(unknown)}", "unknown_param")
    if body.get("stream"):
        raise BadRequest("streaming is not supported by the torch backend", "unsupported")
    if body.get("top_logprobs_num") not in (None, 0):
        raise BadRequest("top_logprobs_num is not supported by the torch backend", "unsupported")

    input_ids = body.get("input_ids")
    if not isinstance(input_ids, list) or not input_ids:
        raise BadRequest("input_ids must be a non-empty list of token ids (or a list of such lists)", "empty")
    batched = isinstance(input_ids[0], list)
    prompts = input_ids if batched else [input_ids]
    n = len(prompts)

    def per_item(key: str, default: Any) -> list[Any]:
        value = body.get(key, default)
        if batched and isinstance(value, list):
            if len(value) != n:
                raise BadRequest(f"{key} has {len(value)} entries for {n} prompts", "type")
            return value
        return [value] * n

    sampling = per_item("sampling_params", None)
    return_logprob = per_item("return_logprob", False)
    rids = per_item("rid", None)
    if batched and body.get("rid") is not None and not isinstance(body["rid"], list):
        raise BadRequest("rid must be a list of strings for a batched request", "type")

    requests = []
    for prompt, params, want_logprob, rid in zip(prompts, sampling, return_logprob, rids):
        if not isinstance(prompt, list) or not prompt:
            raise BadRequest("every prompt must be a non-empty list of token ids", "empty")
        _check_token_ids(prompt, "input_ids", limits.vocab_size)
        p = _parse_sampling_params(params, limits)
        if want_logprob is None:
            want_logprob = False
        if not isinstance(want_logprob, bool):
            raise BadRequest("return_logprob must be a boolean", "type")
        if rid is None:
            rid = uuid.uuid4().hex
        elif not isinstance(rid, str) or not rid:
            raise BadRequest("rid must be a non-empty string", "type")
        if limits.max_positions is not None and len(prompt) + p["max_new_tokens"] > limits.max_positions:
            raise BadRequest(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({p['max_new_tokens']}) exceeds the "
                f"model's {limits.max_positions} positions",
                "too_long",
            )
        stop_ids = set(p["stop_token_ids"])
        if not p["ignore_eos"]:
            stop_ids |= limits.eos_token_ids
        if p["min_new_tokens"] > 0 and sum(t < limits.vocab_size for t in stop_ids) >= limits.vocab_size:
            # Every token is banned until min_new_tokens: nothing could be sampled.
            raise BadRequest("min_new_tokens > 0 but the stop tokens (with eos) cover the whole vocabulary", "range")
        requests.append(
            _Request(
                rid=rid,
                input_ids=list(prompt),
                max_new_tokens=p["max_new_tokens"],
                min_new_tokens=p["min_new_tokens"],
                temperature=p["temperature"],
                top_p=p["top_p"],
                top_k=p["top_k"],
                min_p=p["min_p"],
                stop_ids=frozenset(stop_ids),
                return_logprob=want_logprob,
            )
        )
    if len({r.rid for r in requests}) != len(requests):
        raise BadRequest("duplicate rid in a batched request", "duplicate_rid")
    return requests, batched


# --------------------------------------------------------------------------- KV cache


class _Window:
    """The live part of a running batch's buffers: rows [0, rows), columns
    [start, end). Shared by every layer."""

    __slots__ = ("rows", "start", "end")

    def __init__(self, rows: int, start: int, end: int):
        self.rows, self.start, self.end = rows, start, end


class _KVBuffer(DynamicLayer):
    """One layer's keys/values in a preallocated [rows, kv_heads, columns, head_dim] buffer.

    `update` writes the new keys/values in place right after the live window and
    returns views; the running batch reserves room before each forward and
    advances the shared window after it.
    """

    def __init__(self, keys_buf: torch.Tensor, values_buf: torch.Tensor, window: _Window):
        super().__init__()
        self.keys_buf, self.values_buf, self.window = keys_buf, values_buf, window
        self.dtype, self.device = keys_buf.dtype, keys_buf.device
        self.is_initialized = True
        w = window
        self.keys = keys_buf[: w.rows, :, w.start : w.end]
        self.values = values_buf[: w.rows, :, w.start : w.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        w = self.window
        new_end = w.end + key_states.shape[-2]
        self.keys_buf[: w.rows, :, w.end : new_end].copy_(key_states)
        self.values_buf[: w.rows, :, w.end : new_end].copy_(value_states)
        self.keys = self.keys_buf[: w.rows, :, w.start : new_end]
        self.values = self.values_buf[: w.rows, :, w.start : new_end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.window.end - self.window.start


# Keys/values of some rows, (per-layer (keys, values), mask), columns right-aligned.
_Rows = tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]


class _RunningBatch:
    """The requests being decoded, their left-padded KV cache and per-row state.

    Buffers are allocated with spare rows and columns and reused: a finished row
    is replaced by the last row (one indexed copy per layer), a joining group is
    written into free rows right-aligned at `end`, a decode step writes one
    column in place. Only when rows or columns run out are the buffers
    re-allocated (zero-filled, so stale padding is always finite) and the live
    window copied over.
    """

    def __init__(self, requests: list[_Request], rows: _Rows, config, max_rows: int):
        self.config = config
        self.max_rows = max_rows
        self.requests: list[_Request] = []
        kv, mask = rows
        self._allocate([(kv, mask)], n_rows=mask.shape[0], length=mask.shape[1], extra_requests=requests)
        self.requests = list(requests)
        self._refresh_rows()

    # ---- views and sizes

    @property
    def size(self) -> int:
        return self.window.rows

    @property
    def length(self) -> int:
        return self.window.end - self.window.start

    def live(self) -> _Rows:
        w = self.window
        kv = [
            (layer.keys_buf[: w.rows, :, w.start : w.end], layer.values_buf[: w.rows, :, w.start : w.end])
            for layer in self.cache.layers
        ]
        return kv, self.mask[: w.rows, w.start : w.end]

    def decode_mask(self) -> torch.Tensor:
        """The 4D boolean mask [rows, 1, 1, length + 1] for the next decode step
        (HF passes a 4D mask through untouched)."""
        w = self.window
        self.mask[: w.rows, w.end] = True
        return self.mask[: w.rows, None, None, w.start : w.end + 1]

    @staticmethod
    def headroom(requests: list[_Request]) -> int:
        remaining = max(r.max_new_tokens - len(r.output_ids) for r in requests)
        return max(1, min(remaining, _MAX_HEADROOM))

    # ---- (re)allocation

    def _allocate(self, parts: list[_Rows], n_rows: int, length: int, extra_requests: list[_Request]) -> None:
        """Fresh zeroed buffers holding `parts` stacked by rows, right-aligned at `length`."""
        requests = self.requests + extra_requests
        row_capacity = min(max(self.max_rows, n_rows), max(2 * n_rows, 8))
        col_capacity = length + self.headroom(requests)
        device = parts[0][1].device
        self.mask = torch.zeros((row_capacity, col_capacity), dtype=torch.bool, device=device)
        self.window = _Window(n_rows, 0, length)
        layers = []
        for k0, v0 in parts[0][0]:
            keys = k0.new_zeros((row_capacity, k0.shape[1], col_capacity, k0.shape[3]))
            values = v0.new_zeros((row_capacity, v0.shape[1], col_capacity, v0.shape[3]))
            layers.append(_KVBuffer(keys, values, self.window))
        row = 0
        for kv, part_mask in parts:
            n, cols = part_mask.shape
            offset = length - cols
            self.mask[row : row + n, offset:length] = part_mask
            for layer, (k, v) in zip(layers, kv):
                layer.keys_buf[row : row + n, :, offset:length] = k
                layer.values_buf[row : row + n, :, offset:length] = v
            row += n
        self.cache = DynamicCache(config=self.config)
        self.cache.layers = layers

    def _refresh_rows(self) -> None:
        """Rebuild the per-row tensors from the requests (after rows changed)."""
        device = self.mask.device
        self.last_tokens = torch.tensor([r.output_ids[-1] for r in self.requests], dtype=torch.long, device=device)
        self.positions = torch.tensor(
            [len(r.input_ids) + len(r.output_ids) - 1 for r in self.requests], dtype=torch.long, device=device
        )
        self.params = _RowParams.from_requests(self.requests, device)
        for layer in self.cache.layers:  # views over the new row count
            w = self.window
            layer.keys = layer.keys_buf[: w.rows, :, w.start : w.end]
            layer.values = layer.values_buf[: w.rows, :, w.start : w.end]

    def reserve(self, n: int) -> None:
        """Make room for n more columns (re-allocating, rarely, with fresh headroom)."""
        if self.window.end + n <= self.mask.shape[1]:
            return
        self._allocate([self.live()], n_rows=self.size, length=self.length, extra_requests=[])
        self._refresh_rows()

    # ---- membership

    def clear(self, rows: list[int]) -> None:
        """Zero every column of these rows (ones a fault may have filled with
        NaN): a later occupant of the slot sees them as masked padding, and a
        masked NaN value still turns attention into NaN."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        for layer in self.cache.layers:
            layer.keys_buf.index_fill_(0, index, 0)
            layer.values_buf.index_fill_(0, index, 0)

    def remove(self, drop: list[int]) -> bool:
        """Drop rows (by index); returns False if the batch became empty."""
        w = self.window
        n_left = w.rows - len(drop)
        if n_left == 0:
            return False
        dropped = set(drop)
        # Kept rows beyond the new end move into the dropped slots below it.
        holes = [i for i in sorted(dropped) if i < n_left]
        movers = [i for i in range(n_left, w.rows) if i not in dropped]
        if holes:
            device = self.mask.device
            dst = torch.tensor(holes, dtype=torch.long, device=device)
            src = torch.tensor(movers, dtype=torch.long, device=device)
            for layer in self.cache.layers:
                for buf in (layer.keys_buf, layer.values_buf):
                    live = buf[:, :, w.start : w.end]
                    live.index_copy_(0, dst, live.index_select(0, src))
            live_mask = self.mask[:, w.start : w.end]
            live_mask.index_copy_(0, dst, live_mask.index_select(0, src))
            for h, m in zip(holes, movers):
                self.requests[h] = self.requests[m]
        del self.requests[n_left:]
        w.rows = n_left
        # Columns that are now padding in every row are dropped from the window.
        first = int(self.mask[:n_left, w.start : w.end].any(dim=0).int().argmax())
        w.start += first
        self._refresh_rows()
        return True

    def add(self, requests: list[_Request], rows: _Rows) -> None:
        """Join freshly prefilled rows (keys/values/mask right-aligned)."""
        kv, mask = rows
        n, cols = mask.shape
        w = self.window
        row_capacity, col_capacity = self.mask.shape
        if w.rows + n > row_capacity or cols > w.end or w.end >= col_capacity:
            length = max(self.length, cols)
            self._allocate([self.live(), rows], n_rows=w.rows + n, length=length, extra_requests=requests)
        else:
            c0 = w.end - cols
            if c0 < w.start:  # the window widens to the left for the longer newcomers
                self.mask[: w.rows, c0 : w.start] = False
                w.start = c0
            r0, r1 = w.rows, w.rows + n
            self.mask[r0:r1, w.start : w.end] = False
            self.mask[r0:r1, c0 : w.end] = mask
            for layer, (k, v) in zip(self.cache.layers, kv):
                layer.keys_buf[r0:r1, :, c0 : w.end] = k
                layer.values_buf[r0:r1, :, c0 : w.end] = v
            w.rows = r1
        self.requests.extend(requests)
        self._refresh_rows()


@dataclass
class _RowParams:
    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_p: torch.Tensor
    top_k: torch.Tensor  # [B] long; <= 0 = off
    min_p: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    any_filter: bool

    @classmethod
    def from_requests(cls, requests: list[_Request], device: torch.device) -> _RowParams:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor([r.temperature for r in requests], **f32),
            top_p=torch.tensor([r.top_p for r in requests], **f32),
            top_k=torch.tensor([r.top_k for r in requests], dtype=torch.long, device=device),
            min_p=torch.tensor([r.min_p for r in requests], **f32),
            all_greedy=all(r.is_greedy for r in requests),
            any_greedy=any(r.is_greedy for r in requests),
            any_filter=any(r.needs_filter for r in requests),
        )


def sample_tokens(
    logits: torch.Tensor,
    params: _RowParams,
    generator: torch.Generator,
    banned: list[tuple[int, list[int]]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens, logprobs) with logprob =
    log_softmax(logits / T)[token] (T = 1 for greedy rows), before any filtering.

    `banned`: (row, token ids) that must not be picked (min_new_tokens)."""
    logits = logits.float()
    temperature = params.temperature
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / scale[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    # NaN / +inf logits (or all -inf) make every logprob of the row NaN. Refuse
    # them here: torch.multinomial would raise on CPU but hit a device-side
    # assert on CUDA (which ends the process), and greedy rows would return NaN.
    if not bool(torch.isfinite(logprobs.amax(dim=-1)).all()):
        raise FloatingPointError("the model produced non-finite logits (NaN or inf)")

    pick_from = scaled
    if banned:
        pick_from = scaled.clone()
        for row, ids in banned:
            pick_from[row, ids] = float("-inf")

    if params.all_greedy:
        tokens = pick_from.argmax(dim=-1)
    else:
        if params.any_filter:
            sorted_logits, sorted_idx = pick_from.sort(dim=-1, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            ranks = torch.arange(sorted_logits.shape[-1], device=logits.device)
            top_k = params.top_k[:, None]
            drop = (top_k > 0) & (ranks[None, :] >= top_k)
            # top-p: drop a token if the tokens ranked above it already cover top_p
            drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > params.top_p[:, None]
            drop |= sorted_probs < params.min_p[:, None] * sorted_probs[:, :1]
            drop[:, 0] = False  # the most likely token always survives
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            choice = torch.multinomial(torch.softmax(sorted_logits, dim=-1), 1, generator=generator)
            sampled = sorted_idx.gather(1, choice).squeeze(1)
        else:
            sampled = torch.multinomial(torch.softmax(pick_from, dim=-1), 1, generator=generator).squeeze(1)
        if params.any_greedy:
            sampled = torch.where(temperature > 0, sampled, pick_from.argmax(dim=-1))
        tokens = sampled
    token_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
    return tokens, token_logprobs


# --------------------------------------------------------------------------- weights


def read_weights_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory (single file or sharded + index), on CPU."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise WeightLoadError(f"{path!r} is not a directory")
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise WeightLoadError(f"cannot read {index}: {e}") from e
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no safetensors files in {path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file, device="cpu"))
        except Exception as e:  # missing shard, truncated file, bad header
            raise WeightLoadError(f"cannot read {file}: {e}") from e
    return tensors


class _WeightTargets:
    """The model's state-dict tensors (sharing storage with its parameters) and
    which names are aliases of one another (tied embeddings)."""

    def __init__(self, model: torch.nn.Module):
        self.tensors = dict(model.state_dict())
        groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        for name, t in self.tensors.items():
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
        self.groups = list(groups.values())

    def check(self, loaded: dict[str, torch.Tensor]) -> None:
        loaded = {k: v for k, v in loaded.items() if not k.endswith("rotary_emb.inv_freq")}
        unexpected = sorted(set(loaded) - set(self.tensors))
        if unexpected:
            raise WeightLoadError(f"unexpected tensors {unexpected[:5]} (model has no such parameters)")
        for name, t in loaded.items():
            if tuple(t.shape) != tuple(self.tensors[name].shape):
                raise WeightLoadError(
                    f"shape of {name}: file {tuple(t.shape)} vs model {tuple(self.tensors[name].shape)}"
                )
        missing = [group[0] for group in self.groups if not any(name in loaded for name in group)]
        if missing:
            raise WeightLoadError(f"missing tensors {missing[:5]}")

    @torch.no_grad()
    def copy_in(self, loaded: dict[str, torch.Tensor]) -> None:
        for name, t in loaded.items():
            if name in self.tensors:
                self.tensors[name].copy_(t)


# --------------------------------------------------------------------------- engine


def _refuse(item: tuple, message: str) -> None:
    """Answer an inbox item the loop will never handle."""
    name, args, reply = item
    if name == "generate":
        args.reply(EngineError(message))
    elif reply is not None:
        reply({"success": False, "message": message})


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
    ):
        self.model = model
        self.length_before_eos = length_before_eos
        self.config = model.config
        self.device = device
        self.max_running_requests = max_running_requests
        self.max_prefill_tokens = max_prefill_tokens
        self.weight_version = str(weight_version)
        text_config = self.config.get_text_config(decoder=True)
        self.limits = GenerateLimits(
            vocab_size=model.get_input_embeddings().num_embeddings,
            max_positions=getattr(text_config, "max_position_embeddings", None),
            eos_token_ids=eos_token_ids,
        )
        self._check_full_attention()
        self._targets = _WeightTargets(model)
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(seed)

        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._waiting: deque[_Request] = deque()
        self._batch: _RunningBatch | None = None
        self._live: dict[str, _Request] = {}  # rid -> request, waiting or running
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
            "weight_update_failures": 0,
            "engine_errors": 0,  # failed engine steps (batched prefill / decode, commands)
            "requests_failed": 0,  # requests answered with an engine error (HTTP 500)
        }
        self.rejections: dict[str, int] = {}
        self._stats_lock = threading.Lock()
        self._prefilling: list[_Request] = []  # taken off the queue, not yet in the batch
        self._closed = False  # the loop has ended: submissions are refused at once
        self._closed_lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="generation-loop", daemon=True)

    def _check_full_attention(self) -> None:
        layers = DynamicCache(config=self.config).layers
        if any(type(layer) is not DynamicLayer for layer in layers):
            kinds = sorted({type(layer).__name__ for layer in layers})
            raise ValueError(f"the torch server supports full-attention models only (cache layers: {kinds})")

    # ---- thread-safe API

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Abort everything in flight and end the loop."""
        self._put(("stop", None, None))
        self._thread.join(timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, request: _Request) -> None:
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
        self._targets.check(tensors)
        return tensors

    def info(self) -> dict[str, Any]:
        batch = self._batch
        steps = max(1, self.stats["decode_steps"])
        return {
            "weight_version": self.weight_version,
            "num_running_requests": batch.size if batch is not None else 0,
            "num_waiting_requests": len(self._waiting),
            "paused": self._paused,
            "max_running_requests": self.max_running_requests,
            "length_before_eos": self.length_before_eos,
            "avg_decode_batch_size": self.stats["decode_rows"] / steps,
            "stats": dict(self.stats),
            "rejections": dict(self.rejections),
        }

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
                        if self._batch is not None:
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
            self._pending_update["reply"]({"success": False, "message": "server shutting down"})
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
        if self._batch is not None or self._pending_update is not None:
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
                error = {"success": False, "message": f"{name} failed: {e}"}
                if name == "generate":
                    self.stats["requests_failed"] += 1
                    args.reply(EngineError(error["message"]))
                elif reply is not None:
                    reply(error)

    def _handle(self, name: str, args: Any, reply: Callable[[Any], None] | None) -> None:
        if name == "generate":
            req: _Request = args
            if req.rid in self._live:
                self.count_rejection("duplicate_rid")
                req.reply(BadRequest(f"a request with rid {req.rid!r} is already running", "duplicate_rid"))
                return
            self._live[req.rid] = req
            self._waiting.append(req)
        elif name == "stop":
            self._stopping = True
        elif name == "abort":
            rid = args.get("rid")
            n = self._abort(lambda r: args.get("abort_all") or r.rid == rid, include_waiting=True)
            reply({"success": True, "num_aborted": n})
        elif name == "pause":
            n = self._abort(lambda r: True, include_waiting=False)
            self._paused = True
            reply({"success": True, "num_aborted": n})
        elif name == "continue":
            self._paused = False
            reply({"success": True})
        elif name == "flush_cache":
            # No prefix cache is kept across requests; nothing to drop.
            reply({"success": True, "message": "no cached prefixes to flush"})
        elif name == "update":
            if args["abort_all_requests"]:
                n = self._abort(lambda r: True, include_waiting=False)
                self._apply_update(dict(args, reply=reply), num_aborted=n)
            else:
                self._pending_update = dict(args, reply=reply)
        else:
            reply({"success": False, "message": f"unknown command {name!r}"})

    def _apply_update(self, update: dict, num_aborted: int) -> None:
        try:
            self._targets.copy_in(update["tensors"])
        except Exception as e:  # the caller gets an answer; the weights may be half-copied
            logger.exception("copying new weights failed")
            self.stats["weight_update_failures"] += 1
            update["reply"]({"success": False, "message": f"copying the weights failed: {e}", "num_paused_requests": 0})
            return
        old = self.weight_version
        if update["weight_version"] is not None:
            self.weight_version = str(update["weight_version"])
        self.stats["weight_updates"] += 1
        logger.info(
            "weights updated from %s: version %s -> %s (%d requests aborted)",
            update["model_path"],
            old,
            self.weight_version,
            num_aborted,
        )
        update["reply"](
            {
                "success": True,
                "message": f"Succeeded to update model weights (version {self.weight_version}).",
                "num_paused_requests": num_aborted,
            }
        )

    # ---- finishing

    def _finish(self, req: _Request, reason: dict[str, Any]) -> None:
        self._live.pop(req.rid, None)
        self.stats["requests_finished"] += 1
        self.stats[f"finish_{reason['type']}"] += 1
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": reason,
            "prompt_tokens": len(req.input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - req.arrival_time,
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(req.output_logprobs, req.output_ids)]
        req.reply({"output_ids": list(req.output_ids), "meta_info": meta})

    def _abort(self, match: Callable[[_Request], bool], include_waiting: bool, message: str = "aborted") -> int:
        n = 0
        if include_waiting and self._waiting:
            kept = deque()
            for req in self._waiting:
                if match(req):
                    self._finish(req, {"type": "abort", "message": message})
                    n += 1
                else:
                    kept.append(req)
            self._waiting = kept
        if self._batch is not None:
            drop = []
            for i, req in enumerate(self._batch.requests):
                if match(req):
                    self._finish(req, {"type": "abort", "message": message})
                    drop.append(i)
            self._drop_rows(drop)
            n += len(drop)
        return n

    def _drop_rows(self, drop: list[int]) -> None:
        if drop and not self._batch.remove(drop):
            self._batch = None

    def _abort_all(self, message: str) -> None:
        self._abort(lambda r: True, include_waiting=True, message=message)

    def _fail_request(self, req: _Request, error: Exception) -> None:
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
            group: list[_Request] = []
            longest = 0
            while self._waiting and len(group) < free:
                req = self._waiting[0]
                if req.max_new_tokens == 0:
                    self._waiting.popleft()
                    self._finish(req, {"type": "length"})
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
                    self._batch = _RunningBatch(requests, rows, self.config, self.max_running_requests)
                else:
                    self._batch.add(requests, rows)
            self._prefilling = []

    def _prefill_isolated(self, group: list[_Request]) -> list[tuple[list[_Request], _Rows]]:
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
            del req.output_ids[n:], req.output_logprobs[n:]  # a token recorded before the failure
            try:
                joined = self._prefill([req])
            except Exception as e:
                logger.warning("prefill of request %s failed: %s: %s", req.rid, type(e).__name__, e)
                self._fail_request(req, e)
                continue
            if joined is not None:
                out.append(joined)
        return out

    def _prefill(self, group: list[_Request]) -> tuple[list[_Request], _Rows] | None:
        """One forward over the group's prompts (left-padded); samples each first
        token; returns the rows that go on with their keys/values and mask."""
        self.stats["prefill_batches"] += 1
        # Identical prompts (a GRPO group's answers) are computed once; their
        # rows are copied out of the one forward (`source`: request -> row).
        unique: dict[tuple[int, ...], int] = {}
        source = [unique.setdefault(tuple(r.input_ids), len(unique)) for r in group]
        prompts = list(unique)
        length = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), length), dtype=torch.long)
        mask = torch.zeros((len(prompts), length), dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, length - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, length - len(p) :] = True
        self.stats["prompt_tokens"] += sum(len(r.input_ids) for r in group)
        self.stats["prompt_tokens_shared"] += sum(len(r.input_ids) for r in group) - sum(len(p) for p in prompts)
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.long().cumsum(dim=-1) - 1).clamp(min=0)
        cache = DynamicCache(config=self.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        params = _RowParams.from_requests(group, self.device)
        source_rows = torch.tensor(source, dtype=torch.long, device=self.device)
        last_logits = out.logits[:, -1, :].index_select(0, source_rows)
        tokens, logprobs = sample_tokens(last_logits, params, self._generator, self._banned(group))
        done = set(self._record(group, tokens.tolist(), logprobs.tolist()))
        keep = [i for i in range(len(group)) if i not in done]
        if not keep:
            return None
        rows = source_rows[torch.tensor(keep, dtype=torch.long, device=self.device)]
        kv = [(layer.keys.index_select(0, rows), layer.values.index_select(0, rows)) for layer in cache.layers]
        row_mask = mask.index_select(0, rows)
        first = int(row_mask.any(dim=0).int().argmax())
        # Zero the padded positions: their keys/values are never attended, but
        # they must be finite.
        pad = ~row_mask[:, None, first:, None]
        kv = [(k[:, :, first:].masked_fill(pad, 0), v[:, :, first:].masked_fill(pad, 0)) for k, v in kv]
        return [group[i] for i in keep], (kv, row_mask[:, first:])

    def _banned(self, requests: list[_Request]) -> list[tuple[int, list[int]]] | None:
        banned = [
            (i, sorted(r.stop_ids))
            for i, r in enumerate(requests)
            if r.stop_ids and len(r.output_ids) < r.min_new_tokens
        ]
        return banned or None

    def _record(self, requests: list[_Request], tokens: list[int], logprobs: list[float]) -> list[int]:
        """Append each row's new token; finish the rows that are done and return
        their indices."""
        done = []
        for i, (req, tok, lp) in enumerate(zip(requests, tokens, logprobs)):
            req.output_ids.append(tok)
            req.output_logprobs.append(lp)
            n = len(req.output_ids)
            at_stop = tok in req.stop_ids and n >= req.min_new_tokens
            at_limit = n >= req.max_new_tokens
            if at_limit and (self.length_before_eos or not at_stop):
                self._finish(req, {"type": "length"})
                done.append(i)
            elif at_stop:
                self._finish(req, {"type": "stop", "matched": tok})
                done.append(i)
        self.stats["generated_tokens"] += len(tokens)
        return done

    def _step(self, batch: _RunningBatch) -> tuple[torch.Tensor, list[int], list[float]]:
        """One decode forward and sampling. The new keys/values are written at
        column `end`, but the window does not advance: a step that raises can
        be run again."""
        batch.reserve(1)
        out = self.model(
            input_ids=batch.last_tokens[:, None],
            attention_mask=batch.decode_mask(),
            position_ids=batch.positions[:, None],
            past_key_values=batch.cache,
            use_cache=True,
        )
        tokens, logprobs = sample_tokens(
            out.logits[:, -1, :], batch.params, self._generator, self._banned(batch.requests)
        )
        return tokens, tokens.tolist(), logprobs.tolist()

    def _decode_step(self) -> None:
        batch = self._batch
        try:
            tokens, token_list, logprob_list = self._step(batch)
        except Exception as e:
            self.stats["engine_errors"] += 1
            self._isolate_decode_fault(e)
            return
        batch.window.end += 1
        batch.last_tokens = tokens
        batch.positions += 1
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += batch.size
        self._drop_rows(self._record(batch.requests, token_list, logprob_list))

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
            kv, mask = batch.live()
            for i, req in enumerate(batch.requests):
                row = ([(k[i : i + 1], v[i : i + 1]) for k, v in kv], mask[i : i + 1])
                try:
                    self._step(_RunningBatch([req], row, self.config, max_rows=1))
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


# --------------------------------------------------------------------------- HTTP


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
        app = web.Application(client_max_size=_MAX_BODY_BYTES)
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
        self.engine.command(name, args or {}, _threadsafe_setter(loop, fut))
        return fut

    async def _read_json(self, request: web.Request) -> dict:
        try:
            return await read_json(request, max_bytes=_MAX_BODY_BYTES, max_depth=_MAX_BODY_DEPTH)
        except BodyError as e:
            raise BadRequest(str(e), "too_large" if e.status == 413 else "bad_json", e.status) from None

    def _reject(self, e: BadRequest) -> web.Response:
        self.engine.count_rejection(e.reason)
        logger.debug("rejected request: %s", e)
        return _json_error(e.status, str(e))

    # ---- handlers

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            reqs, batched = parse_generate_body(body, self.engine.limits)
        except BadRequest as e:
            return self._reject(e)
        loop = asyncio.get_running_loop()
        futures = []
        for req in reqs:
            fut = loop.create_future()
            req.reply = _threadsafe_setter(loop, fut)
            futures.append(fut)
            self.engine.submit(req)
        try:
            results = await asyncio.gather(*futures)
        except asyncio.CancelledError:  # the client went away: stop generating for it
            for req in reqs:
                self.engine.command("abort", {"rid": req.rid}, lambda result: None)
            raise
        for result in results:
            if isinstance(result, BadRequest):
                return _json_error(result.status, str(result))
            if isinstance(result, Exception):  # EngineError: this request failed in the engine
                return _json_error(500, str(result))
        return web.json_response(results if batched else results[0])

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            model_path = body.get("model_path")
            if not isinstance(model_path, str) or not model_path:
                raise BadRequest("model_path must be a non-empty string", "type")
            version = body.get("weight_version")
            if version is not None and (isinstance(version, bool) or not isinstance(version, (str, int))):
                raise BadRequest("weight_version must be a string or an integer", "type")
            abort_all = body.get("abort_all_requests", True)
            if not isinstance(abort_all, bool):
                raise BadRequest("abort_all_requests must be a boolean", "type")
            if body.get("load_format") not in (None, "auto", "safetensors"):
                raise BadRequest("only safetensors weights are supported", "unsupported")
        except BadRequest as e:
            return self._reject(e)
        if self._update_lock is None:
            self._update_lock = asyncio.Lock()
        async with self._update_lock:
            try:
                tensors = await asyncio.to_thread(self.engine.read_weights, model_path)
            except Exception as e:  # WeightLoadError, or anything the filesystem throws
                self.engine.stats["weight_update_failures"] += 1
                logger.warning("weight update from %s refused: %s", model_path, e)
                return web.json_response(
                    {"success": False, "message": f"Failed to update weights: {e}", "num_paused_requests": 0},
                    status=400,
                )
            result = await self._call(
                "update",
                {
                    "tensors": tensors,
                    "weight_version": version,
                    "abort_all_requests": abort_all,
                    "model_path": model_path,
                },
            )
        if not result.get("success"):
            return web.json_response(dict(result, num_paused_requests=0), status=400)
        return web.json_response(result)

    async def pause_generation(self, request: web.Request) -> web.Response:
        return web.json_response(await self._call("pause"))

    async def continue_generation(self, request: web.Request) -> web.Response:
        return web.json_response(await self._call("continue"))

    async def abort_request(self, request: web.Request) -> web.Response:
        try:
            body = await self._read_json(request)
            rid, abort_all = body.get("rid"), body.get("abort_all", False)
            if not isinstance(abort_all, bool):
                raise BadRequest("abort_all must be a boolean", "type")
            if not abort_all and (not isinstance(rid, str) or not rid):
                raise BadRequest("give rid (a string) or abort_all: true", "type")
        except BadRequest as e:
            return self._reject(e)
        return web.json_response(await self._call("abort", {"rid": rid, "abort_all": abort_all}))

    async def flush_cache(self, request: web.Request) -> web.Response:
        return web.json_response(await self._call("flush_cache"))

    async def health(self, request: web.Request) -> web.Response:
        if not self.engine.is_alive():
            return web.Response(status=503, text="generation loop is not running")
        return web.Response(status=200)

    async def model_info(self, request: web.Request) -> web.Response:
        limits = self.engine.limits
        return web.json_response(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "weight_version": self.engine.weight_version,
                "is_generation": True,
                "backend": "torch",
                "vocab_size": limits.vocab_size,
                "max_position_embeddings": limits.max_positions,
                "eos_token_ids": sorted(limits.eos_token_ids),
                "device": self.device,
                "dtype": self.dtype,
            }
        )

    async def weight_version(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def server_info(self, request: web.Request) -> web.Response:
        info = self.engine.info()
        info.update(model_path=self.model_path, device=self.device, dtype=self.dtype, backend="torch")
        return web.json_response(info)

    async def metrics(self, request: web.Request) -> web.Response:
        info = self.engine.info()
        lines = [f"realrl_torch_server_{k} {float(v)}" for k, v in info["stats"].items()]
        lines += [f'realrl_torch_server_rejections{{reason="{k}"}} {v}' for k, v in info["rejections"].items()]
        lines += [
            f"realrl_torch_server_num_running_requests {info['num_running_requests']}",
            f"realrl_torch_server_num_waiting_requests {info['num_waiting_requests']}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")


def _threadsafe_setter(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> Callable[[Any], None]:
    def set_result(result: Any) -> None:
        if not fut.done():
            fut.set_result(result)

    def reply(result: Any) -> None:
        try:
            loop.call_soon_threadsafe(set_result, result)
        except RuntimeError:  # the event loop is already closed (shutdown)
            pass

    return reply


# --------------------------------------------------------------------------- entry point


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def eos_token_ids_of(model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        ids |= token_ids(getattr(source, "eos_token_id", None))
    return frozenset(ids)


def load_model(model_path: str, device: str, dtype: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=_DTYPES[dtype], attn_implementation="sdpa")
    return model.to(device).eval()


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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--length-before-eos", action="store_true", help="check the length limit before stop tokens, as SGLang does"
    )
    parser.add_argument("--log-level", default=None)
    args = parser.parse_args(argv)

    configure(f"torch_server:{args.port}", args.log_level)
    transformers.logging.disable_progress_bar()  # a "Loading weights" bar per weight update
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    model = load_model(args.model_path, args.device, args.dtype)
    engine = GenerationEngine(
        model,
        device=device,
        seed=args.seed,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        weight_version=args.weight_version,
        eos_token_ids=eos_token_ids_of(model),
        length_before_eos=args.length_before_eos,
    )
    engine.start()
    logger.info(
        "loaded %s on %s (%s), weight version %s", args.model_path, args.device, args.dtype, engine.weight_version
    )
    asyncio.run(serve(TorchGenerationServer(engine, args.model_path, args.device, args.dtype), args.host, args.port))


if __name__ == "__main__":
    main()
