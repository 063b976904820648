"""Evaluation's numbers (docs/custom_tasks.md, "How evaluation scores a prompt").

Per episode an `EpisodeOutcome`: its score (the best raw score among its
sequences), its `turns` (how many generation calls it made: a token agent's
`generate` calls, a function agent's chat calls) and `solved_at_turn`, the
call whose answer first had full credit (None: never). Which call answered a
sequence is `metadata["answer_turn"]` (filled by `Trajectory.from_results`
from `GenerationResult.turn`, which `Agent.generate` numbers); a sequence that
does not say (a chat agent's chain of turns, scored once for the whole
episode, or a trajectory an agent built by hand) counts as answered by the
episode's last call.

Per evaluation `summarize` gives sums that add up over data-parallel ranks
(`merge`), and `metrics` the numbers logged as `eval/*`: accuracy, mean
score, mean turns and, for k = 1 .. the most turns any episode made, the
share of episodes solved within k turns. No torch here: the master imports it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from realrl.api.agent_api import FULL_CREDIT
from realrl.api.trajectory import Trajectory


@dataclasses.dataclass
class EpisodeOutcome:
    """One evaluated prompt."""

    score: float = 0.0  # the best raw score among its sequences (0: none)
    text: str = ""  # the first sequence's completion, decoded (for the log's samples)
    turns: int = 0  # generation calls the episode made
    solved_at_turn: int | None = None  # the call whose answer first had full credit; None: never


def outcome(trajectories: list[Trajectory], turns: int, text: str = "") -> EpisodeOutcome:
    """The outcome of an episode that returned `trajectories` after `turns` generation calls."""
    best, solved = None, []
    for t in trajectories:
        answer_turn = t.metadata.get("answer_turn")
        if not (
            isinstance(answer_turn, list)
            and len(answer_turn) == len(t.scores)
            and all(isinstance(k, int) and not isinstance(k, bool) and k > 0 for k in answer_turn)
        ):
            answer_turn = [turns] * len(t.scores)  # not said: scored when the episode ended
        for score, k in zip(t.scores, answer_turn):
            best = score if best is None else max(best, score)
            if score >= FULL_CREDIT:
                solved.append(k)
    solved_at = max(1, min(solved)) if solved else None
    return EpisodeOutcome(0.0 if best is None else float(best), text, int(turns), solved_at)


def summarize(outcomes: Iterable[EpisodeOutcome]) -> dict:
    """Sums over episodes (they add up over ranks: `merge`). `solved_at[k-1]`
    counts the episodes first solved at turn k; `max_turns` is the most turns
    any episode made."""
    outcomes = list(outcomes)
    max_turns = max([max(o.turns, o.solved_at_turn or 0) for o in outcomes] or [0])
    solved_at = [0] * max_turns
    for o in outcomes:
        if o.solved_at_turn is not None:
            solved_at[o.solved_at_turn - 1] += 1
    return {
        "n": len(outcomes),
        "n_correct": sum(o.score >= FULL_CREDIT for o in outcomes),
        "score_sum": float(sum(o.score for o in outcomes)),
        "turns_sum": sum(o.turns for o in outcomes),
        "max_turns": max_turns,
        "solved_at": solved_at,
    }


def merge(parts: list[dict]) -> dict:
    """One summary of several ranks' summaries."""
    max_turns = max([p["max_turns"] for p in parts] or [0])
    solved_at = [0] * max_turns
    for p in parts:
        for k, count in enumerate(p["solved_at"]):
            solved_at[k] += count
    return {
        "n": sum(p["n"] for p in parts),
        "n_correct": sum(p["n_correct"] for p in parts),
        "score_sum": float(sum(p["score_sum"] for p in parts)),
        "turns_sum": sum(p["turns_sum"] for p in parts),
        "max_turns": max_turns,
        "solved_at": solved_at,
    }


def metrics(summary: dict) -> dict[str, float]:
    """`accuracy` (full credit), `score_mean`, `turns_mean` (generation calls
    per episode) and `solved_within_<k>` for k = 1 .. `max_turns`: the share of
    episodes whose answer had full credit by their k-th call. A single-turn
    agent gets turns_mean 1 and solved_within_1 = accuracy; at k = max_turns
    the share is the accuracy."""
    n = max(summary["n"], 1)
    stats = {
        "accuracy": summary["n_correct"] / n,
        "score_mean": summary["score_sum"] / n,
        "turns_mean": summary["turns_sum"] / n,
    }
    solved = 0
    for k, count in enumerate(summary["solved_at"], start=1):
        solved += count
        stats[f"solved_within_{k}"] = solved / n
    return stats


def samples(prompts: list, outcomes: list[EpisodeOutcome], n: int = 3) -> list[dict]:
    """The first `n` prompts' outcomes, for the log and `realrl eval`'s line."""
    return [
        {"prompt": p.prompt, "completion": o.text, "score": o.score, "turns": o.turns}
        for p, o in zip(prompts[:n], outcomes)
    ]
