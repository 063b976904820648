"""The Environment contract and its registry.

An environment is made per episode (`make_env(name, **args)`) and is async,
because rewards may come from slow verifiers, sandboxes or remote services:

    obs, info = await env.reset(options={"prompt": record})
    obs, reward, terminated, truncated, info = await env.step(action)

What `action` and `reward` are is up to the env and the agents that use it
(the math env takes a list of answer strings and returns a list of 0/1
rewards). Register a new kind with `register_environment("name", Class)`.
A class whose constructor takes `judge` gets the trial's judge model
(`judge.model.path`; docs/custom_tasks.md, "Rewards from a judge model").
"""

from __future__ import annotations

import abc
from typing import Any

from realrl.base.registry import Registry


class EnvironmentService(abc.ABC):
    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        return None, {}

    @abc.abstractmethod
    async def step(self, action: Any) -> tuple[Any, Any, bool, bool, dict]:
        """-> (observation, reward, terminated, truncated, info)"""

    async def close(self) -> None:
        pass


ENVIRONMENTS: Registry[EnvironmentService] = Registry("environment")


def register_environment(name: str, factory) -> None:
    ENVIRONMENTS.register(name, factory)


def make_env(name: str, **kwargs) -> EnvironmentService:
    """A new `name` environment. A `judge` argument that is the trial's judge
    settings (a dict, realrl/experiment/config.py `judge_settings`) arrives as
    the process's judge client factory (`client = await judge()`)."""
    if isinstance(kwargs.get("judge"), dict):
        from realrl.impl.judge import judge_access

        kwargs["judge"] = judge_access(kwargs["judge"])
    return ENVIRONMENTS.make(name, **kwargs)
