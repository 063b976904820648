"""`python -m realrl <command>` (also the `realrl` console script).

    realrl status [EXPERIMENT [TRIAL]] [KEY=VALUE ...] [--stacks] [--config-name NAME]
    realrl add-server [EXPERIMENT [TRIAL]] [KEY=VALUE ...] [--config-name NAME] [--timeout S]
        (one more generation server for a running local trial: realrl/add_server.py)

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
import json
import os
import sys
import urllib.request

from realrl.base import name_resolve, names
from realrl.base.process import pid_alive
from realrl.system.trial_status import DEAD, Row, expected_workers, format_table, read_rows, row_from_json

COMMANDS = ("status", "add-server")
_NR_KEYS = ("name_resolve.type", "name_resolve.etcd3_addr", "name_resolve.file_root")


class UsageError(ValueError):
    pass


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "status":
        return status_main(rest)
    if command == "add-server":  # one more generation server for a running trial (realrl/add_server.py)
        from realrl.add_server import add_server_main

        return add_server_main(rest)
    print(f"realrl: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
    return 2


# ---- finding the trial --------------------------------------------------------------------------------


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load_settings(overrides: list[str], config_name: str = "async-ppo") -> dict:
    """experiment_name, trial_name, fileroot and name_resolve as the run saw
    them: composed like `training/main_async_ppo.py` does (same defaults),
    else (realrl installed without its repository) from the overrides alone."""
    root = _repo_root()
    if os.path.isfile(os.path.join(root, "training", "main_async_ppo.py")):
        if root not in sys.path:
            sys.path.insert(0, root)
        from training.main_async_ppo import load_config

        cfg = load_config(overrides, config_name)
        nr = cfg.name_resolve
        return {
            "experiment_name": cfg.experiment_name,
            "trial_name": cfg.trial_name,
            "fileroot": cfg.fileroot,
            "name_resolve": name_resolve.NameResolveConfig(nr.type, nr.etcd3_addr, nr.file_root),
        }
    values = dict(o.lstrip("+").split("=", 1) for o in overrides)
    return {
        "experiment_name": values.get("experiment_name", "async-ppo-tiny"),
        "trial_name": values.get("trial_name", "run0"),
        "fileroot": values.get("fileroot", "runs"),
        "name_resolve": name_resolve.NameResolveConfig(
            values.get("name_resolve.type", "etcd3"),
            values.get("name_resolve.etcd3_addr", ""),
            values.get("name_resolve.file_root", ""),
        ),
    }


def parse_trial_args(
    argv: list[str], doc: str, flags: tuple[str, ...] = (), valued: tuple[str, ...] = ()
) -> tuple[list[str], list[str], dict]:
    """`[EXPERIMENT [TRIAL]] [KEY=VALUE ...]` plus `--config-name NAME`, the
    `flags` (True when given) and the `valued` options (their string):
    (positional names, overrides, {option: value}). UsageError on anything else."""
    positional, overrides = [], []
    options: dict = {"--config-name": "async-ppo", **{f: False for f in flags}, **{v: None for v in valued}}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            raise UsageError(doc.strip())
        if a in flags:
            options[a] = True
        elif a == "--config-name" or a in valued:
            if i + 1 >= len(argv):
                raise UsageError(f"{a} needs a value")
            options[a] = argv[i + 1]
            i += 1
        elif a.startswith("-"):
            known = ", ".join([*flags, "--config-name NAME", *(f"{v} VALUE" for v in valued)])
            raise UsageError(f"unknown option {a!r} (options: {known})")
        elif "=" in a:
            overrides.append(a)
        else:
            positional.append(a)
        i += 1
    if len(positional) > 2:
        raise UsageError(f"at most EXPERIMENT and TRIAL, got {positional}")
    return positional, overrides, options


def parse_status_args(argv: list[str]) -> tuple[list[str], list[str], bool, str]:
    """(positional names, KEY=VALUE overrides, --stacks, config name)."""
    positional, overrides, options = parse_trial_args(argv, __doc__, flags=("--stacks",))
    return positional, overrides, options["--stacks"], options["--config-name"]


def _etcd_healthy(addr: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
            return json.load(r).get("health") == "true"
    except Exception:
        return False


def connect(nr: name_resolve.NameResolveConfig, run_dir: str):
    """(repository, None) or (None, why the name service cannot be reached)."""
    if nr.type == "memory":
        return None, "name_resolve.type=memory lives inside one process"
    if nr.type == "file":
        if not os.path.isdir(nr.file_root):
            return None, f"no name_resolve directory {nr.file_root}"
        return name_resolve.make_repository(nr), None
    addr = nr.etcd3_addr
    if not addr:  # a private etcd: its supervisor wrote where it listens
        try:
            with open(os.path.join(run_dir, "etcd", "etcd.addr")) as f:
                addr = f.read().strip()
        except OSError:
            return None, "no etcd address (the trial's private etcd never started)"
    if not _etcd_healthy(addr):
        return None, f"etcd at {addr} does not answer"
    return name_resolve.make_repository(name_resolve.NameResolveConfig("etcd3", addr)), None


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None


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
            code = tail.rsplit(mark, 1)[1].split()[0]
            row.state, row.note = ("COMPLETED" if code == "0" else "ERROR"), f"log: exited with code {code}"
        else:
            row.state, row.note = DEAD, "its log has no exit line (killed?)"
        rows.append(row)
    return rows


# ---- the command ------------------------------------------------------------------------------------


def resolve_trial(positional: list[str], overrides: list[str], config_name: str) -> tuple[dict, str, str, str, str]:
    """[experiment [trial]] + overrides -> (settings, experiment, trial, run dir,
    log dir); a UsageError/ValueError says what is wrong."""
    overrides = list(overrides) + [
        f"{key}={value}" for key, value in zip(("experiment_name", "trial_name"), positional)
    ]
    settings = load_settings(overrides, config_name)
    exp, trial = settings["experiment_name"], settings["trial_name"]
    names.trial_root(exp, trial)  # checks the names
    fileroot = os.path.abspath(settings["fileroot"])
    return settings, exp, trial, os.path.join(fileroot, "run", exp, trial), os.path.join(fileroot, "logs", exp, trial)


def status_main(argv: list[str]) -> int:
    try:
        positional, overrides, want_stacks, config_name = parse_status_args(argv)
        settings, exp, trial, run_dir, log_dir = resolve_trial(positional, overrides, config_name)
    except (UsageError, ValueError) as e:  # ConfigError is a ValueError
        print(f"realrl status: {e}", file=sys.stderr)
        return 2
    fileroot = os.path.abspath(settings["fileroot"])
    record = _read_json(os.path.join(run_dir, "trial.json"))
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
            **{k: v for k, v in record["name_resolve"].items() if k in ("type", "etcd3_addr", "file_root")}
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
        s = _read_json(summary) or {}
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


if __name__ == "__main__":
    sys.exit(main())
