"""A test plugin: the math agent, except that in a rollout worker (not while
the trainer evaluates) its first episode blocks the worker forever in a
plain `time.sleep`, as a deadlocked call would. For the hang watchdog test."""

from __future__ import annotations

import time

from realrl.api.agent_api import register_agent
from realrl.impl.agents.single_step import SingleStepAgent


def block_forever() -> None:
    while True:
        time.sleep(3600)


class BlockForeverAgent(SingleStepAgent):
    async def collect_trajectory(self, prompt, env):
        if self.settings.evaluating:
            return await super().collect_trajectory(prompt, env)
        block_forever()  # blocks the rollout worker's event loop: nothing of it runs any more


register_agent("block-forever-agent", BlockForeverAgent)
