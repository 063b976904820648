"""The skeleton every worker process lives in (docs/design.md §2).

A worker is a loop: `_configure` once, then `_poll` (or `_poll_async`) until
the trial ends. The base class owns everything that is the same for every
kind of worker:

- a status key (READY / RUNNING / PAUSED / COMPLETED / STOPPED / ERROR) held with a TTL,
  so a worker that dies even by SIGKILL drops out of name_resolve;
- exit when `experiment_status` becomes COMPLETE or ABORTED, when the
  launcher's keep-alive key disappears (the launcher died), or on SIGTERM /
  SIGINT (those keys and the stack dump request are followed through a
  `name_resolve` watch: with etcd the loop's checks read nothing);
- on an exception: status ERROR, the traceback in the log and under
  `names.worker_error`, where the launcher reads it to say what failed;
- a progress record under `names.worker_progress` (host, pid, state, a
  progress counter and what the worker is doing: `_progress_info`),
  rewritten every two seconds (PROGRESS_INTERVAL) from the loop, for `realrl status` and the
  hang watchdog (docs/observability.md);
- stack dumps of all its threads into `<log_dir>/stacks/<type>-<index>.txt`,
  on SIGUSR1 (faulthandler, works even while the process is wedged) or when
  `names.stack_dump_request` changes (a thread watches it, so launchers and
  `realrl status --stacks` reach workers on any node).

Run a worker process with `python -m realrl.system.worker_base --spec F`
(the launcher writes F; see `realrl.api.system_api.WorkerSpec`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import faulthandler
import gc
import json
import os
import signal
import socket
import threading
import time
import traceback
from typing import Any, NamedTuple

from realrl.api.system_api import WorkerInfo, WorkerSpec, from_plain
from realrl.base import logging as realrl_logging
from realrl.base import name_resolve, names, network, trial_secret
from realrl.base.plugins import load_plugins


class WorkerStatus:
    READY = "READY"
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    COMPLETED = "COMPLETED"  # exited cleanly once the trial completed
    STOPPED = "STOPPED"  # exited cleanly before that: Ctrl-C, the trial aborted, the launcher gone
    ERROR = "ERROR"


class ExperimentStatus:
    RUNNING = "RUNNING"
    COMPLETE = "COMPLETE"
    ABORTED = "ABORTED"


def set_experiment_status(experiment_name: str, trial_name: str, status: str) -> None:
    """Sets the trial's status. The key outlives the writer (delete_on_exit is
    off): every worker must get to see COMPLETE/ABORTED."""
    name_resolve.add(names.experiment_status(experiment_name, trial_name), status, replace=True, delete_on_exit=False)


class PollResult(NamedTuple):
    sample_count: int = 0
    batch_count: int = 0


IDLE = PollResult(0, 0)
_MAX_IDLE_SLEEP = 0.05  # seconds; a poll that found nothing backs off up to this
RESTARTS_ENV = "REALRL_WORKER_RESTARTS"  # set by the launcher for a worker it started again after it failed
_STATUS_CHECK_INTERVAL = 0.5  # seconds between reads of experiment_status
# Seconds between rewrites of the progress record: each is a name-service write (etcd: a put
# and its fsync, ~2 ms of CPU both sides); realrl status calls a record stale after STALE_S (10 s).
PROGRESS_INTERVAL = 2.0
_STACK_REQUEST_POLL = 1.0  # seconds between reads of the stack dump request key


def stacks_path(log_dir: str, worker_type: str, worker_index: int) -> str:
    """Where a worker appends its stack dumps."""
    return os.path.join(log_dir, "stacks", f"{worker_type}-{worker_index}.txt")


class WorkerExiting(Exception):
    """Raised out of a long wait (see `Worker.raise_if_exiting`) once the
    worker has been asked to exit; `run` treats it as a clean stop."""


class Worker:
    """Synchronous worker: subclasses implement `_configure` and `_poll`."""

    config_cls: type | None = None  # the dataclass the spec's config is parsed into
    # The collector's thresholds once the worker runs (`gc.set_threshold`; None: Python's own).
    collector_thresholds: tuple[int, int, int] | None = None

    def __init__(self, info: WorkerInfo, config: Any = None):
        self.info = info
        self.config = config
        self.logger = realrl_logging.getLogger(f"realrl.{info.worker_type}")
        self.exit_reason = ""
        self.trial_complete = False  # exiting because the trial completed (not aborted, not a signal)
        self._stop = threading.Event()
        self._last_status_check = 0.0
        self._status = ""
        self._progress_count = 0  # work done: the poll results' sample + batch counts
        self._last_progress_publish = -float("inf")
        self._progress_lock = threading.Lock()
        self._stacks_file = None
        self._stacks_lock = threading.Lock()
        self._ran = threading.Event()  # run() returned: the stack dump thread ends
        # experiment_status and the stack dump request, as the loop's checks read them (`_names`)
        self._watch: name_resolve.ValueWatch | None = None
        self._watch_lock = threading.Lock()

    # ---- hooks for subclasses ---------------------------------------------
    def _configure(self, config: Any) -> None:
        """Set up sockets, models, servers. Runs once before the first poll."""

    def _poll(self) -> PollResult:
        raise NotImplementedError

    def _exit_hook(self) -> None:
        """Release what `_configure` acquired (child processes, sockets)."""

    def _progress_info(self) -> dict:
        """What this worker is doing now, in a few JSON-able fields (its queue
        depths among them), for `realrl status` and the hang watchdog. Called
        every two seconds from the loop while RUNNING: keep it cheap."""
        return {}

    # ---- control ------------------------------------------------------------
    def _names(self) -> name_resolve.ValueWatch:
        """The trial's keys this worker's checks look at often (`experiment_status`,
        `stack_dump_request`): with etcd a watch keeps them, so a check reads
        nothing; made on first use, and again if the process's name service changed."""
        repo = name_resolve.default_repository()
        watch = self._watch
        if watch is not None and watch.repository is repo:
            return watch
        with self._watch_lock:
            if self._watch is None or self._watch.repository is not repo:
                self._status_key = names.experiment_status(self.experiment_name, self.trial_name)
                self._stack_key = names.stack_dump_request(self.experiment_name, self.trial_name)
                keys = [self._status_key, self._stack_key]
                old, self._watch = self._watch, repo.watch_values(keys, _STATUS_CHECK_INTERVAL)
                if old is not None:
                    old.close()
            return self._watch

    @property
    def experiment_name(self) -> str:
        return self.info.experiment_name

    @property
    def trial_name(self) -> str:
        return self.info.trial_name

    def request_exit(self, reason: str) -> None:
        if not self._stop.is_set():
            self.exit_reason = reason
            self.logger.info("exiting: %s", reason)
        self._stop.set()

    @property
    def exiting(self) -> bool:
        return self._stop.is_set()

    def set_status(self, status: str) -> None:
        key = names.worker_status(self.experiment_name, self.trial_name, self.info.worker_type, self.info.worker_index)
        final = status in (WorkerStatus.COMPLETED, WorkerStatus.STOPPED, WorkerStatus.ERROR)
        # Live states carry a TTL (a dead worker's key vanishes); final states
        # stay after exit so the launcher can read how the worker ended.
        name_resolve.add(
            key,
            status,
            keepalive_ttl=None if final else self.info.heartbeat_ttl,
            replace=True,
            delete_on_exit=not final,
        )
        self._status = status
        self._publish_progress(force=True)

    def _publish_progress(self, force: bool = False) -> None:
        """Rewrites this worker's progress record (at most every
        PROGRESS_INTERVAL unless `force`). Never raises: it is only a report."""
        now = time.monotonic()
        if not force and now - self._last_progress_publish < PROGRESS_INTERVAL:
            return
        if not self._progress_lock.acquire(blocking=False):
            return  # another thread is publishing right now
        try:
            self._last_progress_publish = now
            doing: dict = {}
            if self._status in (WorkerStatus.RUNNING, WorkerStatus.PAUSED):
                try:
                    doing = self._progress_info() or {}
                except Exception as e:  # e.g. a field not set up yet
                    self.logger.debug("progress info failed: %s: %s", type(e).__name__, e)
            record = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "state": self._status,
                "time": time.time(),
                "progress": self._progress_count,
                "main_thread": f"0x{threading.main_thread().ident:016x}",
                "doing": doing,
            }
            key = names.worker_progress(
                self.experiment_name, self.trial_name, self.info.worker_type, self.info.worker_index
            )
            name_resolve.add(key, json.dumps(record, default=str), replace=True, delete_on_exit=False)
        except Exception as e:  # the name service hiccuped: the next one will do
            self.logger.debug("progress record not published: %s: %s", type(e).__name__, e)
        finally:
            self._progress_lock.release()

    # ---- stack dumps ------------------------------------------------------------
    def _install_stack_dumps(self) -> None:
        """SIGUSR1 dumps every thread's stack into the stacks file (faulthandler:
        C code, so it works while the interpreter is stuck), and a thread
        serves `names.stack_dump_request` the same way for requesters on other
        nodes (launchers, `realrl status --stacks`)."""
        if not self.info.log_dir:
            return
        path = stacks_path(self.info.log_dir, self.info.worker_type, self.info.worker_index)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            self._stacks_file = open(path, "a")
        except OSError as e:
            self.logger.warning("no stack dumps (cannot open %s: %s)", path, e)
            return
        if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
            faulthandler.register(signal.SIGUSR1, file=self._stacks_file, all_threads=True, chain=False)
        threading.Thread(target=self._serve_stack_requests, name="stack-dumps", daemon=True).start()

    def _serve_stack_requests(self) -> None:
        key = names.stack_dump_request(self.experiment_name, self.trial_name)
        last = None
        first = True
        while not self._ran.is_set():
            try:
                request = self._names().get(key)
            except Exception:  # none yet, or the name service hiccuped
                request = None
            if first:  # a request from before we started is not for us
                first, last = False, request
            elif request is not None and request != last:
                last = request
                self.dump_stacks(request)
            self._ran.wait(_STACK_REQUEST_POLL)

    def _uninstall_stack_dumps(self) -> None:
        self._ran.set()
        with self._watch_lock:
            if self._watch is not None:
                self._watch.close()
        if self._stacks_file is None:
            return
        if hasattr(signal, "SIGUSR1") and threading.current_thread() is threading.main_thread():
            faulthandler.unregister(signal.SIGUSR1)
        with self._stacks_lock:
            self._stacks_file.close()
            self._stacks_file = None

    def dump_stacks(self, request_id: str = "") -> None:
        """Appends the stacks of all threads to the stacks file, between a
        header naming the main thread and an end line (what requesters wait for)."""
        with self._stacks_lock:
            f = self._stacks_file
            if f is None:
                return
            try:
                stamp = datetime.datetime.now().isoformat(timespec="seconds")
                f.write(
                    f"=== stack dump {request_id} | {self.info.tag} pid {os.getpid()} on {socket.gethostname()} | "
                    f"main thread 0x{threading.main_thread().ident:016x} | {stamp} ===\n"
                )
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
                f.write(f"=== end {request_id} ===\n")
                f.flush()
            except (OSError, ValueError) as e:  # disk full, file closed at exit
                self.logger.debug("stack dump failed: %s", e)

    @property
    def bind_host(self) -> str:
        """The address this worker's servers and sockets bind and advertise:
        127.0.0.1 in local mode, else its node's address (set by the launcher)."""
        return network.bind_address(self.info.mode, self.info.bind_address)

    def raise_if_exiting(self) -> None:
        """For long waits outside the poll loop (e.g. for peers to connect):
        raises WorkerExiting once the trial ends or a signal asks us to stop."""
        if self._check_exit_conditions():
            raise WorkerExiting(self.exit_reason)

    def _check_exit_conditions(self) -> bool:
        self._publish_progress()
        if self._stop.is_set():
            return True
        now = time.monotonic()
        watch = self._names()
        if watch.live or now - self._last_status_check >= _STATUS_CHECK_INTERVAL:  # (live: nothing read)
            self._last_status_check = now
            try:
                status = watch.get(self._status_key)
            except name_resolve.NameEntryNotFoundError:
                status = None
            if status in (ExperimentStatus.COMPLETE, ExperimentStatus.ABORTED):
                self.trial_complete = status == ExperimentStatus.COMPLETE and not self._stop.is_set()
                self.request_exit(f"experiment status {status}")
        return self._stop.is_set()

    # ---- the process ----------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        signals = []

        def on_signal(signum, frame):
            # A second signal (a second Ctrl-C): stop now. One signal while the worker already
            # exits on its own (the trial ended) is the launcher's stop sequence: the exit hooks
            # (e.g. stopping a server process) run to the end, within the launcher's stop_timeout.
            signals.append(signum)
            if len(signals) > 1:
                raise SystemExit(128 + signum)
            self.request_exit(f"signal {signal.Signals(signum).name}")

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    def _watch_launcher(self) -> None:
        if not self.info.watch_launcher:
            return
        key = names.launcher_keepalive(self.experiment_name, self.trial_name)
        try:
            name_resolve.get(key)
        except name_resolve.NameEntryNotFoundError:
            self.logger.warning("no launcher keep-alive key %s; not watching the launcher", key)
            return
        name_resolve.watch_names(
            key,
            lambda: self.request_exit("launcher keep-alive key disappeared"),
            poll_frequency=min(1.0, self.info.heartbeat_ttl / 4),
        )

    def _main_loop(self) -> None:
        idle_sleep = 0.001
        while not self._check_exit_conditions():
            result = self._poll()
            self._progress_count += result.sample_count + result.batch_count
            if result.sample_count or result.batch_count:
                idle_sleep = 0.001
            else:
                time.sleep(idle_sleep)
                idle_sleep = min(idle_sleep * 2, _MAX_IDLE_SLEEP)

    def run(self) -> int:
        """Runs the worker to the end; returns the process exit code."""
        realrl_logging.configure(self.info.tag)
        self._install_signal_handlers()
        self._install_stack_dumps()
        code = 0
        try:
            self.set_status(WorkerStatus.READY)
            self._watch_launcher()
            self._configure(self.config)
            # What exists now (imported libraries: torch and transformers alone are about a million
            # objects; models, tokenizers) lives as long as the process: out of every later collection,
            # whose pauses stall the worker's loop (a full one took ~0.5 s in a rollout worker of 8k
            # episodes, benchmarks/control_plane.py).
            gc.freeze()
            if self.collector_thresholds is not None:
                gc.set_threshold(*self.collector_thresholds)
                self.logger.info("collector thresholds %s", gc.get_threshold())
            self.set_status(WorkerStatus.RUNNING)
            self.logger.info("running")
            self._main_loop()
        except BaseException as e:  # noqa: BLE001 - everything must be reported
            if isinstance(e, (KeyboardInterrupt, SystemExit, WorkerExiting)) and self._stop.is_set():
                self.logger.info("stopped by %s", type(e).__name__)
            elif not self._name_service_reachable():
                # Every worker fails when etcd goes; the cause is not in our
                # traceback, and the launcher says it once for the trial.
                code = 1
                # (Worded apart from the launcher's "name service lost" line, which is the one that says it
                # on the console; the master's log is echoed there too.)
                self.logger.error(
                    "exiting: the name service does not answer (%s: %s)",
                    type(e).__name__,
                    str(e).strip().split("\n")[0],
                )
                self.logger.debug("while name service was lost:\n%s", traceback.format_exc())
            else:
                code = 1
                self._report_error(traceback.format_exc())
        finally:
            try:
                self._exit_hook()
            except Exception:
                self.logger.error("exit hook failed:\n%s", traceback.format_exc())
                if code == 0:
                    code = 1
                    self._report_error(traceback.format_exc())
            final = WorkerStatus.ERROR if code else self._clean_exit_status()
            try:
                self.set_status(final)
                name_resolve.reset()
            except Exception as e:  # name service gone at shutdown: nothing to tell
                self.logger.debug("final status not recorded: %s", e)
        self.logger.info("exited with code %d (%s)", code, final)
        self._uninstall_stack_dumps()
        return code

    def _clean_exit_status(self) -> str:
        """COMPLETED when the trial completed (the master set COMPLETE), else STOPPED: a
        worker that Ctrl-C or an aborted trial stopped did not complete anything."""
        try:
            status = name_resolve.get(names.experiment_status(self.experiment_name, self.trial_name))
        except Exception:  # not set, or the name service is gone: nothing says the trial completed
            status = None
        return WorkerStatus.COMPLETED if status == ExperimentStatus.COMPLETE else WorkerStatus.STOPPED

    def _name_service_reachable(self) -> bool:
        try:
            name_resolve.get(names.experiment_status(self.experiment_name, self.trial_name))
        except name_resolve.NameEntryNotFoundError:
            pass
        except Exception:
            return False
        return True

    def _report_error(self, tb: str) -> None:
        self.logger.error("worker failed:\n%s", tb)
        try:
            key = names.worker_error(
                self.experiment_name, self.trial_name, self.info.worker_type, self.info.worker_index
            )
            name_resolve.add(key, tb, replace=True, delete_on_exit=False)
        except Exception as e:
            self.logger.error("could not record the traceback in name_resolve: %s", e)


class AsyncWorker(Worker):
    """Worker whose loop is a coroutine: implement `_poll_async`; optional
    `_setup_async` / `_teardown_async` run inside the event loop (e.g. to start
    and stop an HTTP service)."""

    _loop_task: asyncio.Task | None = None
    # An idle loop sleeps 1 ms after a poll that found nothing, then twice as long each time up to
    # this; `wake_poll` ends the sleep at once (a worker that is told of its changes can sleep longer).
    max_idle_sleep: float = _MAX_IDLE_SLEEP
    _woken = False
    _wake_future: asyncio.Future | None = None

    def awaiting(self) -> list[str]:
        """The coroutines the loop is suspended in, outermost first (function
        names, e.g. `[..., "_poll_async", "_train_step", "_fetch", "sleep"]`).
        Meaningful when called from another task of the loop (the progress
        record is published from the exit watcher)."""
        chain: list[str] = []
        coro = self._loop_task.get_coro() if self._loop_task is not None else None
        while coro is not None and len(chain) < 64:
            code = getattr(coro, "cr_code", None) or getattr(coro, "gi_code", None)
            if code is None:  # a future, not a coroutine: the bottom of the chain
                break
            chain.append(code.co_name)
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        return chain

    async def _setup_async(self) -> None:
        pass

    def wake_poll(self) -> None:
        """The next poll runs now, not after the idle sleep (call it on the loop's thread)."""
        self._woken = True
        future = self._wake_future
        if future is not None and not future.done():
            future.set_result(None)

    async def _idle_sleep(self, seconds: float) -> None:
        if self._woken:
            self._woken = False
            return
        loop = asyncio.get_running_loop()
        future = self._wake_future = loop.create_future()
        timer = loop.call_later(seconds, _set_done, future)
        try:
            await future
        finally:
            timer.cancel()
            self._wake_future = None
            self._woken = False

    async def _poll_async(self) -> PollResult:
        raise NotImplementedError

    async def _teardown_async(self) -> None:
        pass

    def _main_loop(self) -> None:
        asyncio.run(self._main_loop_async())

    async def _main_loop_async(self) -> None:
        # The loop runs as a task beside a watcher of the exit conditions: a
        # poll may wait a long time (the master in an RPC to a worker that just
        # died), and the trial's end or a SIGTERM must stop it within a poll
        # interval, not when the wait times out.
        loop_task = self._loop_task = asyncio.create_task(self._setup_and_poll())
        watcher = asyncio.create_task(self._watch_exit())
        try:
            await asyncio.wait({loop_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not loop_task.done():
                self.logger.info("stopping the running poll: %s", self.exit_reason)
                loop_task.cancel()
                await asyncio.gather(loop_task, return_exceptions=True)
            elif not loop_task.cancelled() and loop_task.exception() is not None:
                raise loop_task.exception()
        finally:
            watcher.cancel()
            await asyncio.gather(watcher, return_exceptions=True)
            await self._teardown_async()

    async def _setup_and_poll(self) -> None:
        await self._setup_async()
        idle_sleep = 0.001
        while not self._check_exit_conditions():
            result = await self._poll_async()
            self._progress_count += result.sample_count + result.batch_count
            if result.sample_count or result.batch_count:
                idle_sleep = 0.001
                await asyncio.sleep(0)
            else:
                await self._idle_sleep(idle_sleep)
                idle_sleep = min(idle_sleep * 2, self.max_idle_sleep)

    async def _watch_exit(self) -> None:
        while not self._check_exit_conditions():
            await asyncio.sleep(_STATUS_CHECK_INTERVAL / 5)


def _set_done(future: asyncio.Future) -> None:
    if not future.done():
        future.set_result(None)


def run_worker(spec: WorkerSpec) -> int:
    """Builds the worker a spec names and runs it. Errors while building
    (plugins, config, imports) are reported like errors in the loop."""
    from realrl.system import load_worker_class

    info = spec.info
    realrl_logging.configure(info.tag)
    trial_secret.install(info.secret_path)  # this process's keys, before it talks to anyone
    name_resolve.reconfigure(info.name_resolve)
    try:
        load_plugins(info.plugins)
        cls = load_worker_class(spec.worker_class)
        config = from_plain(cls.config_cls, spec.config) if cls.config_cls is not None else spec.config
        worker = cls(info, config)
    except Exception:
        tb = traceback.format_exc()
        realrl_logging.getLogger("worker_base").error("could not build worker %s:\n%s", info.tag, tb)
        key = names.worker_error(info.experiment_name, info.trial_name, info.worker_type, info.worker_index)
        name_resolve.add(key, tb, replace=True, delete_on_exit=False)
        return 1
    return worker.run()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Run one realrl worker process.")
    parser.add_argument("--spec", required=True, help="path of the WorkerSpec JSON the launcher wrote")
    args = parser.parse_args(argv)
    with open(args.spec) as f:
        spec = WorkerSpec.from_json(f.read())
    return run_worker(spec)


if __name__ == "__main__":
    # Run the imported module's main, not this __main__ copy, so worker classes
    # and the entry point share one `realrl.system.worker_base`.
    from realrl.base.process import exit_process
    from realrl.system.worker_base import main as _main

    exit_process(_main())  # (its status recorded, its keys deleted: no module teardown to wait for)
