"""Generation servers that come and go without stopping training
(docs/architecture.md), in the default trial run as the user runs it
(`training/main_async_ppo.py` in a subprocess):

- chaos: the torch server process of generation server 0 is SIGKILLed, then
  the whole GenerationServer worker 1, then the rollout worker: each server is
  restarted, loads the current weights and rejoins, the rollout worker is
  started again and takes over its shard; the trial completes its steps, accuracy rises, the
  trajectory accounting holds and nothing is left running;
- a server added mid-run with `python -m realrl add-server` serves requests
  within one weight version, and ends with the trial.

Each trial is held at a step by a `gate` fault point (realrl/base/faults.py)
until the test's events are done, so it is short and still running for them
however fast the steps are. The measured times (kill -> back in routing) are
printed (`pytest -s`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import psutil

from realrl.base import faults
from tests.e2e.test_faults import REPO, Trial

EXP = "async-ppo-tiny"


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def gate_step(monkeypatch, tmp_path, step: int) -> tuple[str, str]:
    """Arms a gate before training step `step` (the launcher passes the environment to
    every worker); returns (markers directory, gate name) for `faults.open_gate`."""
    marks, gate = tmp_path / "faults", f"master_worker.step_{step}"
    marks.mkdir()
    monkeypatch.setenv(faults.FAULTS_ENV, f"{gate}=gate")
    monkeypatch.setenv(faults.FAULTS_DIR_ENV, str(marks))
    return str(marks), gate


def check_trained_and_accounted(summary: dict, steps: int, eta: int) -> None:
    assert summary["steps"] == steps and summary["final_version"] == steps
    assert summary["max_staleness_trained"] <= eta
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t


def test_killed_server_and_server_worker_rejoin_and_training_completes(tmp_path, kit_cache, monkeypatch):
    # 40 steps learn (the default run's floor, benchmarks/learning_floors.json), judged on the whole
    # held-out split; the trial holds before its last step until the three kills and rejoins are done.
    steps, eta = 40, 2
    marks, gate = gate_step(monkeypatch, tmp_path, steps)
    trial = Trial(
        tmp_path,
        kit_cache,
        "chaos",
        "eval.max_prompts=0",
        "allocation_mode=torch.d2p1m1+d1p1m1",
        f"total_train_steps={steps}",
        f"rollout.max_head_offpolicyness={eta}",
    )
    timings = {}
    try:
        trial.wait_for_step(3)
        # 1. The torch server process of generation server 0.
        (server,) = trial.worker("generation_server-0").children()
        mark = len(trial.log("gserver_manager-0"))
        t0 = time.monotonic()
        server.kill()
        # out of routing by a health check, or as its worker unregistered it, whichever came first
        trial.wait_for_log("gserver_manager-0", r"generation server 0 at \S+ (is down|left routing)", mark)
        timings["server child: kill -> out of routing"] = time.monotonic() - t0
        rejoined = trial.wait_for_log(
            "gserver_manager-0",
            r"generation server 0 at \S+ rejoined routing at weight "
            r"version (\d+) after [\d.]+s \(trainer version (\d+)\)",
            mark,
        )
        timings["server child: kill -> back in routing"] = time.monotonic() - t0
        assert int(rejoined.group(1)) >= int(rejoined.group(2))  # on the current weights
        assert gone(server.pid)

        # 2. A whole GenerationServer worker: the launcher starts it again from its spec.
        worker = trial.worker("generation_server-1")
        (server1,) = worker.children()
        mark = len(trial.log("gserver_manager-0"))
        t0 = time.monotonic()
        worker.kill()
        rejoined = trial.wait_for_log(
            "gserver_manager-0",
            r"generation server 1 at \S+ rejoined routing at weight "
            r"version (\d+) after [\d.]+s \(trainer version (\d+)\)",
            mark,
        )
        timings["server worker: kill -> back in routing"] = time.monotonic() - t0
        assert int(rejoined.group(1)) >= int(rejoined.group(2))
        assert gone(worker.pid) and gone(server1.pid)

        # 3. A rollout worker: started again, it takes over its shard and its running rollouts.
        rollout = trial.worker("rollout_worker-0")
        mark = len(trial.log("rollout_worker-0"))
        t0 = time.monotonic()
        rollout.kill()
        trial.wait_for_log("rollout_worker-0", r"took over from a failed rollout worker 0", mark)
        timings["rollout worker: kill -> taken over"] = time.monotonic() - t0
        faults.open_gate(marks, gate)
        code = trial.wait(timeout=900)
    finally:
        trial.kill()
    print(f"\nchaos timings (s): {json.dumps({k: round(v, 1) for k, v in timings.items()})}")
    out = trial.console()
    assert code == 0, out[-3000:]
    assert "realrl: worker generation_server/1 failed (signal SIGKILL); starting it again" in out, out[-3000:]
    assert "realrl: worker rollout_worker/0 failed (signal SIGKILL); starting it again" in out, out[-3000:]
    summary = trial.summary()
    check_trained_and_accounted(summary, steps, eta)
    assert summary["final_eval_accuracy"] > summary["initial_eval_accuracy"], summary["eval_history"]  # it learned
    manager = trial.log("gserver_manager-0")
    assert len(re.findall(r"generation server 0 at \S+ (is down|left routing)", manager)) == 1, manager[-3000:]  # once
    assert "restarting it (restart 1" in trial.log("generation_server-0")
    # Every worker ended by itself (the autouse fixture also checks nothing is left running).
    for tag in (
        "master_worker-0",
        "model_worker-0",
        "generation_server-0",
        "generation_server-1",
        "gserver_manager-0",
        "rollout_worker-0",
    ):
        assert "exited with code 0" in trial.log(tag), tag


def test_server_added_mid_run_serves_within_one_weight_version(tmp_path, kit_cache, monkeypatch):
    # Held before step 20 until the new server is in routing: 10 steps after it for its requests.
    steps, eta = 30, 2
    marks, gate = gate_step(monkeypatch, tmp_path, 20)
    trial = Trial(
        tmp_path,
        kit_cache,
        "add",
        "eval.max_prompts=32",
        "allocation_mode=torch.d1p1m1+d1p1m1",
        f"total_train_steps={steps}",
        f"rollout.max_head_offpolicyness={eta}",
    )
    pid = None
    try:
        trial.wait_for_step(3)
        t0 = time.monotonic()
        added = subprocess.run(
            [sys.executable, "-m", "realrl", "add-server", EXP, "add", f"fileroot={tmp_path}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        pid = int(m.group(1)) if (m := re.search(r"\(pid (\d+)\)", added.stdout)) else None
        assert added.returncode == 0, added.stdout + added.stderr
        print(f"\nadd-server: in routing {time.monotonic() - t0:.1f}s after the command started")
        assert re.search(r"generation_server 1 at \S+ is in routing at weight version \d+", added.stdout), added.stdout
        faults.open_gate(marks, gate)
        code = trial.wait(timeout=900)
        # The added worker ends with the trial, by itself.
        deadline = time.monotonic() + 60
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert gone(pid)
    finally:
        trial.kill()
        if pid is not None and not gone(pid):
            psutil.Process(pid).kill()
    out = trial.console()
    assert code == 0, out[-3000:]
    check_trained_and_accounted(trial.summary(), steps, eta)
    manager = trial.log("gserver_manager-0")
    joined = re.search(
        r"generation server 1 at \S+ joined routing at weight version (\d+) after [\d.]+s "
        r"\(trainer version (\d+)\)",
        manager,
    )
    assert joined, manager[-3000:]
    version, trainer_version = int(joined.group(1)), int(joined.group(2))
    assert version == trainer_version  # the current weights
    first = re.search(
        r"generation server 1 at \S+ got its first request \(weight version (\d+), trainer version "
        r"(\d+)\)",
        manager,
    )
    assert first, manager[-3000:]
    # Served with the first rollouts admitted after it joined: the version it held at its first request.
    # The trainer, held at step 20, left the generation side at the staleness bound: no rollout is
    # admitted until the manager sees a newer version, and by then the trainer may have trained on
    # the up to eta + 1 batches already generated (the manager saw 19 -> 21 in one poll once, with
    # steps of ~0.2 s): its first request comes at most eta + 1 versions after it joined.
    assert version <= int(first.group(1)) <= version + eta + 1
    # (The trainer's version when the manager heard of it, a load report later, may be one more.)
    assert int(first.group(2)) <= version + eta + 2
    routed = re.search(r"requests routed per server \(index: requests\): 0: (\d+), 1: (\d+)", manager)
    assert routed and int(routed.group(2)) > 0, manager[-3000:]
    assert "exited with code 0" in trial.log("generation_server-1")
    assert os.path.exists(os.path.join(trial.log_dir, "generation_server-1.server.log"))
    assert os.path.exists(os.path.join(trial.log_dir, "specs", "generation_server-1.json"))
