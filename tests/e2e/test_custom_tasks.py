"""A user's own task, end to end through the launcher: a reward function with
partial credit in a file outside the package, and a multi-turn agent whose
retries run concurrently."""

from __future__ import annotations

import json

from realrl.impl.tiny_model import TinyKitRecipe, build_tiny_kit
from tests.e2e.test_async_ppo import run

# Partial credit: a number of the right length earns 0.25, the right last digit
# another 0.25; only the exact answer earns 1. `n_digits` is a field of the
# dataset row (the test adds it), so it reaches the function as a keyword.
REWARD_FILE = """
def reward(prompt, completion, answer, n_digits, **row):
    text = completion.strip()
    if text == answer:
        return 1.0
    right_length = len(text.lstrip("-")) == n_digits and text.lstrip("-").isdigit()
    return 0.25 * right_length + 0.25 * (text[-1:] == answer[-1:])
"""


def with_digit_counts(src: str, dst) -> None:
    with open(src) as f, open(dst, "w") as out:
        for line in f:
            row = json.loads(line)
            out.write(json.dumps({**row, "n_digits": len(row["answer"].lstrip("-"))}) + "\n")


def test_a_reward_function_with_partial_credit_trains(tmp_path, kit_cache):
    # The default kit's warm-started model and arithmetic data, with one more field per row.
    kit = build_tiny_kit(kit_cache, TinyKitRecipe(seed=1))
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "digits.py").write_text(REWARD_FILE)
    with_digit_counts(kit.train_path, tmp_path / "task" / "train.jsonl")
    with_digit_counts(kit.test_path, tmp_path / "task" / "test.jsonl")
    steps = 30
    _, summary, stats = run(
        tmp_path,
        kit_cache,
        "rewardfn",
        f"total_train_steps={steps}",
        "eval.every_n_steps=0",
        f"rollout.reward_fn={tmp_path / 'task' / 'digits.py'}:reward",
        f"model.path={kit.model_path}",
        f"dataset.train_path={tmp_path / 'task' / 'train.jsonl'}",
        f"dataset.test_path={tmp_path / 'task' / 'test.jsonl'}",
    )
    assert summary["steps"] == steps
    # Evaluation runs the same function: accuracy is full credit, the score counts partial credit.
    assert summary["final_eval_accuracy"] > summary["initial_eval_accuracy"], summary["eval_history"]
    last = summary["eval_history"][-1]
    assert last["score_mean"] >= last["accuracy"]
    train_steps = [s for s in stats if "rollout/score/mean" in s]
    assert len(train_steps) == steps
    # Partial credit reached the trainer as it was: scores strictly between 0 and 1.
    assert any(0 < s["rollout/score/mean"] < 1 and s["rollout/accuracy"] < s["rollout/score/mean"] for s in train_steps)
    samples = [
        json.loads(line)
        for line in open(tmp_path / "logs" / "async-ppo-tiny" / "rewardfn" / "samples" / "rollout-0.jsonl")
    ]
    assert any(0 < x < 1 for s in samples for x in s["scores"]), samples[:3]


def test_a_multi_turn_agent_retries_concurrently_and_trains(tmp_path, kit_cache):
    steps = 6
    _, summary, stats = run(
        tmp_path,
        kit_cache,
        "multiturn",
        f"total_train_steps={steps}",
        "eval.every_n_steps=0",
        "eval.max_prompts=64",
        "rollout.agent.type=math-multi-turn",
        "rollout.agent.args.num_turns=2",
    )  # a new key under agent args, no `+`
    assert summary["steps"] == steps and summary["trajectories"]["consumed"] == steps * 16
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    train_steps = [s for s in stats if "train/actor_loss" in s]
    assert len(train_steps) == steps
    # A group's retries were in flight together (up to one per chain).
    assert max(s["rollout/generate_in_flight/max"] for s in train_steps) > 1
    assert summary["initial_eval_accuracy"] is not None and summary["final_eval_accuracy"] is not None
    # Evaluation ran the two-turn agent: turns per episode and the share solved within 1 and 2 turns.
    for e in summary["eval_history"]:
        assert 1.0 <= e["turns_mean"] <= 2.0, e
        assert e["solved_within_1"] <= e["solved_within_2"] == e["accuracy"], e
        assert "solved_within_3" not in e
    evals = [s for s in stats if "eval/score" in s]
    assert len(evals) == len(summary["eval_history"]) and all("eval/turns_mean" in s for s in evals), evals
    assert all(s["eval/solved_within_2"] == s["eval/accuracy"] for s in evals), evals
