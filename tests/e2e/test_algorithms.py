"""Algorithm presets trained end to end (docs/algorithms.md): every worker in
its own process, through the launcher, a few steps each.

One preset per distinct path through the system (the rest differ only in
the trainer's maths, which tests/impl/test_algorithms.py checks): `dapo`
(dynamic sampling in the agents, the overlong penalty, clip-higher),
`reinforce_plus_plus` (a reference model for its KL in the reward, batch
whitening) and `gspo` (the sequence-level loss, seq-mean aggregation). And a
task dynamic sampling rejects entirely stops with the reason.
"""

from __future__ import annotations

import json
import math

import pytest

from realrl.experiment.config import load_config
from realrl.experiment.run import run_experiment

STEPS = 3


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


@pytest.mark.parametrize(
    "preset, present",
    [
        ("dapo", ("train/clip_high_frac", "rollout/rejected_groups")),
        ("reinforce_plus_plus", ("train/behav_ess",)),
        ("gspo", ("train/clip_low_frac",)),
    ],
)
def test_a_preset_trains_end_to_end_with_its_stats(tmp_path, kit_cache, preset, present):
    code, summary_path = _run(tmp_path, kit_cache, preset, f"algorithm={preset}")
    assert code == 0, f"trial failed (exit {code}); logs in {tmp_path}/logs"
    with open(summary_path) as f:
        summary = json.load(f)
    with open(summary["stats_path"]) as f:
        steps = [r for r in map(json.loads, f) if "train/actor_loss" in r]
    assert summary["steps"] == STEPS and len(steps) == STEPS
    for record in steps:
        for key in ("train/behav_ess", "train/entropy", "train/approx_kl", "train/behav_capped_frac", *present):
            assert key in record and math.isfinite(record[key]), (key, record)
        assert 0 < record["train/behav_ess"] <= 1 + 1e-6
        assert record["train/entropy"] > 0
    if preset == "dapo":  # dynamic sampling: every trained group had a signal
        assert all(r["rollout/accuracy"] not in (0.0, 1.0) for r in steps)


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
