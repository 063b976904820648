"""The `"math-single-step"` agent: one prompt, one group of answers, one trajectory.

Per episode (`collect_trajectory`):

1. `env.reset(options={"prompt": record})`;
2. one `GenerationRequest(qid, prompt_ids, group_size, gconfig)` on obs_queue,
   then one `GenerationResult` (group_size answers) from act_queue;
3. the answers are decoded (special tokens skipped) and scored by `env.step`
   (0/1 per answer for the math env);
4. success-rate filter: with `accuracy` = fraction of answers correct, the group
   is dropped (returns `[]`, which uses no staleness budget) when
   `accuracy < success_rate_lb` or `accuracy > success_rate_ub`. lb=0, ub=1 keep
   everything; ub<1 drops all-correct groups, lb>0 drops all-wrong ones (groups
   whose answers all score the same give GRPO no signal);
5. one Trajectory with group_size sequences: input_ids = prompt + answer tokens
   (int32), behaviour logprobs / versions per answer token, version_start/end,
   no_eos, and `reward = shape_reward(correct, reward_bias, reward_scaling)`
   = ((correct - 0.5) * 2 - bias) * scaling, i.e. -1/+1 for wrong/right with
   bias 0 and scaling 1. metadata: `correct` (raw 0/1 per answer), `answers`
   (decoded text), `accuracy`, `solutions`.

Construct with `make_agent("math-single-step", tokenizer_path=..., group_size=8,
gconfig={"max_new_tokens": 16, "temperature": 1.0}, ...)`. The agent keeps no
per-episode state, so one instance serves any number of concurrent episodes;
`pop_stats()` returns (and resets) counters the rollout worker can log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import numpy as np

from realrl.api.agent_api import Agent, PromptRecord, register_agent
from realrl.api.env_api import EnvironmentService
from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest, GenerationResult
from realrl.api.trajectory import Trajectory
from realrl.impl.ppo_functional import shape_reward


# ---------------------------------------------------------------- helpers shared by the math agents


def load_tokenizer(tokenizer_path: str | None, tokenizer: Any = None) -> Any:
    """A tokenizer object given directly, or loaded from an HF directory."""
    if tokenizer is not None:
        return tokenizer
    if not tokenizer_path:
        raise ValueError("the agent needs a tokenizer: pass tokenizer_path (an HF directory) or tokenizer")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_path)


def as_gconfig(gconfig: GenerationHyperparameters | dict | None) -> GenerationHyperparameters:
    """Configs arrive as dicts (from YAML / Hydra) or as the dataclass."""
    if gconfig is None:
        gconfig = GenerationHyperparameters()
    elif isinstance(gconfig, dict):
        known = {f.name for f in dataclasses.fields(GenerationHyperparameters)}
        unknown = sorted(set(gconfig) - known)
        if unknown:
            raise ValueError(f"unknown gconfig keys {unknown}; known: {sorted(known)}")
        gconfig = GenerationHyperparameters(**{k: (list(v) if k == "stop_token_ids" else v) for k, v in gconfig.items()})
    gconfig.validate()
    return gconfig


def check_success_rate_bounds(lb: float, ub: float) -> None:
    if not 0.0 <= lb <= ub <= 1.0:
        raise ValueError(f"need 0 <= success_rate_lb <= success_rate_ub <= 1, got lb={lb}, ub={ub}")


async def generate(
    obs_queue: asyncio.Queue, act_queue: asyncio.Queue, request: GenerationRequest
) -> GenerationResult:
    """One round trip to the rollout worker: one request out, its result back.
    An agent has at most one request in flight, so results cannot be confused."""
    await obs_queue.put(request)
    result: GenerationResult = await act_queue.get()
    if result.qid != request.qid or result.group_size != request.group_size:
        raise RuntimeError(
            f"generation result for {result.qid!r} with {result.group_size} answers does not answer "
            f"request {request.qid!r} for {request.group_size}"
        )
    return result


def sequence_arrays(prompt_ids: list[int], result: GenerationResult, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """input_ids (prompt + answer i), its logprobs and versions, in schema dtypes."""
    input_ids = np.asarray(list(prompt_ids) + list(result.output_ids[i]), dtype=np.int32)
    logprobs = np.asarray(result.output_logprobs[i], dtype=np.float32)
    versions = np.asarray(result.output_versions[i], dtype=np.int32)
    return input_ids, logprobs, versions


class AgentStats:
    """Counters since the last `pop()` (the rollout worker logs them)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n_episodes = self.n_rejected = 0
        self.n_answers = self.n_correct = 0  # every answer of every turn
        self.n_chains = self.n_solved = 0  # multi-turn: dialogues, and those solved at some turn

    def pop(self) -> dict[str, float]:
        stats = {
            "n_episodes": float(self.n_episodes),
            "n_rejected": float(self.n_rejected),
            "n_answers": float(self.n_answers),
            "accuracy": self.n_correct / self.n_answers if self.n_answers else 0.0,
        }
        if self.n_chains:
            stats["solve_rate"] = self.n_solved / self.n_chains
        self.reset()
        return stats


# ---------------------------------------------------------------- the agent


class MathSingleStepAgent(Agent):
    def __init__(
        self,
        tokenizer_path: str | None = None,
        *,
        tokenizer: Any = None,
        group_size: int = 1,
        gconfig: GenerationHyperparameters | dict | None = None,
        reward_bias: float = 0.0,
        reward_scaling: float = 1.0,
        success_rate_lb: float = 0.0,
        success_rate_ub: float = 1.0,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        check_success_rate_bounds(success_rate_lb, success_rate_ub)
        self.tokenizer = load_tokenizer(tokenizer_path, tokenizer)
        self.group_size = group_size
        self.gconfig = as_gconfig(gconfig)
        self.reward_bias = reward_bias
        self.reward_scaling = reward_scaling
        self.success_rate_lb = success_rate_lb
        self.success_rate_ub = success_rate_ub
        self.stats = AgentStats()

    def pop_stats(self) -> dict[str, float]:
        return self.stats.pop()

    async def collect_trajectory(
        self,
        prompt: PromptRecord,
        env: EnvironmentService,
        obs_queue: asyncio.Queue,
        act_queue: asyncio.Queue,
    ) -> list[Trajectory]:
        await env.reset(options={"prompt": prompt})
        prompt_ids = list(prompt.prompt_ids)
        request = GenerationRequest(qid=prompt.qid, prompt_ids=prompt_ids, group_size=self.group_size,
                                    gconfig=self.gconfig)  # fmt: skip
        result = await generate(obs_queue, act_queue, request)

        answers = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in result.output_ids]
        _, scores, *_ = await env.step(answers)
        correct = [1.0 if s > 0.5 else 0.0 for s in scores]
        accuracy = sum(correct) / len(correct)

        self.stats.n_episodes += 1
        self.stats.n_answers += len(correct)
        self.stats.n_correct += int(sum(correct))
        if accuracy < self.success_rate_lb or accuracy > self.success_rate_ub:
            self.stats.n_rejected += 1
            return []

        input_ids, logprobs, versions = [], [], []
        for i in range(result.group_size):
            ids, lps, vers = sequence_arrays(prompt_ids, result, i)
            input_ids.append(ids)
            logprobs.append(lps)
            versions.append(vers)
        trajectory = Trajectory(
            qid=prompt.qid,
            task=prompt.task,
            birth_time=time.time(),
            input_ids=input_ids,
            prompt_len=[len(prompt_ids)] * result.group_size,
            logprobs=logprobs,
            versions=versions,
            version_start=[int(v) for v in result.version_start],
            version_end=[int(v) for v in result.version_end],
            reward=[float(shape_reward(c, self.reward_bias, self.reward_scaling)) for c in correct],
            no_eos=[bool(x) for x in result.no_eos],
            metadata={"correct": correct, "answers": answers, "accuracy": accuracy,
                      "solutions": list(prompt.solutions)},  # fmt: skip
        )
        return [trajectory.validate()]


register_agent("math-single-step", MathSingleStepAgent)
