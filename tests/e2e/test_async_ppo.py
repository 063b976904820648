"""Whole-system runs: every worker kind in its own process, through the launcher.

The tiny-model kit is built once per session (the `kit_cache` fixture of
tests/conftest.py; the first test to need it pays for the warm start) and
shared through `tiny_kit.cache_dir`.
"""

from __future__ import annotations

import json
import os

from benchmarks.learning_floors import RUNS, assert_reaches_floor, train, trial_name
from realrl.experiment.config import load_config
from realrl.experiment.run import run_experiment

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(tmp_path, kit_cache, trial: str, *overrides: str) -> tuple[int, dict, list[dict]]:
    cfg = load_config(
        [
            f"fileroot={tmp_path}",
            f"trial_name={trial}",
            f"tiny_kit.cache_dir={kit_cache}",
            "heartbeat_ttl=3",
            *overrides,
        ]
    )
    code, summary_path = run_experiment(cfg, timeout=900)
    assert code == 0, f"trial failed (exit {code}); logs in {tmp_path}/logs"
    with open(summary_path) as f:
        summary = json.load(f)
    with open(summary["stats_path"]) as f:
        stats = [json.loads(line) for line in f]
    return code, summary, stats


def test_async_grpo_learns_end_to_end(tmp_path, kit_cache):
    """The default task (grpo) with η = 2, seed 1: its learning floor is measured over
    seeds 1-5 (benchmarks/learning_floors.py, run "default"; the record:
    benchmarks/learning_floors.json and docs/benchmarks.md "Learning floors")."""
    eta, steps = 2, RUNS["default"].steps
    summary, stats = train("default", 1, str(tmp_path), kit_cache)
    # Learning: the final greedy accuracy on the held-out split reaches the measured floor.
    assert_reaches_floor(summary, "default", seed=1)
    assert summary["steps"] == steps and summary["final_version"] == steps
    # Staleness: nothing older than η was trained on, and rollouts really used
    # newer weights (the servers were updated while generation went on).
    assert summary["max_staleness_trained"] <= eta
    train_steps = [s for s in stats if "train/actor_loss" in s]
    assert len(train_steps) == steps
    assert max(s["rollout/version_start/max"] for s in train_steps) >= steps - eta - 1
    # The proximal logprobs come from the train forward (one minibatch): no step has an
    # `inference` request (a round trip of a few ms), train_step prepares the batch.
    assert max(s["time/inference_s"] for s in train_steps) < 5e-4
    # Accounting: every produced trajectory is consumed, dropped or still buffered.
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    assert t["consumed"] == steps * 16
    # Weights: the newest version is complete on disk, and the manager deleted
    # the old versions no server uses any more.
    weights = os.path.join(tmp_path, "weights", "async-ppo-tiny", trial_name("default", 1), "actor")
    left = sorted(int(v) for v in os.listdir(weights))
    assert left[-1] == steps and left[0] >= steps - eta - 1, left
    assert os.path.isfile(os.path.join(weights, str(steps), "config.json"))
    # COMPLETE: the master finished and every worker exited cleanly.
    logs = os.path.join(tmp_path, "logs", "async-ppo-tiny", trial_name("default", 1))
    for name in ("master_worker-0", "model_worker-0", "generation_server-0", "gserver_manager-0", "rollout_worker-0"):
        assert "exited with code 0" in open(os.path.join(logs, f"{name}.log")).read(), name
    # (The autouse no_orphan_processes fixture fails the test if any process is left.)


def test_custom_plugin_example_trains(tmp_path, kit_cache):
    """The README's plugin example: a new Environment and Agent, loaded from
    a file path in every process, trained for a few steps."""
    import subprocess
    import sys

    data = tmp_path / "reverse"
    subprocess.run(
        [sys.executable, os.path.join(REPO, "examples/plugins/reverse_string/make_data.py"), "--out-dir", str(data)],
        check=True,
    )
    _, summary, stats = run(
        tmp_path,
        kit_cache,
        "plugin",
        "total_train_steps=3",
        "eval.every_n_steps=0",
        f"plugins=[{os.path.join(REPO, 'examples/plugins/reverse_string/plugin.py')}]",
        "rollout.agent.type=reverse-string-agent",
        "rollout.env.type=reverse-string",
        "tiny_kit.warm_start_steps=50",
        f"dataset.train_path={data}/train.jsonl",
        f"dataset.test_path={data}/test.jsonl",
    )
    assert summary["steps"] == 3
    assert summary["trajectories"]["consumed"] == 3 * 16
    assert len([s for s in stats if "train/actor_loss" in s]) == 3


def test_recover_after_a_kill_keeps_the_bound_and_the_accounting(tmp_path, kit_cache, capfd):
    """Every process of a run is SIGKILLed (as by a machine going down) after
    its checkpoint at step 3; `recover=auto` resumes from the last checkpoint:
    step numbers go on without gap or repeat, admission over the
    resumed run stays within the staleness bound counted over the whole trial,
    and produced = consumed + dropped + buffered holds over the whole trial."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    eta, steps, trial = 1, 10, "recover"
    common = [
        f"fileroot={tmp_path}",
        f"trial_name={trial}",
        f"tiny_kit.cache_dir={kit_cache}",
        "heartbeat_ttl=3",
        "saver.checkpoint_every_n_steps=3",
        "eval.every_n_steps=0",
        "saver.save_final_model=false",
        f"rollout.max_head_offpolicyness={eta}",
        f"total_train_steps={steps}",
    ]
    logs = os.path.join(tmp_path, "logs", "async-ppo-tiny", trial)
    first = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "training", "main_async_ppo.py"), *common],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    trial_procs: list = []
    try:
        deadline = time.monotonic() + 600
        while True:  # until a step after the checkpoint was trained
            assert first.poll() is None, "the first run ended before it could be killed"
            assert time.monotonic() < deadline, "the first run never reached step 4"
            path = os.path.join(logs, "stats.jsonl")
            if os.path.exists(path) and any(
                json.loads(line).get("step", 0) >= 4 and "train/actor_loss" in line for line in open(path)
            ):
                break
            time.sleep(0.2)
        trial_procs = psutil.Process(first.pid).children(recursive=True)
        for p in [psutil.Process(first.pid), *trial_procs]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        first.wait()
        _, alive = psutil.wait_procs(trial_procs, timeout=60)
        assert not alive, alive
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
        for p in trial_procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
    from realrl.system import checkpoints

    newest = checkpoints.newest_valid(os.path.join(tmp_path, "checkpoints", "async-ppo-tiny", trial))
    with open(os.path.join(newest, "master_state.json")) as f:
        checkpoint = json.load(f)
    resumed_at = checkpoint["step"]
    assert resumed_at in (3, 6)  # (usually 3; 6 if the kill came late)

    capfd.readouterr()
    _, summary, stats = run(tmp_path, kit_cache, trial, "recover=auto", *common[4:])
    assert summary["steps"] == steps and summary["final_version"] == steps
    log = open(os.path.join(logs, "master_worker-0.log")).read()
    assert f"recovered at step {resumed_at} (weight version {resumed_at})" in log
    # The console shows this attempt only, not the killed one's log again.
    console = capfd.readouterr().out
    assert (
        f"recovered at step {resumed_at}" in console and f"step 1/{steps} " in log and f"step 1/{steps} " not in console
    )
    train_steps = [s["step"] for s in stats if "train/actor_loss" in s]
    assert train_steps == list(range(1, steps + 1))  # no gap, no repeat
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    assert t["consumed"] == steps * 16
    assert summary["max_staleness_trained"] <= eta
    # Admission: what the resumed run accepted, on top of what the trial had
    # consumed, dropped and buffered at its checkpoint, minus drops, never exceeds
    # (η + version + 1) batches (docs/design.md §7). A manager that forgot the first
    # run's consumption admits up to 3 batches too many here.
    r = summary["rollouts"]
    accepted_after_resume = r["admitted"] - (r["rejected"] - checkpoint["filtered"])  # one trajectory per episode
    # restored into the trainers: accepted before the crash (invalid ones never were: §12)
    before = checkpoint["consumed"] + checkpoint["dropped_stale"] + checkpoint["buffered"]
    assert before + accepted_after_resume - r["dropped"] <= (eta + steps + 1) * 16, (checkpoint, r)

    # A fresh run of the same trial (recover off) starts its stats anew.
    _, third, stats = run(tmp_path, kit_cache, trial, "total_train_steps=2", *common[4:-1])
    assert [s["step"] for s in stats if "train/actor_loss" in s] == [1, 2]
