"""A test plugin: the math agent, but rejecting 3 of every 4 groups that come
from rollout worker 2 (the one shard that feeds trainer rank 1 when 3 rollout
workers feed 2 ranks): trajectories then reach the ranks very unevenly.

With `SHARD_FILTER_GATE` set (a directory), rollout workers 0 and 1 hand in
no group before worker 2 has rejected one: the whole run can otherwise take
less than a second, and a worker 2 that starts late (two busy cores) would
see no prompt before training ends, and filter nothing."""

from __future__ import annotations

import asyncio
import os

from realrl.api.agent_api import register_agent
from realrl.impl.agents.single_step import SingleStepAgent

GATE = os.environ.get("SHARD_FILTER_GATE")


class ShardFilterAgent(SingleStepAgent):
    async def collect_trajectory(self, prompt, env):
        trajectories = await super().collect_trajectory(prompt, env)
        if self.settings.evaluating:  # evaluation keeps every prompt (and has no rollout ids)
            return trajectories
        worker, _, position = prompt.metadata["rollout_id"].split(":")[:3]
        if worker == "2" and int(position) % 4 != 0:
            if GATE:
                open(os.path.join(GATE, "worker-2-rejected"), "w").close()
            return []
        while GATE and worker != "2" and not os.path.exists(os.path.join(GATE, "worker-2-rejected")):
            await asyncio.sleep(0.05)
        return trajectories


register_agent("shard-filter-agent", ShardFilterAgent)
