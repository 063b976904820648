"""StatsLogger: JSONL + TensorBoard, fresh versus resumed trials."""

from __future__ import annotations

import json
import os
import struct

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


def _tensorboard_scalars(directory) -> dict[tuple[int, str], float]:
    """(step, tag) -> value of every scalar in the event files (TFRecords of Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    found = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = Event.FromString(data[at + 12 : at + 12 + length])  # after the length and its CRC
            at += 12 + length + 4
            for value in event.summary.value:
                found[(event.step, value.tag)] = value.simple_value
    return found


def test_every_numeric_stat_of_a_step_reaches_tensorboard(tmp_path):
    """One event per step carries all of its scalars (tags TensorBoard refuses are made legal);
    strings, booleans and non-finite numbers stay in the JSONL only."""
    log = StatsLogger(str(tmp_path))
    log.log(1, {"train/loss": 0.5, "perf/x y": 2, "note": "x", "flag": True, "bad": float("nan")})
    log.log(2, {"train/loss": 0.25})
    log.close()
    assert _tensorboard_scalars(tmp_path / "tensorboard") == {
        (1, "train/loss"): 0.5,
        (1, "perf/x_y"): 2.0,
        (2, "train/loss"): 0.25,
    }
