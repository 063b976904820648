"""The Agent contract and its registry.

An agent turns one prompt into trajectories by talking to an environment and
to the generation service:

    trajectories = await agent.collect_trajectory(prompt, env, obs_queue, act_queue)

It puts `GenerationRequest`s on `obs_queue` and awaits `GenerationResult`s
from `act_queue` (the rollout worker serves them through the
PartialRolloutManager), steps `env` to get rewards, and returns a list of
`Trajectory` (DESIGN §5). An empty list rejects the prompt (e.g. the
success-rate filter dropped an all-correct group); rejected prompts use no
staleness budget. Register a new kind with `register_agent("name", Class)`.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
from typing import Any

from realrl.api.env_api import EnvironmentService
from realrl.api.trajectory import Trajectory
from realrl.base.registry import Registry


@dataclasses.dataclass
class PromptRecord:
    """One dataset entry as the rollout worker hands it to an agent."""

    qid: str
    prompt: str
    prompt_ids: list[int]
    solutions: list[str]  # accepted answers (the `answer` field becomes [answer])
    task: str = "math"
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)


class Agent(abc.ABC):
    @abc.abstractmethod
    async def collect_trajectory(
        self,
        prompt: PromptRecord,
        env: EnvironmentService,
        obs_queue: asyncio.Queue,
        act_queue: asyncio.Queue,
    ) -> list[Trajectory]: ...

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call (e.g. episodes, accuracy) for the
        rollout worker's log; agents without any return {}."""
        return {}


AGENTS: Registry[Agent] = Registry("agent")


def register_agent(name: str, factory) -> None:
    AGENTS.register(name, factory)


def make_agent(name: str, **kwargs) -> Agent:
    return AGENTS.make(name, **kwargs)
