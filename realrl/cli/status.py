"""`realrl status [EXPERIMENT [TRIAL]] [KEY=VALUE ...] [--stacks] [--config-name NAME] [--config-dir DIR]`

Shows what every worker of a trial is doing: one row per worker with its
host, pid, state, heartbeat age (seconds since its loop last published) and
what it is doing (docs/observability.md). The trial is found the way the run
found it: EXPERIMENT and TRIAL (default: the config's experiment_name and
trial_name), and the same KEY=VALUE overrides the run was given (those that
matter: fileroot, name_resolve.*; any other key of the config is accepted). The
launcher records how to reach the trial's name service (its private etcd
too) in `<fileroot>/run/<experiment>/<trial>/trial.json`; after the trial,
that file (with every worker's last row), summary.json and the logs say how
it ended.

`--stacks` also writes a hang report (`<log_dir>/hang-report-<time>.txt`):
every worker's stacks (all threads), progress record and heartbeat, and the
worker the others wait on when that can be seen. Workers on any node answer
through the name service; this machine must see the log directory.

Exit code: 0 the trial runs and every worker has a heartbeat; 3 it runs but
a worker is dead; 1 it does not run (ended, never started, launcher gone);
2 bad arguments.
"""

from __future__ import annotations

import datetime
import os
import sys

from realrl.base import name_resolve, names
from realrl.base.process import pid_alive
from realrl.cli.trial import HelpRequested, UsageError, connect, parse_trial_args, read_json, resolve_trial
from realrl.system.trial_status import (
    DEAD,
    FINAL_STATES,
    Row,
    expected_workers,
    format_table,
    read_rows,
    row_from_json,
)

_NR_KEYS = ("name_resolve.type", "name_resolve.etcd3_addr", "name_resolve.file_root")


def parse_status_args(argv: list[str]) -> tuple[list[str], list[str], bool, str, str | None]:
    """(positional names, KEY=VALUE overrides, --stacks, config name, config dir)."""
    positional, overrides, options = parse_trial_args(argv, __doc__, flags=("--stacks",))
    return positional, overrides, options["--stacks"], options["--config-name"], options["--config-dir"]


def _when(epoch) -> str:
    return datetime.datetime.fromtimestamp(epoch).isoformat(sep=" ", timespec="seconds") if epoch else "?"


def rows_from_logs(log_dir: str) -> list[Row]:
    """What the logs say of each worker: the exit line it wrote, if any."""
    rows = []
    for kind, index in expected_workers(log_dir):
        row = Row(kind, index)
        try:
            with open(os.path.join(log_dir, f"{kind}-{index}.log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 64 * 1024))
                tail = f.read().decode(errors="replace")
        except OSError:
            tail = ""
        mark = "exited with code "
        if mark in tail:
            code, *how = tail.rsplit(mark, 1)[1].split("\n", 1)[0].split()
            said = how[0].strip("()") if how else ""  # "(COMPLETED)", "(STOPPED)": how a clean exit ended
            clean = said if said in FINAL_STATES else "COMPLETED"
            row.state, row.note = (clean if code == "0" else "ERROR"), f"log: exited with code {code}"
        else:
            row.state, row.note = DEAD, "its log has no exit line (killed?)"
        rows.append(row)
    return rows


# ---- the command ------------------------------------------------------------------------------------


def main(argv: list[str]) -> int:
    try:
        positional, overrides, want_stacks, config_name, config_dir = parse_status_args(argv)
        settings, exp, trial, run_dir, log_dir = resolve_trial(positional, overrides, config_name, config_dir)
    except HelpRequested as e:
        print(e)
        return 0
    except (UsageError, ValueError) as e:  # ConfigError is a ValueError
        print(f"realrl status: {e}", file=sys.stderr)
        return 2
    fileroot = os.path.abspath(settings["fileroot"])
    record = read_json(os.path.join(run_dir, "trial.json"))
    if record is None and not os.path.isdir(run_dir) and not os.path.isdir(log_dir):
        print(
            f"realrl: no trial {exp}/{trial} under fileroot {fileroot} (no {run_dir}); give the names and "
            "the fileroot=... the run used",
            file=sys.stderr,
        )
        return 1
    nr = settings["name_resolve"]
    if record is not None and isinstance(record.get("name_resolve"), dict):
        nr = name_resolve.NameResolveConfig(
            **{k: v for k, v in record["name_resolve"].items() if k in _RECORDED_NR_KEYS}
        )
    for o in overrides:  # an explicit name_resolve.* override wins over the record
        key, _, value = o.lstrip("+").partition("=")
        if key in _NR_KEYS:
            setattr(nr, key.split(".", 1)[1], value)
    log_dir = (record or {}).get("log_dir") or log_dir

    repo, problem = connect(nr, run_dir)
    try:
        running = False
        if repo is not None:
            try:
                repo.get(names.launcher_keepalive(exp, trial))
                running = True
            except name_resolve.NameEntryNotFoundError:
                pass
        if running:
            return _show_running(repo, exp, trial, log_dir, record, nr, want_stacks)
        return _show_ended(repo, problem, exp, trial, log_dir, record, want_stacks)
    finally:
        if repo is not None:
            repo.close()


# What a trial record's name service config says (the private etcd's user and secret: §14 of docs/design.md).
_RECORDED_NR_KEYS = ("type", "etcd3_addr", "etcd3_user", "etcd3_secret", "file_root")


def _where(nr: name_resolve.NameResolveConfig) -> str:
    return f"etcd {nr.etcd3_addr}" if nr.type == "etcd3" else f"{nr.type} {nr.file_root}"


def _show_running(repo, exp, trial, log_dir, record, nr, want_stacks) -> int:
    launcher = ""
    if record is not None:
        pid, host, started = record.get("launcher_pid"), record.get("launcher_host"), _when(record.get("started"))
        launcher = f"launcher pid {pid} on {host}, started {started}; "
    rows = read_rows(repo, exp, trial, expected_workers(log_dir))
    try:
        experiment_status = repo.get(names.experiment_status(exp, trial))
    except name_resolve.NameEntryNotFoundError:
        experiment_status = None
    state = "RUNNING" if experiment_status in (None, "RUNNING") else f"STOPPING (experiment_status {experiment_status})"
    where = _where(nr) if nr.etcd3_addr or nr.type != "etcd3" else "private etcd"
    print(f"trial {exp}/{trial}: {state} ({launcher}name service {where})")
    print(format_table(rows))
    dead = [r.tag for r in rows if r.state in (DEAD, "ERROR")]
    stale = [r.tag for r in rows if r.stale]
    if dead:
        print(f"dead: {', '.join(dead)} (the launcher stops the trial when it notices)")
    if stale:
        print(
            f"stale: {', '.join(stale)} "
            "(alive, but the loop has not run lately: `realrl status --stacks` shows where it is)"
        )
    if want_stacks:
        from realrl.system.hang_report import build_report

        path, findings, _ = build_report(
            repo, exp, trial, log_dir, [(r.worker_type, r.index) for r in rows], "asked for by `realrl status --stacks`"
        )
        print("\n".join(findings))
        print(f"hang report (stacks of every worker): {path}")
    return 3 if dead else 0


def _show_ended(repo, problem, exp, trial, log_dir, record, want_stacks) -> int:
    how = []
    if record is not None and record.get("ended"):
        code = record.get("exit_code")
        how.append(f"at {_when(record['ended'])}, exit code {code if code is not None else '?'}")
        if record.get("failed_worker"):
            how.append(f"failed worker {record['failed_worker']}")
        for path in record.get("hang_reports") or []:
            how.append(f"hang report {path}")
    elif record is not None:
        pid, host = record.get("launcher_pid"), record.get("launcher_host")
        import socket

        if host == socket.gethostname() and isinstance(pid, int) and pid_alive(pid):
            how.append(
                f"its launcher (pid {pid}) runs but the trial's keep-alive key is gone ({problem or 'name service up'})"
            )
        else:
            how.append(f"its launcher (pid {pid} on {host}) is gone")
    summary = os.path.join(log_dir, "summary.json")
    if os.path.exists(summary):
        s = read_json(summary) or {}
        how.append(f"summary {summary} ({s.get('steps', '?')} steps)")
    print(f"trial {exp}/{trial} has ended" + (": " + "; ".join(how) if how else ""))
    if record is not None and record.get("workers"):
        rows = [row_from_json(w) for w in record["workers"]]
        print(f"workers as the launcher left them at {_when(record.get('ended'))}:")
    elif repo is not None and (rows := read_rows(repo, exp, trial, expected_workers(log_dir))):
        print("workers as their last records say:")
    else:
        rows = rows_from_logs(log_dir)
        print(f"workers as their logs say ({problem or 'no records'}):")
    for r in rows:
        r.doing = {}  # what it did last is history; the state and note say how it ended
    if rows:
        print(format_table(rows))
    print(f"logs: {log_dir}")
    if want_stacks:
        print("realrl status --stacks: the trial is not running; no stacks to ask for", file=sys.stderr)
    return 1
