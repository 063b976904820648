"""Whole-system runs off the single-trainer default: 2 data-parallel trainers
(gloo) fed by 3 rollout workers, synchronous (η = 0) and asynchronous (η = 2),
and with an agent filter that starves one rank's rollout workers. Each used to
hang (a per-rank share of the batch that uneven arrival never fills); now a
step takes its batch from what all ranks hold together."""

from __future__ import annotations

import os

import pytest

from tests.e2e.test_async_ppo import run

HERE = os.path.dirname(os.path.abspath(__file__))
TWO_TRAINERS = [
    "allocation_mode=torch.d1p1m1+d2p1m1",
    "rollout.n_workers=3",
    "eval.every_n_steps=0",
    "saver.save_final_model=false",
    "train.num_threads=1",
]


def check(summary: dict, stats: list[dict], steps: int, eta: int) -> None:
    assert summary["steps"] == steps and summary["final_version"] == steps
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    assert t["consumed"] == steps * 16
    assert summary["max_staleness_trained"] <= eta
    assert summary["dp_weights_identical"] is True
    train_steps = [s for s in stats if "train/actor_loss" in s]
    assert [s["step"] for s in train_steps] == list(range(1, steps + 1))
    assert all(s["staleness/max"] <= eta for s in train_steps)


@pytest.mark.parametrize("eta", [0, 2])
def test_two_trainers_three_rollout_workers(tmp_path, kit_cache, eta):
    steps = 6
    _, summary, stats = run(
        tmp_path,
        kit_cache,
        f"dp2-eta{eta}",
        f"total_train_steps={steps}",
        f"rollout.max_head_offpolicyness={eta}",
        *TWO_TRAINERS,
    )
    check(summary, stats, steps, eta)


def test_filter_that_starves_one_rank(tmp_path, kit_cache):
    steps = 4
    _, summary, stats = run(
        tmp_path,
        kit_cache,
        "dp2-filter",
        f"total_train_steps={steps}",
        "rollout.max_head_offpolicyness=1",
        f"plugins=[{os.path.join(HERE, 'shard_filter_plugin.py')}]",
        "rollout.agent.type=shard-filter-agent",
        *TWO_TRAINERS,
    )
    check(summary, stats, steps, 1)
    assert summary["trajectories"]["filtered_by_agent"] > 0
    # Rank 1's only rollout worker was filtered hard: trajectories moved to it.
    assert sum(s["batch/moved_between_ranks"] for s in stats if "train/actor_loss" in s) > 0
