"""The hang watchdog (`watchdog.timeout`, `watchdog.action`; docs/observability.md).

The launcher calls `tick()` from its wait loop. Once every worker is RUNNING,
the watchdog looks at the master's progress record (rewritten every two seconds) about once a second
(through a `name_resolve` watch of its keys: with etcd, read from the values
etcd pushed, not from a read each time); a new
step or a new stage (fetch, inference, train_step, evaluate, checkpoint,
...) is progress. When there has been none for `timeout` seconds it writes a
hang report (every worker's progress record, heartbeat and stacks, and the
worker everybody waits on when that can be seen: realrl/system/hang_report.py),
prints a short block naming it, and answers "stop" (the launcher stops the
trial, exit code 1) or, with action=report, "report" and starts counting
again.

Set-up (model loading, server start) is not watched: it has its own
timeouts (server.startup_timeout, ...). Set the timeout above the longest
single step, evaluation or checkpoint of the run.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable

from realrl.base import name_resolve, names
from realrl.base.logging import getLogger
from realrl.system.hang_report import build_report, signal_local_worker
from realrl.system.trial_status import Row, read_row

logger = getLogger("launcher.watchdog")

READ_INTERVAL_S = 1.0
MASTER = ("master_worker", 0)


class Watchdog:
    def __init__(
        self,
        experiment: str,
        trial: str,
        log_dir: str,
        workers: list[tuple[str, int]],
        timeout: float,
        action: str,
        say: Callable[[str], None],
        signal_worker: Callable[[Row], bool] | None = signal_local_worker,
    ):
        if action not in ("stop", "report"):
            raise ValueError(f"watchdog.action must be stop|report, got {action!r}")
        self.experiment, self.trial, self.log_dir = experiment, trial, log_dir
        self.workers = list(workers)
        self.timeout = timeout
        self.action = action
        self.say = say
        self.signal_worker = signal_worker
        self.armed = False
        self._last_read = -float("inf")
        self._mark: tuple | None = None  # the master's (step, stage) when it last changed
        self._since = 0.0  # monotonic time of that change (or of arming)
        self._since_wall = 0.0
        self.reports: list[str] = []
        self.culprit: str | None = None
        self._master_keys: name_resolve.ValueWatch | None = None  # (the master's row, once armed)

    def tick(self) -> str | None:
        """None while all is well (or nothing to say yet); "report" or "stop" after a hang report."""
        now = time.monotonic()
        if now - self._last_read < READ_INTERVAL_S:
            return None
        self._last_read = now
        repo = name_resolve.default_repository()
        if not self.armed:
            rows = [read_row(repo, self.experiment, self.trial, kind, index) for kind, index in self.workers]
            if rows and all(r.state == "RUNNING" for r in rows):
                self.armed = True
                self._restart(now, self._master_mark(repo))
                logger.debug(
                    "watchdog armed: every worker is running (timeout %gs, action %s)", self.timeout, self.action
                )
            return None
        mark = self._master_mark(repo)
        if mark != self._mark:
            self._restart(now, mark)
            return None
        if now - self._since < self.timeout:
            return None
        return self._report(now)

    def _restart(self, now: float, mark: tuple | None) -> None:
        self._mark, self._since, self._since_wall = mark, now, time.time()

    def _master_mark(self, repo) -> tuple | None:
        watch = self._master_keys
        if watch is None or watch.repository is not repo:
            kind, index = MASTER
            keys = [
                names.worker_status(self.experiment, self.trial, kind, index),
                names.worker_progress(self.experiment, self.trial, kind, index),
                names.worker_error(self.experiment, self.trial, kind, index),
            ]
            if watch is not None:
                watch.close()
            watch = self._master_keys = repo.watch_values(keys, READ_INTERVAL_S)
        row = read_row(watch, self.experiment, self.trial, *MASTER)
        if not row.doing:
            return None
        return row.doing.get("step"), row.doing.get("stage")

    def _report(self, now: float) -> str:
        idle = now - self._since
        since = datetime.datetime.fromtimestamp(self._since_wall).isoformat(timespec="seconds")
        step, stage = self._mark if self._mark is not None else ("?", "?")
        reason = (
            f"no training progress for {idle:.0f}s (watchdog.timeout={self.timeout:g}): the master has been at "
            f"step {step}, stage {stage} since {since} (epoch {self._since_wall:.3f})"
        )
        try:
            path, findings, culprit = build_report(
                name_resolve.default_repository(),
                self.experiment,
                self.trial,
                self.log_dir,
                self.workers,
                reason,
                self.signal_worker,
            )
        except Exception as e:  # the report must not take the launcher down; say what we know
            logger.warning("hang report failed: %s: %s", type(e).__name__, e)
            path, findings, culprit = f"(not written: {e})", [], None
        self.reports.append(path)
        self.culprit = culprit
        what = (
            "stopping the trial"
            if self.action == "stop"
            else f"still running (watchdog.action=report; next check in {self.timeout:g}s)"
        )
        conclusion = findings[-1] if findings else "=> could not tell which worker the others wait on"
        self.say(
            f"realrl: watchdog: no training progress for {idle:.0f}s (step {step}, stage {stage}); {what}.\n"
            f"  {conclusion.removeprefix('=> ')}\n"
            f"  hang report (stacks of every worker): {path}"
        )
        self._restart(time.monotonic(), self._mark)
        return "stop" if self.action == "stop" else "report"
