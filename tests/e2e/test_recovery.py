"""Crash and resume: with recover=auto a trial whose trainer is SIGKILLed
restarts by itself from its newest checkpoint, trains every prompt of an epoch
exactly once across the crash (buffered trajectories kept, in-flight prompts
generated again once), and stays within the staleness bound; a damaged newest
checkpoint falls back to the previous one."""

from __future__ import annotations

import collections
import json
import os

from realrl.impl.tiny_model import TinyKitRecipe, build_tiny_kit
from realrl.system import checkpoints
from tests.e2e.test_faults import Trial

N_PROMPTS = 96  # one rollout worker: an epoch is 6 steps of 16


def small_dataset(kit_cache, tmp_path) -> tuple[str, list[str], list[str]]:
    kit = build_tiny_kit(kit_cache, TinyKitRecipe(seed=1))
    rows = [json.loads(line) for line in open(kit.train_path)][:N_PROMPTS]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return kit.model_path, [str(path), kit.test_path], [str(r["query_id"]) for r in rows]


def trained_per_epoch(stats_path: str) -> tuple[dict[int, list[str]], list[dict]]:
    steps = [json.loads(line) for line in open(stats_path)]
    steps = [s for s in steps if "batch/qids" in s]
    per_epoch: dict[int, list[str]] = collections.defaultdict(list)
    for s in steps:
        for qid in s["batch/qids"]:
            query_id, epoch = qid.rsplit("@", 1)
            per_epoch[int(epoch)].append(query_id)
    return per_epoch, steps


def assert_each_prompt_trained_once(per_epoch: dict[int, list[str]], query_ids, excused: int) -> list[int]:
    """No epoch trains a prompt twice, and every epoch that later epochs have
    fully overtaken (its complete epochs, returned) was trained whole, save at
    most `excused` prompts (those the ledger counts done without training:
    dropped as stale, rejected by the agent)."""
    for epoch, trained in per_epoch.items():
        assert len(trained) == len(set(trained)), f"epoch {epoch} trained a prompt twice"
    complete = [e for e in per_epoch if e + 2 in per_epoch]
    assert complete, per_epoch.keys()
    assert all(set(per_epoch[e]) <= set(query_ids) for e in complete)
    missing = {e: sorted(set(query_ids) - set(per_epoch[e])) for e in complete}
    assert sum(map(len, missing.values())) <= excused, f"gaps {missing}, only {excused} excused"
    return complete


def test_a_killed_trainer_restarts_by_itself_and_trains_each_prompt_once(tmp_path, kit_cache):
    model, (train, test), query_ids = small_dataset(kit_cache, tmp_path)
    steps, eta = 30, 2
    trial = Trial(
        tmp_path,
        kit_cache,
        "crash",
        f"model.path={model}",
        f"dataset.train_path={train}",
        f"dataset.test_path={test}",
        f"total_train_steps={steps}",
        f"rollout.max_head_offpolicyness={eta}",
        "recover=auto",
        "recover_retries=2",
        "saver.checkpoint_every_n_steps=4",
    )
    try:
        trial.wait_for_step(10)
        trial.workers()["model_worker-0"].kill()
        assert trial.wait(timeout=900) == 0, trial.console()[-4000:]
    finally:
        trial.kill()
    console = trial.console()
    assert (
        "\nrealrl: worker model_worker/0 failed; restarting the trial from its newest checkpoint "
        "(restart 1 of at most 2)" in console
    ), console[-3000:]
    summary = json.load(open(os.path.join(trial.log_dir, "summary.json")))
    assert summary["steps"] == steps and [r["why"] for r in summary["restarts"]] == ["worker model_worker/0 failed"]
    assert summary["max_staleness_trained"] <= eta
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t

    per_epoch, train_steps = trained_per_epoch(summary["stats_path"])
    assert [s["step"] for s in train_steps] == list(range(1, steps + 1))  # the resumed stats continue the checkpoint's
    assert all(s["staleness/max"] <= eta for s in train_steps)
    # A loaded machine can make rollouts stale after the resume (the ledger counts them done);
    # a quiet one drops none, and then every complete epoch is exactly the dataset.
    assert_each_prompt_trained_once(per_epoch, query_ids, excused=t["dropped_stale"])
    # The resume generated again what was in flight at the checkpoint (η = 2 keeps rollouts running
    # ahead of training, so there always is some): the path above was exercised, not skipped.
    assert summary["regenerated_after_resume"] > 0, summary


def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, kit_cache):
    model, (train, test), _ = small_dataset(kit_cache, tmp_path)
    common = [
        f"model.path={model}",
        f"dataset.train_path={train}",
        f"dataset.test_path={test}",
        "saver.checkpoint_every_n_steps=3",
        "eval.max_prompts=16",
    ]
    first = Trial(tmp_path, kit_cache, "damaged", *common, "total_train_steps=6")
    try:
        assert first.wait(timeout=600) == 0, first.console()[-3000:]
    finally:
        first.kill()
    root = os.path.join(tmp_path, "checkpoints", "async-ppo-tiny", "damaged")
    assert checkpoints.problem(os.path.join(root, "step6")) is None
    with open(os.path.join(root, "step6", "model_worker.pt"), "r+b") as f:  # flip a byte
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert "sha256" in checkpoints.problem(os.path.join(root, "step6"))

    resumed = Trial(tmp_path, kit_cache, "damaged", *common, "total_train_steps=8", "recover=auto")
    try:
        assert resumed.wait(timeout=600) == 0, resumed.console()[-3000:]
    finally:
        resumed.kill()
    log = open(os.path.join(resumed.log_dir, "master_worker-0.log")).read()
    assert "step6 is damaged (model_worker.pt does not match its sha256 in the manifest); falling back" in log, log[
        -3000:
    ]
    assert "recovered at step 3" in log
    summary = json.load(open(os.path.join(resumed.log_dir, "summary.json")))
    assert summary["steps"] == 8


def test_a_killed_rollout_worker_is_started_again_and_takes_over_its_shard(tmp_path, kit_cache):
    model, (train, test), query_ids = small_dataset(kit_cache, tmp_path)
    steps = 20
    trial = Trial(
        tmp_path,
        kit_cache,
        "rwkill",
        f"model.path={model}",
        f"dataset.train_path={train}",
        f"dataset.test_path={test}",
        f"total_train_steps={steps}",
    )
    try:
        trial.wait_for_step(5)
        trial.workers()["rollout_worker-0"].kill()
        assert trial.wait(timeout=900) == 0, trial.console()[-4000:]
    finally:
        trial.kill()
    console = trial.console()
    assert (
        "\nrealrl: worker rollout_worker/0 failed (signal SIGKILL); starting it again (2 restarts left)" in console
    ), console[-3000:]
    log = open(os.path.join(trial.log_dir, "rollout_worker-0.log")).read()
    assert "took over from a failed rollout worker 0" in log
    summary = json.load(open(os.path.join(trial.log_dir, "summary.json")))
    assert summary["steps"] == steps
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    per_epoch, _ = trained_per_epoch(summary["stats_path"])
    for epoch, trained in per_epoch.items():
        assert len(trained) == len(set(trained)), f"epoch {epoch} trained a prompt twice"
    complete = [e for e in per_epoch if e + 2 in per_epoch]
    for epoch in complete:
        assert sorted(per_epoch[epoch]) == sorted(query_ids), f"epoch {epoch} has gaps"
