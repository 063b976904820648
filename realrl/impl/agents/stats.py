"""Counters the built-in agents keep for the rollout worker's log."""

from __future__ import annotations

import collections

from realrl.api.agent_api import FULL_CREDIT


def env_numbers(info: dict | None) -> dict[str, float]:
    """The numbers in an environment's `info` (bools and other values left
    out). Agents sum them per episode into `Trajectory.metadata["env"]`; the
    trainer logs each step's sums as `env/<key>` in stats.jsonl."""
    return {
        str(k): float(v) for k, v in (info or {}).items() if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


class AgentStats:
    """Counters since the last `pop()`."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.n_episodes = self.n_rejected = 0
        self.n_answers = self.n_correct = 0  # every answer of every turn
        self.score_sum = 0.0
        self.n_chains = self.n_solved = 0  # multi-turn: dialogues, and those solved at some turn
        self.env: collections.Counter = collections.Counter()  # numeric `info` of env.step, summed

    def add_answers(self, scores: list[float], info: dict | None = None) -> None:
        self.n_answers += len(scores)
        self.n_correct += sum(s >= FULL_CREDIT for s in scores)
        self.score_sum += sum(scores)
        self.env.update(env_numbers(info))

    def add_episode(self, scores: list[float], info: dict | None = None) -> None:
        self.n_episodes += 1
        self.add_answers(scores, info)

    def pop(self) -> dict[str, float]:
        stats = {
            "n_episodes": float(self.n_episodes),
            "n_rejected": float(self.n_rejected),
            "n_answers": float(self.n_answers),
            "accuracy": self.n_correct / self.n_answers if self.n_answers else 0.0,
            "mean_score": self.score_sum / self.n_answers if self.n_answers else 0.0,
        }
        if self.n_chains:
            stats["solve_rate"] = self.n_solved / self.n_chains
        stats.update({f"env/{k}": float(v) for k, v in self.env.items()})
        self.reset()
        return stats
