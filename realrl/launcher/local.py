"""Local launcher: one subprocess per worker on this machine.

`LocalLauncher(...).run(groups)`:
1. starts a private etcd (under the trial's run directory) when the config
   asks for etcd3 without an address, and clears the trial's keys;
2. holds the launcher keep-alive key (workers exit if it disappears, so even a
   SIGKILLed launcher leaves nothing behind) and sets experiment_status RUNNING;
3. starts each worker as `python -m realrl.system.worker_base --spec F`, in
   its own process group, with its log in `<fileroot>/logs/<exp>/<trial>/`;
4. waits. When a worker fails, it prints which one and the tail of its
   traceback, sets ABORTED, stops the rest (SIGTERM, then SIGKILL at
   `stop_timeout`), and returns non-zero. When the master sets COMPLETE, it
   waits for the workers to finish. Ctrl-C or SIGTERM stops everything; so
   does losing the name service (one line says so).
When `run` returns, no process of the trial is left.

One launcher per trial: `acquire_trial()` (called by `run`) takes an
exclusive lock on `<fileroot>/run/<exp>/<trial>/launcher.lock` that the
kernel releases when the launcher dies, and a second launcher of the same
trial raises `TrialAlreadyRunning` naming the first one's pid before it
touches anything.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import signal
import subprocess
import sys
import time
from typing import Any

from realrl.api.system_api import WorkerInfo, WorkerSpec, to_plain
from realrl.base import name_resolve, names, trial_secret
from realrl.base.console import ConsoleRenderer
from realrl.base.etcd_server import PRIVATE_ETCD_USER, enable_auth, start_supervised
from realrl.base.logging import getLogger
from realrl.base.process import log_tail, signal_tree
from realrl.system import worker_class_path
from realrl.system.worker_base import RESTARTS_ENV, ExperimentStatus, set_experiment_status

logger = getLogger("launcher")

_TRACEBACK_TAIL_LINES = 40
HUNG_STOP_TIMEOUT_S = 10.0  # after a hang report: ABORTED, SIGTERM, then SIGKILL this soon
SECURITY_OFF_WARNING = (
    "security.enabled=false: anyone who reaches this trial's ports can steer it: the manager's, the "
    "generation servers' and the chat endpoint's HTTP APIs take requests without a key, the servers load "
    "weights from any path, the trainers train any trajectory pushed to them, the master and the trainers "
    "take any control message, and etcd takes any write"
)


@dataclasses.dataclass
class WorkerGroup:
    worker_type: str  # a registered worker type, or "module:Class"
    count: int
    # One config for every index, or a list with one per index.
    config: Any = None
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    # Extra environment of each index (e.g. its own CUDA_VISIBLE_DEVICES); empty = none.
    env_per_index: list[dict[str, str]] = dataclasses.field(default_factory=list)
    # What one worker holds on a cluster (the ray launcher reserves it; local mode ignores it).
    cpus_per_worker: float = 1.0
    gpus_per_worker: int = 0
    # A worker of this group that fails is started again from its spec (same
    # index) up to this many times, instead of stopping the trial: only for
    # workers the trial can lose for a while (generation servers; see
    # docs/architecture.md, "Generation servers that come and go").
    restarts: int = 0

    @property
    def name(self) -> str:
        """The worker type as workers and logs name it (a class path's class name)."""
        return (
            self.worker_type if ":" not in self.worker_type else worker_class_path(self.worker_type).rsplit(":", 1)[1]
        )

    def config_for(self, index: int) -> Any:
        if isinstance(self.config, list):
            if len(self.config) != self.count:
                raise ValueError(f"{self.worker_type}: {len(self.config)} configs for {self.count} workers")
            return self.config[index]
        return self.config


@dataclasses.dataclass
class WorkerProcess:
    """One worker process as the launcher sees it. Here a local subprocess;
    other launchers (ray) subclass it to reach a process on another node."""

    tag: str
    worker_type: str
    index: int
    log_path: str
    popen: subprocess.Popen | None = None
    node: str = "localhost"

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code, or None while it runs."""
        return self.popen.poll()

    def signal(self, sig: int) -> None:
        """Signals the worker's whole process tree."""
        signal_tree(self.popen.pid, sig)

    def wait(self, timeout: float) -> None:
        self.popen.wait(timeout=timeout)

    def describe_exit(self, code: int) -> str:
        return f"signal {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"


class WorkerFailed(RuntimeError):
    pass


class TrialAlreadyRunning(RuntimeError):
    """Another launcher runs this experiment/trial; nothing was touched."""

    def __init__(self, experiment_name: str, trial_name: str, pid: str) -> None:
        self.pid = pid
        super().__init__(f"trial {experiment_name}/{trial_name} already running (pid {pid}); leaving it alone")


class NameServiceLost(RuntimeError):
    """The name service (etcd) stopped answering while the trial ran."""


class LocalLauncher:
    mode = "local"  # workers bind 127.0.0.1

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        fileroot: str,
        name_resolve_config: name_resolve.NameResolveConfig,
        heartbeat_ttl: float = 5.0,
        plugins: list[str] | tuple[str, ...] = (),
        stop_timeout: float = 30.0,
        poll_interval: float = 0.2,
        echo_worker: str | None = None,
        console_every_n_steps: int = 10,
        watchdog_timeout: float = 0.0,
        watchdog_action: str = "stop",
        security: bool = True,
    ):
        names.trial_root(experiment_name, trial_name)  # validates both names
        name_resolve_config.validate()
        self.experiment_name = experiment_name
        self.trial_name = trial_name
        self.fileroot = os.path.abspath(fileroot)
        self.nr_config = dataclasses.replace(name_resolve_config)
        self.heartbeat_ttl = heartbeat_ttl
        self.plugins = list(plugins)
        self.stop_timeout = stop_timeout
        self.poll_interval = poll_interval
        self.log_dir = os.path.join(self.fileroot, "logs", experiment_name, trial_name)
        self.run_dir = os.path.join(self.fileroot, "run", experiment_name, trial_name)
        self.echo_worker = echo_worker  # copy this worker type's log (index 0) to our stdout
        self._echo_offset = 0
        self._echo_partial = b""  # the echoed log's last line, until its newline arrives
        self.console_every_n_steps = console_every_n_steps
        self._console: ConsoleRenderer | None = None  # made at the first echo: renders the echoed lines
        self._procs: list[WorkerProcess] = []
        # WorkerGroup.restarts: tag -> (info, spec_path, env, log_path, restarts left)
        self._respawn: dict[str, tuple] = {}
        self._etcd_supervisor: subprocess.Popen | None = None
        self._lock_file = None  # held while this launcher owns the trial
        self._owns_keepalive = False
        self._repo: name_resolve.NameRecordRepository | None = None  # the name service, as this launcher uses it
        self._status_watch: name_resolve.ValueWatch | None = None  # experiment_status, as the wait loop reads it
        self.failed_worker: str | None = None
        # The hang watchdog (realrl/launcher/watchdog.py): seconds without training progress before a
        # hang report (0 = off; it needs a master_worker), then stop the trial or only report.
        self.watchdog_timeout = watchdog_timeout
        self.watchdog_action = watchdog_action
        self._watchdog = None
        self._outcome: int | None = None  # what run() returns, for the trial record
        # The trial secret (docs/design.md §14): created by `acquire_trial`, its path in every spec.
        self.security = security
        self.secret_path = ""

    # ---- public ---------------------------------------------------------------
    def run(self, groups: list[WorkerGroup], timeout: float | None = None) -> int:
        """Runs the trial to the end. Returns 0 on success, 1 when a worker
        failed, 124 on `timeout`, 130 when interrupted."""
        self.acquire_trial()
        if not self.security:
            logger.warning(SECURITY_OFF_WARNING)
        previous_sigterm = signal.getsignal(signal.SIGTERM)
        if _in_main_thread():
            signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
        name_service_ok = True
        try:
            self._start_name_resolve()
            self._write_trial_record()
            self._start_workers(groups)
            self._watchdog = self._make_watchdog()
            self._outcome = self._wait(timeout)
            return self._outcome
        except KeyboardInterrupt:
            self._say(f"realrl: interrupted; stopping trial {self.experiment_name}/{self.trial_name}")
            self._set_experiment_status(ExperimentStatus.ABORTED)
            self._outcome = 130
            return 130
        except NameServiceLost as e:
            name_service_ok = False
            # Stop talking to it: its keep-alive thread would warn every second while the workers stop.
            self._owns_keepalive = False
            self._release_name_resolve()
            self._say(f"realrl: name service lost ({e}); stopping trial {self.experiment_name}/{self.trial_name}")
            self._outcome = 1
            return 1
        finally:
            self._close_console()
            self._stop_all(name_service_ok)
            self._write_trial_record(final=name_service_ok)
            self._stop_name_resolve()
            if _in_main_thread():
                signal.signal(signal.SIGTERM, previous_sigterm)
            self.release_trial()

    def acquire_trial(self) -> None:
        """Makes this launcher the trial's only one, or raises TrialAlreadyRunning."""
        if self._lock_file is not None:
            return
        os.makedirs(self.run_dir, exist_ok=True)
        f = open(os.path.join(self.run_dir, "launcher.lock"), "a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "?"
            f.close()
            raise TrialAlreadyRunning(self.experiment_name, self.trial_name, pid) from None
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._lock_file = f
        # The secret comes before anything else of the trial (a resume keeps it).
        if self.security:
            self.secret_path = trial_secret.ensure_secret(self.run_dir)

    def release_trial(self) -> None:
        if self._lock_file is not None:
            self._lock_file.close()  # closing drops the lock
            self._lock_file = None

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def log_path(self, worker_type: str, index: int) -> str:
        return os.path.join(self.log_dir, f"{worker_type}-{index}.log")

    # ---- set-up -----------------------------------------------------------------
    def _start_name_resolve(self) -> None:
        if self.nr_config.type == "etcd3" and not self.nr_config.etcd3_addr:
            # Outlive this process long enough for workers to see our
            # keep-alive key expire if we are SIGKILLed, then stop.
            linger = 3 * self.heartbeat_ttl + 5
            self._etcd_supervisor, addr = start_supervised(
                os.path.join(self.run_dir, "etcd"), os.getpid(), linger, host=self._etcd_host()
            )
            if self.security:  # authentication on before anyone learns the address (docs/design.md §14)
                enable_auth(addr, trial_secret.load_keys(self.secret_path).etcd_password)
                self.nr_config.etcd3_user, self.nr_config.etcd3_secret = PRIVATE_ETCD_USER, self.secret_path
            self.nr_config.etcd3_addr = addr
            logger.info("started private etcd at %s", addr)
        # The launcher's own repository: the one before it (another launcher's, in a test process
        # that runs two trials) stays open; each launcher closes its own (`_release_name_resolve`).
        self._repo = name_resolve.reconfigure(self.nr_config, close_old=False)
        keepalive = names.launcher_keepalive(self.experiment_name, self.trial_name)
        if self._etcd_supervisor is None:  # a shared name service: another machine may run this trial
            self._check_no_live_launcher(keepalive)
        name_resolve.clear_subtree(names.trial_root(self.experiment_name, self.trial_name))
        name_resolve.add(keepalive, str(os.getpid()), keepalive_ttl=self.heartbeat_ttl, replace=True)
        self._owns_keepalive = True
        self._set_experiment_status(ExperimentStatus.RUNNING)
        # The wait loop looks at experiment_status every poll_interval: with etcd, pushed to a watch.
        self._status_watch = self._repo.watch_values(
            [names.experiment_status(self.experiment_name, self.trial_name)], self.poll_interval
        )

    def _cluster_problem(self, force: bool = False) -> str | None:
        """A machine of the trial that is gone (none here: one machine)."""
        return None

    def _etcd_host(self) -> str:
        """Where the private etcd listens: only this machine's workers use it here."""
        return "127.0.0.1"

    def _check_no_live_launcher(self, keepalive: str) -> None:
        """Raises TrialAlreadyRunning while another launcher refreshes the
        trial's keep-alive key. A SIGKILLed launcher's key expires within its
        TTL, so a key still there after two TTLs is alive."""
        deadline = time.monotonic() + 2 * self.heartbeat_ttl + 1
        while True:
            try:
                pid = name_resolve.get(keepalive)
            except name_resolve.NameEntryNotFoundError:
                return
            if time.monotonic() > deadline:
                raise TrialAlreadyRunning(self.experiment_name, self.trial_name, pid)
            time.sleep(0.2)

    def _start_workers(self, groups: list[WorkerGroup]) -> None:
        os.makedirs(os.path.join(self.log_dir, "specs"), exist_ok=True)
        base_env = dict(os.environ)
        base_env.update(name_resolve.config_to_env(self.nr_config))
        base_env["PYTHONUNBUFFERED"] = "1"
        # Worker classes given as module paths (tests, plugins) import from here.
        base_env["PYTHONPATH"] = os.pathsep.join(p for p in (os.getcwd(), base_env.get("PYTHONPATH", "")) if p)
        for group in groups:
            class_path = worker_class_path(group.worker_type)
            worker_type = group.name
            for index in range(group.count):
                info = WorkerInfo(
                    experiment_name=self.experiment_name,
                    trial_name=self.trial_name,
                    worker_type=worker_type,
                    worker_index=index,
                    worker_count=group.count,
                    name_resolve=self.nr_config,
                    log_dir=self.log_dir,
                    heartbeat_ttl=self.heartbeat_ttl,
                    mode=self.mode,
                    plugins=self.plugins,
                    secret_path=self.secret_path,
                )
                info = self._worker_info(info)
                config = group.config_for(index)
                if dataclasses.is_dataclass(config):
                    config = to_plain(config)
                spec_path = os.path.join(self.log_dir, "specs", f"{worker_type}-{index}.json")
                with open(spec_path, "w") as f:
                    f.write(WorkerSpec(class_path, info, config).to_json())
                log_path = self.log_path(worker_type, index)
                if worker_type == self.echo_worker and index == 0 and os.path.exists(log_path):
                    self._echo_offset = os.path.getsize(log_path)  # a resumed trial: echo only this attempt
                env = dict(base_env, **group.env, **(group.env_per_index[index] if group.env_per_index else {}))
                self._procs.append(self._spawn(info, spec_path, env, log_path))
                if group.restarts > 0:
                    self._respawn[info.tag] = (info, spec_path, env, log_path, group.restarts)
        logger.info("started %d workers; logs in %s", len(self._procs), self.log_dir)

    def _worker_info(self, info: WorkerInfo) -> WorkerInfo:
        """Where a worker binds etc.: local mode keeps the defaults (127.0.0.1)."""
        return info

    def _spawn(self, info: WorkerInfo, spec_path: str, env: dict[str, str], log_path: str) -> WorkerProcess:
        """Starts one worker process (here: a local subprocess)."""
        with open(log_path, "ab") as log:
            popen = subprocess.Popen(
                worker_command(spec_path),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # its own process group: we can stop its whole tree
            )
        return WorkerProcess(info.tag, info.worker_type, info.worker_index, log_path, popen)

    # ---- waiting ----------------------------------------------------------------
    def _experiment_status(self) -> str | None:
        key = names.experiment_status(self.experiment_name, self.trial_name)
        try:
            return self._status_watch.get(key) if self._status_watch is not None else name_resolve.get(key)
        except name_resolve.NameEntryNotFoundError:
            return None
        except Exception as e:  # the backend itself failed
            logger.debug("reading the experiment status failed: %s: %s", type(e).__name__, e)
            raise NameServiceLost(self._name_service_problem() or f"{self._name_service} does not answer") from None

    @property
    def _name_service(self) -> str:
        return (
            f"etcd at {self.nr_config.etcd3_addr}"
            if self.nr_config.type == "etcd3"
            else f"{self.nr_config.type} backend"
        )

    def _name_service_problem(self) -> str | None:
        """Why the name service is unusable, or None while it answers."""
        try:
            name_resolve.get(names.launcher_keepalive(self.experiment_name, self.trial_name))
        except name_resolve.NameEntryNotFoundError:
            pass
        except Exception as e:
            logger.debug("name service check failed: %s: %s", type(e).__name__, e)
            return f"{self._name_service} does not answer"
        if self._etcd_supervisor is not None and self._etcd_supervisor.poll() is not None:
            return f"the private {self._name_service} exited"
        return None

    def _set_experiment_status(self, status: str) -> None:
        try:
            set_experiment_status(self.experiment_name, self.trial_name, status)
        except Exception as e:
            logger.warning("could not set experiment status %s: %s", status, e)

    def _wait(self, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self._echo()
            if self._etcd_supervisor is not None and self._etcd_supervisor.poll() is not None:
                raise NameServiceLost(self._name_service_problem() or f"the private {self._name_service} exited")
            lost = self._cluster_problem()
            if lost is not None:
                return self._abort(f"realrl: {lost}; stopping the trial")
            failed = [p for p in self._procs if p.poll() not in (None, 0)]
            if failed and self._respawn:
                failed = self._restart_failed(failed)
            if failed:
                problem = self._name_service_problem()  # workers die when it goes: say the cause, not a symptom
                if problem is not None:
                    raise NameServiceLost(problem)
                lost = self._cluster_problem(force=True)  # the same for a lost machine
                if lost is not None:
                    return self._abort(f"realrl: {lost}; stopping the trial")
                first = min(failed, key=lambda p: _exit_time_key(p))
                self._report_failure(first)
                self._set_experiment_status(ExperimentStatus.ABORTED)
                return 1
            if all(p.poll() == 0 for p in self._procs):
                logger.info("all workers exited cleanly")
                return 0
            status = self._experiment_status()
            if status == ExperimentStatus.COMPLETE:
                return self._wait_for_completion()
            if status == ExperimentStatus.ABORTED:
                self._say("realrl: trial aborted (experiment_status=ABORTED)")
                return 1
            if self._watchdog is not None and self._watchdog_tick() == "stop":
                return self._stop_hung_trial()
            if deadline is not None and time.monotonic() > deadline:
                self._say(f"realrl: trial did not finish within {timeout}s; stopping it")
                self._set_experiment_status(ExperimentStatus.ABORTED)
                return 124
            time.sleep(self.poll_interval)

    def _restart_failed(self, failed: list[WorkerProcess]) -> list[WorkerProcess]:
        """Starts again the failed workers of groups with `restarts` left
        (while the trial runs and its name service answers); returns the
        failed workers that stop the trial."""
        if self._name_service_problem() is not None or self._experiment_status() != ExperimentStatus.RUNNING:
            return failed
        rest = []
        for proc in failed:
            entry = self._respawn.get(proc.tag)
            if entry is None or entry[4] <= 0:
                rest.append(proc)
                continue
            info, spec_path, env, log_path, left = entry
            # How many times it was started again: a worker that takes over from a dead one may act on it.
            env = {**env, RESTARTS_ENV: str(int(env.get(RESTARTS_ENV, "0")) + 1)}
            self._respawn[proc.tag] = (info, spec_path, env, log_path, left - 1)
            self._say(
                f"realrl: worker {proc.tag} failed ({proc.describe_exit(proc.poll())}); starting it again "
                f"({left - 1} restarts left); log: {log_path}"
            )
            self._procs[self._procs.index(proc)] = self._spawn(info, spec_path, env, log_path)
        return rest

    def _echo(self, final: bool = False) -> None:
        """Copies what the echoed worker wrote since the last call to stdout,
        line by line through the console renderer (realrl/base/console.py:
        the master's step lines become a progress bar on a terminal, periodic
        plain lines otherwise). `final`: also the last line without a newline."""
        if self.echo_worker is None:
            return
        try:
            with open(self.log_path(self.echo_worker, 0), "rb") as f:
                f.seek(self._echo_offset)
                chunk = f.read()
        except FileNotFoundError:
            chunk = b""
        self._echo_offset += len(chunk)
        *lines, self._echo_partial = (self._echo_partial + chunk).split(b"\n")
        if final and self._echo_partial:
            lines.append(self._echo_partial)
            self._echo_partial = b""
        for line in lines:
            self.console.feed(line.decode(errors="replace"))

    @property
    def console(self) -> ConsoleRenderer:
        if self._console is None:
            self._console = ConsoleRenderer(sys.stdout, self.console_every_n_steps)
        return self._console

    def _close_console(self) -> None:
        if self._console is not None:
            self._console.close()

    def _abort(self, message: str) -> int:
        """Says why the trial stops and sets ABORTED; the exit code of a failed trial."""
        self._say(message)
        self._set_experiment_status(ExperimentStatus.ABORTED)
        return 1

    def _say(self, message: str) -> None:
        """A message of ours on stderr, on a line of its own (above the
        console's progress bar, if one is drawn)."""
        if self._console is not None:
            self._console.pause()
        print(message, file=sys.stderr, flush=True)
        if self._console is not None:
            self._console.resume()

    def _wait_for_completion(self) -> int:
        logger.info("experiment COMPLETE; waiting for workers to exit")
        deadline = time.monotonic() + self.stop_timeout
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
            self._echo()
            time.sleep(self.poll_interval)
        self._echo(final=True)
        for p in self._procs:
            if p.poll() not in (None, 0):
                logger.warning("%s exited with %s after completion; log: %s", p.tag, p.poll(), p.log_path)
        return 0

    def _report_failure(self, proc: WorkerProcess) -> None:
        self.failed_worker = proc.tag
        code = proc.poll()
        how = proc.describe_exit(code)
        try:
            tb = name_resolve.get(
                names.worker_error(self.experiment_name, self.trial_name, proc.worker_type, proc.index)
            )
            source = "traceback"
        except Exception:  # none recorded (e.g. killed by a signal), or the name service is gone
            tb, source = log_tail(proc.log_path, _TRACEBACK_TAIL_LINES), "log tail"
        lines = tb.rstrip().splitlines()[-_TRACEBACK_TAIL_LINES:]
        self._say(
            f"realrl: worker {proc.tag} failed ({how}); stopping the trial.\n"
            f"---- {proc.tag} {source} ----\n" + "\n".join(lines) + f"\n---- full log: {proc.log_path}"
        )

    # ---- teardown -----------------------------------------------------------------
    def _stop_all(self, name_service_ok: bool = True) -> None:
        if not self._procs:
            return
        if any(p.poll() is None for p in self._procs):
            if name_service_ok:
                self._set_experiment_status(ExperimentStatus.ABORTED)
                # Workers notice ABORTED within a poll; give them a moment, then
                # SIGTERM, then SIGKILL at stop_timeout.
                self._wait_exit(min(3.0, self.stop_timeout / 3))
            for p in self._procs:
                p.signal(signal.SIGTERM)
            self._wait_exit(self.stop_timeout - min(3.0, self.stop_timeout / 3))
        for p in self._procs:
            p.signal(signal.SIGKILL)  # also reaps stragglers in the group
            try:
                p.wait(timeout=5)
            except (subprocess.TimeoutExpired, TimeoutError):
                logger.error("%s (pid %d on %s) did not die after SIGKILL", p.tag, p.pid, p.node)

    # ---- observability: the trial record, the hang watchdog ---------------------------------
    def _make_watchdog(self):
        workers = [(p.worker_type, p.index) for p in self._procs]
        if self.watchdog_timeout <= 0 or ("master_worker", 0) not in workers:
            return None
        from realrl.launcher.watchdog import Watchdog

        return Watchdog(
            self.experiment_name,
            self.trial_name,
            self.log_dir,
            workers,
            self.watchdog_timeout,
            self.watchdog_action,
            self._say,
            signal_worker=self._signal_for_stacks,
        )

    def _watchdog_tick(self) -> str | None:
        """The watchdog reads the rows itself, so it may be the first to find the name service gone."""
        try:
            return self._watchdog.tick()
        except Exception:
            if (problem := self._name_service_problem()) is None:  # (the watchdog's own failure)
                raise
            raise NameServiceLost(problem) from None

    def _signal_for_stacks(self, row) -> bool:
        """SIGUSR1 to a worker that did not answer a stack dump request: only a
        local worker process itself (a signal to its tree would kill children
        such as the inference server, for which SIGUSR1 is fatal)."""
        from realrl.system.hang_report import signal_local_worker

        return self.mode == "local" and signal_local_worker(row)

    def _stop_hung_trial(self) -> int:
        """The watchdog found a hang: stop the trial like a failed worker. A
        hung worker ignores ABORTED and SIGTERM, so do not wait long for it."""
        self.failed_worker = self._watchdog.culprit  # None when the report could not tell
        self.stop_timeout = min(self.stop_timeout, HUNG_STOP_TIMEOUT_S)
        self._set_experiment_status(ExperimentStatus.ABORTED)
        return 1

    def _write_trial_record(self, final: bool = False) -> None:
        """`<run_dir>/trial.json`: how to reach this trial's name service and
        whether it runs (read by `realrl status`, also after the trial and its
        private etcd are gone). `final`: the exit code and every worker's last
        row, read before the name service stops."""
        import json
        import socket

        record = {
            "experiment_name": self.experiment_name,
            "trial_name": self.trial_name,
            "mode": self.mode,
            "launcher_pid": os.getpid(),
            "launcher_host": socket.gethostname(),
            "log_dir": self.log_dir,
            "name_resolve": dataclasses.asdict(self.nr_config),
            "started": getattr(self, "_started_at", None),
            "ended": None,
        }
        if record["started"] is None:
            record["started"] = self._started_at = time.time()
        if final or self._outcome is not None:
            record.update(
                ended=time.time(),
                exit_code=self._outcome,
                failed_worker=self.failed_worker,
                hang_reports=list(self._watchdog.reports) if self._watchdog is not None else [],
            )
        if final:
            try:
                from realrl.system.trial_status import FINAL_STATES, read_rows, row_to_json

                rows = read_rows(
                    name_resolve.default_repository(),
                    self.experiment_name,
                    self.trial_name,
                    [(p.worker_type, p.index) for p in self._procs],
                )
                exits = {(p.worker_type, p.index): p for p in self._procs}
                for row in rows:
                    proc = exits.get((row.worker_type, row.index))
                    code = proc.poll() if proc is not None else None
                    if code not in (None, 0):
                        row.note = f"process ended: {proc.describe_exit(code)}" + (f"; {row.note}" if row.note else "")
                        if row.state not in FINAL_STATES:
                            row.state = "DEAD"
                record["workers"] = [row_to_json(r) for r in rows]
            except Exception as e:  # the record must not fail the teardown
                logger.debug("no final worker rows in the trial record: %s", e)
        try:
            path = os.path.join(self.run_dir, "trial.json")
            with open(path + ".tmp", "w") as f:
                json.dump(record, f, indent=1)
            os.replace(path + ".tmp", path)
        except OSError as e:
            logger.warning("could not write the trial record: %s", e)

    def _wait_exit(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and any(p.poll() is None for p in self._procs):
            time.sleep(0.05)

    def _release_name_resolve(self) -> None:
        """Stops using the launcher's repository (its keys with delete_on_exit go)."""
        watch, self._status_watch = self._status_watch, None
        if watch is not None:
            watch.close()
        repo, self._repo = self._repo, None
        if repo is not None:
            name_resolve.release(repo)

    def _stop_name_resolve(self) -> None:
        if self._owns_keepalive and self._repo is not None:
            self._owns_keepalive = False
            try:
                self._repo.delete(names.launcher_keepalive(self.experiment_name, self.trial_name))
            except Exception:
                pass
        self._release_name_resolve()
        if self._etcd_supervisor is not None and self._etcd_supervisor.poll() is None:
            self._etcd_supervisor.terminate()
            try:
                self._etcd_supervisor.wait(timeout=15)
            except subprocess.TimeoutExpired:
                signal_tree(self._etcd_supervisor.pid, signal.SIGKILL)
                self._etcd_supervisor.wait()


def worker_command(spec_path: str) -> list[str]:
    return [sys.executable, "-m", "realrl.system.worker_base", "--spec", spec_path]


def _exit_time_key(proc: WorkerProcess) -> float:
    # Popen has no exit time; the log's mtime is when the worker last wrote.
    try:
        return os.path.getmtime(proc.log_path)
    except OSError:
        return 0.0


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt
