"""The local launcher with real worker processes and a real private etcd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from realrl.base.name_resolve import NameResolveConfig
from realrl.launcher.local import LocalLauncher, WorkerGroup

W = "tests.launcher.workers_for_tests"


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def spawned_pids(log_dir: str) -> list[int]:
    return [int(open(os.path.join(log_dir, f)).read()) for f in os.listdir(log_dir) if f.startswith("spawned-")]


def test_tiny_experiment_runs_to_complete(tmp_path):
    launcher = LocalLauncher("launchtest", "complete", str(tmp_path), NameResolveConfig(type="etcd3"), heartbeat_ttl=2)
    groups = [
        WorkerGroup(f"{W}:CountingWorker", 3, {"polls": 30}),
        WorkerGroup(f"{W}:AsyncCountingWorker", 2),
        WorkerGroup(f"{W}:SpawningWorker", 1),
    ]
    code = launcher.run(groups, timeout=120)
    assert code == 0
    pids = launcher.worker_pids + spawned_pids(launcher.log_dir)
    assert len(pids) == 7 and not any(alive(p) for p in pids)
    assert launcher._etcd_supervisor.poll() is not None  # private etcd stopped
    for kind, n in [("CountingWorker", 3), ("AsyncCountingWorker", 2), ("SpawningWorker", 1)]:
        for i in range(n):
            log = open(launcher.log_path(kind, i)).read()
            assert "exiting: experiment status COMPLETE" in log, log[-2000:]
            assert "exited with code 0" in log


def test_failing_worker_stops_trial_and_shows_its_traceback(tmp_path, capfd):
    launcher = LocalLauncher("launchtest", "failing", str(tmp_path), NameResolveConfig(type="etcd3"), heartbeat_ttl=2)
    groups = [
        WorkerGroup(f"{W}:CountingWorker", 3, {"fail_index": 2, "fail_at": 20}),
        WorkerGroup(f"{W}:SpawningWorker", 2),
    ]
    t0 = time.monotonic()
    code = launcher.run(groups, timeout=120)
    elapsed = time.monotonic() - t0
    err = capfd.readouterr().err
    assert code == 1
    assert launcher.failed_worker == "CountingWorker/2"
    assert "worker CountingWorker/2 failed" in err
    assert "ValueError: boom from CountingWorker/2 at poll 20" in err
    assert "in _poll" in err  # the remote traceback, not just the message
    pids = launcher.worker_pids + spawned_pids(launcher.log_dir)
    assert len(pids) == 7 and not any(alive(p) for p in pids)
    assert elapsed < 60  # generous: stop_timeout is 30 s and workers exit on ABORTED at once


def test_worker_that_cannot_be_built_is_reported(tmp_path, capfd):
    launcher = LocalLauncher("launchtest", "badbuild", str(tmp_path), NameResolveConfig(type="file", file_root=str(tmp_path / "nr")))
    code = launcher.run([WorkerGroup(f"{W}:BadConfigWorker", 1), WorkerGroup(f"{W}:CountingWorker", 1, {})], timeout=120)
    err = capfd.readouterr().err
    assert code == 1
    assert "worker BadConfigWorker/0 failed" in err and "model_path" in err
    assert not any(alive(p) for p in launcher.worker_pids)


def test_unknown_worker_type_fails_before_any_process_starts(tmp_path):
    launcher = LocalLauncher("launchtest", "unknown", str(tmp_path), NameResolveConfig(type="memory"))
    with pytest.raises(KeyError, match="unknown worker type 'no_such_worker'"):
        launcher.run([WorkerGroup("no_such_worker", 1)])
    assert launcher.worker_pids == []


def test_sigkilled_launcher_leaves_no_orphans(tmp_path):
    ttl = 2.0
    repo_root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    launcher = subprocess.Popen(
        [sys.executable, os.path.join(os.path.dirname(__file__), "launch_child.py"), str(tmp_path), str(ttl)],
        stdout=subprocess.PIPE, text=True, cwd=repo_root, start_new_session=True,
    )  # fmt: skip
    pids: dict = {}
    try:
        pids = json.loads(launcher.stdout.readline())
        log_dir = tmp_path / "logs" / "launchtest" / "sigkill"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not spawned_pids(str(log_dir)):
            time.sleep(0.1)
        pids["spawned"] = spawned_pids(str(log_dir))
        assert pids["spawned"] and all(alive(p) for p in pids["workers"])
        time.sleep(1.0)  # running steadily
        os.kill(launcher.pid, signal.SIGKILL)
        launcher.wait()
        killed = time.monotonic()
        workers = pids["workers"] + pids["spawned"]
        while time.monotonic() - killed < 2 * ttl + 5 and any(alive(p) for p in workers):
            time.sleep(0.1)
        gone_after = time.monotonic() - killed
        assert not any(alive(p) for p in workers), f"orphans after {gone_after:.1f}s"
        # 2x TTL for the key to expire and be noticed, plus interpreter exit.
        assert gone_after < 2 * ttl + 2, gone_after
        # The private etcd lingers (so workers could see the key expire), then goes.
        deadline = time.monotonic() + 3 * ttl + 15
        while time.monotonic() < deadline and alive(pids["etcd"]):
            time.sleep(0.2)
        assert not alive(pids["etcd"])
    finally:
        for pid in [launcher.pid] + pids.get("workers", []) + pids.get("spawned", []) + [pids.get("etcd", launcher.pid)]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
