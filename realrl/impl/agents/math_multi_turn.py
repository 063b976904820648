"""The `"math-multi-turn"` agent: wrong answers get feedback and another try.

Works with any environment that scores a list of answers (0/1 or partial
credit: an answer with full credit, score >= 1, solves its chain).

Group size and turns. `group_size` is the number of independent dialogues
("chains") per prompt:

- turn 0: one `generate(prompt_ids)` for `group_size` answers; answer i starts
  chain i (all chains share the prompt, so one request samples them all);
- turn t >= 1: every chain whose last answer was wrong continues on its own
  context `previous context + previous answer (trailing special tokens such as
  eos removed) + feedback` (default feedback "\\nWrong. Try again.\\nA:"), with
  one `generate(context, n=1)` per live chain, all chains' requests of a turn
  in flight at once;
- a chain stops at its first correct answer, after `num_turns` answers, or when
  its next context plus `gconfig.max_new_tokens` would exceed
  `max_context_tokens` (if set).

All answers of one turn are scored by one `env.step(list_of_answers)`.

Trajectory. One Trajectory per prompt holding every answer of every chain as a
sequence (chain-major: chain 0 turn 0, chain 0 turn 1, ..., chain 1 turn 0, ...).
Sequence = prompt part: the whole context the answer was generated from
(`prompt_len` = its length), completion: that turn's answer tokens, with their
behaviour logprobs / versions, and `scores` = the environment's raw score of
that answer. metadata per sequence: `chain`, `turn`, `credit` (discounted,
below), `answers` (decoded text).

Rewards (turn-level discount γ = `turn_level_discount`). For a chain whose first
correct answer is at turn k, the answer at turn t <= k gets the credit
`γ ** (k - t)`: 1 for the correct answer itself, γ for the wrong answer just
before it, γ² for the one before that, ... . Every answer of a chain that is
never correct gets its own score (partial credit, 0 for a plain wrong answer).
Each sequence's reward is `settings.reward(credit)` = ((credit - 0.5) * 2 - bias) * scaling,
so with bias 0 / scaling 1: correct answers +1, answers of unsolved chains -1,
and a wrong answer that the chain later fixed 2γ^(k-t) - 1 (γ=1: +1, the
dialogue as a whole succeeded; γ=0: -1, only the correct answer is rewarded).

Success-rate filter: over chains, `solve_rate` = fraction of chains solved at
some turn; the prompt is dropped (returns []) when solve_rate < success_rate_lb
or > success_rate_ub.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses

from realrl.api.agent_api import FULL_CREDIT, Agent, AgentSettings, PromptRecord, register_agent
from realrl.api.env_api import EnvironmentService
from realrl.api.generation_api import GenerationResult
from realrl.api.trajectory import Trajectory
from realrl.impl.agents.stats import AgentStats, env_numbers

DEFAULT_FEEDBACK = "\nWrong. Try again.\nA:"


@dataclasses.dataclass
class _Turn:
    """One answer of one chain (a group-size-1 result) and its score."""

    result: GenerationResult
    text: str = ""
    score: float = 0.0

    @property
    def solved(self) -> bool:
        return self.score >= FULL_CREDIT


class MathMultiTurnAgent(Agent):
    def __init__(
        self,
        settings: AgentSettings | None = None,
        num_turns: int = 3,
        turn_level_discount: float = 1.0,
        feedback: str = DEFAULT_FEEDBACK,
        max_context_tokens: int | None = None,
    ):
        super().__init__(settings)
        if num_turns < 1:
            raise ValueError(f"num_turns must be >= 1, got {num_turns}")
        if not 0.0 <= turn_level_discount <= 1.0:
            raise ValueError(f"turn_level_discount must be in [0, 1], got {turn_level_discount}")
        self.num_turns = num_turns
        self.turn_level_discount = turn_level_discount
        self.feedback_ids = list(self.tokenizer.encode(feedback, add_special_tokens=False))
        self.max_context_tokens = max_context_tokens
        self._special_ids = set(self.tokenizer.all_special_ids)
        self.stats = AgentStats()

    def pop_stats(self) -> dict[str, float]:
        return self.stats.pop()

    def _next_context(self, turn: _Turn) -> list[int]:
        output = list(turn.result.output_ids[0])
        while output and output[-1] in self._special_ids:  # drop eos (and pads) before the feedback
            output.pop()
        return list(turn.result.prompt_ids) + output + self.feedback_ids

    async def _score(self, env: EnvironmentService, turns: list[_Turn], env_sums: collections.Counter) -> None:
        for t in turns:
            t.text = self.decode(t.result.output_ids[0])
        _, scores, _, _, info = await env.step([t.text for t in turns])
        for t, s in zip(turns, scores):
            t.score = float(s)
        self.stats.add_answers([t.score for t in turns], info)
        env_sums.update(env_numbers(info))

    async def collect_trajectory(self, prompt: PromptRecord, env: EnvironmentService) -> list[Trajectory]:
        await env.reset(options={"prompt": prompt})
        first = await self.generate(prompt.prompt_ids)
        chains = [[_Turn(first.answer(i))] for i in range(first.group_size)]
        env_sums: collections.Counter = collections.Counter()  # numbers of env.step's info, over the episode
        await self._score(env, [chain[0] for chain in chains], env_sums)

        budget = self.settings.gconfig.max_new_tokens
        for _ in range(1, self.num_turns):
            live, contexts = [], []
            for chain in chains:
                context = self._next_context(chain[-1])
                if chain[-1].solved or (self.max_context_tokens and len(context) + budget > self.max_context_tokens):
                    continue
                live.append(chain)
                contexts.append(context)
            if not live:
                break
            # Every live chain retries at once: one request each, all in flight together.
            results = await asyncio.gather(*(self.generate(context, n=1) for context in contexts))
            for chain, result in zip(live, results):
                chain.append(_Turn(result))
            await self._score(env, [chain[-1] for chain in live], env_sums)

        solved = [chain[-1].solved for chain in chains]
        solve_rate = sum(solved) / len(chains)
        self.stats.n_episodes += 1
        self.stats.n_chains += len(chains)
        self.stats.n_solved += sum(solved)
        if not self.settings.keep_group(solve_rate, [float(s) for s in solved]):
            self.stats.n_rejected += 1
            return []

        turns, credits, meta = [], [], {"chain": [], "turn": [], "credit": [], "answers": []}
        for c, (chain, chain_solved) in enumerate(zip(chains, solved)):
            last = len(chain) - 1
            for t, turn in enumerate(chain):
                credit = self.turn_level_discount ** (last - t) if chain_solved else turn.score
                turns.append(turn)
                credits.append(credit)
                for key, value in (("chain", c), ("turn", t), ("credit", credit), ("answers", turn.text)):
                    meta[key].append(value)
        first_turn_accuracy = sum(chain[0].solved for chain in chains) / len(chains)
        meta.update(solve_rate=solve_rate, first_turn_accuracy=first_turn_accuracy, solutions=list(prompt.solutions))
        meta["env"] = dict(env_sums)
        return [
            Trajectory.from_results(
                prompt, [t.result for t in turns], [t.score for t in turns], self.settings.rewards(credits), meta
            )
        ]


register_agent("math-multi-turn", MathMultiTurnAgent)
