"""Evaluation: the training agent and environment, greedy, on the trainer's own weights.

The contract (docs/custom_tasks.md, "How evaluation scores a prompt"):

- every test prompt runs one episode of the *same* agent and environment (or
  reward function) as training, with `settings.for_evaluation()`: one answer
  per request, greedy decoding, success-rate filters off. A multi-turn agent
  is evaluated as a multi-turn agent (its retries are part of the episode);
- the prompt's score is the highest raw task score (`Trajectory.scores`) among
  the sequences the episode returned: the best answer it reached (an agent
  that returns no trajectory or no scores scores 0 for that prompt);
- `accuracy` is the fraction of prompts whose score reaches full credit
  (>= 1); `score_mean` the mean score (partial credit counts here);
- `turns_mean` is the mean number of generation calls per episode (each
  `Agent.generate`, so each chat call of a function agent), and
  `solved_within_<k>` the share of episodes whose answer had full credit by
  their k-th call, for k = 1 .. the most calls any episode made
  (realrl/impl/eval_metrics.py).

`ModelGenerator` is the `Generator` these episodes use: requests from all
episodes in flight are batched into one left-padded `model.generate` call
(greedy), so evaluation costs a few batched forwards, not one per prompt.
Under FSDP every forward is a collective: the ranks agree each round (an
all-reduce) on whether anyone has a batch, and a rank with none runs a
one-token dummy so that every rank calls `generate` the same number of times.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from realrl.api.agent_api import Agent, PromptRecord
from realrl.api.env_api import EnvironmentService
from realrl.api.generation_api import GenerationRequest, GenerationResult
from realrl.base.logging import getLogger
from realrl.impl.eval_metrics import EpisodeOutcome, outcome
from realrl.impl.generation.eos import token_ids

logger = getLogger(__name__)


@dataclasses.dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


class ModelGenerator:
    """Greedy generation with an HF model in this process, batched across the
    episodes in flight. `all_ranks_busy(mine) -> (anyone has a batch, anyone
    still running)` syncs data-parallel ranks (None: this rank alone)."""

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device,
        version: int,
        batch_size: int = 256,
        all_ranks_busy: Callable[[bool, bool], tuple[bool, bool]] | None = None,
    ):
        self.model, self.tokenizer, self.device = model, tokenizer, device
        self.version = version
        self.batch_size = batch_size
        self.all_ranks_busy = all_ranks_busy
        # Every eos id, as the generation servers stop (generation_config.json, config.json, tokenizer).
        self.eos_ids = token_ids(getattr(tokenizer, "eos_token_id", None))
        for source in (getattr(model, "config", None), getattr(model, "generation_config", None)):
            self.eos_ids |= token_ids(getattr(source, "eos_token_id", None))
        self._pending: list[_Pending] = []
        self.n_batches = 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        future = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(request, future))
        return await future

    async def serve(self, episodes_done: Callable[[], bool]) -> None:
        """Runs batches until every episode (of every rank) has finished."""
        while True:
            await asyncio.sleep(0)  # let every runnable episode submit first
            batch, self._pending = self._pending[: self.batch_size], self._pending[self.batch_size :]
            have, running = bool(batch), not episodes_done()
            if self.all_ranks_busy is not None:
                have, running = self.all_ranks_busy(have, running)
            if have:
                self._run(batch)
            elif not running:
                return
            else:  # episodes are scoring or waiting on something else
                await asyncio.sleep(0.002)

    @torch.no_grad()
    def _run(self, batch: list[_Pending]) -> None:
        self.n_batches += 1
        tok = self.tokenizer
        prompts = [p.request.prompt_ids for p in batch] or [[tok.eos_token_id or 0]]  # an FSDP dummy
        max_new = max([p.request.gconfig.max_new_tokens for p in batch] or [1])
        width = max(len(ids) for ids in prompts)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        input_ids = torch.tensor([[pad] * (width - len(ids)) + list(ids) for ids in prompts], device=self.device)
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in prompts], device=self.device)
        out = self.model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
            synced_gpus=self.all_ranks_busy is not None,
        )
        for row, pending in zip(out[:, width:].tolist(), batch):
            request = pending.request
            stops = self.eos_ids | set(request.gconfig.stop_token_ids)
            ids, finished = [], False
            for t in row[: request.gconfig.max_new_tokens]:
                ids.append(t)
                if t in stops:
                    finished = True
                    break
            n = request.group_size  # greedy: every answer is the same one
            result = GenerationResult(
                qid=request.qid,
                prompt_ids=list(request.prompt_ids),
                output_ids=[ids] * n,
                output_logprobs=[[0.0] * len(ids)] * n,
                output_versions=[[self.version] * len(ids)] * n,
                no_eos=[not finished] * n,
                version_start=[self.version] * n,
                version_end=[self.version] * n,
            )
            if not pending.future.done():
                pending.future.set_result(result)


class _CountingGenerator:
    """One episode's view of the shared generator: counts the calls it makes."""

    def __init__(self, generator: ModelGenerator):
        self.generator, self.calls = generator, 0

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        self.calls += 1
        return await self.generator.generate(request)


async def evaluate_prompts(
    agent: Agent, make_env: Callable[[], EnvironmentService], prompts: list[PromptRecord], generator: ModelGenerator
) -> list[EpisodeOutcome]:
    """One outcome per prompt (score, first answer's text, turns, the turn it
    was solved at), running every episode at once."""
    done = 0

    async def episode(prompt: PromptRecord) -> EpisodeOutcome:
        nonlocal done
        env = make_env()
        counted = _CountingGenerator(generator)
        try:
            trajectories = await agent.run_episode(prompt, env, counted)
        finally:
            await env.close()
            done += 1
        text = agent.decode(trajectories[0].completion_ids(0).tolist()) if trajectories else ""
        return outcome(trajectories, counted.calls, text)

    tasks = [asyncio.create_task(episode(p), name=f"eval {p.qid}") for p in prompts]
    serve = asyncio.create_task(generator.serve(lambda: done == len(tasks)))
    episodes = asyncio.gather(*tasks)
    try:
        # A generator that fails leaves its episodes waiting: its error ends the evaluation.
        await asyncio.wait([episodes, serve], return_when=asyncio.FIRST_EXCEPTION)
        if serve.done() and not serve.cancelled() and serve.exception() is not None:
            raise serve.exception()
        results = await episodes
        await serve
    finally:
        for task in (*tasks, serve):
            task.cancel()
        await asyncio.gather(*tasks, serve, episodes, return_exceptions=True)
    return results
