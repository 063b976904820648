"""The local launcher with real worker processes and a real private etcd."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import psutil
import pytest

from realrl.base import name_resolve, names
from realrl.base.name_resolve import NameResolveConfig
from realrl.launcher.local import LocalLauncher, TrialAlreadyRunning, WorkerGroup

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


def test_a_worker_slow_to_stop_its_child_finishes_its_exit_despite_the_launchers_sigterm(tmp_path):
    """An aborted trial: the launcher sets ABORTED, then SIGTERMs the workers
    still running after 3 s. A worker already exiting (stopping its server
    takes 5 s) runs its exit hook to the end and exits by itself, within the
    launcher's stop_timeout, instead of dying half-way."""
    launcher = LocalLauncher("launchtest", "slowstop", str(tmp_path), NameResolveConfig(type="etcd3"), heartbeat_ttl=2)
    groups = [
        WorkerGroup(f"{W}:CountingWorker", 1, {"fail_index": 0, "fail_at": 20}),
        WorkerGroup(f"{W}:SpawningWorker", 1, {"exit_hook_s": 5}),
    ]
    assert launcher.run(groups, timeout=120) == 1
    log = open(launcher.log_path("SpawningWorker", 0)).read()
    assert "exiting: experiment status ABORTED" in log, log[-2000:]
    assert "child stopped" in log and "exited with code 0" in log, log[-2000:]
    assert not any(alive(p) for p in launcher.worker_pids + spawned_pids(launcher.log_dir))


def test_two_launchers_in_one_process_leave_each_others_trial_alone(tmp_path):
    """A process that runs a second trial while a first one runs (as a test
    process does): the second launcher's start and end must not close the
    first one's name service, whose keep-alive key its workers watch."""
    first = LocalLauncher("launchtest", "first", str(tmp_path), NameResolveConfig(type="etcd3"), heartbeat_ttl=2)
    outcome = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("code", first.run([WorkerGroup(f"{W}:AsyncCountingWorker", 1)], timeout=120))
    )
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not first.worker_pids:
            assert time.monotonic() < deadline and thread.is_alive(), "the first trial did not start"
            time.sleep(0.1)
        second = LocalLauncher("launchtest", "second", str(tmp_path), NameResolveConfig(type="etcd3"), heartbeat_ttl=2)
        assert second.run([WorkerGroup(f"{W}:CountingWorker", 1, {"polls": 30})], timeout=120) == 0
        time.sleep(3)  # > the keep-alive TTL and a worker's watch interval
        assert thread.is_alive() and all(alive(p) for p in first.worker_pids), open(
            first.log_path("AsyncCountingWorker", 0)
        ).read()[-2000:]
    finally:
        repo = name_resolve.make_repository(first.nr_config)
        repo.add(names.experiment_status("launchtest", "first"), "COMPLETE", replace=True, delete_on_exit=False)
        repo.close()
        thread.join(120)
    assert outcome["code"] == 0


def test_worker_that_cannot_be_built_is_reported(tmp_path, capfd):
    launcher = LocalLauncher(
        "launchtest", "badbuild", str(tmp_path), NameResolveConfig(type="file", file_root=str(tmp_path / "nr"))
    )
    code = launcher.run(
        [WorkerGroup(f"{W}:BadConfigWorker", 1), WorkerGroup(f"{W}:CountingWorker", 1, {})], timeout=120
    )
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
        stdout=subprocess.PIPE,
        text=True,
        cwd=repo_root,
        start_new_session=True,
    )
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
        for pid in (
            [launcher.pid] + pids.get("workers", []) + pids.get("spawned", []) + [pids.get("etcd", launcher.pid)]
        ):
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_a_trial_has_one_launcher_per_fileroot(tmp_path):
    first = LocalLauncher("launchtest", "once", str(tmp_path), NameResolveConfig(type="memory"))
    second = LocalLauncher("launchtest", "once", str(tmp_path), NameResolveConfig(type="memory"))
    first.acquire_trial()
    try:
        with pytest.raises(TrialAlreadyRunning, match=rf"launchtest/once already running \(pid {os.getpid()}\)"):
            second.acquire_trial()
    finally:
        first.release_trial()
    second.acquire_trial()  # free again once the first lets go
    second.release_trial()


REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SECOND_LAUNCHER = """
import sys
from realrl.base.name_resolve import NameResolveConfig
from realrl.launcher.local import LocalLauncher, TrialAlreadyRunning, WorkerGroup
fileroot, addr, trial = sys.argv[1:]
nr = NameResolveConfig(type="etcd3", etcd3_addr=addr)
launcher = LocalLauncher("launchtest", trial, fileroot, nr, heartbeat_ttl=1)
try:
    launcher.run([WorkerGroup("tests.launcher.workers_for_tests:CountingWorker", 1, {})], timeout=60)
except TrialAlreadyRunning as e:
    print("refused:", e)
"""


def test_a_trial_running_elsewhere_on_a_shared_etcd_is_left_alone(tmp_path, etcd_server):
    """Two launchers of one trial on one shared etcd, with different fileroots
    (as on two machines): the second refuses before it clears any key."""
    shared = NameResolveConfig(type="etcd3", etcd3_addr=etcd_server.addr)
    trial = f"shared{uuid.uuid4().hex[:6]}"
    first = LocalLauncher("launchtest", trial, str(tmp_path / "a"), shared, heartbeat_ttl=1)
    result: dict = {}
    thread = threading.Thread(
        target=lambda: result.update(
            code=first.run([WorkerGroup(f"{W}:CountingWorker", 1, {"polls": 10**9})], timeout=120)
        )
    )
    thread.start()
    repo = name_resolve.make_repository(shared)
    try:
        status = names.experiment_status("launchtest", trial)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (first.worker_pids and repo.find_subtree(status)):
            time.sleep(0.05)
        # The second launcher in its own process, as on another machine.
        second = subprocess.run(
            [sys.executable, "-c", SECOND_LAUNCHER, str(tmp_path / "b"), etcd_server.addr, trial],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO_ROOT,
        )
        assert (
            second.stdout.strip()
            == f"refused: trial launchtest/{trial} already running (pid {os.getpid()}); leaving it alone"
        ), second.stderr
        assert not os.path.exists(tmp_path / "b" / "logs")  # no worker started
        assert repo.get(status) == "RUNNING" and all(alive(p) for p in first.worker_pids)  # untouched
        repo.add(status, "COMPLETE", replace=True, delete_on_exit=False)
        thread.join(60)
        assert result["code"] == 0
    finally:
        if thread.is_alive():
            repo.add(names.experiment_status("launchtest", trial), "ABORTED", replace=True, delete_on_exit=False)
            thread.join(60)
        repo.close()


def test_etcd_lost_under_the_watchdogs_read_ends_the_trial_with_the_one_line(tmp_path):
    """The watchdog reads the workers' rows from etcd itself, so it can be the
    first to find etcd gone (the status watch learns a moment later that its
    stream ended). That read must end the trial as the status check does:
    NameServiceLost naming etcd, not the read's traceback."""
    from realrl.launcher.local import NameServiceLost
    from realrl.launcher.watchdog import Watchdog

    launcher = LocalLauncher("launchtest", "wdlost", str(tmp_path), NameResolveConfig(type="etcd3"), heartbeat_ttl=2)
    launcher.acquire_trial()
    try:
        launcher._start_name_resolve()
        watchdog = Watchdog("launchtest", "wdlost", launcher.log_dir, [("master_worker", 0)], 60, "stop", print)
        launcher._watchdog = watchdog
        assert launcher._watchdog_tick() is None  # etcd answers: no row yet, nothing to say
        [etcd] = [p for p in psutil.Process(launcher._etcd_supervisor.pid).children() if p.name() == "etcd"]
        etcd.kill()
        etcd.wait(10)
        watchdog._last_read = -float("inf")  # (its next tick reads the rows)
        with pytest.raises(NameServiceLost, match=r"etcd at 127\.0\.0\.1:\d+ does not answer|private etcd .* exited"):
            launcher._watchdog_tick()
    finally:
        launcher._owns_keepalive = False
        launcher._release_name_resolve()
        launcher._stop_name_resolve()
        launcher.release_trial()
    assert launcher._etcd_supervisor.poll() is not None
