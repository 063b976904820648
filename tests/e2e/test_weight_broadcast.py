"""`weights.transport=broadcast` in the default trial, whole (docs/design.md §8,
"Broadcast"), with `recover=auto`:

1. two torch servers get each version over a gloo group; the trainer is
   killed in the middle of a version's buckets (a fault point the test arms
   once a checkpoint exists): the trial restarts from its checkpoint, whose
   version goes to the servers by disk, and a new epoch begins after it;
2. in the resumed trial, a server added with `add-server` is a member of a
   later group and gets versions over the wire.

The trial completes, and every step's server logprobs equal the trainer's
recomputation. (A server killed mid-version, restarted and back in a later
group: tests/system/test_weight_broadcast.py, with the real manager and
server workers.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import psutil

from realrl.base import faults
from tests.e2e.test_faults import REPO, TRAINED_LOGPROB_GAP, Trial
from tests.e2e.test_servers_come_and_go import gone

STEPS = 45  # after the resume, an added server (in routing ~20 s later) still joins a group before the end
CHECKPOINT_EVERY = 3
KILL_TRAINER = "test.kill_trainer"  # a marker the test creates: the trainer's fault point is armed after it


def test_versions_go_over_the_wire_through_a_trainer_crash_and_to_an_added_server(tmp_path, kit_cache, monkeypatch):
    monkeypatch.setenv(faults.FAULTS_ENV, f"weights.bucket_sent=kill;after={KILL_TRAINER}")
    fault_dir = tmp_path / "faults"
    monkeypatch.setenv(faults.FAULTS_DIR_ENV, str(fault_dir))
    fault_dir.mkdir()
    trial = Trial(
        tmp_path,
        kit_cache,
        "wire",
        "weights.transport=broadcast",
        "weights.bucket_mb=1",  # the tiny model's version is several buckets: the kill lands inside one
        "allocation_mode=torch.d2p1m1+d1p1m1",
        f"total_train_steps={STEPS}",
        # η = 0: every trained token comes from the weights the step starts with, so the
        # importance weight exp(prox - behav) compares server and trainer logprobs directly.
        "rollout.max_head_offpolicyness=0",
        "recover=auto",
        "recover_retries=1",
        f"saver.checkpoint_every_n_steps={CHECKPOINT_EVERY}",
    )
    added_pid = None
    try:
        trial.wait_for_step(CHECKPOINT_EVERY + 1)
        (fault_dir / KILL_TRAINER).touch()  # the trainer dies at its next bucket on the wire
        trial.wait_for("the restart", lambda: "restarting the trial from its newest checkpoint" in trial.console())
        resumed_at = int(trial.wait_for_log("master_worker-0", r"recovered at step (\d+)").group(1))
        trial.wait_for_step(resumed_at + 2)
        added = subprocess.run(
            [sys.executable, "-m", "realrl", "add-server", "async-ppo-tiny", "wire", f"fileroot={tmp_path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        added_pid = int(m.group(1)) if (m := re.search(r"\(pid (\d+)\)", added.stdout)) else None
        assert added.returncode == 0, added.stdout + added.stderr
        code = trial.wait(timeout=900)
        deadline = time.monotonic() + 60  # the added worker ends with the trial, by itself
        while not gone(added_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone(added_pid)
    finally:
        trial.kill()
        if added_pid is not None and not gone(added_pid):
            added_worker = psutil.Process(added_pid)
            for p in [*added_worker.children(recursive=True), added_worker]:
                p.kill()
    out = trial.console()
    assert code == 0, out[-4000:]
    assert faults.fired("weights.bucket_sent")
    summary = trial.summary()
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    assert [r["why"] for r in summary["restarts"]] == ["worker model_worker/0 failed"], summary["restarts"]
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    steps = [s for s in map(json.loads, open(summary["stats_path"])) if "train/actor_loss" in s]
    for s in steps:
        assert max(s["train/behav_imp_weight_max"] - 1, 1 - s["train/behav_imp_weight_min"]) <= TRAINED_LOGPROB_GAP, s

    # 1. The resume: the checkpoint's version by disk, then the first epoch of the new launch.
    first, resumed = re.split(r"\d+ generation servers healthy", trial.log("gserver_manager-0"))[1:]
    assert re.search(r"weight group realrl-wire-e1: 2 servers", first), first[-3000:]
    epochs = re.findall(r"weight group realrl-wire-e(\d+): (\d+) servers", resumed)
    assert epochs[0] == ("1", "2"), resumed[-3000:]
    over_the_wire = [int(v) for v in re.findall(r"to weight version (\d+) \(broadcast\)", resumed)]
    assert over_the_wire and min(over_the_wire) > resumed_at, (resumed_at, over_the_wire)

    # 2. Every server, the added one too, got versions through the last group.
    last, members = epochs[-1]
    assert int(last) > 1 and members == "3", epochs
    servers = [trial.log(f"generation_server-{i}.server") for i in range(3)]
    assert all(f"weights updated from weight group realrl-wire-e{last}:" in log for log in servers), [
        log[-2000:] for log in servers
    ]
