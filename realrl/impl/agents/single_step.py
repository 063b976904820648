"""The `"single-step"` agent: one prompt, one group of answers, one trajectory.

Works with any environment whose `step(answers)` returns one float score per
answer (the `"math"` environment's 0/1, a reward function's partial credit,
...). Per episode:

1. `env.reset(options={"prompt": record})`;
2. `self.generate(prompt_ids)`: `group_size` answers;
3. the answers are decoded (special tokens skipped) and scored by one
   `env.step(answers)`; the scores pass through unchanged (partial credit stays
   partial) into `trajectory.scores`, and `settings.reward(score)` =
   ((score - 0.5) * 2 - bias) * scaling into `trajectory.reward`;
4. success-rate filter: the fraction of answers with full credit (score >= 1)
   must lie in [success_rate_lb, success_rate_ub], else the group is dropped
   (returns `[]`, which uses no staleness budget): ub < 1 drops all-correct
   groups, lb > 0 all-wrong ones. A group whose answers all score the same is
   dropped too with `rollout.dynamic_sampling` (DAPO) or the agent's own
   argument `drop_uniform_groups`: its group-relative advantages are all 0.

Registered also as `"math-single-step"`, its name before it served any task.
"""

from __future__ import annotations

from realrl.api.agent_api import FULL_CREDIT, Agent, AgentSettings, PromptRecord, register_agent
from realrl.api.env_api import EnvironmentService
from realrl.api.trajectory import Trajectory
from realrl.impl.agents.stats import AgentStats, env_numbers


class SingleStepAgent(Agent):
    def __init__(self, settings: AgentSettings | None = None, drop_uniform_groups: bool = False):
        super().__init__(settings)
        self.drop_uniform_groups = drop_uniform_groups
        self.stats = AgentStats()

    def pop_stats(self) -> dict[str, float]:
        return self.stats.pop()

    async def collect_trajectory(self, prompt: PromptRecord, env: EnvironmentService) -> list[Trajectory]:
        await env.reset(options={"prompt": prompt})
        result = await self.generate(prompt.prompt_ids)
        answers = [self.decode(ids) for ids in result.output_ids]
        _, scores, _, _, info = await env.step(answers)
        scores = [float(s) for s in scores]
        accuracy = sum(s >= FULL_CREDIT for s in scores) / len(scores)
        self.stats.add_episode(scores, info)
        uniform = self.drop_uniform_groups and len(set(scores)) == 1 and not self.settings.evaluating
        if not self.settings.keep_group(accuracy, scores) or uniform:
            self.stats.n_rejected += 1
            return []
        metadata = {"answers": answers, "accuracy": accuracy, "solutions": list(prompt.solutions)}
        metadata["env"] = env_numbers(info)
        return [Trajectory.from_results(prompt, [result], scores, self.settings.rewards(scores), metadata)]


register_agent("single-step", SingleStepAgent)
register_agent("math-single-step", SingleStepAgent)
