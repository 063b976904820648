"""`weights.transport=broadcast` in the default trial, whole (docs/design.md §8,
"Broadcast"): two torch servers get each version over a gloo group; one of
them is killed in the middle of a version's buckets (a fault point): the
sender and the other member fail that group, the version reaches every
server from disk, the killed server is restarted, loads the current version
from disk and is a member again of a later group; the trial completes, and
every step's server logprobs equal the trainer's recomputation."""

from __future__ import annotations

import json
import re

from realrl.base import faults
from tests.e2e.test_faults import Trial

STEPS = 60  # a restarted server takes ~20 s to be back (~20 steps here): the rest go through its new group


def test_two_servers_take_versions_over_the_wire_and_a_server_killed_mid_version_rejoins(
    tmp_path, kit_cache, monkeypatch
):
    # The first bucket a server receives after some server put a whole version in place kills it.
    monkeypatch.setenv(
        faults.FAULTS_ENV,
        "weights.version_in_place=fail_once,weights.bucket_received=kill;after=weights.version_in_place",
    )
    monkeypatch.setenv(faults.FAULTS_DIR_ENV, str(tmp_path / "faults"))
    (tmp_path / "faults").mkdir()
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
    )
    try:
        code = trial.wait(timeout=900)
    finally:
        trial.kill()
    out = trial.console()
    assert code == 0, out[-4000:]
    summary = trial.summary()
    assert summary["steps"] == STEPS and summary["final_version"] == STEPS
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    steps = [s for s in map(json.loads, open(summary["stats_path"])) if "train/actor_loss" in s]
    for s in steps:
        assert abs(s["train/behav_imp_weight_max"] - 1) <= 1e-4 and abs(s["train/behav_imp_weight_min"] - 1) <= 1e-4, s
    manager = trial.log("gserver_manager-0")
    epochs = re.findall(r"weight group realrl-wire-e(\d+): (\d+) servers", manager)
    assert epochs[0] == ("1", "2"), manager[-3000:]
    assert int(epochs[-1][0]) > 1 and epochs[-1][1] == "2", epochs  # both servers again, in a later group
    # The group failed at the kill (the sender saw it, or the manager's wait for a member did first);
    # that version reached the survivor from disk.
    assert re.search(r"weight group realrl-wire-e1( failed|: \S+ did not get version)", manager), manager[-3000:]
    assert faults.fired("weights.bucket_received")
    assert "restarting it (restart 1" in trial.log("generation_server-0") + trial.log("generation_server-1")
    servers = [trial.log(f"generation_server-{i}.server") for i in range(2)]
    last = f"weights updated from weight group realrl-wire-e{epochs[-1][0]}:"
    assert all(last in log for log in servers), servers  # the restarted server too, through the last group
    over_the_wire = re.findall(r"weights updated from weight group realrl-wire-e(\d+)", "".join(servers))
    assert len(over_the_wire) >= STEPS, over_the_wire
