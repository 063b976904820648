"""A LocalLauncher trial in a background thread, for tests that drive real
worker processes through the trial's keys. The test uses its own name_resolve
repository (the launcher owns the process-global one)."""

from __future__ import annotations

import json
import threading
import time
import uuid

import pytest

from realrl.base import name_resolve, names, trial_secret
from realrl.base.name_resolve import NameResolveConfig
from realrl.launcher.local import LocalLauncher, WorkerGroup
from realrl.system.worker_base import ExperimentStatus


def wait_until(predicate, timeout: float = 120.0, what: str = "condition", interval: float = 0.05):
    """Polls until `predicate()` is truthy and returns it; fails the test after
    `timeout` (a hang guard, not a performance threshold)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(interval)


class TrialThread:
    def __init__(self, root, etcd_addr: str, groups: list[WorkerGroup], experiment: str, trial: str | None = None):
        self.experiment = experiment
        self.trial = trial or f"t{uuid.uuid4().hex[:8]}"
        nr_config = NameResolveConfig(type="etcd3", etcd3_addr=etcd_addr)
        self.launcher = LocalLauncher(experiment, self.trial, str(root), nr_config, heartbeat_ttl=2, stop_timeout=15)
        self.repo = name_resolve.make_repository(nr_config)
        self.groups = groups
        self.code: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="launcher", daemon=True)

    def _run(self) -> None:
        try:
            self.code = self.launcher.run(self.groups, timeout=400)
        except BaseException as e:  # surfaced by the test
            self.error = e

    def start(self) -> TrialThread:
        self.thread.start()
        # The launcher clears the trial's keys before it sets its keep-alive key:
        # from then on, keys the test adds stay.
        self.wait_key(names.launcher_keepalive(self.experiment, self.trial))
        # The test process is one of the trial's (its clients carry the trial's key); conftest's
        # autouse fixture drops the keys after the test.
        trial_secret.install(self.launcher.secret_path)
        return self

    def get(self, key: str) -> str | None:
        try:
            return self.repo.get(key)
        except name_resolve.NameEntryNotFoundError:
            return None

    def wait_key(self, key: str, timeout: float = 180.0) -> str:
        def get():
            if not self.thread.is_alive():
                pytest.fail(f"the trial ended (code {self.code}, error {self.error!r}) before {key} appeared")
            return self.get(key)

        return wait_until(get, timeout, key, interval=0.1)

    def set(self, key: str, value: str) -> None:
        self.repo.add(key, value, replace=True, delete_on_exit=False)

    def start_training(self) -> None:
        """What a fresh master publishes when training starts: the manager
        admits rollouts from then on (for trials without a master)."""
        start = {"step": 0, "version": 0, "consumed": 0, "dropped": 0, "filtered": 0}
        self.set(names.training_start(self.experiment, self.trial), json.dumps(start))

    def join(self, timeout: float = 120.0) -> int:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "the launcher did not return"
        if self.error is not None:
            raise self.error
        return self.code

    def complete(self) -> int:
        """Marks the experiment COMPLETE and returns the launcher's exit code."""
        self.set(names.experiment_status(self.experiment, self.trial), ExperimentStatus.COMPLETE)
        return self.join()

    def close(self) -> None:
        """Teardown: whatever happened, end the trial and wait for the launcher."""
        if self.thread.is_alive():
            try:
                self.set(names.experiment_status(self.experiment, self.trial), ExperimentStatus.COMPLETE)
            except Exception:
                pass
            self.thread.join(120)
        self.repo.close()
        if trial_secret.installed_path() == self.launcher.secret_path:
            trial_secret.install("")
