"""A worker that hosts many simulated generation servers in one process.

Servers `first_index .. first_index + n_servers - 1` of the trial: each is
started by `SimServerHost` on a port of its own and registered under
`names.gen_server(exp, trial, index)`, as a GenerationServer worker registers
a real server, so the manager waits for them, checks their health, routes to
them and loads weights into them as into real ones. Every second (and at the
end) the host's counters (`SimServerHost.stats`) are written to `stats_path`
as JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from realrl.base import name_resolve, names, network
from realrl.impl.generation.sim_server import SimServerConfig, SimServerHost
from realrl.system.worker_base import IDLE, AsyncWorker, PollResult

STATS_INTERVAL_S = 1.0


@dataclasses.dataclass
class SimServerHostConfig:
    first_index: int = 0
    n_servers: int = 1
    server: SimServerConfig = dataclasses.field(default_factory=SimServerConfig)
    stats_path: str = ""


class SimServerHostWorker(AsyncWorker):
    config_cls = SimServerHostConfig

    def _configure(self, config: SimServerHostConfig) -> None:
        self.cfg = config
        self.host: SimServerHost | None = None
        self._last_stats = 0.0

    def _key(self, i: int) -> str:
        return names.gen_server(self.experiment_name, self.trial_name, self.cfg.first_index + i)

    async def _setup_async(self) -> None:
        self.host = SimServerHost(self.cfg.server, network.bind_address(self.info.mode, self.info.bind_address))
        urls = await self.host.start(self.cfg.n_servers)
        for i, url in enumerate(urls):
            name_resolve.add(self._key(i), url, replace=True)
        self.logger.info(
            "%d simulated servers registered as %d..%d (%s ... %s)",
            len(urls),
            self.cfg.first_index,
            self.cfg.first_index + len(urls) - 1,
            urls[0],
            urls[-1],
        )

    async def _poll_async(self) -> PollResult:
        if time.monotonic() - self._last_stats >= STATS_INTERVAL_S:
            self._write_stats()
        return IDLE

    def _write_stats(self) -> None:
        self._last_stats = time.monotonic()
        if not self.cfg.stats_path or self.host is None:
            return
        tmp = f"{self.cfg.stats_path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"time": time.time(), **self.host.stats()}, f)
        os.replace(tmp, self.cfg.stats_path)

    async def _teardown_async(self) -> None:
        if self.host is None:
            return
        self._write_stats()
        for i in range(len(self.host.urls)):
            try:
                name_resolve.delete(self._key(i))
            except Exception as e:  # the trial's keys may be gone already
                self.logger.debug("could not unregister server %d: %s", self.cfg.first_index + i, e)
        await self.host.close()
