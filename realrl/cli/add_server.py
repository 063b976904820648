"""`realrl add-server [EXPERIMENT [TRIAL]] [KEY=VALUE ...] [--config-name NAME] [--config-dir DIR] [--timeout S]`

Starts one more generation server for a running local-mode trial
(docs/architecture.md, "Generation servers that come and go"). The trial is
found as `realrl status` finds it: EXPERIMENT and TRIAL (default: the
config's names) and the overrides the run was given that matter (fileroot,
name_resolve.*), through `<fileroot>/run/<exp>/<trial>/trial.json`.

The new GenerationServer worker is generation_server 0's spec
(`<log_dir>/specs/generation_server-0.json`) with the next free index: its
spec is `specs/generation_server-<i>.json`, its log
`<log_dir>/generation_server-<i>.log` (its server's `...-<i>.server.log`).
It starts its server, loads the trainer's current weight version, registers
under `names.gen_server(exp, trial, i)`, and the manager puts it into routing
once it holds the current weights. It runs in its own session, outside the
launcher, and ends with the trial like every worker: when experiment_status
becomes COMPLETE or ABORTED, or the launcher's keep-alive key disappears. The
launcher does not watch it: if it fails, the trial goes on without it.

On a GPU machine, give it its devices: `CUDA_VISIBLE_DEVICES=3 python -m realrl add-server ...`.

The command returns once the manager routes to the new server (0), or when
it failed or did not join within --timeout seconds (1; a server that did not
even register is stopped); 2 for bad arguments.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request

from realrl.api.system_api import WorkerSpec
from realrl.base import name_resolve, names, trial_secret
from realrl.base.process import log_tail, signal_tree
from realrl.cli.trial import HelpRequested, UsageError, connect, parse_trial_args, read_json, resolve_trial
from realrl.launcher.local import worker_command

WORKER_TYPE = "generation_server"


def parse_args(argv: list[str]) -> tuple[list[str], list[str], str, str | None, float | None]:
    """(positional names, KEY=VALUE overrides, config name, config dir, timeout)."""
    positional, overrides, options = parse_trial_args(argv, __doc__, valued=("--timeout",))
    timeout = options["--timeout"]
    if timeout is not None:
        try:
            timeout = float(timeout)
        except ValueError:
            raise UsageError(f"--timeout: not a number: {timeout!r}") from None
    return positional, overrides, options["--config-name"], options["--config-dir"], timeout


def next_index(log_dir: str, registered: list[str]) -> int:
    """One more than any generation server index the trial has used (spec files and registered keys)."""
    used = [int(k.rsplit("/", 1)[1]) for k in registered if k.rsplit("/", 1)[1].isdigit()]
    try:
        for name in os.listdir(os.path.join(log_dir, "specs")):
            stem, ext = os.path.splitext(name)
            kind, _, index = stem.rpartition("-")
            if ext == ".json" and kind == WORKER_TYPE and index.isdigit():
                used.append(int(index))
    except OSError:
        pass
    return max(used, default=-1) + 1


def write_spec(log_dir: str, template: WorkerSpec, registered: list[str]) -> tuple[int, str]:
    """Claims the next free index (the spec file is created exclusively) and writes its spec."""
    for _ in range(100):
        index = next_index(log_dir, registered)
        path = os.path.join(log_dir, "specs", f"{WORKER_TYPE}-{index}.json")
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another add-server took it
            continue
        info = dataclasses.replace(
            template.info, worker_index=index, worker_count=max(template.info.worker_count, index + 1)
        )
        with os.fdopen(fd, "w") as f:
            f.write(WorkerSpec(template.worker_class, info, template.config).to_json())
        return index, path
    raise RuntimeError(f"could not claim a generation server index in {log_dir}/specs")


def _manager_servers(manager_url: str, secret_path: str) -> dict | None:
    """The manager's `/servers`, asked with the trial's key (read from the secret the workers read)."""
    headers = {"Authorization": f"Bearer {trial_secret.load_keys(secret_path).http_api_key}"} if secret_path else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{manager_url}/servers", headers=headers), timeout=5) as r:
            return json.load(r)
    except Exception:
        return None


def main(argv: list[str]) -> int:
    try:
        positional, overrides, config_name, config_dir, timeout = parse_args(argv)
        settings, exp, trial, run_dir, log_dir = resolve_trial(positional, overrides, config_name, config_dir)
    except HelpRequested as e:
        print(e)
        return 0
    except ValueError as e:  # UsageError and ConfigError are ValueErrors
        print(f"realrl add-server: {e}", file=sys.stderr)
        return 2
    fileroot = os.path.abspath(settings["fileroot"])
    record = read_json(os.path.join(run_dir, "trial.json"))
    if record is not None:
        log_dir = record.get("log_dir") or log_dir
        if record.get("mode", "local") != "local":
            print(
                f"realrl add-server: trial {exp}/{trial} runs in {record['mode']} mode; add-server starts local "
                "workers only",
                file=sys.stderr,
            )
            return 1
    template_path = os.path.join(log_dir, "specs", f"{WORKER_TYPE}-0.json")
    try:
        with open(template_path) as f:
            template = WorkerSpec.from_json(f.read())
    except OSError:
        print(
            f"realrl add-server: no {template_path}: is {exp}/{trial} a trial under fileroot {fileroot}?",
            file=sys.stderr,
        )
        return 1
    nr = template.info.name_resolve
    repo, problem = connect(nr, run_dir)
    if repo is None:
        print(f"realrl add-server: trial {exp}/{trial} is not running ({problem})", file=sys.stderr)
        return 1
    proc = None
    try:
        try:
            repo.get(names.launcher_keepalive(exp, trial))
            status = repo.get(names.experiment_status(exp, trial))
        except name_resolve.NameEntryNotFoundError:
            status = None
        if status != "RUNNING":
            print(
                f"realrl add-server: trial {exp}/{trial} is not running (no launcher keep-alive, or status {status})",
                file=sys.stderr,
            )
            return 1
        index, spec_path = write_spec(log_dir, template, repo.find_subtree(names.gen_servers(exp, trial)))
        log_path = os.path.join(log_dir, f"{WORKER_TYPE}-{index}.log")
        env = dict(os.environ, **name_resolve.config_to_env(nr), PYTHONUNBUFFERED="1")
        # the worker imports this realrl (the directory holding the package) and the plugins next to cwd
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, os.getcwd(), env.get("PYTHONPATH", "")) if p)
        threads = str(((template.config or {}).get("torch") or {}).get("num_threads") or 1)
        for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            env.setdefault(key, threads)
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                worker_command(spec_path),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        print(f"started {WORKER_TYPE} {index} (pid {proc.pid}) for trial {exp}/{trial}; log {log_path}", flush=True)

        startup = float((template.config or {}).get("startup_timeout") or 300.0)
        deadline = time.monotonic() + (timeout if timeout is not None else startup + 120.0)
        key = names.gen_server(exp, trial, index)
        url = None
        while True:
            if proc.poll() is not None:
                print(
                    f"realrl add-server: {WORKER_TYPE} {index} exited with code {proc.returncode} before it "
                    f"{'joined routing' if url else 'registered'}; last lines of {log_path}:\n"
                    f"{log_tail(log_path, 30)}",
                    file=sys.stderr,
                )
                return 1
            if url is None:
                try:
                    url = repo.get(key)
                    print(f"{WORKER_TYPE} {index} registered at {url}", flush=True)
                except name_resolve.NameEntryNotFoundError:
                    pass
            if url is not None:
                try:
                    manager_url = repo.get(names.gen_server_manager(exp, trial))
                except name_resolve.NameEntryNotFoundError:
                    manager_url = None
                info = _manager_servers(manager_url, template.info.secret_path) if manager_url else None
                server = next((s for s in (info or {}).get("servers", []) if s.get("url") == url), None)
                if server is not None and server.get("state") == "up":
                    print(
                        f"{WORKER_TYPE} {index} at {url} is in routing at weight version {server.get('version')}",
                        flush=True,
                    )
                    proc = None  # it runs on, with the trial
                    return 0
            if time.monotonic() > deadline:
                if url is None:
                    print(
                        f"realrl add-server: {WORKER_TYPE} {index} did not register in time; stopping it. Last "
                        f"lines of {log_path}:\n{log_tail(log_path, 30)}",
                        file=sys.stderr,
                    )
                    signal_tree(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        signal_tree(proc.pid, signal.SIGKILL)
                        proc.wait()
                else:
                    print(
                        f"realrl add-server: {WORKER_TYPE} {index} registered at {url} but the manager has not "
                        "put it into routing yet; it keeps trying (see the gserver_manager log)",
                        file=sys.stderr,
                    )
                proc = None
                return 1
            time.sleep(0.5)
    except KeyboardInterrupt:
        if proc is not None and proc.poll() is None:
            signal_tree(proc.pid, signal.SIGTERM)
            proc.wait()
        return 130
    finally:
        repo.close()
