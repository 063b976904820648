"""Algorithm presets trained end to end (docs/algorithms.md): every worker in
its own process, through the launcher, each preset a short seeded run whose
final greedy accuracy must reach its learning floor.

Every preset but `grpo` (the default, whose run is tests/e2e/test_async_ppo.py's):
benchmarks/learning_floors.py's run of that name, seed 1, 30 steps of 16
prompts x 8 answers; the floors are measured over seeds 1-5 and recorded in
benchmarks/learning_floors.json (docs/benchmarks.md "Learning floors"). Each
run's stats show its preset's path through the system: `dapo` (dynamic
sampling in the agents, the overlong penalty, clip-higher), `cispo` and `gspo`
(their clip ranges), `ppo` (a critic); `reinforce_plus_plus` trains beside a
reference model. The maths of each is checked in tests/impl/test_presets.py.
And a task dynamic sampling rejects entirely stops with the reason.
"""

from __future__ import annotations

import math

import pytest

from benchmarks.learning_floors import RUNS, assert_reaches_floor, train
from realrl.experiment.config import algorithm_presets, load_config
from realrl.experiment.run import run_experiment

STEPS = 3

PRESENT = {  # stats a preset's steps must carry, beyond every preset's
    "dapo": ("train/clip_high_frac", "rollout/rejected_groups"),
    "cispo": ("train/clip_high_frac",),
    "gspo": ("train/clip_low_frac",),
    "ppo": ("train/critic_loss",),
}


def _run(tmp_path, kit_cache, trial: str, *overrides: str) -> tuple[int, str]:
    cfg = load_config(
        [
            f"fileroot={tmp_path}",
            f"trial_name={trial}",
            f"tiny_kit.cache_dir={kit_cache}",
            "heartbeat_ttl=3",
            f"total_train_steps={STEPS}",
            "ppo.train_batch_size=8",
            "eval.every_n_steps=0",
            "eval.max_prompts=16",
            *overrides,
        ]
    )
    return run_experiment(cfg, timeout=600)


@pytest.mark.parametrize("preset", [p for p in RUNS if p in algorithm_presets()])
def test_a_preset_learns_end_to_end_to_its_floor(tmp_path, kit_cache, preset):
    summary, stats = train(preset, 1, str(tmp_path), kit_cache)
    steps = [r for r in stats if "train/actor_loss" in r]
    assert summary["steps"] == RUNS[preset].steps and len(steps) == RUNS[preset].steps
    for record in steps:
        for key in ("train/behav_ess", "train/entropy", "train/approx_kl", "train/behav_capped_frac"):
            assert key in record and math.isfinite(record[key]), (key, record)
        for key in PRESENT.get(preset, ()):
            assert key in record and math.isfinite(record[key]), (key, record)
        assert 0 < record["train/behav_ess"] <= 1 + 1e-6
        assert record["train/entropy"] > 0
    if preset == "dapo":  # dynamic sampling: every trained group had a signal
        assert all(r["rollout/accuracy"] not in (0.0, 1.0) for r in steps)
    assert_reaches_floor(summary, preset, seed=1)


def test_a_task_dynamic_sampling_rejects_entirely_stops_with_the_reason(tmp_path, kit_cache):
    reward = tmp_path / "always_right.py"
    reward.write_text("def reward(prompt, completion, **row):\n    return 1.0\n")
    code, summary_path = _run(
        tmp_path,
        kit_cache,
        "too-easy",
        f"rollout.reward_fn={reward}:reward",
        "rollout.dynamic_sampling=true",
        "rollout.max_rejected_batches=1",
        "watchdog.timeout=0",
    )
    assert code != 0
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "logs").rglob("*.log"))
    assert "the agent rejected" in logs and "rollout.dynamic_sampling" in logs, logs[-3000:]
