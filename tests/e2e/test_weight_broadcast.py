"""`weights.transport=broadcast` in the default trial, whole (docs/design.md §8,
"Broadcast"), with `recover=auto`:

1. the trainer is killed in the middle of a version's buckets (a fault point
   the test arms once a checkpoint exists): the trial restarts from its
   checkpoint, whose version goes to the servers by disk, and a new epoch
   begins after it;
2. in the resumed trial, one of the two torch servers is killed in the middle
   of a version's buckets: the sender and the other member fail that group,
   the version reaches every server from disk, the killed server is
   restarted, loads the current version from disk and is a member again of a
   later group;
3. a server added with `add-server` is a member of a later group and gets
   versions over the wire.

The trial completes, and every step's server logprobs equal the trainer's
recomputation."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import psutil

from realrl.base import faults
from tests.e2e.test_faults import REPO, Trial
from tests.e2e.test_servers_come_and_go import gone

STEPS = 70  # after the resume: a restarted server (~20 s) and an added one still join groups before the end
CHECKPOINT_EVERY = 3
KILL_TRAINER = "test.kill_trainer"  # a marker the test creates: the trainer's fault point is armed after it


def test_versions_go_over_the_wire_through_a_trainer_crash_a_server_crash_and_an_added_server(
    tmp_path, kit_cache, monkeypatch
):
    monkeypatch.setenv(
        faults.FAULTS_ENV,
        ",".join(
            (
                f"weights.bucket_sent=kill;after={KILL_TRAINER}",
                # After the resume: the first bucket a server receives after some server put a
                # whole version in place kills it.
                "weights.version_in_place=fail_once;after=weights.bucket_sent",
                "weights.bucket_received=kill;after=weights.version_in_place",
            )
        ),
    )
    fault_dir = tmp_path / "faults"
    monkeypatch.setenv(faults.FAULTS_DIR_ENV, str(fault_dir))
    fault_dir.mkdir()
    trial = Trial(
        tmp_path,
        kit_cache,
        "wire",
        "weights.transport=broadcast",
        "weights.bucket_mb=1",  # the tiny model's version is several buckets: the kills land inside one
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
    assert faults.fired("weights.bucket_sent") and faults.fired("weights.bucket_received")
    summary = trial.summary()
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    assert [r["why"] for r in summary["restarts"]] == ["worker model_worker/0 failed"], summary["restarts"]
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    steps = [s for s in map(json.loads, open(summary["stats_path"])) if "train/actor_loss" in s]
    for s in steps:
        assert abs(s["train/behav_imp_weight_max"] - 1) <= 1e-4 and abs(s["train/behav_imp_weight_min"] - 1) <= 1e-4, s

    # 1. The resume: the checkpoint's version by disk, then the first epoch of the new launch.
    first, resumed = re.split(r"\d+ generation servers healthy", trial.log("gserver_manager-0"))[1:]
    assert re.search(r"weight group realrl-wire-e1: 2 servers", first), first[-3000:]
    epochs = re.findall(r"weight group realrl-wire-e(\d+): (\d+) servers", resumed)
    assert epochs[0] == ("1", "2"), resumed[-3000:]
    over_the_wire = [int(v) for v in re.findall(r"to weight version (\d+) \(broadcast\)", resumed)]
    assert over_the_wire and min(over_the_wire) > resumed_at, (resumed_at, over_the_wire)

    # 2. The server killed mid-version: that group failed (the sender saw it, or the manager's wait
    # for a member did first), the version reached the survivor from disk, the server came back.
    assert re.search(r"weight group realrl-wire-e1( failed|: \S+ did not get version)", resumed), resumed[-3000:]
    assert "restarting it (restart 1" in "".join(trial.log(f"generation_server-{i}") for i in range(3))

    # 3. Every server, the restarted and the added one too, got versions through the last group.
    last, members = epochs[-1]
    assert int(last) > 1 and members == "3", epochs
    servers = [trial.log(f"generation_server-{i}.server") for i in range(3)]
    assert all(f"weights updated from weight group realrl-wire-e{last}:" in log for log in servers), [
        log[-2000:] for log in servers
    ]
