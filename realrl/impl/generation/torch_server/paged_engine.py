"""The paged generation engine: the same loop, commands and answers as
`engine.GenerationEngine`, over a paged KV cache.

What it changes is where keys/values live and how a step is formed; what the
runtime relies on stays the base class's (the inbox, aborts, pauses, weight
updates and LoRA merges between steps, fault isolation, stop rules, stats):

- `block_manager.BlockAllocator` and `scheduler.Scheduler` (pure Python)
  decide each step: a packed prefill of waiting requests under
  `--max-prefill-tokens` (a group's answers are forks of one computed
  prompt), or a decode step of every running sequence, preempting the newest
  when the pool runs out (they are prefilled again later, outputs kept);
- `model_runner.ModelRunner` owns the pool tensors and runs each step as one
  HF forward through `paged_attention`, with one device-to-host copy;
- the running set is the scheduler's (`_batch` below is the scheduler while
  anything runs): removing a row frees its blocks.

A request whose prompt and `max_new_tokens` cannot fit the whole pool is
refused (400, `kv_cache_too_small`) instead of waiting forever. Models that
`paged_attention.paged_supported` refuses (sliding-window and hybrid layers,
soft-capped logits) stay on the dense engine (`create_engine`).
"""

from __future__ import annotations

from transformers import PreTrainedModel

from realrl.api.sglang_api import FinishReason
from realrl.base.http_body import BodyError
from realrl.base.logging import getLogger
from realrl.impl.generation.torch_server.block_manager import BlockAllocator, OutOfBlocks
from realrl.impl.generation.torch_server.engine import GenerationEngine
from realrl.impl.generation.torch_server.model_runner import ModelRunner
from realrl.impl.generation.torch_server.paged_attention import paged_supported
from realrl.impl.generation.torch_server.scheduler import Scheduler
from realrl.impl.generation.torch_server.sequence import Sequence

logger = getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


class PagedGenerationEngine(GenerationEngine):
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        kv_cache_tokens: int,
        block_size: int = DEFAULT_BLOCK_SIZE,
        cuda_graphs: bool = True,
        **kwargs,
    ):
        if (reason := paged_supported(model.config)) is not None:
            raise ValueError(f"the paged engine does not serve models with {reason}")
        super().__init__(model, **kwargs)
        num_blocks = max(1, kv_cache_tokens // block_size)
        self.allocator = BlockAllocator(num_blocks, block_size)
        self._scheduler = Scheduler(self.allocator, self.max_running_requests, self.max_prefill_tokens, self._waiting)
        self.runner = ModelRunner(
            model,
            device=self.device,
            num_blocks=num_blocks,
            block_size=block_size,
            max_seqs=self.max_running_requests,
            generator=self._generator,
            cuda_graphs=cuda_graphs,
        )
        max_len = self.limits.max_positions or num_blocks * block_size
        self.runner.capture_graphs(max_blocks_per_seq=min(num_blocks, -(-max_len // block_size)))
        self.stats.update(preemptions=0, kv_blocks=num_blocks, kv_blocks_free=num_blocks)

    # The running set is the scheduler's; the base class reads and clears it as `_batch`.
    @property
    def _batch(self):
        scheduler = self.__dict__.get("_scheduler")
        return scheduler if scheduler is not None and scheduler.running else None

    @_batch.setter
    def _batch(self, value) -> None:
        if value is None and "_scheduler" in self.__dict__:
            self._scheduler.clear()

    def _requeue_running(self) -> int:
        n = self._scheduler.preempt_all()
        self.stats["kv_blocks_free"] = self.allocator.num_free
        return n

    # ---- prefill

    def _admit(self) -> None:
        if self._paused or not self._waiting:
            return
        step = self._scheduler.schedule_prefill(resumed_only=self._pending_update is not None)
        if step is None:
            return
        for req in step.no_tokens:
            self._finish(req, FinishReason("length"))
        for req in step.too_long:
            self._live.pop(req.rid, None)
            self.count_rejection("kv_cache_too_small")
            req.reply(
                BodyError(
                    f"{len(req.input_ids)} prompt tokens + max_new_tokens {req.max_new_tokens} do not fit the KV "
                    f"cache ({self.allocator.num_blocks * self.allocator.block_size} tokens)",
                    reason="kv_cache_too_small",
                )
            )
        if not step.seqs:
            return
        self.stats["prefill_batches"] += 1
        self.stats["prompt_tokens"] += sum(len(s.request.input_ids) for s in step.rows)
        self.stats["prompt_tokens_shared"] += sum(len(s.request.input_ids) for s in step.rows[len(step.seqs) :])
        try:
            self._prefill(step.seqs, step.rows, step.source, step.copies)
        except Exception as e:
            self.stats["engine_errors"] += 1
            self._scheduler.release(step.rows)
            if len(step.rows) == 1:
                logger.warning("prefill of request %s failed: %s: %s", step.rows[0].request.rid, type(e).__name__, e)
                self._fail_request(step.rows[0].request, e)
                return
            logger.warning(
                "prefill of %d requests failed (%s: %s); retrying them one by one", len(step.rows), type(e).__name__, e
            )
            self._prefill_one_by_one([s.request for s in step.rows])
        self.stats["kv_blocks_free"] = self.allocator.num_free

    def _prefill(self, seqs: list[Sequence], rows: list[Sequence], source: list[int], copies) -> None:
        """One packed forward; the first token of every row; forks get their blocks."""
        self.runner.clear_blocks(self.allocator.take_handed_out())
        _, (tokens, logprobs, sampling) = self.runner.prefill(
            seqs, rows, source, self._banned([s.request for s in rows])
        )
        self.runner.copy_blocks(copies)
        done = self._record([s.request for s in rows], tokens, logprobs, sampling)
        self._scheduler.release([rows[i] for i in done])

    def _prefill_one_by_one(self, requests: list) -> None:
        for k, req in enumerate(requests):
            seq = Sequence(req)
            try:
                seq.block_table = self.allocator.allocate(seq.num_tokens)
            except OutOfBlocks:  # the rest waits for a normal step
                self._waiting.extendleft(reversed(requests[k:]))
                return
            seq.num_cached = seq.num_tokens
            self._scheduler.running.append(seq)
            try:
                self._prefill([seq], [seq], [0], [])
            except Exception as e:
                logger.warning("prefill of request %s failed: %s: %s", req.rid, type(e).__name__, e)
                self._scheduler.release([seq])
                self._fail_request(req, e)

    # ---- decode

    def _decode_step(self) -> None:
        step = self._scheduler.schedule_decode()
        self.stats["preemptions"] += len(step.preempted)
        if not step.seqs:
            return
        requests = [s.request for s in step.seqs]
        try:
            self.runner.clear_blocks(self.allocator.take_handed_out())
            _, (tokens, logprobs, sampling) = self.runner.decode(step.seqs, self._banned(requests))
        except Exception as e:
            self.stats["engine_errors"] += 1
            self._isolate_decode_fault_paged(step.seqs, e)
            return
        self.stats["decode_steps"] += 1
        self.stats["decode_rows"] += len(step.seqs)
        done = self._record(requests, tokens, logprobs, sampling)
        self._scheduler.release([step.seqs[i] for i in done])
        self.stats["kv_blocks_free"] = self.allocator.num_free

    def _isolate_decode_fault_paged(self, seqs: list[Sequence], error: Exception) -> None:
        """Step each sequence alone (it rewrites only its own next slot; the
        result is thrown away) and fail those that fail alone; if none does,
        the fault is the batch's and every running request fails."""
        culprits = []
        if len(seqs) > 1:
            logger.warning(
                "decode step of %d requests failed (%s: %s); stepping them one by one",
                len(seqs),
                type(error).__name__,
                error,
            )
            for seq in seqs:
                try:
                    self.runner.decode([seq], self._banned([seq.request]))
                except Exception as e:
                    logger.warning("decode of request %s failed: %s: %s", seq.request.rid, type(e).__name__, e)
                    culprits.append(seq)
                    self._fail_request(seq.request, e)
        if not culprits:
            logger.warning("decode step failed for the whole batch: %s: %s", type(error).__name__, error)
            self._fail_in_flight(error)
            return
        self._scheduler.release(culprits)


def create_engine(
    kind: str,
    model: PreTrainedModel,
    *,
    kv_cache_tokens: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
    cuda_graphs: bool = True,
    **kwargs,
):
    """The engine `kind` names (`engine_kind`)."""
    if engine_kind(kind, model.config, kwargs["device"]) == "dense":
        return GenerationEngine(model, **kwargs)
    if kv_cache_tokens is None:
        kv_cache_tokens = default_kv_cache_tokens(model, kwargs.get("max_running_requests", 64))
    return PagedGenerationEngine(
        model, kv_cache_tokens=kv_cache_tokens, block_size=block_size, cuda_graphs=cuda_graphs, **kwargs
    )


def engine_kind(kind: str, config, device) -> str:
    """ "paged" or "dense": `kind` itself, or for "auto" paged on CUDA where the
    model allows it, dense elsewhere (on CPU the dense engine measured faster:
    docs/design.md §6)."""
    if kind != "auto":
        return kind
    return "paged" if device.type == "cuda" and paged_supported(config) is None else "dense"


def default_kv_cache_tokens(model: PreTrainedModel, max_running_requests: int) -> int:
    """Every running request at up to 2048 tokens (capped by the model's
    positions); on CUDA at most half the free memory."""
    import torch

    from realrl.impl.generation.torch_server.model_runner import blocks_for_memory

    config = model.config.get_text_config(decoder=True)
    per_request = min(2048, getattr(config, "max_position_embeddings", None) or 2048)
    tokens = max_running_requests * per_request
    device = next(model.parameters()).device
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        tokens = min(tokens, blocks_for_memory(model, DEFAULT_BLOCK_SIZE, free // 2) * DEFAULT_BLOCK_SIZE)
    return tokens
