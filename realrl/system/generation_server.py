"""GenerationServer worker: owns one inference server process (docs/design.md §2, §6).

`_configure`:
1. checks the backend can run here (e.g. SGLang installed) and that the model
   exists, before anything starts;
2. takes a port from `network.find_free_port(exp, trial)` and starts the
   backend's command as a child process. The child writes its output to
   `<log_dir>/<worker_type>-<index>.server.log` (next to the worker's log),
   stays in the worker's process group (so the launcher's group kill reaches
   it), and asks the kernel for SIGKILL when the worker dies
   (`prctl(PR_SET_PDEATHSIG)` in a tiny exec wrapper), so it can never outlive
   the worker, even one killed by SIGKILL;
3. waits for `/health` (up to `startup_timeout`); if the child dies or never
   gets healthy the worker fails with the tail of the server log;
4. registers `http://<address>:<port>` under `names.gen_server(exp, trial, i)`.

`_poll` watches the child: if it dies the worker raises (status ERROR, the
launcher stops the trial and shows the server log tail). `_exit_hook`
unregisters the URL, stops the child's whole process tree (SIGTERM, then
SIGKILL after a grace period) and reaps it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time

from realrl.api.system_api import GenerationServerConfig
from realrl.base import name_resolve, names, network
from realrl.base.process import log_tail, stop_process_tree, with_parent_death_signal
from realrl.impl.generation.backends import get_backend
from realrl.impl.generation.client import GenerationClient
from realrl.system.worker_base import IDLE, PollResult, Worker

_LOG_TAIL_LINES = 60
_STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL

class GenerationServer(Worker):
    config_cls = GenerationServerConfig

    def _configure(self, config: GenerationServerConfig) -> None:
        self.cfg = config
        self.process: subprocess.Popen | None = None
        self._log_file = None
        self.url: str | None = None

        # Everything that can be checked without starting a process comes first.
        backend = get_backend(config.backend)
        backend.check_available()
        if not config.model_path:
            raise ValueError("GenerationServerConfig.model_path is empty: the server needs initial weights")
        if not os.path.exists(config.model_path):
            raise FileNotFoundError(f"generation server model_path {config.model_path!r} does not exist")

        host = network.bind_address(self.info.mode, self.info.bind_address)
        port = network.find_free_port(self.experiment_name, self.trial_name, host=host)
        # The launcher hands each worker its own devices through
        # CUDA_VISIBLE_DEVICES; without that, server i takes GPUs [i*tp, (i+1)*tp).
        base_gpu_id = 0 if os.environ.get("CUDA_VISIBLE_DEVICES") else self.info.worker_index * config.tp_size
        cmd = backend.command(config, host, port, base_gpu_id=base_gpu_id)

        log_dir = self.info.log_dir or tempfile.mkdtemp(prefix="realrl-gen-server-")
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"{self.info.worker_type}-{self.info.worker_index}.server.log")
        self._log_file = open(self.log_path, "ab")
        self.logger.info("starting %s server on %s:%d (log %s): %s", config.backend, host, port, self.log_path,
                         " ".join(cmd))  # fmt: skip
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(
            with_parent_death_signal(cmd, os.getpid()),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            # No new session: the child stays in our process group, so a
            # signal to the group (the launcher's teardown) reaches it too.
        )

        url = f"http://{network.advertise_address(self.info.mode, self.info.bind_address)}:{port}"
        t0 = time.monotonic()
        if not asyncio.run(self._wait_healthy(url)):
            return  # the trial ended while we waited; the main loop exits at once
        self.url = url
        self.logger.info("server pid %d healthy at %s after %.1fs", self.process.pid, url, time.monotonic() - t0)
        name_resolve.add(names.gen_server(self.experiment_name, self.trial_name, self.info.worker_index), url,
                         replace=True)  # fmt: skip

    async def _wait_healthy(self, url: str) -> bool:
        """True once /health answers; False if the worker is asked to exit
        first; raises if the child dies or `startup_timeout` passes."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        async with GenerationClient(timeout_s=10.0, connect_timeout_s=2.0) as client:
            while True:
                self._check_child("during startup")
                if await client.health(url, timeout_s=2.0):
                    return True
                if self._check_exit_conditions():
                    return False
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"{self.cfg.backend} server (pid {self.process.pid}) at {url} was not healthy after "
                        f"startup_timeout={self.cfg.startup_timeout}s; last lines of {self.log_path}:\n"
                        f"{log_tail(self.log_path, _LOG_TAIL_LINES)}"
                    )
                await asyncio.sleep(0.25)

    def _check_child(self, when: str) -> None:
        code = self.process.poll()
        if code is None:
            return
        if code < 0:
            how = f"was killed by signal {signal.Signals(-code).name if -code in signal.valid_signals() else -code}"
        else:
            how = f"exited with code {code}"
        raise RuntimeError(
            f"{self.cfg.backend} generation server (pid {self.process.pid}) {how} {when}; "
            f"last lines of {self.log_path}:\n{log_tail(self.log_path, _LOG_TAIL_LINES)}"
        )

    def _poll(self) -> PollResult:
        self._check_child("while serving")
        return IDLE

    def _exit_hook(self) -> None:
        if getattr(self, "url", None) is not None:
            try:  # stop routing to us before the server goes away
                name_resolve.delete(names.gen_server(self.experiment_name, self.trial_name, self.info.worker_index))
            except Exception as e:
                self.logger.debug("could not unregister %s: %s", self.url, e)
        process = getattr(self, "process", None)
        if process is not None:
            running = process.poll() is None
            stop_process_tree(process, _STOP_GRACE_S)
            if running:
                self.logger.info("stopped the generation server (pid %d, exit code %s)", process.pid,
                                 process.returncode)  # fmt: skip
        if getattr(self, "_log_file", None) is not None:
            self._log_file.close()
