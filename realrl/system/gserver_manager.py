"""GserverManager worker: admission, routing and weight updates (docs/design.md §2, §6-§8).

One manager per trial sits between the rollout workers and the generation
servers, serving the HTTP API of `realrl/api/manager_api.py` (JSON, 127.0.0.1
in local mode, base URL under `names.gen_server_manager`). This module is the
async glue: HTTP handlers, polling loops and the weight-update fan-out. The
decisions live in plain synchronous classes: `StalenessController`
(`staleness.py`: admission under the staleness bound, docs/design.md §7),
`RequestRouter` (`router.py`: least-requests routing sticky per weight
version, and the servers' utilization that `/rollout_stats` carries for the
master's `perf/gen_*` figures, docs/observability.md) and `ServerRegistry`
(`server_registry.py`: the servers' states). (Over 700 lines on purpose: the
glue of three loops that share the worker's state, the HTTP handlers, the
trainer poll with its weight-update fan-out, and server joins with health
checks.)

A malformed request gets HTTP 400 `{"error": ...}` naming the field (bodies
are read by `realrl.base.http_body`: 413 over 1 MiB, 400 for bad JSON or
nesting deeper than 8), is counted, and changes nothing. Allocate and finish
are idempotent per `rollout_id` (clients retry them). `allocate_rollout` is a
long poll: while the first rollout is refused, admission is tried again
whenever it may have opened, for up to `wait_s`.

`_poll_async` reads `training_start` (once: the master writes it when it knows
the step training starts from; admission opens with its counts),
`model_version/actor` and `dropped_samples` through a `name_resolve` watch:
etcd pushes their changes, which wake the loop at once (no read per poll);
other backends are read every `poll_interval`. An idle loop polls every
`poll_interval` at most; a routing change or a finished weight update wakes
it too. When the
trainer's version v is newer than what the servers hold, every server loads
`<weights_dir>/<v>` concurrently (`GenerationClient.load_version`: full
weights by `update_weights_from_disk`, a LoRA run's adapter by
`load_lora_adapter` + `update_weight_version`; in-flight requests aborted;
1 + weight_update_retries attempts per server, each within
weight_update_timeout). A server that refuses every attempt stops the trial
with a message naming it; one that does not answer an attempt (dead, or
wedged: its load never completes), or whose weights a failed load left half
written (vLLM: `ServerWeightsBroken`; it cannot be restarted from here),
leaves routing at once, as a dead one, and rejoins once healthy, loading the
current version first. Intermediate versions are skipped. Once all servers hold
v, the directories `<weights_dir>/<u>` for u < v are deleted (nothing else in
weights_dir is touched).

Servers come and go (docs/architecture.md, "Generation servers that come and
go"). The registry (`names.gen_servers`) is read every second: a server
registered under a new index, or again under an index at a new URL (a
restarted one), joins: once healthy it is brought to `max(router version,
trainer version)` and only then put into routing, so `version`, and with it
admission, never goes back. Every server's `/health` is checked every
health_check_interval (within health_check_timeout); one that fails leaves
routing (logged once, counted in `server_events`) and its clients resubmit
its requests; while the manager loads weights into a server, failed checks
are not counted against it (SGLang's `/health` waits behind a weight load),
unless the connection is refused. A client that just failed on servers names them in
`avoid_urls`: they are probed at once, another server is picked while one is
up, and `down` says which of them are out of routing. With no server up,
`url` is null. A weight update skips servers that left routing meanwhile.

Client-side routing (`realrl/system/client_routing.py`, the default): the
rollout workers route their requests themselves. The manager publishes the
routing table (`/routing_table`, a long poll answered when the servers in
routing or their versions change, serialized once per revision), sums the
workers' load reports (`/report_load`: in-flight counts, tokens, servers that
answered, which then skip their health check) and probes the servers a
worker reports failing (`/report_failures`).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import os
import shutil
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from realrl.api.manager_api import (
    AllocateRolloutReply,
    AllocateRolloutRequest,
    ErrorReply,
    FailureReply,
    FailureReport,
    FinishRolloutRequest,
    HealthReply,
    LoadReply,
    LoadReport,
    ModelVersionReply,
    RejectedRolloutsReply,
    ReleaseRequest,
    ResetRolloutWorkerReply,
    ResetRolloutWorkerRequest,
    RolloutStats,
    RoutedServer,
    RoutingTable,
    RoutingTableRequest,
    ScheduledServer,
    ScheduleReply,
    ScheduleRequest,
    ServersReply,
    SuccessReply,
)
from realrl.api.system_api import GserverManagerConfig
from realrl.base import faults, name_resolve, names, network, trial_secret
from realrl.base.http_auth import BearerGate
from realrl.base.http_body import BodyError, from_json, read_json, to_json
from realrl.impl.generation import make_client
from realrl.impl.generation.client import GenerationClient, GenerationServerError, GenerationServerUnavailable
from realrl.impl.weights.on_disk import version_dirs
from realrl.system.router import NoServerUp, RequestRouter, Reservations
from realrl.system.server_registry import Server, ServerRegistry
from realrl.system.staleness import StalenessController
from realrl.system.worker_base import IDLE, AsyncWorker, PollResult

if TYPE_CHECKING:
    from realrl.system.weight_broadcast import WeightEpochs

STATS_LOG_INTERVAL_S = 5.0  # stats line (when something changed) and refusal summary
STATS_LOG_IDLE_INTERVAL_S = 60.0  # stats line even when nothing changed
SERVER_HEALTH_TIMEOUT_S = 120.0
REGISTRY_POLL_S = 1.0  # seconds between reads of the generation server registry
AVOID_PROBE_WAIT_S = 1.0  # a schedule_request naming failed servers waits this long at most for their probes
# A routing_table long poll woken by a change waits this long for more before it answers: a weight
# update reaching N servers one by one is a few tables, not N per rollout worker.
TABLE_COALESCE_S = 0.02
_BAD_REQUESTS_LOGGED = 20  # then every 1000th
# Request bodies are flat JSON objects of a few fields.
_MAX_BODY_BYTES = 1024 * 1024
_MAX_BODY_DEPTH = 8


def newest_weight_dir(weights_dir: str) -> int:
    """The newest version with a directory in `weights_dir` (renamed into place whole), or -1."""
    return max(version_dirs(weights_dir), default=-1)


def delete_old_weight_dirs(weights_dir: str, current_version: int) -> list[str]:
    """Deletes `<weights_dir>/<u>` for integer u < current_version but the
    newest directory there (with weights.transport=broadcast the current
    version may have none: the newest written one stays); returns what it
    deleted. Nothing else (temp dirs of a publish in progress, other files,
    symlinks) is touched."""
    dirs = version_dirs(weights_dir)
    newest = max(dirs, default=None)
    deleted = []
    for version, path in dirs.items():
        if version < current_version and version != newest:
            shutil.rmtree(path)
            deleted.append(path)
    return deleted


class WeightUpdateError(RuntimeError):
    pass


class WeightsNotWritten(WeightUpdateError):
    """The trainer did not write a version the manager asked for in time (broadcast transport)."""


class GserverManager(AsyncWorker):
    config_cls = GserverManagerConfig

    def _configure(self, config: GserverManagerConfig) -> None:
        self.cfg = config
        self.controller = StalenessController(
            config.train_batch_size,
            config.max_head_offpolicyness,
            config.max_concurrent_rollouts,
            config.total_train_steps * config.train_batch_size or None,
        )
        self.router: RequestRouter | None = None
        self.reservations = Reservations()  # who holds which scheduled requests
        # A test's fault point: once it fires, finishes fail until a rollout worker is
        # reset (the one that gave up on them was replaced), however long its retries take.
        self._finishes_failing = False
        self.registry: ServerRegistry | None = None
        self.bad_requests = 0
        self._gate = BearerGate(trial_secret.http_api_key())  # docs/design.md §14
        self.requests_served = 0  # HTTP requests answered (progress record: the load on the manager)
        self.requests_by_path: collections.Counter[str] = collections.Counter()  # (logged at the end)
        self._refusals: collections.Counter[str] = collections.Counter()
        # Set (and replaced) whenever admission may have opened: waiting allocations try again.
        self._admission_changed = asyncio.Event()
        self._admission_state: tuple = ()
        # Set as the worker stops: long polls answer at once, so the HTTP server's
        # cleanup (which waits for running handlers) does not wait out their wait_s.
        self._closing = False
        self._last_refusal = ""
        self._update_task: asyncio.Task | None = None  # a weight update, or a new broadcast epoch
        self._epochs: WeightEpochs | None = None  # weights.transport=broadcast (docs/design.md §8)
        self._wanted = -1  # broadcast: the newest version asked of the trainer as a directory (_on_disk)
        self._runner: web.AppRunner | None = None
        self._client: GenerationClient | None = None
        self._last_read = 0.0
        self._last_stats_log = time.monotonic()
        self._last_refusal_log = time.monotonic()
        self._last_logged_stats: dict | None = None
        self._server_tasks: dict[str, asyncio.Task] = {}  # url -> its join task
        self._probe_tasks: dict[str, asyncio.Task] = {}  # url -> an immediate health probe
        self._health_task: asyncio.Task | None = None
        self._last_registry_read = 0.0
        # Client-side routing: the routing table (serialized once per revision) and its long polls,
        # and each rollout worker's latest load report (url -> requests in flight) with their sums.
        self._table_changed = asyncio.Event()
        self._table_cache: tuple[int, bytes] | None = None
        self._loads: dict[int, dict[str, int]] = {}
        self._load_totals: collections.Counter[str] = collections.Counter()
        # The trainer's version, dropped samples and training start (_read_trainer_state)
        self._trainer_state: name_resolve.ValueWatch | None = None
        self._trainer_keys: tuple[str, str, str] = ("", "", "")  # (their keys: names.* builds one in ~10 us)
        self.max_idle_sleep = config.poll_interval  # (changes wake the loop: _watch_trainer_state)
        self.server_urls = self._wait_for_servers()

    def _wait_for_servers(self) -> list[str] | None:
        """The URLs of servers 0..n_servers-1, as they register (None if the
        trial ends first)."""
        urls: dict[int, str] = {}
        next_log = time.monotonic() + 30
        while len(urls) < self.cfg.n_servers:
            for i in range(self.cfg.n_servers):
                if i not in urls:
                    try:
                        urls[i] = name_resolve.get(names.gen_server(self.experiment_name, self.trial_name, i))
                    except name_resolve.NameEntryNotFoundError:
                        pass
            if len(urls) == self.cfg.n_servers:
                break
            if self._check_exit_conditions():
                return None
            if time.monotonic() > next_log:
                self.logger.info("waiting for generation servers: %d/%d registered", len(urls), self.cfg.n_servers)
                next_log = time.monotonic() + 30
            time.sleep(0.1)
        return [urls[i] for i in range(self.cfg.n_servers)]

    # ---- life cycle (inside the event loop) -----------------------------------------------
    async def _setup_async(self) -> None:
        if self.server_urls is None:
            return
        self._client = make_client(self.cfg.server_api, timeout_s=max(60.0, self.cfg.weight_update_timeout))
        await asyncio.gather(*(self._client.wait_healthy(u, SERVER_HEALTH_TIMEOUT_S) for u in self.server_urls))
        versions = await asyncio.gather(*(self._server_version(u) for u in self.server_urls))
        self.router = RequestRouter(self.server_urls, versions)
        self.router.on_change = self._routing_changed
        self.logger.info(
            "%d generation servers healthy, weight versions %s: %s", len(self.server_urls), versions, self.server_urls
        )
        self.registry = ServerRegistry(self.router, self.server_urls, self.cfg.health_check_failures)
        if self.cfg.weights.transport == "broadcast":
            from realrl.system.weight_broadcast import WeightEpochs  # (torch: only in a broadcast run)

            self._epochs = WeightEpochs(
                self.cfg.weights,
                self._client,
                self.experiment_name,
                self.trial_name,
                network.bind_address(self.info.mode, self.info.bind_address),
                network.advertise_address(self.info.mode, self.info.bind_address),
                self.epoch_join_timeout_s(),
                # (SGLang: a member that lags its peers this long in a version, a newer one waiting,
                # is out of routing and dropped from the epoch, as one that misses a health check)
                straggler_s=self.cfg.health_check_timeout,
                on_straggler=self._mark_down,
            )
            try:  # (a previous launch's request: this one asks for its own)
                await asyncio.to_thread(name_resolve.delete, self._wanted_key())
            except name_resolve.NameEntryNotFoundError:
                pass
        self._health_task = asyncio.create_task(self._health_loop())
        await self._watch_trainer_state()

        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._gate.middleware])
        post, get = app.router.add_post, app.router.add_get
        post("/allocate_rollout", self._handle(self._allocate_rollout, AllocateRolloutRequest.from_body))
        post("/finish_rollout", self._handle(self._finish_rollout, FinishRolloutRequest.from_body))
        post("/schedule_request", self._handle(self._schedule_request, functools.partial(from_json, ScheduleRequest)))
        post("/release_request", self._handle(self._release_request, functools.partial(from_json, ReleaseRequest)))
        post("/routing_table", self._handle(self._routing_table, functools.partial(from_json, RoutingTableRequest)))
        post("/report_load", self._handle(self._report_load, functools.partial(from_json, LoadReport)))
        post("/report_failures", self._handle(self._report_failures, functools.partial(from_json, FailureReport)))
        post("/stop_rollouts", self._handle(self._stop_rollouts))
        post(
            "/reset_rollout_worker",
            self._handle(self._reset_rollout_worker, functools.partial(from_json, ResetRolloutWorkerRequest)),
        )
        get("/get_model_version", self._handle(self._get_model_version))
        get("/rollout_stats", self._handle(self._rollout_stats))
        get("/rejected_rollouts", self._handle(self._rejected_rollouts))
        get("/servers", self._handle(self._servers_info))
        get("/health", self._handle(HealthReply))  # {"status": "ok"}
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host = network.bind_address(self.info.mode, self.info.bind_address)
        port = network.find_free_port(self.experiment_name, self.trial_name, host=host)
        await web.TCPSite(self._runner, host, port).start()
        url = f"http://{network.advertise_address(self.info.mode, self.info.bind_address)}:{port}"
        name_resolve.add(names.gen_server_manager(self.experiment_name, self.trial_name), url, replace=True)
        self.logger.info(
            "serving at %s: train_batch_size %d, max_head_offpolicyness %d, max_concurrent_rollouts %d",
            url,
            self.cfg.train_batch_size,
            self.cfg.max_head_offpolicyness,
            self.cfg.max_concurrent_rollouts,
        )

    async def _watch_trainer_state(self) -> None:
        keys = self._trainer_keys = (
            names.model_version(self.experiment_name, self.trial_name, "actor"),
            names.dropped_samples(self.experiment_name, self.trial_name),
            names.training_start(self.experiment_name, self.trial_name),
        )
        self._trainer_state = await asyncio.to_thread(name_resolve.watch_values, keys, self.cfg.poll_interval)
        loop = asyncio.get_running_loop()

        def changed() -> None:  # (on the watch's thread)
            try:
                loop.call_soon_threadsafe(self.wake_poll)
            except RuntimeError:  # the loop closed: the worker is gone
                pass

        self._trainer_state.add_listener(changed)

    async def _teardown_async(self) -> None:
        self._closing = True
        if self._trainer_state is not None:
            self._trainer_state.close()
        self._wake_allocations()
        self._routing_changed()
        if self._update_task is not None and not self._update_task.done():
            self._update_task.cancel()
            await asyncio.gather(self._update_task, return_exceptions=True)
        await self._stop_server_tasks()
        if self._runner is not None:
            try:
                name_resolve.delete(names.gen_server_manager(self.experiment_name, self.trial_name))
            except Exception as e:
                self.logger.debug("could not unregister the manager: %s", e)
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()
        if self._epochs is not None:
            self._epochs.close()
        if self.router is not None:
            self._log_stats(force=True)
        self.logger.info("HTTP requests served per path: %s", dict(self.requests_by_path.most_common()))

    async def _server_version(self, url: str) -> int:
        version = await self._client.weight_version(url)
        try:
            return int(version)
        except ValueError:
            self.logger.warning("server %s reports weight version %r, not an integer; taking it as 0", url, version)
            return 0

    # ---- the loop ---------------------------------------------------------------------------
    async def _poll_async(self) -> PollResult:
        if self.router is None:
            return IDLE
        if self._update_task is not None and self._update_task.done():
            task, self._update_task = self._update_task, None
            task.result()  # a failed update stops the worker, and with it the trial
        now = time.monotonic()
        state = self._trainer_state
        if state.live or now - self._last_read >= self.cfg.poll_interval:  # (live: no read, the values pushed)
            self._last_read = now
            version, dropped, start = (
                self._read_trainer_state() if state.live else await asyncio.to_thread(self._read_trainer_state)
            )
            if version is not None and version != self.controller.trainer_version:
                self.logger.info("trainer weight version %d -> %d", self.controller.trainer_version, version)
                self.controller.trainer_version = version
            if dropped is not None:
                self.controller.dropped = dropped
            if start is not None and not self.controller.started:
                # Trajectories restored into the trainers' buffers from a checkpoint were accepted too.
                self.controller.start(
                    accepted=start["consumed"] + start["dropped"] + start.get("buffered", 0), rejected=start["filtered"]
                )
                self.logger.info(
                    "training starts at step %d (version %d): admission opens with %d trajectories "
                    "consumed and %d dropped so far",
                    start["step"],
                    start["version"],
                    start["consumed"],
                    start["dropped"],
                )
            if self._update_task is None and self.controller.trainer_version > self.router.version:
                self._start_update(self._update_weights(self.controller.trainer_version))
            elif self._update_task is None and self._epochs is not None:
                up = list(self.router.up_urls)
                if (
                    self._epochs.needs_rebuild(up, self.controller.trainer_version) and not self._trial_ending()
                ):  # a version boundary
                    self._start_update(self._epochs.rebuild(up))
        await self._poll_servers(now)
        self._sync_admission_version()
        c = self.controller
        state = (c.version, c.dropped, c.started, c.stopped)
        if state != self._admission_state:
            self._admission_state = state
            self._wake_allocations()
        self._log_refusals(now)
        self._log_stats()
        return IDLE

    def _start_update(self, coro) -> None:
        """A weight update or a new broadcast epoch; its end wakes the loop (the next one may wait)."""
        self._update_task = asyncio.create_task(coro)
        self._update_task.add_done_callback(lambda _: self.wake_poll())

    def _read_trainer_state(self) -> tuple[int | None, int | None, dict | None]:
        """(trainer version, dropped samples, training start); a missing count
        is 0, a missing start or an unreadable value None."""
        values: list = []
        version_key, dropped_key, start_key = self._trainer_keys
        for key in (version_key, dropped_key):
            try:
                values.append(int(self._trainer_state.get(key)))
            except name_resolve.NameEntryNotFoundError:
                values.append(0)
            except Exception as e:  # a bad value or a name service hiccup: keep what we had
                self.logger.warning("could not read %s: %s: %s", key, type(e).__name__, e)
                values.append(None)
        start = None
        if not self.controller.started:
            key = start_key
            try:
                start = json.loads(self._trainer_state.get(key))
                start = {
                    k: int(start.get(k, 0)) for k in ("step", "version", "consumed", "dropped", "filtered", "buffered")
                }
            except name_resolve.NameEntryNotFoundError:
                start = None
            except Exception as e:
                self.logger.warning("could not read %s: %s: %s", key, type(e).__name__, e)
                start = None
        return values[0], values[1], start

    # ---- weight updates ------------------------------------------------------------------
    def epoch_join_timeout_s(self) -> float:
        """How long a member of a new broadcast epoch waits for the trainer's
        first version through it: as long as this manager lets one version
        take to reach a server, every attempt (docs/design.md §8)."""
        return self.cfg.weight_update_timeout * (1 + max(0, self.cfg.weight_update_retries))

    def _sync_admission_version(self) -> None:
        """Admission for version v opens once the trainer published v and
        every server holds it (docs/design.md §7): rollouts admitted for v are
        generated with v, and never with more than the trainer has."""
        self.controller.version = min(self.controller.trainer_version, self.router.version)

    async def _update_weights(self, version: int) -> None:
        if not self.cfg.weights_dir:
            raise WeightUpdateError(
                f"trainer published weight version {version} but GserverManagerConfig.weights_dir is empty"
            )
        path = os.path.join(self.cfg.weights_dir, str(version))
        stale = [u for u in self.router.up_urls if self.router.loaded_version[u] < version]
        if not stale:  # e.g. no server up: a server that joins loads the current version itself
            return
        t0 = time.monotonic()
        via_group = self._epochs is not None and await asyncio.to_thread(self._epochs.went_through_group, version)
        self.logger.info(
            "updating %d servers to weight version %d %s",
            len(stale),
            version,
            "(broadcast)" if via_group else f"from {path}",
        )
        results = await asyncio.gather(
            *(self._update_server(u, path, version, via_group) for u in stale), return_exceptions=True
        )
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise WeightUpdateError(
                f"{len(failures)} of {len(stale)} generation servers could not load weight version {version}:\n"
                + "\n".join(str(f) for f in failures)
            )
        interrupted = sum(r for r in results if r is not None)
        self.logger.info(
            "all servers hold weight version %d (%.2fs, %d requests interrupted)",
            version,
            time.monotonic() - t0,
            interrupted,
        )
        if self.router.version >= version:
            deleted = await asyncio.to_thread(delete_old_weight_dirs, self.cfg.weights_dir, version)
            if deleted:
                self.logger.info("deleted old weights: %s", ", ".join(os.path.basename(d) for d in deleted))

    def _wanted_key(self) -> str:
        return names.weights_wanted(self.experiment_name, self.trial_name, "actor")

    async def _on_disk(self, version: int) -> tuple[str, int]:
        """The directory to load `version` from, and the version it holds.
        With weights.transport=broadcast a version that went through every
        member has no directory: the trainer writes its newest version on
        demand (`names.weights_wanted`, docs/design.md §8), so this waits for
        a directory of `version` or newer (then loaded as that version),
        within weight_update_timeout (WeightsNotWritten)."""
        if self._epochs is None:
            return os.path.join(self.cfg.weights_dir, str(version)), version
        deadline = time.monotonic() + self.cfg.weight_update_timeout
        while (newest := await asyncio.to_thread(newest_weight_dir, self.cfg.weights_dir)) < version:
            if version > self._wanted:
                self._wanted = version
                await asyncio.to_thread(name_resolve.add, self._wanted_key(), str(version), replace=True)
                self.logger.info("weight version %d is not on disk: the trainer is asked to write it", version)
            if time.monotonic() > deadline:
                raise WeightsNotWritten(
                    f"the trainer did not write weight version {version} (or a newer one) to "
                    f"{self.cfg.weights_dir} within weight_update_timeout={self.cfg.weight_update_timeout}s"
                )
            await asyncio.sleep(self.cfg.poll_interval)
        return os.path.join(self.cfg.weights_dir, str(newest)), newest

    async def _load_weights(self, url: str, path: str, version: int) -> int:
        """One version load (`GenerationClient.load_version`: full weights, or
        a LoRA run's adapter); returns how many requests it aborted. Health
        checks of `url` that fail meanwhile are not counted (see ServerRegistry)."""
        self.registry.start_loading(url)
        try:
            aborted = await self._client.load_version(url, path, version, self.cfg.lora, self.cfg.weight_update_timeout)
            if self._epochs is not None:  # (an SGLang member a failed version left paused serves again)
                await self._epochs.resume(url)
            return aborted
        finally:
            ignored = self.registry.stop_loading(url)
            if ignored:
                self.logger.info(
                    "generation server %d at %s: %d health checks failed while it loaded weight version %d "
                    "(not counted: a server's /health may wait behind a weight load)",
                    self.registry.get(url).index,
                    url,
                    ignored,
                    version,
                )

    async def _update_server(self, url: str, path: str, version: int, via_group: bool = False) -> int | None:
        """Loads `version` on `url`; returns how many requests it aborted,
        None if the server left routing meanwhile.
        A failed load is retried: loading the same directory again is
        idempotent, and fixes SGLang 0.5.23's "weights updated, but the cache
        was not flushed" (`success: false` with the new weights serving and
        the old version reported; `realrl.impl.generation.backends`)."""
        if self._epochs is not None and self._epochs.holds(url, version):  # (SGLang: its group's epoch failed since)
            self.router.set_loaded_version(url, version)
            return 0
        if via_group and self._epochs.is_member(url):  # it received the version through its group
            if await self._epochs.await_version(url, version, self.cfg.weight_update_timeout):
                self.router.set_loaded_version(url, version)
                return 0
            if not self.router.is_up(url):  # found down meanwhile: it loads the current version as it rejoins
                self.logger.warning("weight update of %s to version %d skipped: the server left routing", url, version)
                return None
        attempts = 1 + max(0, self.cfg.weight_update_retries)
        last_error: Exception | None = None
        loaded = version
        for attempt in range(1, attempts + 1):
            try:
                path, loaded = await self._on_disk(version)  # (broadcast: maybe written on demand, maybe newer)
                aborted = await self._load_weights(url, path, loaded)
            except (GenerationServerError, GenerationServerUnavailable, WeightsNotWritten) as e:
                last_error = e
                if isinstance(e, GenerationServerUnavailable):
                    # Dead, wedged (its load did not complete within weight_update_timeout, though
                    # its /health may answer) or half-written weights (ServerWeightsBroken): out of
                    # routing as a dead one, so admission goes on with the others; it rejoins, loading
                    # the current version, once healthy.
                    self._mark_down(url, f"weight version {version} was not loaded: {e}")
                if not self.router.is_up(url):  # it rejoins with the current weights, if it comes back
                    self.logger.warning(
                        "weight update of %s to version %d skipped: the server left routing (%s)", url, version, e
                    )
                    return None
                self.logger.warning(
                    "weight update of %s to version %d failed (attempt %d/%d): %s", url, version, attempt, attempts, e
                )
                if attempt < attempts:
                    await asyncio.sleep(min(2.0 ** (attempt - 1), 10.0))
                continue
            self.router.set_loaded_version(url, loaded)
            return aborted
        if not self.router.is_up(url):
            return None
        raise WeightUpdateError(
            f"generation server {url} could not load weight version {version} from {path} "
            f"after {attempts} attempts: {last_error}"
        )

    # ---- servers that come and go (their states: ServerRegistry) -------------------------------
    async def _stop_server_tasks(self) -> None:
        tasks = [
            t
            for t in (self._health_task, *self._server_tasks.values(), *self._probe_tasks.values())
            if t is not None and not t.done()
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.registry is not None:
            self.logger.info(
                "requests routed per server (index: requests): %s; server events: %s",
                self.registry.routed(),
                dict(self.registry.events) or "none",
            )

    def _trial_ending(self) -> bool:
        """Rollouts stopped and none running: the servers exit with the trial
        (until the last rollout finished, faults are still handled)."""
        return self.controller.stopped and self.controller.running == 0

    async def _poll_servers(self, now: float) -> None:
        """Picks up servers registered, re-registered or unregistered since the last read."""
        for task in [self._health_task, *self._server_tasks.values()]:
            if task is not None and task.done() and not task.cancelled():
                task.result()  # a bug there must not pass silently: it stops the worker
        if now - self._last_registry_read < REGISTRY_POLL_S or self._trial_ending():
            return  # servers unregister as the trial ends: not a change to act on
        self._last_registry_read = now
        try:
            found = await asyncio.to_thread(self._read_registry)
        except Exception as e:  # a name service hiccup: keep what we know
            self.logger.warning("could not read the generation server registry: %s: %s", type(e).__name__, e)
            return
        for change in self.registry.read(found):
            if change.action == "retire":
                self._retire(change.url, change.why)
            else:
                self._start_join(change.index, change.url)

    def _read_registry(self) -> dict[int, str]:
        root = names.gen_servers(self.experiment_name, self.trial_name)
        found = {}
        for key, url in name_resolve.items_subtree(root).items():  # (one etcd range, whatever N)
            suffix = key[len(root) :].strip("/")
            if suffix.isdigit():
                found[int(suffix)] = url
        return found

    def _retire(self, url: str, why: str) -> None:
        retired = self.registry.retire(url, why)
        if retired is None:
            return
        was, orphaned = retired
        if self._epochs is not None:
            self._epochs.member_down(url, f"retired: {why}")
        task = self._server_tasks.pop(url, None)
        if task is not None and not task.done():
            task.cancel()
        index = self.registry.get(url).index
        if was == "up":
            self.logger.warning(
                "generation server %d at %s left routing (%s); %d requests it had in flight go to "
                "the other servers; %s",
                index,
                url,
                why,
                orphaned,
                self.registry.up_count(),
            )
        else:
            self.logger.info("generation server %d at %s (%s) is gone: %s", index, url, was, why)

    def _mark_down(self, url: str, reason: str) -> None:
        if self._epochs is not None:  # (a weight group still forming would wait for it: ended now)
            self._epochs.member_down(url, reason)
        orphaned = self.registry.mark_down(url, reason)
        if orphaned is None:
            return
        self.logger.warning(
            "generation server %d at %s is down (%s): out of routing; %d requests it had in flight "
            "go to the other servers; %s",
            self.registry.get(url).index,
            url,
            reason,
            orphaned,
            self.registry.up_count(),
        )

    def _start_join(self, index: int, url: str) -> None:
        """Brings a new, restarted or recovered server to the current weights,
        then puts it into routing (`_join`)."""
        new = self.registry.get(url) is None
        server = self.registry.start_join(index, url)
        if server is None:  # already up or joining
            return
        if new:
            self.logger.info("generation server %d registered at %s: joining", index, url)
        self._server_tasks[url] = asyncio.create_task(self._join(server))

    async def _join(self, server: Server) -> None:
        url, t0 = server.url, time.monotonic()
        warned = False
        load_failures = 0
        while server.state == "joining":
            probe = await self._client.probe(url, self.cfg.health_check_timeout)
            if not probe.ok:
                if not warned and time.monotonic() - t0 > SERVER_HEALTH_TIMEOUT_S:
                    warned = True
                    self.logger.warning(
                        "generation server %d at %s registered but is not healthy after %.0fs (%s); still waiting",
                        server.index,
                        url,
                        time.monotonic() - t0,
                        probe.reason,
                    )
                await asyncio.sleep(0.5)
                continue
            try:
                version = await self._server_version(url)
                # Never behind the servers in routing: admission must not go back (docs/design.md §7).
                target = max(self.router.version, self.controller.trainer_version)
                # (a server left paused with part of a failed version loads one whole, even the one it reports)
                if version < target or (self._epochs is not None and self._epochs.partly_updated(url)):
                    if not self.cfg.weights_dir:
                        raise WeightUpdateError(f"server holds version {version} < {target} and weights_dir is empty")
                    path, loaded = await self._on_disk(target)  # (broadcast: maybe written on demand, maybe newer)
                    self.logger.info(
                        "generation server %d at %s holds weight version %d: loading version %d before "
                        "it takes requests",
                        server.index,
                        url,
                        version,
                        loaded,
                    )
                    await self._load_weights(url, path, loaded)
                    continue  # check again: the trainer may have moved on meanwhile
            except (GenerationServerError, GenerationServerUnavailable, WeightUpdateError) as e:
                load_failures += 1
                self.logger.warning(
                    "generation server %d at %s could not be brought to the current weights (attempt %d): %s",
                    server.index,
                    url,
                    load_failures,
                    e,
                )
                await asyncio.sleep(min(2.0**load_failures, 10.0))
                continue
            event = self.registry.finish_join(url, version)  # (no await since the version check above)
            if event is None:
                continue
            self.logger.info(
                "generation server %d at %s %s routing at weight version %d after %.1fs (trainer version %d); %s",
                server.index,
                url,
                event,
                version,
                time.monotonic() - t0,
                self.controller.trainer_version,
                self.registry.up_count(),
            )
            return

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval)
            # (servers a rollout worker reported answering meanwhile need no probe)
            urls = self.registry.to_check(answered_within=self.cfg.health_check_interval)
            await asyncio.gather(*(self._check_server(u) for u in urls))

    async def _check_server(self, url: str) -> None:
        """One health check: a refused or dropped connection, or
        health_check_failures failures in a row, take the server out of
        routing; a down server that answers again rejoins."""
        server = self.registry.get(url)
        if server is None:
            return
        probe = await self._client.probe(url, self.cfg.health_check_timeout)
        if self._trial_ending():
            return  # servers leaving now is the trial ending, not a fault
        action = self.registry.health_checked(url, probe.ok, probe.gone)
        if action == "rejoin":
            self._start_join(server.index, url)
        elif action == "down":
            how = "" if probe.gone else f", {server.failures} health checks failed in a row"
            self._mark_down(url, f"{probe.reason}{how}")

    def _probe_soon(self, url: str) -> asyncio.Task:
        """A client reported `url` failing: check it now, not at the next round
        (one probe at a time per server)."""
        task = self._probe_tasks.get(url)
        if task is None or task.done():
            task = self._probe_tasks[url] = asyncio.get_running_loop().create_task(self._check_server(url))
        return task

    # ---- HTTP handlers ---------------------------------------------------------------------
    def _handle(self, handler: Callable[..., Any], parse: Callable[[Any], Any] | None = None):
        """Wraps a handler `(request) -> reply` (a `manager_api` class each;
        `parse` builds the request from the JSON body, None: no body is read):
        JSON in and out, 400 on a bad request."""

        async def wrapped(request: web.Request) -> web.Response:
            self.requests_served += 1
            self.requests_by_path[request.path] += 1
            try:
                args = []
                if parse is not None:
                    args.append(parse(await read_json(request, max_bytes=_MAX_BODY_BYTES, max_depth=_MAX_BODY_DEPTH)))
                reply = handler(*args)
                if asyncio.iscoroutine(reply):
                    reply = await reply
                if isinstance(reply, web.Response):  # (already serialized)
                    return reply
                return web.json_response(to_json(reply))
            except BodyError as e:
                self.bad_requests += 1
                # The first ones in full; then a sample, so a broken client cannot flood the log.
                if self.bad_requests <= _BAD_REQUESTS_LOGGED or self.bad_requests % 1000 == 0:
                    self.logger.warning("bad request #%d to %s: %s", self.bad_requests, request.path, e)
                return web.json_response(to_json(ErrorReply(str(e))), status=e.status)

        return wrapped

    async def _allocate_rollout(self, request: AllocateRolloutRequest) -> AllocateRolloutReply:
        """Admits one rollout, or a list in order (as many as admission
        allows: one call per batch of prompts instead of one per prompt).
        A long poll: while the first is refused and `wait_s` > 0, admission
        is tried again whenever it may have opened (a new version, a
        finished, dropped or released rollout), until `wait_s` has passed.
        The rollout worker thus starts the next rollouts as soon as it may,
        without polling; a repeated call for the same id admits nothing new."""
        wanted = [(r.rollout_id, r.qid) for r in request.rollouts]
        deadline = time.monotonic() + request.wait_s
        admitted, reason = self.controller.allocate_many(wanted)
        while not admitted and not self.controller.stopped and not self._closing:
            changed = self._admission_changed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
            admitted, reason = self.controller.allocate_many(wanted)
        if admitted < len(wanted):
            self._refusals[reason.split(":")[0].split(" (")[0]] += 1
            self._last_refusal = reason
        return AllocateRolloutReply(
            success=admitted > 0, admitted=admitted, reason=reason, version=self.controller.version
        )

    def _wake_allocations(self) -> None:
        self._admission_changed.set()
        self._admission_changed = asyncio.Event()

    def _reset_rollout_worker(self, request: ResetRolloutWorkerRequest) -> ResetRolloutWorkerReply:
        """A rollout worker (re)starting: its earlier process's running
        rollouts are gone. Their slots go back to admission; their qids go to
        the new process, which generates them again, and the requests they
        had scheduled leave the servers' in-flight counts."""
        if request.worker_index >= self.cfg.n_rollout_workers:
            raise BodyError(
                f"field 'worker_index': {request.worker_index} is not a rollout worker of this trial "
                f"(0..{self.cfg.n_rollout_workers - 1})"
            )
        rollout_ids, qids = self.controller.release_worker(request.worker_index)
        self._set_load(request.worker_index, {})  # its requests in flight died with it
        self._release_reservations(qids)
        self._finishes_failing = False
        self._wake_allocations()
        if qids:
            self.logger.warning(
                "rollout worker %d restarted: %d running rollouts released, to be generated again",
                request.worker_index,
                len(qids),
            )
        return ResetRolloutWorkerReply(qids=qids, rollout_ids=rollout_ids, done=self.controller.done.to_wire())

    def _finish_rollout(self, request: FinishRolloutRequest) -> SuccessReply:
        if self._finishes_failing or faults.point("gserver_manager.finish_rollout"):
            self._finishes_failing = True
            raise BodyError("finish_rollout is failing (fault point)", status=503)
        qids = [self.controller.qid_of(r.rollout_id) for r in request.rollouts]
        try:  # all or none: a rejected call changes nothing
            self.controller.finish_many([(r.rollout_id, r.n_trajectories, r.n_tokens) for r in request.rollouts])
        except KeyError as e:
            raise BodyError(str(e.args[0])) from None
        self._release_reservations([q for q in qids if q is not None])
        self._wake_allocations()
        return SuccessReply()

    def _release_reservations(self, qids: list[str]) -> None:
        """What the schedules of these ended rollouts still hold goes back to
        the servers' in-flight counts (a qid another running rollout shares
        keeps its tickets)."""
        for qid in dict.fromkeys(qids):
            if not self.controller.runs_qid(qid):
                for url, n in self.reservations.release_qid(qid).items():
                    self.router.release(url, n)

    async def _schedule_request(self, request: ScheduleRequest) -> ScheduleReply:
        """A server for `n` requests; with `parts`, a server for each part in
        turn (the requests of several groups sent at once: each part is
        routed as if it came alone, so they spread over the servers). Only
        for a running rollout's qid, within what one rollout may hold
        (`Reservations`): the reply's ticket names what its release gives back."""
        if not self.controller.runs_qid(request.qid):
            raise BodyError(f"field 'qid': no running rollout has qid {request.qid!r}", status=409)
        if request.n > self.reservations.room(request.qid):
            raise BodyError(
                f"field 'n': qid {request.qid!r} would hold more than {self.reservations.max_per_qid} requests",
                status=409,
            )
        avoid = request.avoid_urls
        # Servers that just failed for the caller: check them now (a dead one
        # answers at once; a slow one does not hold the caller up for long).
        probes = [self._probe_soon(u) for u in dict.fromkeys(avoid) if self.router.is_up(u)]
        if probes:
            await asyncio.wait([asyncio.shield(p) for p in probes], timeout=AVOID_PROBE_WAIT_S)
        down = [u for u in avoid if not self.router.is_up(u)]
        try:
            picks = [
                self.router.schedule(k, request.previous_server_url, request.previous_version, avoid)
                for k in request.parts or [request.n]
            ]
        except NoServerUp as e:  # (none is up: the first part already finds that)
            reason = f"{e} ({self.registry.not_retired() or 'none registered'})"
            return ScheduleReply(url=None, version=self.router.version, reason=reason, down=down)
        self._note_first_requests(dict(picks))
        counts: collections.Counter[str] = collections.Counter()
        for (u, _), k in zip(picks, request.parts or [request.n]):
            counts[u] += k
        ticket = self.reservations.reserve(request.qid, counts)
        url, version = picks[0]
        return ScheduleReply(
            url=url,
            version=version,
            ticket=ticket,
            parts=[ScheduledServer(u, v) for u, v in picks] if request.parts is not None else None,
            down=down if avoid else None,
        )

    # ---- client-side routing (realrl/system/client_routing.py) -------------------------------
    def _routing_changed(self) -> None:
        self._table_changed.set()
        self._table_changed = asyncio.Event()
        self.wake_poll()  # (the servers' version may have moved: admission follows in the poll)

    async def _routing_table(self, request: RoutingTableRequest) -> web.Response:
        """The routing table once its revision is past `after` (a long poll)."""
        deadline = time.monotonic() + request.wait_s
        waited = False
        while self.router.revision <= request.after and not self._trial_ending() and not self._closing:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(self._table_changed.wait(), remaining)
                waited = True
            except asyncio.TimeoutError:
                break
        if waited and not self._closing:
            await asyncio.sleep(TABLE_COALESCE_S)
        revision = self.router.revision
        if self._table_cache is None or self._table_cache[0] != revision:
            router = self.router
            servers = [RoutedServer(u, router.loaded_version[u], router.in_flight[u]) for u in router.up_urls]
            reason = (
                None if servers else f"no generation server is up ({self.registry.not_retired() or 'none registered'})"
            )
            table = RoutingTable(revision=revision, version=router.version, servers=servers, reason=reason)
            self._table_cache = (revision, json.dumps(to_json(table)).encode())
        return web.Response(body=self._table_cache[1], content_type="application/json")

    def _report_load(self, report: LoadReport) -> LoadReply:
        """A rollout worker's requests in flight per server (replacing its
        previous report), the tokens they generated and the servers that
        answered; the reply: every worker's load per server in routing."""
        if report.worker_index >= self.cfg.n_rollout_workers:
            raise BodyError(
                f"field 'worker_index': {report.worker_index} is not a rollout worker of this trial "
                f"(0..{self.cfg.n_rollout_workers - 1})"
            )
        known = self.router.in_flight  # every server ever in routing; other URLs are ignored
        self._set_load(report.worker_index, {u: n for u, n in report.in_flight.items() if u in known and n})
        self.router.generated_tokens += report.n_tokens
        for url, n in report.started.items():
            if url in known:
                self.router.total_scheduled[url] += n
        for url in report.answered:
            self.registry.answered(url)
        self._note_first_requests({u: self.router.loaded_version[u] for u in report.started if self.router.is_up(u)})
        return LoadReply(loads={u: n for u, n in self._load_totals.items() if n and self.router.is_up(u)})

    def _set_load(self, worker_index: int, loads: dict[str, int]) -> None:
        previous = self._loads.pop(worker_index, {})
        if loads:
            self._loads[worker_index] = loads
        for url in previous.keys() | loads.keys():
            self._load_totals[url] += loads.get(url, 0) - previous.get(url, 0)
            if not self._load_totals[url]:
                del self._load_totals[url]
            self.router.set_in_flight(url, self._load_totals.get(url, 0))

    async def _report_failures(self, report: FailureReport) -> FailureReply:
        """Servers that just failed for a client: probed now (a dead one
        answers at once; a slow one holds the caller up a second at most)."""
        urls = list(dict.fromkeys(report.urls))
        probes = [self._probe_soon(u) for u in urls if self.router.is_up(u)]
        if probes:
            await asyncio.wait([asyncio.shield(p) for p in probes], timeout=AVOID_PROBE_WAIT_S)
        return FailureReply(down=[u for u in urls if not self.router.is_up(u)])

    def _note_first_requests(self, picks: dict[str, int]) -> None:
        """Servers (url -> the version they hold) just given requests: one that joined mid-run
        and got its first says so (when it starts serving, against the trainer's version)."""
        for server in self.registry.first_requests(picks):
            self.logger.info(
                "generation server %d at %s got its first request (weight version %d, trainer version %d)",
                server.index,
                server.url,
                server.first_request_version,
                self.controller.trainer_version,
            )

    def _release_request(self, request: ReleaseRequest) -> SuccessReply:
        if request.url not in self.router.in_flight:
            raise BodyError(f"field 'url': unknown server {request.url!r}")
        try:  # at most what the ticket still holds there: a repeated or invented release lowers nothing
            released = self.reservations.release(request.ticket, request.url, request.n)
        except KeyError as e:
            raise BodyError(f"field 'ticket': {e.args[0]}") from None
        if released:
            self.router.release(request.url, released, request.n_tokens)
        return SuccessReply()

    def _stop_rollouts(self) -> SuccessReply:
        if not self.controller.stopped:
            self.logger.info("rollouts stopped: every later allocate_rollout is refused")
        self.controller.stop()
        self._wake_allocations()
        return SuccessReply()

    def _get_model_version(self) -> ModelVersionReply:
        return ModelVersionReply(version=self.router.version)

    def _rejected_rollouts(self) -> RejectedRolloutsReply:
        return RejectedRolloutsReply(rejected=self.controller.rejected_done.to_wire())

    def _rollout_stats(self) -> RolloutStats:
        # utilization() changes with the clock: not in _stats(), whose changes trigger a log line
        return RolloutStats(**self._stats(), **self.router.utilization())

    def _servers_info(self) -> ServersReply:
        return ServersReply(
            version=self.router.version, servers=self.registry.describe(), events=dict(self.registry.events)
        )

    def _progress_info(self) -> dict:
        c = self.controller
        return {
            "running": c.running,
            "accepted": c.accepted,
            "rejected": c.rejected,
            "admission": c.admission(),
            "version": c.version,
            "trainer_version": c.trainer_version,
            "requests": self.requests_served,
        }

    # ---- logging ------------------------------------------------------------------------------
    def _stats(self) -> dict[str, Any]:
        return {
            **self.controller.stats(),
            "loaded_version": self.router.version,
            "n_servers": len(self.router.up),  # in routing
            "server_in_flight": dict(self.router.in_flight),
            "server_events": dict(self.registry.events),  # down / joined / rejoined / retired
            "bad_requests": self.bad_requests,
            "unauthorized": self._gate.refused,
        }

    def _log_refusals(self, now: float) -> None:
        if now - self._last_refusal_log < STATS_LOG_INTERVAL_S:
            return
        self._last_refusal_log = now
        if self._refusals:
            counts = ", ".join(f"{k}: {v}" for k, v in sorted(self._refusals.items()))
            self.logger.info(
                "refused %d rollouts in the last %.0fs (%s); latest: %s",
                sum(self._refusals.values()),
                STATS_LOG_INTERVAL_S,
                counts,
                self._last_refusal,
            )
            self._refusals.clear()

    def _log_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        since = now - self._last_stats_log
        stats = self._stats()
        changed = stats != self._last_logged_stats
        if not force and (since < STATS_LOG_INTERVAL_S or (not changed and since < STATS_LOG_IDLE_INTERVAL_S)):
            return
        self._last_stats_log = now
        self._last_logged_stats = stats
        self.logger.info(
            "rollouts: running %d accepted %d rejected %d dropped %d%s%s | versions: trainer %d servers %s"
            " | in flight %s",
            stats["running"],
            stats["accepted"],
            stats["rejected"],
            stats["dropped"],
            " (stopped)" if stats["stopped"] else "",
            "" if stats["started"] else " (not started)",
            stats["trainer_version"],
            sorted({self.router.loaded_version[u] for u in self.router.up}),
            [stats["server_in_flight"][u] for u in self.router.up_urls],
        )
