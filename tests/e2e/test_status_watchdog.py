"""`realrl status` against real trials (while they run, right after a worker
is killed, after they ended) and the hang watchdog tripped by a worker that
blocks forever (tests/e2e/hang_plugin.py). Trials run as the user runs them
(`training/main_async_ppo.py` in a subprocess, see test_faults.Trial)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time

from realrl.cli import main as realrl_main
from tests.e2e.test_faults import REPO, WORKERS, Trial, check_stopped_by_a_killed_worker

HANG_PLUGIN = os.path.join(REPO, "tests", "e2e", "hang_plugin.py")


def status(tmp_path, trial: str, *extra: str) -> subprocess.CompletedProcess:
    """`python -m realrl status` as a user types it."""
    return subprocess.run(
        [sys.executable, "-m", "realrl", "status", "async-ppo-tiny", trial, f"fileroot={tmp_path}", *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def status_here(tmp_path, trial: str) -> tuple[int, str]:
    """The same, in this process (no interpreter start-up: right after a kill)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = realrl_main(["status", "async-ppo-tiny", trial, f"fileroot={tmp_path}"])
    return code, out.getvalue()


def table(text: str) -> dict[str, list[str]]:
    """Rows of the status table: worker tag -> the other columns (DOING as one string)."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("WORKER "))
    starts = [lines[header].index(c) for c in ("HOST", "PID", "STATE", "HEARTBEAT", "DOING")]
    rows = {}
    for line in lines[header + 1 :]:
        if not re.match(r"^\w+/\d+ ", line):
            break
        cells = [line[a:b].strip() for a, b in zip([0, *starts], [*starts, len(line) + 1])]
        rows[cells[0]] = cells[1:]
    return rows


def _doing_in_training(rows: dict[str, list[str]]) -> bool:
    """Whether each worker's DOING shows what it does once training runs."""
    doing = {tag: cells[4] for tag, cells in rows.items()}
    return bool(
        re.search(r"step=\d+/400 stage=\w+", doing.get("master_worker/0", ""))
        and "buffered=" in doing.get("model_worker/0", "")
        and "episodes=" in doing.get("rollout_worker/0", "")
        and re.search(r"admission=(?!not started)", doing.get("gserver_manager/0", ""))
        and "version=" in doing.get("generation_server/0", "")
    )


def test_status_while_running_after_a_kill_and_after_the_end(tmp_path, kit_cache):
    """Also test_faults' killed worker for the rollout worker: its death stops the trial, the
    rest exit by themselves. (A rollout worker is started again by default: test_recovery.py.)"""
    trial = Trial(tmp_path, kit_cache, "status", "rollout.max_restarts=0")  # its death must end the trial here
    tags = [f"{w}/0" for w in WORKERS]
    try:
        trial.wait_for_step(2)
        workers = trial.workers()

        # Running: every worker listed with a live heartbeat and what it does. A worker rewrites its
        # record every PROGRESS_INTERVAL (2 s), so the first ones may predate training: read again
        # until every worker's record says what it does in training.
        deadline = time.monotonic() + 60
        while True:
            shown = status(tmp_path, "status")
            assert shown.returncode == 0, shown.stdout + shown.stderr
            assert shown.stdout.startswith("trial async-ppo-tiny/status: RUNNING"), shown.stdout
            rows = table(shown.stdout)
            if all(tag in rows for tag in tags) and _doing_in_training(rows) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert sorted(rows) == sorted(tags), shown.stdout
        for tag in tags:
            _, pid, state, heartbeat, _ = rows[tag]
            assert state.startswith("RUNNING") and re.fullmatch(r"[\d.]+[smh]", heartbeat), shown.stdout
            assert int(pid) == workers[tag.replace("/", "-")].pid
        assert _doing_in_training(rows), shown.stdout

        # --stacks: a report with every worker's stacks.
        shown = status(tmp_path, "status", "--stacks")
        assert shown.returncode == 0, shown.stdout + shown.stderr
        path = re.search(r"hang report \(stacks of every worker\): (\S+)", shown.stdout).group(1)
        with open(path) as f:
            report = f.read()
        for tag in tags:
            assert f"\n---- {tag} (pid " in report
        assert report.count("=== end ") == len(tags), report[:3000]
        assert "in _main_loop" in report  # the workers' loops, as faulthandler saw them

        # A killed worker: dead at once (its process is gone), while the trial still runs.
        workers["rollout_worker-0"].kill()
        code, text = status_here(tmp_path, "status")
        if text.startswith(("trial async-ppo-tiny/status: RUNNING", "trial async-ppo-tiny/status: STOPPING")):
            assert code == 3, text
            assert table(text)["rollout_worker/0"][2] == "DEAD", text
            print("status right after the kill:\n" + text)
        else:  # the launcher already stopped everything: the view after the end (below) says it
            assert "has ended" in text, text
        code = trial.wait()
    finally:
        trial.kill()
    check_stopped_by_a_killed_worker(trial, workers, "rollout_worker-0", code)

    # Ended: says so, exit code 1, with how each worker ended.
    shown = status(tmp_path, "status")
    assert shown.returncode == 1, shown.stdout + shown.stderr
    first = shown.stdout.splitlines()[0]
    assert first.startswith("trial async-ppo-tiny/status has ended") and "failed worker rollout_worker/0" in first, (
        shown.stdout
    )
    rows = table(shown.stdout)
    assert sorted(rows) == sorted(tags)
    assert rows["rollout_worker/0"][2] == "DEAD" and "SIGKILL" in rows["rollout_worker/0"][4], shown.stdout


def test_a_worker_that_blocks_forever_trips_the_watchdog(tmp_path, kit_cache):
    # Above the longest stage before the hang (the 16-prompt initial evaluation: ~0.1 s), not more:
    # the test waits out the whole timeout.
    timeout = 10
    trial = Trial(
        tmp_path,
        kit_cache,
        "hang",
        f"plugins=[{HANG_PLUGIN}]",
        "rollout.agent.type=block-forever-agent",
        f"watchdog.timeout={timeout}",
    )
    try:
        code = trial.wait(timeout=600)  # a hang guard
        ended = time.time()
    finally:
        trial.kill()
    out = trial.console()
    assert code == 1, out[-3000:]
    # One block on the console, on lines of its own.
    m = re.search(
        r"\nrealrl: watchdog: no training progress for \d+s \(step 0, stage fetch\); stopping the trial\.\n"
        r"  every other worker waits on rollout_worker/0 \(.*\)\n"
        r"  hang report \(stacks of every worker\): (\S+)\n",
        out,
    )
    assert m, out[-3000:]
    with open(m.group(1)) as f:
        report = f.read()
    assert "=> every other worker waits on rollout_worker/0" in report, report[:3000]
    rollout = report.split("\n---- rollout_worker/0 ", 1)[1]
    assert "in block_forever" in rollout and "in collect_trajectory" in rollout and "hang_plugin.py" in rollout
    # Stopped within the timeout plus 30 s of the last progress the report names (a hang guard).
    last_progress = float(re.search(r"\(epoch ([\d.]+)\)", report).group(1))
    assert ended - last_progress <= timeout + 30, (ended - last_progress, report[:500])
    with open(os.path.join(tmp_path, "run", "async-ppo-tiny", "hang", "trial.json")) as f:
        record = json.load(f)
    assert record["exit_code"] == 1 and record["failed_worker"] == "rollout_worker/0"
    assert record["hang_reports"] == [m.group(1)]
    # (The autouse no_orphan_processes fixture fails the test if any process is left.)
