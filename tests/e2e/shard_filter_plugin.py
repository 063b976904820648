"""A test plugin: the math agent, but rejecting 3 of every 4 groups that come
from rollout worker 2 (the one shard that feeds trainer rank 1 when 3 rollout
workers feed 2 ranks): trajectories then reach the ranks very unevenly."""

from __future__ import annotations

from realrl.api.agent_api import register_agent
from realrl.impl.agents.single_step import SingleStepAgent


class ShardFilterAgent(SingleStepAgent):
    async def collect_trajectory(self, prompt, env):
        trajectories = await super().collect_trajectory(prompt, env)
        if self.settings.evaluating:  # evaluation keeps every prompt (and has no rollout ids)
            return trajectories
        worker, _, position = prompt.metadata["rollout_id"].split(":")[:3]
        if worker == "2" and int(position) % 4 != 0:
            return []
        return trajectories


register_agent("shard-filter-agent", ShardFilterAgent)
