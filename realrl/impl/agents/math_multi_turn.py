"""The `"math-multi-turn"` agent: wrong answers get feedback and another try.

Group size and turns. `group_size` is the number of independent dialogues
("chains") per prompt:

- turn 0: one `GenerationRequest(qid, prompt_ids, group_size)`; answer i starts
  chain i (all chains share the prompt, so one request samples them all);
- turn t >= 1: every chain whose last answer was wrong continues on its own
  context `previous context + previous answer (trailing special tokens such as
  eos removed) + feedback` (default feedback "\\nWrong. Try again.\\nA:"), with
  one `GenerationRequest(qid, context, group_size=1)` per live chain, one at a
  time (the agent never has two requests in flight, so each result answers the
  request before it);
- a chain stops at its first correct answer, after `num_turns` answers, or when
  its next context plus `gconfig.max_new_tokens` would exceed
  `max_context_tokens` (if set).

All answers of one turn are scored by one `env.step(list_of_answers)`.

Trajectory. One Trajectory per prompt holding every answer of every chain as a
sequence (chain-major: chain 0 turn 0, chain 0 turn 1, ..., chain 1 turn 0, ...).
Sequence = prompt part: the whole context the answer was generated from
(`prompt_len` = its length), completion: that turn's answer tokens, with their
behaviour logprobs / versions. metadata per sequence: `chain`, `turn`,
`correct` (raw 0/1), `score` (discounted, below), `answers` (decoded text).

Rewards (turn-level discount γ = `turn_level_discount`). For a chain whose first
correct answer is at turn k, the answer at turn t <= k gets the score
`γ ** (k - t)`: 1 for the correct answer itself, γ for the wrong answer just
before it, γ² for the one before that, ... . Every answer of a chain that is
never correct scores 0. Each sequence's reward is
`shape_reward(score, reward_bias, reward_scaling)` = ((score - 0.5) * 2 - bias) * scaling,
so with bias 0 / scaling 1: correct answers +1, answers of unsolved chains -1,
and a wrong answer that the chain later fixed 2γ^(k-t) - 1 (γ=1: +1, the
dialogue as a whole succeeded; γ=0: -1, only the correct answer is rewarded).

Success-rate filter: over chains, `solve_rate` = fraction of chains solved at
some turn; the prompt is dropped (returns []) when solve_rate < success_rate_lb
or > success_rate_ub.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from realrl.api.agent_api import Agent, PromptRecord, register_agent
from realrl.api.env_api import EnvironmentService
from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest, GenerationResult
from realrl.api.trajectory import Trajectory
from realrl.impl.agents.math_single_step import (
    AgentStats,
    as_gconfig,
    check_success_rate_bounds,
    generate,
    load_tokenizer,
    sequence_arrays,
)
from realrl.impl.ppo_functional import shape_reward

DEFAULT_FEEDBACK = "\nWrong. Try again.\nA:"


@dataclasses.dataclass
class _Answer:
    """One turn of one chain: the context it saw and the answer it got."""

    context_ids: list[int]
    result: GenerationResult
    index: int  # which answer of `result`
    text: str = ""
    correct: float = 0.0

    @property
    def output_ids(self) -> list[int]:
        return list(self.result.output_ids[self.index])


class MathMultiTurnAgent(Agent):
    def __init__(
        self,
        tokenizer_path: str | None = None,
        *,
        tokenizer: Any = None,
        group_size: int = 1,
        num_turns: int = 3,
        turn_level_discount: float = 1.0,
        feedback: str = DEFAULT_FEEDBACK,
        max_context_tokens: int | None = None,
        gconfig: GenerationHyperparameters | dict | None = None,
        reward_bias: float = 0.0,
        reward_scaling: float = 1.0,
        success_rate_lb: float = 0.0,
        success_rate_ub: float = 1.0,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        if num_turns < 1:
            raise ValueError(f"num_turns must be >= 1, got {num_turns}")
        if not 0.0 <= turn_level_discount <= 1.0:
            raise ValueError(f"turn_level_discount must be in [0, 1], got {turn_level_discount}")
        check_success_rate_bounds(success_rate_lb, success_rate_ub)
        self.tokenizer = load_tokenizer(tokenizer_path, tokenizer)
        self.group_size = group_size
        self.num_turns = num_turns
        self.turn_level_discount = turn_level_discount
        self.feedback = feedback
        self.feedback_ids = list(self.tokenizer.encode(feedback, add_special_tokens=False))
        self.max_context_tokens = max_context_tokens
        self.gconfig = as_gconfig(gconfig)
        self.reward_bias = reward_bias
        self.reward_scaling = reward_scaling
        self.success_rate_lb = success_rate_lb
        self.success_rate_ub = success_rate_ub
        self._special_ids = set(self.tokenizer.all_special_ids)
        self.stats = AgentStats()

    def pop_stats(self) -> dict[str, float]:
        return self.stats.pop()

    def _next_context(self, answer: _Answer) -> list[int]:
        output = answer.output_ids
        while output and output[-1] in self._special_ids:  # drop eos (and pads) before the feedback
            output.pop()
        return answer.context_ids + output + self.feedback_ids

    async def _score(self, env: EnvironmentService, answers: list[_Answer]) -> None:
        for a in answers:
            a.text = self.tokenizer.decode(a.output_ids, skip_special_tokens=True)
        _, scores, *_ = await env.step([a.text for a in answers])
        for a, s in zip(answers, scores):
            a.correct = 1.0 if s > 0.5 else 0.0

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
        first = await generate(obs_queue, act_queue, request)
        chains = [[_Answer(prompt_ids, first, i)] for i in range(self.group_size)]
        await self._score(env, [chain[0] for chain in chains])

        for _ in range(1, self.num_turns):
            new_answers = []
            for chain in chains:
                if chain[-1].correct:
                    continue
                context = self._next_context(chain[-1])
                if self.max_context_tokens and len(context) + self.gconfig.max_new_tokens > self.max_context_tokens:
                    continue
                request = GenerationRequest(qid=prompt.qid, prompt_ids=context, group_size=1, gconfig=self.gconfig)
                chain.append(_Answer(context, await generate(obs_queue, act_queue, request), 0))
                new_answers.append(chain[-1])
            if not new_answers:
                break
            await self._score(env, new_answers)

        solved = [chain[-1].correct > 0.5 for chain in chains]
        solve_rate = sum(solved) / len(chains)
        all_answers = [a for chain in chains for a in chain]
        self.stats.n_episodes += 1
        self.stats.n_chains += len(chains)
        self.stats.n_solved += sum(solved)
        self.stats.n_answers += len(all_answers)
        self.stats.n_correct += int(sum(a.correct for a in all_answers))
        if solve_rate < self.success_rate_lb or solve_rate > self.success_rate_ub:
            self.stats.n_rejected += 1
            return []

        seqs: dict[str, list] = {k: [] for k in ("input_ids", "prompt_len", "logprobs", "versions", "version_start",
                                                 "version_end", "reward", "no_eos")}  # fmt: skip
        meta: dict[str, list] = {k: [] for k in ("chain", "turn", "correct", "score", "answers")}
        for c, (chain, chain_solved) in enumerate(zip(chains, solved)):
            last = len(chain) - 1
            for t, answer in enumerate(chain):
                score = self.turn_level_discount ** (last - t) if chain_solved else 0.0
                ids, lps, vers = sequence_arrays(answer.context_ids, answer.result, answer.index)
                seqs["input_ids"].append(ids)
                seqs["prompt_len"].append(len(answer.context_ids))
                seqs["logprobs"].append(lps)
                seqs["versions"].append(vers)
                seqs["version_start"].append(int(answer.result.version_start[answer.index]))
                seqs["version_end"].append(int(answer.result.version_end[answer.index]))
                seqs["reward"].append(float(shape_reward(score, self.reward_bias, self.reward_scaling)))
                seqs["no_eos"].append(bool(answer.result.no_eos[answer.index]))
                meta["chain"].append(c)
                meta["turn"].append(t)
                meta["correct"].append(answer.correct)
                meta["score"].append(float(score))
                meta["answers"].append(answer.text)
        first_turn_accuracy = sum(chain[0].correct for chain in chains) / len(chains)
        trajectory = Trajectory(
            qid=prompt.qid,
            task=prompt.task,
            birth_time=time.time(),
            **seqs,
            metadata={**meta, "solve_rate": solve_rate, "first_turn_accuracy": first_turn_accuracy,
                      "solutions": list(prompt.solutions)},  # fmt: skip
        )
        return [trajectory.validate()]


register_agent("math-multi-turn", MathMultiTurnAgent)
