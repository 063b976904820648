"""Exactly once under chaos (docs/design.md §12): one trial, the default
workers as the user runs them, and deterministic fault points
(realrl/base/faults.py) that fire once each, in this order:

1. the trainer is SIGKILLed in the step right after a checkpoint (rollouts
   were running when it was taken) -> recover=auto resumes the trial;
2. the rollout worker is SIGKILLed once the first episode of its redo list
   finished -> the launcher starts it again, and it takes up the ledger;
3. the rollout worker is SIGKILLed after the trainer acknowledged an
   episode's trajectories and before its finish_rollout;
4. the manager answers 503 to /finish_rollout until the worker gives up.

The whole-trial ledger must hold: no `qid@epoch` trained twice, none
skipped, and produced = consumed + dropped + buffered exactly; the copies
that the kills made are dropped at the puller and counted."""

from __future__ import annotations

import json
import os

from realrl.base import faults
from tests.e2e.test_faults import Trial
from tests.e2e.test_recovery import assert_each_prompt_trained_once, small_dataset, trained_per_epoch

FAULTS = ",".join(
    [
        "model_worker.step_after_checkpoint=kill",
        "rollout_worker.redo_finished=kill",
        "rollout_worker.acknowledged=kill;after=rollout_worker.redo_finished",
        "gserver_manager.finish_rollout=fail:8;after=rollout_worker.acknowledged",
    ]
)


def test_kills_at_the_bad_moments_train_every_prompt_exactly_once(tmp_path, kit_cache, monkeypatch):
    model, (train, test), query_ids = small_dataset(kit_cache, tmp_path)
    steps, eta = 24, 2
    marks = tmp_path / "faults"
    marks.mkdir()
    monkeypatch.setenv(faults.FAULTS_ENV, FAULTS)  # the launcher passes its environment to every worker
    monkeypatch.setenv(faults.FAULTS_DIR_ENV, str(marks))
    trial = Trial(
        tmp_path,
        kit_cache,
        "chaos",
        f"model.path={model}",
        f"dataset.train_path={train}",
        f"dataset.test_path={test}",
        f"total_train_steps={steps}",
        f"rollout.max_head_offpolicyness={eta}",
        "recover=auto",
        "recover_retries=2",
        "saver.checkpoint_every_n_steps=4",
        "rollout.max_restarts=8",
    )
    try:
        assert trial.wait(timeout=540) == 0, trial.console()[-4000:]
    finally:
        trial.kill()
    console = trial.console()
    assert sorted(os.listdir(marks)) == sorted(f.split("=")[0] for f in FAULTS.split(",")), console[-3000:]
    assert "worker model_worker/0 failed; restarting the trial from its newest checkpoint" in console
    log = trial.log("rollout_worker-0")
    assert log.count("took over from a failed rollout worker 0") >= 3, log[-3000:]
    assert "finish_rollout is failing (fault point)" in log

    summary = trial.summary()
    assert summary["steps"] == steps and len(summary["restarts"]) == 1
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    # The kill after acknowledgement and the 503s left delivered rollouts unfinished: generated
    # again under the same ids, their second copies were dropped at the puller, not trained.
    assert t["duplicates_dropped"] >= 1 and t["foreign"] == 0 and t["dropped_invalid"] == 0, t
    assert summary["regenerated_after_resume"] > 0
    per_epoch, train_steps = trained_per_epoch(summary["stats_path"])
    assert [s["step"] for s in train_steps] == list(range(1, steps + 1))
    # Nothing is skipped: a prompt of a complete epoch is missing only if the ledger counts it
    # done without training (dropped as stale or rejected by the agent: never generated again).
    excused = t["dropped_stale"] + summary["rollouts"]["rejected"]
    complete = assert_each_prompt_trained_once(per_epoch, query_ids, excused)
    print(
        "chaos ledger:",
        json.dumps(
            {
                **{k: t[k] for k in ("produced", "consumed", "dropped", "buffered", "duplicates_dropped")},
                "regenerated_after_resume": summary["regenerated_after_resume"],
                "epochs_complete": complete,
                "rollout_worker_takeovers": log.count("took over from a failed rollout worker 0"),
            }
        ),
    )
