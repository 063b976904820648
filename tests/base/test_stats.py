"""StatsLogger: JSONL + TensorBoard, fresh versus resumed trials."""

from __future__ import annotations

import json
import os

from realrl.base.stats import StatsLogger


def steps_in(path: str) -> list[int]:
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


def test_fresh_trial_starts_anew_and_resume_drops_steps_after_the_checkpoint(tmp_path):
    log = StatsLogger(str(tmp_path))
    for step in range(1, 6):
        log.log(step, {"train/loss": 1.0 / step, "note": "x"})
    log.close()
    assert steps_in(log.path) == [1, 2, 3, 4, 5]
    assert os.listdir(tmp_path / "tensorboard")

    resumed = StatsLogger(str(tmp_path), resume_step=4)  # recovered at the step-4 checkpoint
    resumed.log(5, {"train/loss": 0.1})
    resumed.close()
    assert steps_in(log.path) == [1, 2, 3, 4, 5]
    assert json.loads(open(log.path).read().splitlines()[-1])["train/loss"] == 0.1

    fresh = StatsLogger(str(tmp_path))
    fresh.log(1, {"train/loss": 2.0})
    fresh.close()
    assert steps_in(log.path) == [1]
    assert len(os.listdir(tmp_path / "tensorboard")) == 1  # the old run's event files are gone
