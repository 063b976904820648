"""Example plugin: a multi-turn agent and its environment, reversing short strings.

Importing this file registers, without touching realrl itself:

- environment `"reverse-string"`: `step(answers)` scores each answer 1.0 for
  the exact reversal, else 0.5 x (correct prefix length) / (target length),
  and says in `info["prefix"]` how many leading characters were right;
- agent `"reverse-string-agent"`: `group_size` first attempts in one request;
  every attempt that is not exact gets feedback naming how many characters were
  right ("2 right. Again:") and another try, all of a turn's retries in flight
  at once, up to `max_turns` attempts. Each answer is trained with the reward
  of its own score; a group whose first attempts all score the same is
  dropped when `drop_uniform_groups` (it carries no GRPO signal).

Use: `plugins=[examples/plugins/reverse_string/plugin.py]
rollout.agent.type=reverse-string-agent rollout.env.type=reverse-string`
(README.md next to this file). Only the public contracts in `realrl.api`.
"""

from __future__ import annotations

import asyncio

from realrl.api.agent_api import FULL_CREDIT, Agent, AgentSettings, register_agent
from realrl.api.env_api import EnvironmentService, register_environment
from realrl.api.trajectory import Trajectory


def correct_prefix(answer: str, target: str) -> int:
    n = 0
    while n < min(len(answer), len(target)) and answer[n] == target[n]:
        n += 1
    return n


class ReverseStringEnv(EnvironmentService):
    async def reset(self, seed=None, options=None):
        self.target = options["prompt"].answer
        return None, {}

    async def step(self, answers: list[str]):
        answers = [a.strip() for a in answers]
        prefix = [correct_prefix(a, self.target) for a in answers]
        scores = [1.0 if a == self.target else 0.5 * p / len(self.target) for a, p in zip(answers, prefix)]
        return None, scores, True, False, {"prefix": prefix}


class ReverseStringAgent(Agent):
    def __init__(self, settings: AgentSettings | None = None, max_turns: int = 2, drop_uniform_groups: bool = True):
        super().__init__(settings)
        self.max_turns = max_turns
        self.drop_uniform_groups = drop_uniform_groups

    async def collect_trajectory(self, prompt, env):
        await env.reset(options={"prompt": prompt})
        first = await self.generate(prompt.prompt_ids)
        attempts = [first.answer(i) for i in range(first.group_size)]  # the latest attempt of each chain
        results, scores = [], []
        for turn in range(self.max_turns):
            texts = [self.decode(a.output_ids[0]).split("\n", 1)[0] for a in attempts]
            _, turn_scores, _, _, info = await env.step(texts)
            results += attempts
            scores += turn_scores
            if turn == 0 and self.drop_uniform_groups and len(set(turn_scores)) == 1 and not self.settings.evaluating:
                return []
            retry = [(a, t, p) for a, t, s, p in zip(attempts, texts, turn_scores, info["prefix"]) if s < FULL_CREDIT]
            if not retry or turn + 1 == self.max_turns:
                break
            # Retries of one turn run concurrently: one request each, all in flight together.
            contexts = [
                list(a.prompt_ids) + self.tokenizer.encode(f"{t}\n{p} right. Again:", add_special_tokens=False)
                for a, t, p in retry
            ]
            attempts = await asyncio.gather(*(self.generate(c, n=1) for c in contexts))
        return [Trajectory.from_results(prompt, results, scores, self.settings.rewards(scores))]


register_environment("reverse-string", ReverseStringEnv)
register_agent("reverse-string-agent", ReverseStringAgent)
