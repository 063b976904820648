"""`realrl status` and the hang report without a trial: the status table,
reading rows from name_resolve keys, parsing faulthandler dumps, the
diagnosis, a real worker's progress record and stack dump (in a thread), and
the watchdog's config checks. The whole-system behaviour is tested in
tests/e2e/test_status_watchdog.py."""

from __future__ import annotations

import faulthandler
import json
import os
import selectors
import subprocess
import sys
import threading
import time

import pytest

from realrl.api.cli_args import ConfigError, validate
from realrl.api.system_api import WorkerInfo
from realrl.base import name_resolve, names
from realrl.cli.status import parse_status_args, rows_from_logs
from realrl.cli.trial import UsageError
from realrl.system.hang_report import busy_frame, diagnose, main_thread_frames, request_stacks
from realrl.system.trial_status import DEAD, Row, format_doing, format_table, read_row, read_rows
from realrl.system.worker_base import PollResult, Worker, WorkerStatus, stacks_path

EXP, TRIAL = "status-unit", "t0"


def rows_for_table() -> list[Row]:
    return [
        Row(
            "master_worker",
            0,
            "RUNNING",
            "node-a",
            101,
            0.4,
            7,
            {"step": 3, "total_steps": 40, "stage": "fetch", "waiting_on": []},
            "0x1",
        ),
        Row("model_worker", 0, "RUNNING", "node-a", 102, 0.25, 12, {"buffered": 5, "version": 3}),
        Row("rollout_worker", 0, "RUNNING", "node-b", 103, 42.0, 0, {"episodes": 8}),
        Row("rollout_worker", 1, DEAD, "node-b", 104, 75.0, 3, {"episodes": 2}, note="no heartbeat"),
        Row("gserver_manager", 0),
    ]


def test_the_status_table_has_one_aligned_row_per_worker():
    lines = format_table(rows_for_table()).splitlines()
    assert lines[0].split() == ["WORKER", "HOST", "PID", "STATE", "HEARTBEAT", "DOING"]
    assert len(lines) == 6
    starts = [lines[0].index(col) for col in ("HOST", "PID", "STATE", "HEARTBEAT", "DOING")]
    for line in lines[1:]:  # every column starts where its header does
        assert all(line[s - 2 : s] == "  " for s in starts if s < len(line)), line
    master, trainer, stuck, dead, silent = lines[1:]
    assert master.split()[:5] == ["master_worker/0", "node-a", "101", "RUNNING", "0.4s"]
    assert master.endswith("step=3/40 stage=fetch")  # an empty list is left out
    assert trainer.endswith("buffered=5 version=3")
    assert "RUNNING (stale)" in stuck and "42.0s" in stuck  # alive, loop silent for > STALE_S
    assert "DEAD" in dead and "1.2m" in dead and dead.endswith("(no heartbeat)") and "episodes" not in dead
    assert silent.split() == ["gserver_manager/0", "-", "-", "-", "-"]


def test_doing_values_are_compact():
    assert (
        format_doing({"a": 0.123456, "b": ["x 1s", "y 2s"], "c": None, "d": {"k": 1}})
        == "a=0.123 b=[x 1s; y 2s] d={k=1}"
    )


def put(repo, worker_type, index, status=None, **record):
    if status is not None:
        repo.add(names.worker_status(EXP, TRIAL, worker_type, index), status, replace=True)
    if record:
        base = {
            "host": "elsewhere",
            "pid": 1,
            "state": status or "RUNNING",
            "time": time.time(),
            "progress": 0,
            "doing": {},
        }
        repo.add(names.worker_progress(EXP, TRIAL, worker_type, index), json.dumps({**base, **record}), replace=True)


def test_rows_from_keys_tell_live_dead_and_finished_workers():
    repo = name_resolve.MemoryNameRecordRepository()
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # a pid that no longer runs
    put(repo, "master_worker", 0, "RUNNING", doing={"step": 2}, time=time.time() - 1.5)
    put(repo, "model_worker", 0, None, state="RUNNING")  # status key expired: SIGKILLed elsewhere
    put(repo, "model_worker", 1, "RUNNING", host=__import__("socket").gethostname(), pid=gone.pid)  # killed here
    put(repo, "rollout_worker", 0, "COMPLETED", state="COMPLETED")
    put(repo, "rollout_worker", 1, None, state="ERROR")
    repo.add(names.worker_error(EXP, TRIAL, "rollout_worker", 1), "Traceback ...")
    rows = {r.tag: r for r in read_rows(repo, EXP, TRIAL, [("generation_server", 0)])}
    assert list(rows) == [
        "master_worker/0",
        "model_worker/0",
        "model_worker/1",
        "generation_server/0",
        "rollout_worker/0",
        "rollout_worker/1",
    ]
    assert rows["master_worker/0"].state == "RUNNING" and 1.4 < rows["master_worker/0"].age < 30
    assert rows["master_worker/0"].doing == {"step": 2}
    assert (rows["model_worker/0"].state, rows["model_worker/0"].note) == (DEAD, "no heartbeat")
    assert rows["model_worker/1"].state == DEAD and f"process {gone.pid} is gone" in rows["model_worker/1"].note
    assert rows["generation_server/0"].state == "-"
    assert rows["rollout_worker/0"].state == "COMPLETED"
    assert rows["rollout_worker/1"].state == "ERROR" and "traceback recorded" in rows["rollout_worker/1"].note


def test_rows_from_logs_after_the_trial(tmp_path):
    (tmp_path / "specs").mkdir()
    for tag, tail in (
        ("master_worker-0", "... exited with code 0 (COMPLETED)\n"),
        ("model_worker-0", "... exited with code 0 (STOPPED)\n"),  # Ctrl-C: stopped, not completed
        ("gserver_manager-0", "... exited with code 0\n"),  # a log of before the state was written
        ("rollout_worker-0", "step 3\n"),
    ):
        (tmp_path / "specs" / f"{tag}.json").write_text("{}")
        (tmp_path / f"{tag}.log").write_text(tail)
    rows = rows_from_logs(str(tmp_path))
    assert sorted((r.tag, r.state) for r in rows) == [
        ("gserver_manager/0", "COMPLETED"),
        ("master_worker/0", "COMPLETED"),
        ("model_worker/0", "STOPPED"),
        ("rollout_worker/0", DEAD),
    ]


def test_status_arguments():
    assert parse_status_args(["exp", "t1", "fileroot=/x", "--stacks"]) == (
        ["exp", "t1"],
        ["fileroot=/x"],
        True,
        "async-ppo",
        None,
    )
    for bad in (["a", "b", "c"], ["--json"], ["--config-name"]):
        with pytest.raises(UsageError):
            parse_status_args(bad)


# ---- faulthandler dumps and the diagnosis -------------------------------------------------------------


def blocked_here(event: threading.Event) -> None:
    event.wait(30)


def idle_in_select(event: threading.Event) -> None:
    with selectors.DefaultSelector() as sel:
        r, w = os.pipe()
        sel.register(r, selectors.EVENT_READ)
        while not event.is_set():
            sel.select(0.2)
        os.close(r)
        os.close(w)


def test_the_main_thread_is_found_in_a_faulthandler_dump(tmp_path):
    stop = threading.Event()
    busy = threading.Thread(target=blocked_here, args=(stop,))
    idle = threading.Thread(target=idle_in_select, args=(stop,))
    busy.start()
    idle.start()
    try:
        time.sleep(0.3)
        with open(tmp_path / "dump.txt", "w+") as f:
            faulthandler.dump_traceback(f, all_threads=True)
            f.seek(0)
            dump = f.read()
    finally:
        stop.set()
        busy.join()
        idle.join()
    busy_id, idle_id = f"0x{busy.ident:016x}", f"0x{idle.ident:016x}"
    assert [fn for _, _, fn in main_thread_frames(dump, busy_id)][:3] == ["wait", "wait", "blocked_here"]
    # threading.Event.wait is not an idle wait of a worker's main thread: it is reported
    path, _, func = busy_frame(dump, busy_id)
    assert os.path.basename(path) == "threading.py" and func == "wait"
    assert busy_frame(dump, idle_id) is None  # the event loop's select is the usual idle wait
    assert main_thread_frames(dump, "0xdeadbeef")  # unknown id: the dump's current thread
    assert main_thread_frames("", "") == []


def test_diagnosis_names_the_worker_the_others_wait_on():
    master = Row("master_worker", 0, "RUNNING", "h", 1, 0.2, 5, {"step": 5, "total_steps": 9, "stage": "fetch"})
    trainer = Row("model_worker", 0, "RUNNING", "h", 2, 0.3, 9, {"buffered": 3})
    rollout = Row("rollout_worker", 0, "RUNNING", "h", 3, 40.0, 1, {"episodes": 4})
    findings, culprit = diagnose([master, trainer, rollout], {})
    assert culprit == "rollout_worker/0"
    assert findings[-1] == "=> every other worker waits on rollout_worker/0 (its loop stopped)"
    assert "  it waits for trajectories: the trainers hold 3" in findings

    # The master waits on one trainer's train_step for a long time.
    master.doing = {
        "step": 5,
        "stage": "train_step",
        "waiting_on": ["model_worker/1 train_step 95s", "model_worker/0 x 1s"],
    }
    rollout.age = 0.5
    _, culprit = diagnose([master, trainer, rollout], {})
    assert culprit == "model_worker/1"

    # Its row shows it waiting on one trainer, not yet for long: `realrl status --stacks` names that trainer.
    master.doing = {"step": 5, "stage": "train_step", "waiting_on": ["model_worker/0 train_step 4s (unconfirmed)"]}
    findings, culprit = diagnose([master, trainer, rollout], {})
    assert culprit == "model_worker/0"
    assert findings[0] == "master_worker/0: step 5/?, stage train_step; waits on model_worker/0 for train_step (4s)"
    assert findings[-1] == "=> every other worker waits on model_worker/0 (the master's RPC waits on it)"

    # Nothing stands out: say so.
    master.doing = {"step": 5, "stage": "fetch"}
    findings, culprit = diagnose([master, trainer, rollout], {})
    assert culprit is None and findings[-1] == "=> could not tell which worker the others wait on"

    # Two silent workers: candidates, no guess.
    trainer.age = rollout.age = 50.0
    findings, culprit = diagnose([master, trainer, rollout], {})
    assert culprit is None and "candidates: model_worker/0, rollout_worker/0" in findings[-1]


# ---- a real worker (in a thread): progress record and stack dump on request ----------------------------


class SleepyWorker(Worker):
    def _configure(self, config):
        self.polls = 0

    def _poll(self):
        self.polls += 1
        time.sleep(0.01)
        return PollResult(sample_count=1)

    def _progress_info(self):
        return {"polls": self.polls}


def test_a_worker_publishes_progress_and_dumps_its_stacks_on_request(tmp_path):
    name_resolve.reconfigure(name_resolve.NameResolveConfig(type="memory"))
    repo = name_resolve.default_repository()
    info = WorkerInfo(EXP, TRIAL, "sleepy_worker", 0, log_dir=str(tmp_path), watch_launcher=False)
    worker = SleepyWorker(info)
    thread = threading.Thread(target=worker.run, name="sleepy")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while (row := read_row(repo, EXP, TRIAL, "sleepy_worker", 0)).doing.get("polls", 0) < 3:
            assert time.monotonic() < deadline, row  # a hang guard
            time.sleep(0.1)
        assert row.state == WorkerStatus.RUNNING and row.pid == os.getpid() and row.progress >= 1
        assert row.age is not None and row.age < 30
        stacks = request_stacks(repo, EXP, TRIAL, str(tmp_path), [row], signal_worker=None)
    finally:
        worker.request_exit("test over")
        thread.join(30)
    dump = stacks["sleepy_worker/0"]
    assert dump.startswith("=== stack dump ") and dump.rstrip().endswith("===")
    assert "in _poll" in dump and "in _main_loop" in dump  # the worker thread, at work
    assert os.path.exists(stacks_path(str(tmp_path), "sleepy_worker", 0))
    final = read_row(repo, EXP, TRIAL, "sleepy_worker", 0)
    # The last record stays after exit; stopped before the trial completed, it is not COMPLETED.
    assert final.state == WorkerStatus.STOPPED
    name_resolve.reconfigure(name_resolve.NameResolveConfig(type="memory"))


@pytest.mark.parametrize("trial_status, final", [("COMPLETE", "COMPLETED"), ("ABORTED", "STOPPED"), (None, "STOPPED")])
def test_a_clean_exit_is_completed_only_when_the_trial_completed(tmp_path, trial_status, final):
    """Ctrl-C, an aborted trial or a gone launcher stop a worker cleanly (exit
    code 0): STOPPED in its status key (and its log's exit line), which `realrl
    status` reads after the trial. COMPLETED once the master set COMPLETE."""
    from realrl.system.worker_base import set_experiment_status

    name_resolve.reconfigure(name_resolve.NameResolveConfig(type="memory"))
    repo = name_resolve.default_repository()
    info = WorkerInfo(EXP, TRIAL, "sleepy_worker", 0, log_dir=str(tmp_path), watch_launcher=False)
    worker = SleepyWorker(info)
    thread = threading.Thread(target=worker.run, name="sleepy")
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while read_row(repo, EXP, TRIAL, "sleepy_worker", 0).doing.get("polls", 0) < 1:
            assert time.monotonic() < deadline  # a hang guard
            time.sleep(0.05)
        if trial_status is not None:
            set_experiment_status(EXP, TRIAL, trial_status)
        else:
            worker.request_exit("signal SIGINT")  # what Ctrl-C does to a worker
    finally:
        thread.join(30)
        if thread.is_alive():
            worker.request_exit("test over")
            thread.join(30)
    assert read_row(repo, EXP, TRIAL, "sleepy_worker", 0).state == final
    name_resolve.reconfigure(name_resolve.NameResolveConfig(type="memory"))


# ---- config ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("watchdog.timeout=3", "watchdog.timeout: must be 0 (off) or >= 5 seconds, got 3.0"),
        ("watchdog.timeout=-1", "watchdog.timeout: must be 0 (off) or >= 5 seconds, got -1.0"),
        ("watchdog.action=kill", "watchdog.action: must be stop|report, got 'kill'"),
    ],
)
def test_watchdog_config_errors_name_the_key(tmp_path, override, message):
    from realrl.experiment.config import load_config

    with pytest.raises(ConfigError) as e:
        validate(load_config([f"fileroot={tmp_path}", override]))
    assert str(e.value) == message


def test_watchdog_defaults_and_off_are_valid(tmp_path):
    from realrl.experiment.config import load_config

    cfg = load_config([f"fileroot={tmp_path}"])
    assert (cfg.watchdog.timeout, cfg.watchdog.action) == (300.0, "stop")
    validate(load_config([f"fileroot={tmp_path}", "watchdog.timeout=0", "watchdog.action=report"]))
