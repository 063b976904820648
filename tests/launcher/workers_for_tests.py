"""Small real workers for the launcher tests (imported by module path)."""

from __future__ import annotations

import asyncio
import subprocess
import time

from realrl.system.worker_base import AsyncWorker, ExperimentStatus, PollResult, Worker, set_experiment_status


class CountingWorker(Worker):
    """config: polls (index 0 sets COMPLETE after that many), fail_index, fail_at."""

    def _configure(self, config):
        self.cfg = config or {}
        self.count = 0

    def _poll(self):
        self.count += 1
        time.sleep(0.01)
        if self.info.worker_index == self.cfg.get("fail_index") and self.count == self.cfg.get("fail_at"):
            raise ValueError(f"boom from {self.info.tag} at poll {self.count}")
        polls = self.cfg.get("polls")
        if polls and self.info.worker_index == 0 and self.count == polls:
            set_experiment_status(self.experiment_name, self.trial_name, ExperimentStatus.COMPLETE)
        return PollResult(sample_count=1)


class AsyncCountingWorker(AsyncWorker):
    def _configure(self, config):
        self.count = 0

    async def _poll_async(self):
        self.count += 1
        await asyncio.sleep(0.01)
        return PollResult(sample_count=1)


class SpawningWorker(Worker):
    """Owns a child process, as a GenerationServer owns its inference server.
    config: exit_hook_s, how long stopping the child takes (a server that is
    slow to stop)."""

    def _configure(self, config):
        self.exit_hook_s = (config or {}).get("exit_hook_s", 0)
        self.child = subprocess.Popen(["sleep", "600"])
        with open(f"{self.info.log_dir}/spawned-{self.info.worker_index}.pid", "w") as f:
            f.write(str(self.child.pid))

    def _poll(self):
        time.sleep(0.05)
        return PollResult()

    def _exit_hook(self):
        time.sleep(self.exit_hook_s)
        self.child.kill()
        self.child.wait()
        self.logger.info("child stopped")


class BadConfigWorker(Worker):
    def _configure(self, config):
        raise KeyError("config key 'model_path' is missing")
