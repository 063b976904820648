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
4. loads the trainer's current weight version (`names.model_version`, from
   `<weights_dir>/<v>/`) when one was published and is on disk (a server
   started mid-run: restarted, or added with `python -m realrl add-server`;
   with weights.transport=broadcast a version may have no directory, and the
   manager has the trainer write it before it routes here);
5. registers `http://<address>:<port>` under `names.gen_server(exp, trial, i)`.

A judge's server (`config.judge`, worker type `judge_server`) is started
frozen (torch: `--frozen`, every weight change answered 400), skips step 4
and registers under `names.judge_server(exp, trial, i)`, where the
generation-server manager never looks (docs/design.md §11).

`_poll` watches the child: if it dies, the worker unregisters, logs the tail
of the server log and starts a new server (steps 2-5, at a new port); the
manager puts it back into routing once it holds the current weights
(docs/architecture.md, "Generation servers that come and go"). A server that
dies more than `max_restarts` times within `restart_window` seconds fails the
worker (status ERROR, the launcher stops the trial and shows why and the
server log tail). `_exit_hook` unregisters the URL, stops the child's whole
process tree (SIGTERM, then SIGKILL after a grace period) and reaps it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import threading
import time

from realrl.api.system_api import GenerationServerConfig
from realrl.base import name_resolve, names, network
from realrl.base.process import log_tail, stop_process_tree, with_parent_death_signal
from realrl.impl.generation import make_client
from realrl.impl.generation.backends import get_backend
from realrl.impl.generation.client import GenerationServerError, GenerationServerUnavailable
from realrl.system.worker_base import IDLE, PollResult, Worker

_LOG_TAIL_LINES = 60
_STOP_GRACE_S = 10.0  # SIGTERM -> SIGKILL
_INFO_INTERVAL_S = 2.0  # the progress record's server figures are at most this old


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

        self._backend = backend
        self._restarts: list[float] = []  # when the server was restarted (time.monotonic())
        log_dir = self.info.log_dir or tempfile.mkdtemp(prefix="realrl-gen-server-")
        os.makedirs(log_dir, exist_ok=True)
        self.log_path = os.path.join(log_dir, f"{self.info.worker_type}-{self.info.worker_index}.server.log")
        self._log_file = open(self.log_path, "ab")
        try:
            self._start_server()
        except RuntimeError:  # it died while starting (e.g. its port was taken meanwhile): a restart
            if self.process is None or self.process.poll() is None:
                raise
            self._restart("during startup")

    def _start_server(self) -> None:
        """Starts the server process, waits for /health, loads the trainer's
        current weight version and registers the URL (a restart registers
        again under the same index, at a new port)."""
        config = self.cfg
        host = network.bind_address(self.info.mode, self.info.bind_address)
        port = network.find_free_port(self.experiment_name, self.trial_name, host=host)
        # The launcher hands each worker its own devices through
        # CUDA_VISIBLE_DEVICES; without that, server i takes GPUs [i*tp, (i+1)*tp).
        base_gpu_id = 0 if os.environ.get("CUDA_VISIBLE_DEVICES") else self.info.worker_index * config.tp_size
        cmd = self._backend.command(config, host, port, base_gpu_id=base_gpu_id)
        if self.info.secret_path:  # the trial's key on every route (docs/design.md §14)
            cmd += self._backend.secure_args(config, self.info.secret_path, self.info.tag.replace("/", "-"))
        self.logger.info(
            "starting %s server on %s:%d (log %s): %s", config.backend, host, port, self.log_path, " ".join(cmd)
        )
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self._backend.env(config))
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
        self.logger.info("server pid %d healthy at %s after %.1fs", self.process.pid, url, time.monotonic() - t0)
        asyncio.run(self._prepare(url))
        if not self.cfg.judge:  # a judge keeps its own weights
            asyncio.run(self._load_current_weights(url))
        self.url = url
        name_resolve.add(self._name(), url, replace=True)

    def _name(self) -> str:
        name = names.judge_server if self.cfg.judge else names.gen_server
        return name(self.experiment_name, self.trial_name, self.info.worker_index)

    def _trainer_version(self) -> int | None:
        try:
            return int(name_resolve.get(names.model_version(self.experiment_name, self.trial_name, "actor")))
        except name_resolve.NameEntryNotFoundError:
            return None
        except Exception as e:
            self.logger.warning("could not read the trainer's weight version: %s: %s", type(e).__name__, e)
            return None

    async def _prepare(self, url: str) -> None:
        """The server's starting weight version, before it registers (vLLM
        has no flag for it: `/update_weight_version`; the others start on it)."""
        async with make_client(self.cfg.server_api, timeout_s=self.cfg.startup_timeout) as client:
            await client.prepare(url, self.cfg.weight_version)

    async def _load_current_weights(self, url: str) -> None:
        """A server started mid-run (restarted, or added) loads the version
        the trainer published last, `<weights_dir>/<v>/`, before it registers.
        The manager checks again and brings it up to date before it routes a
        request there, so a failure here only costs time."""
        if not self.cfg.weights_dir:
            return
        async with make_client(
            self.cfg.server_api, timeout_s=self.cfg.startup_timeout, connect_timeout_s=5.0
        ) as client:
            for attempt in range(1, 4):
                version = await asyncio.to_thread(self._trainer_version)
                if version is None or version <= self.cfg.weight_version:
                    return
                path = os.path.join(self.cfg.weights_dir, str(version))
                if not await asyncio.to_thread(os.path.isdir, path):  # (broadcast: sent, not written)
                    if await asyncio.to_thread(self._trainer_version) != version:
                        continue  # (a newer one was published, this one deleted)
                    self.logger.info(
                        "weight version %d is not on disk: the manager loads it before routing here", version
                    )
                    return
                t0 = time.monotonic()
                try:
                    await client.load_version(url, path, version, self.cfg.lora.rank > 0)
                except (GenerationServerError, GenerationServerUnavailable) as e:
                    # e.g. a newer version was published and this one deleted meanwhile
                    self.logger.warning(
                        "loading weight version %d from %s failed (attempt %d/3): %s", version, path, attempt, e
                    )
                    await asyncio.sleep(0.5 * attempt)
                    continue
                self.logger.info("loaded the current weight version %d in %.1fs", version, time.monotonic() - t0)
                return
        self.logger.warning("registering without the current weights: the manager loads them before routing here")

    async def _wait_healthy(self, url: str) -> bool:
        """True once /health answers; False if the worker is asked to exit
        first; raises if the child dies or `startup_timeout` passes."""
        deadline = time.monotonic() + self.cfg.startup_timeout
        async with make_client(self.cfg.server_api, timeout_s=10.0, connect_timeout_s=2.0) as client:
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
        if self.process is None or self.process.poll() is None:
            return IDLE
        self._restart("while serving")
        return IDLE

    def _restart(self, when: str) -> None:
        """The server process died: unregister, then start a new one on the
        current weights, unless it already died max_restarts times within
        restart_window seconds (then the worker fails, and with it the trial)."""
        while True:
            try:
                self._check_child(when)
                return
            except RuntimeError as e:
                death = str(e)
            self._unregister()
            stop_process_tree(self.process, _STOP_GRACE_S)  # reaps it, and stops anything it left behind
            now = time.monotonic()
            self._restarts = [t for t in self._restarts if now - t < self.cfg.restart_window]
            if len(self._restarts) >= self.cfg.max_restarts:
                raise RuntimeError(
                    f"{death}\nnot restarting it: it was restarted {len(self._restarts)} times within "
                    f"{self.cfg.restart_window:.0f}s (server.max_restarts={self.cfg.max_restarts})"
                )
            self._restarts.append(now)
            self.logger.warning(
                "%s\nrestarting it (restart %d, at most %d within %.0fs)",
                death,
                len(self._restarts),
                self.cfg.max_restarts,
                self.cfg.restart_window,
            )
            try:
                self._start_server()
                return
            except RuntimeError as e:  # it died again while starting: counted as one more restart
                when = "while restarting"
                if self.process is None or self.process.poll() is None:
                    raise
                self.logger.warning("the restarted server failed: %s", str(e).split("\n", 1)[0])

    def _unregister(self) -> None:
        if self.url is None:
            return
        url, self.url = self.url, None
        try:  # stop routing to us (the manager's health checks notice it too)
            name_resolve.delete(self._name())
        except Exception as e:
            self.logger.debug("could not unregister %s: %s", url, e)

    def _progress_info(self) -> dict:
        """The weight version and requests of the server (/model_info and
        /v1/loads, summed over its ranks: SGLang's /get_server_info has no
        request counts), read by a short-lived thread at most every
        _INFO_INTERVAL_S (the loop never waits for the server)."""
        now = time.monotonic()
        if self.url is not None and now - getattr(self, "_info_time", -float("inf")) >= _INFO_INTERVAL_S:
            self._info_time = now
            threading.Thread(target=self._read_server_info, args=(self.url,), name="server-info", daemon=True).start()
        return {**getattr(self, "_info", {}), "server_pid": self.process.pid if self.process is not None else None}

    def _read_server_info(self, url: str) -> None:
        async def read() -> dict:
            async with make_client(self.cfg.server_api, timeout_s=1.0, connect_timeout_s=1.0) as client:
                loads = (await client.loads(url)).loads
                return {
                    "version": await client.weight_version(url),
                    "running": sum(r.num_running_reqs for r in loads),
                    "waiting": sum(r.num_waiting_reqs for r in loads),
                }

        try:
            self._info = asyncio.run(read())
        except Exception as e:  # busy or restarting: say so, the next read may answer
            self._info = {"server_info": f"no answer ({type(e).__name__})"}

    def _exit_hook(self) -> None:
        if getattr(self, "url", None) is not None:
            try:  # stop routing to us before the server goes away
                name_resolve.delete(self._name())
            except Exception as e:
                self.logger.debug("could not unregister %s: %s", self.url, e)
        process = getattr(self, "process", None)
        if process is not None:
            running = process.poll() is None
            stop_process_tree(process, _STOP_GRACE_S)
            if running:
                self.logger.info(
                    "stopped the generation server (pid %d, exit code %s)", process.pid, process.returncode
                )
        if getattr(self, "_log_file", None) is not None:
            self._log_file.close()
