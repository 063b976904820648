"""Example realrl plugin: teach a policy to reverse short strings.

Importing this file registers, without touching realrl itself:

- environment `"reverse-string"` (`ReverseStringEnv`): `reset` takes the
  PromptRecord, `step(answers: list[str])` returns one score in [0, 1] per
  answer: 1.0 for the exact reversal, otherwise a partial credit of
  0.5 * (length of the correct prefix) / (length of the target), so a policy
  that gets the first characters right already earns something;
- agent `"reverse-string-agent"` (`ReverseStringAgent`): one request for
  `group_size` answers, answers cut at the first newline, scores from the env
  mapped to rewards `((score - 0.5) * 2 - reward_bias) * reward_scaling` (in
  [-1, 1] by default), and groups whose answers all score the same are dropped
  (with group-normalised advantages, GRPO, they carry no learning signal; a
  dropped group uses no staleness budget), as are groups whose fraction of
  exact answers is outside [success_rate_lb, success_rate_ub].

Use it with `plugins=[examples/plugins/reverse_string/plugin.py]` (a file path)
or `plugins=[examples.plugins.reverse_string.plugin]` (a module path, run from
the repository root); see README.md next to this file. It uses only the public
contracts in `realrl.api`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np

from realrl.api.agent_api import Agent, PromptRecord, register_agent
from realrl.api.env_api import EnvironmentService, register_environment
from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest, GenerationResult
from realrl.api.trajectory import Trajectory


def reversal_score(answer: str, target: str) -> float:
    """1.0 for an exact match; else half credit scaled by the correct prefix."""
    answer = answer.strip()
    if answer == target:
        return 1.0
    prefix = 0
    for a, b in zip(answer, target):
        if a != b:
            break
        prefix += 1
    return 0.5 * prefix / max(len(target), 1)


class ReverseStringEnv(EnvironmentService):
    def __init__(self) -> None:
        self.target: str | None = None

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        record: PromptRecord = (options or {})["prompt"]
        self.target = record.solutions[0]
        return None, {}

    async def step(self, action: list[str]) -> tuple[Any, list[float], bool, bool, dict]:
        if self.target is None:
            raise RuntimeError("reverse-string env: step() before reset()")
        scores = [reversal_score(answer, self.target) for answer in action]
        return None, scores, True, False, {"n_exact": sum(s == 1.0 for s in scores)}


class ReverseStringAgent(Agent):
    """Accepts the keyword arguments the rollout worker gives every agent
    (tokenizer_path, group_size, gconfig, reward_bias/scaling, success_rate_lb/ub)
    plus its own `drop_uniform_groups`."""

    def __init__(
        self,
        tokenizer_path: str | None = None,
        *,
        tokenizer: Any = None,
        group_size: int = 4,
        gconfig: GenerationHyperparameters | dict | None = None,
        reward_bias: float = 0.0,
        reward_scaling: float = 1.0,
        success_rate_lb: float = 0.0,
        success_rate_ub: float = 1.0,
        drop_uniform_groups: bool = True,
    ):
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        self.tokenizer = tokenizer
        self.group_size = group_size
        if isinstance(gconfig, dict):
            gconfig = GenerationHyperparameters(**gconfig)
        self.gconfig = gconfig or GenerationHyperparameters(max_new_tokens=12)
        self.reward_bias = reward_bias
        self.reward_scaling = reward_scaling
        self.success_rate_lb = success_rate_lb
        self.success_rate_ub = success_rate_ub
        self.drop_uniform_groups = drop_uniform_groups

    async def collect_trajectory(
        self,
        prompt: PromptRecord,
        env: EnvironmentService,
        obs_queue: asyncio.Queue,
        act_queue: asyncio.Queue,
    ) -> list[Trajectory]:
        await env.reset(options={"prompt": prompt})
        prompt_ids = list(prompt.prompt_ids)
        await obs_queue.put(GenerationRequest(prompt.qid, prompt_ids, self.group_size, self.gconfig))
        result: GenerationResult = await act_queue.get()

        texts = [self.tokenizer.decode(ids, skip_special_tokens=True) for ids in result.output_ids]
        answers = [text.split("\n", 1)[0] for text in texts]
        _, scores, *_ = await env.step(answers)
        exact_rate = sum(s == 1.0 for s in scores) / len(scores)
        if exact_rate < self.success_rate_lb or exact_rate > self.success_rate_ub:
            return []
        if self.drop_uniform_groups and len(set(scores)) == 1:
            return []

        n = result.group_size
        return [
            Trajectory(
                qid=prompt.qid,
                task=prompt.task,
                birth_time=time.time(),
                input_ids=[np.asarray(prompt_ids + list(out), dtype=np.int32) for out in result.output_ids],
                prompt_len=[len(prompt_ids)] * n,
                logprobs=[np.asarray(lp, dtype=np.float32) for lp in result.output_logprobs],
                versions=[np.asarray(v, dtype=np.int32) for v in result.output_versions],
                version_start=list(result.version_start),
                version_end=list(result.version_end),
                reward=[((s - 0.5) * 2.0 - self.reward_bias) * self.reward_scaling for s in scores],
                no_eos=list(result.no_eos),
                metadata={"answers": answers, "scores": scores, "target": prompt.solutions[0]},
            ).validate()
        ]


register_environment("reverse-string", ReverseStringEnv)
register_agent("reverse-string-agent", ReverseStringAgent)
