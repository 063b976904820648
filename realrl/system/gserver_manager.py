"""GserverManager worker: admission, routing and weight updates (docs/design.md §2, §6-§8).

One manager per trial sits between the rollout workers and the generation
servers. It serves this HTTP API (the contract with the rollout side; JSON,
127.0.0.1 in local mode, base URL under `names.gen_server_manager`):

    POST /allocate_rollout {"rollout_id", "qid"}            -> {"success", "reason", "version"}
    POST /finish_rollout   {"rollout_id", "n_trajectories", "n_tokens"} -> {"success": true}
    POST /schedule_request {"qid", "n"=1, "previous_server_url", "previous_version"} -> {"url", "version"}
    POST /release_request  {"url", "n"=1}                   -> {"success": true}
    GET  /get_model_version                                 -> {"version"}
    POST /stop_rollouts                                     -> {"success": true}
    GET  /rollout_stats, GET /health

A malformed request gets HTTP 400 `{"error": ...}` (bodies are read by
`realrl.base.http_body`: 413 over 1 MiB, 400 for bad JSON or nesting deeper
than 8), is counted, and changes nothing. Allocate and finish are idempotent per `rollout_id` (clients retry
them), and the unit counted everywhere is one trajectory: `n_trajectories`
is what the episode pushed (0: the agent rejected the prompt).

The state lives in two plain classes that know nothing about HTTP:

- `StalenessController`: admission. A rollout is admitted iff training has
  started, rollouts are not stopped, `running < max_concurrent_rollouts`, and
  `(accepted - dropped + running) // train_batch_size <= η + version`
  (`within_staleness_bound`, docs/design.md §7), where `version` is the weight version
  every server holds (not merely the one the trainer published: rollouts
  admitted for v+1 must be generated with v+1). With version v, at most
  `(η + v + 1) * train_batch_size` trajectories are ever admitted, counting
  the finished-and-accepted ones; agent-rejected rollouts and trainer drops
  give their budget back.
- `RequestRouter`: least-requests routing over the servers' in-flight counts
  (ties go to the server that was given fewer requests in total), sticky while
  the server still holds the caller's weight version.

`_poll_async` reads `training_start` (once: the master writes it when it knows
the step training starts from; admission opens with its counts),
`model_version/actor` and `dropped_samples` every `poll_interval`. When the trainer's version v is newer than what the servers
hold, every server loads `<weights_dir>/<v>` concurrently
(`update_weights_from_disk`, in-flight requests aborted; 1 + weight_update_retries
attempts per server, each within weight_update_timeout). A server that still
fails stops the trial with a message naming it. Intermediate versions are
skipped. Once all servers hold v, the directories `<weights_dir>/<u>` for
u < v are deleted (nothing else in weights_dir is touched).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import time
from typing import Any

from aiohttp import web

from realrl.api.system_api import GserverManagerConfig
from realrl.base import name_resolve, names, network
from realrl.base.http_body import BodyError, read_json
from realrl.impl.generation.client import GenerationClient, GenerationServerError, GenerationServerUnavailable
from realrl.system.worker_base import IDLE, AsyncWorker, PollResult

STATS_LOG_INTERVAL_S = 5.0  # stats line (when something changed) and refusal summary
STATS_LOG_IDLE_INTERVAL_S = 60.0  # stats line even when nothing changed
SERVER_HEALTH_TIMEOUT_S = 120.0
_BAD_REQUESTS_LOGGED = 20  # then every 1000th
# Request bodies are flat JSON objects of a few fields.
_MAX_BODY_BYTES = 1024 * 1024
_MAX_BODY_DEPTH = 8


# --------------------------------------------------------------------------- admission


def within_staleness_bound(
    accepted: int, dropped: int, running: int, train_batch_size: int, max_head_offpolicyness: int, version: int
) -> bool:
    """docs/design.md §7: may one more rollout start? `accepted` counts every trajectory
    finished and accepted so far (consumed or still buffered), `dropped` the
    ones the trainer threw away (their budget is given back), `version` the
    weight version every generation server holds."""
    return (accepted - dropped + running) // train_batch_size <= max_head_offpolicyness + version


# Finished rollout ids remembered for idempotent retries; a retry arrives within
# seconds, so the newest ones suffice and memory stays bounded.
FINISHED_IDS_KEPT = 100_000


class StalenessController:
    """Admission state: which rollouts run, how many trajectories were
    accepted, how many episodes the agent rejected, and what the trainer
    reported. Not thread-safe (one event loop owns it).

    Every rollout has a caller-chosen `rollout_id`; allocate and finish are
    idempotent per id, so a client may retry a call whose reply it lost (a
    timed-out-but-applied allocate must not leak a running slot, a repeated
    finish must not fail or count twice).

    Nothing is admitted before `start()`: the master tells where training
    starts (fresh, or recovered at a checkpoint with some trajectories already
    consumed and dropped), so a resumed trial admits exactly what an
    uninterrupted one would."""

    def __init__(self, train_batch_size: int, max_head_offpolicyness: int, max_concurrent_rollouts: int):
        if train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {train_batch_size}")
        if max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}")
        if max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {max_concurrent_rollouts}")
        self.train_batch_size = train_batch_size
        self.max_head_offpolicyness = max_head_offpolicyness
        self.max_concurrent_rollouts = max_concurrent_rollouts
        self.started = False
        self.version = 0  # the weight version every server holds (admission opens per version only then)
        self.trainer_version = 0  # the newest version the trainer published (for the stats)
        self.dropped = 0  # trajectories the trainer dropped (whole trial, from the master)
        self.accepted = 0  # trajectories finished and accepted (whole trial)
        self.rejected = 0  # episodes the agent rejected (whole trial)
        self.admitted = 0  # episodes admitted by this process
        self.n_tokens = 0
        self.stopped = False
        self._running: dict[str, str] = {}  # rollout_id -> qid
        self._finished: collections.OrderedDict[str, int] = collections.OrderedDict()  # rollout_id -> trajectories

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self, accepted: int = 0, rejected: int = 0) -> None:
        """Opens admission with the trial's counts so far (a recovered trial
        starts with what it had consumed and dropped at its checkpoint)."""
        self.accepted, self.rejected, self.started = accepted, rejected, True

    def allocate(self, rollout_id: str, qid: str = "") -> tuple[bool, str | None]:
        """Admit rollout `rollout_id` (of prompt `qid`) if the rules allow:
        (admitted, refusal reason). A repeated call for an admitted id admits
        nothing new and answers True."""
        if rollout_id in self._running or rollout_id in self._finished:
            return True, None
        if not self.started:
            return False, "waiting for the trainer: training has not started"
        if self.stopped:
            return False, "rollouts stopped"
        if self.running >= self.max_concurrent_rollouts:
            return False, f"max_concurrent_rollouts reached ({self.max_concurrent_rollouts})"
        if not within_staleness_bound(self.accepted, self.dropped, self.running, self.train_batch_size,
                                      self.max_head_offpolicyness, self.version):  # fmt: skip
            return False, (
                f"staleness bound: (accepted {self.accepted} - dropped {self.dropped} + running {self.running})"
                f" // train_batch_size {self.train_batch_size} > max_head_offpolicyness"
                f" {self.max_head_offpolicyness} + version {self.version}"
            )
        self._running[rollout_id] = qid
        self.admitted += 1
        return True, None

    def finish(self, rollout_id: str, n_trajectories: int, n_tokens: int = 0) -> None:
        """Rollout `rollout_id` ended with `n_trajectories` accepted
        trajectories (0: the agent rejected the prompt, which gives its budget
        back). KeyError if it was never admitted; a repeated call is a no-op."""
        if rollout_id in self._finished:
            return
        if rollout_id not in self._running:
            raise KeyError(f"no running rollout with id {rollout_id!r}")
        del self._running[rollout_id]
        self._finished[rollout_id] = n_trajectories
        if len(self._finished) > FINISHED_IDS_KEPT:
            self._finished.popitem(last=False)
        if n_trajectories:
            self.accepted += n_trajectories
        else:
            self.rejected += 1
        self.n_tokens += n_tokens

    def stop(self) -> None:
        self.stopped = True

    def stats(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "dropped": self.dropped,
            "admitted": self.admitted,
            "version": self.version,
            "trainer_version": self.trainer_version,
            "n_tokens": self.n_tokens,
            "started": self.started,
            "stopped": self.stopped,
        }


# --------------------------------------------------------------------------- routing


class RequestRouter:
    """Least-requests routing with stickiness per weight version.

    `in_flight[url]` counts requests handed to a server and not yet released;
    `loaded_version[url]` is the weight version the server holds now."""

    def __init__(self, urls: list[str], loaded_versions: list[int] | None = None):
        if not urls:
            raise ValueError("RequestRouter needs at least one server")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs: {urls}")
        self.urls = list(urls)
        self.in_flight = {url: 0 for url in urls}
        self.total_scheduled = {url: 0 for url in urls}
        versions = loaded_versions if loaded_versions is not None else [0] * len(urls)
        self.loaded_version = dict(zip(urls, versions))

    @property
    def version(self) -> int:
        """The version every server has loaded (the oldest one while an update runs)."""
        return min(self.loaded_version.values())

    def schedule(
        self, n: int = 1, previous_server_url: str | None = None, previous_version: int | None = None
    ) -> tuple[str, int]:
        """Pick a server for `n` requests: (url, version it holds)."""
        url = previous_server_url
        if url not in self.loaded_version or previous_version is None or self.loaded_version[url] != previous_version:
            url = min(self.urls, key=lambda u: (self.in_flight[u], self.total_scheduled[u]))
        self.in_flight[url] += n
        self.total_scheduled[url] += n
        return url, self.loaded_version[url]

    def release(self, url: str, n: int = 1) -> None:
        if url not in self.in_flight:
            raise KeyError(f"unknown server {url!r}; servers: {self.urls}")
        self.in_flight[url] = max(0, self.in_flight[url] - n)

    def set_loaded_version(self, url: str, version: int) -> None:
        self.loaded_version[url] = version


# --------------------------------------------------------------------------- weights


def delete_old_weight_dirs(weights_dir: str, current_version: int) -> list[str]:
    """Deletes `<weights_dir>/<u>` for integer u < current_version; returns
    what it deleted. Nothing else (temp dirs of a publish in progress, other
    files, symlinks) is touched."""
    deleted = []
    try:
        entries = list(os.scandir(weights_dir))
    except FileNotFoundError:
        return deleted
    for entry in entries:
        if entry.name.isdigit() and int(entry.name) < current_version and entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path)
            deleted.append(entry.path)
    return deleted


class WeightUpdateError(RuntimeError):
    pass


# --------------------------------------------------------------------------- HTTP plumbing


class BadRequest(ValueError):
    """A malformed request: answered with HTTP 400 (413 for an oversized body) and counted."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _field(body: dict, name: str, kind: type | tuple[type, ...], required: bool = True, default: Any = None) -> Any:
    if name not in body or body[name] is None:
        if required:
            raise BadRequest(f"missing field {name!r}")
        return default
    value = body[name]
    # bool is an int in Python; a JSON true is never a count or a version.
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise BadRequest(f"field {name!r} must be {_type_names(kind)}, got {type(value).__name__}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _type_names(kind: type | tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in _as_tuple(kind))


def _nonempty(body: dict, name: str) -> str:
    value = _field(body, name, str)
    if not value:
        raise BadRequest(f"field {name!r} must be a non-empty string")
    return value


def _qid(body: dict) -> str:
    return _nonempty(body, "qid")


def _count(body: dict, name: str, minimum: int = 1, default: int | None = 1) -> int:
    """An int field >= minimum; required when `default` is None."""
    n = _field(body, name, int, required=default is None, default=default)
    if n < minimum:
        raise BadRequest(f"field {name!r} must be >= {minimum}, got {n}")
    return n


class GserverManager(AsyncWorker):
    config_cls = GserverManagerConfig

    def _configure(self, config: GserverManagerConfig) -> None:
        self.cfg = config
        self.controller = StalenessController(
            config.train_batch_size, config.max_head_offpolicyness, config.max_concurrent_rollouts
        )
        self.server_urls: list[str] | None = None
        self.router: RequestRouter | None = None
        self.bad_requests = 0
        self._refusals: collections.Counter[str] = collections.Counter()
        self._last_refusal = ""
        self._update_task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._client: GenerationClient | None = None
        self._last_read = 0.0
        self._last_stats_log = time.monotonic()
        self._last_refusal_log = time.monotonic()
        self._last_logged_stats: dict | None = None
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
        self._client = GenerationClient(timeout_s=max(60.0, self.cfg.weight_update_timeout))
        await asyncio.gather(*(self._client.wait_healthy(u, SERVER_HEALTH_TIMEOUT_S) for u in self.server_urls))
        versions = await asyncio.gather(*(self._server_version(u) for u in self.server_urls))
        self.router = RequestRouter(self.server_urls, versions)
        self.logger.info("%d generation servers healthy, weight versions %s: %s", len(self.server_urls), versions,
                         self.server_urls)  # fmt: skip

        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_post("/allocate_rollout", self._handle(self._allocate_rollout))
        app.router.add_post("/finish_rollout", self._handle(self._finish_rollout))
        app.router.add_post("/schedule_request", self._handle(self._schedule_request))
        app.router.add_post("/release_request", self._handle(self._release_request))
        app.router.add_post("/stop_rollouts", self._handle(self._stop_rollouts, needs_body=False))
        app.router.add_get("/get_model_version", self._handle(self._get_model_version, needs_body=False))
        app.router.add_get("/rollout_stats", self._handle(self._rollout_stats, needs_body=False))
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        host = network.bind_address(self.info.mode, self.info.bind_address)
        port = network.find_free_port(self.experiment_name, self.trial_name, host=host)
        await web.TCPSite(self._runner, host, port).start()
        url = f"http://{network.advertise_address(self.info.mode, self.info.bind_address)}:{port}"
        name_resolve.add(names.gen_server_manager(self.experiment_name, self.trial_name), url, replace=True)
        self.logger.info(
            "serving at %s: train_batch_size %d, max_head_offpolicyness %d, max_concurrent_rollouts %d",
            url, self.cfg.train_batch_size, self.cfg.max_head_offpolicyness, self.cfg.max_concurrent_rollouts,
        )  # fmt: skip

    async def _teardown_async(self) -> None:
        if self._update_task is not None and not self._update_task.done():
            self._update_task.cancel()
            await asyncio.gather(self._update_task, return_exceptions=True)
        if self._runner is not None:
            try:
                name_resolve.delete(names.gen_server_manager(self.experiment_name, self.trial_name))
            except Exception as e:
                self.logger.debug("could not unregister the manager: %s", e)
            await self._runner.cleanup()
        if self._client is not None:
            await self._client.close()
        if self.router is not None:
            self._log_stats(force=True)

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
        if now - self._last_read >= self.cfg.poll_interval:
            self._last_read = now
            version, dropped, start = await asyncio.to_thread(self._read_trainer_state)
            if version is not None and version != self.controller.trainer_version:
                self.logger.info("trainer weight version %d -> %d", self.controller.trainer_version, version)
                self.controller.trainer_version = version
            if dropped is not None:
                self.controller.dropped = dropped
            if start is not None and not self.controller.started:
                self.controller.start(accepted=start["consumed"] + start["dropped"], rejected=start["filtered"])
                self.logger.info("training starts at step %d (version %d): admission opens with %d trajectories "
                                 "consumed and %d dropped so far", start["step"], start["version"],
                                 start["consumed"], start["dropped"])  # fmt: skip
            if self._update_task is None and self.controller.trainer_version > self.router.version:
                self._update_task = asyncio.create_task(self._update_weights(self.controller.trainer_version))
        self._sync_admission_version()
        self._log_refusals(now)
        self._log_stats()
        return IDLE

    def _read_trainer_state(self) -> tuple[int | None, int | None, dict | None]:
        """(trainer version, dropped samples, training start); a missing count
        is 0, a missing start or an unreadable value None."""
        values: list = []
        for key in (names.model_version(self.experiment_name, self.trial_name, "actor"),
                    names.dropped_samples(self.experiment_name, self.trial_name)):  # fmt: skip
            try:
                values.append(int(name_resolve.get(key)))
            except name_resolve.NameEntryNotFoundError:
                values.append(0)
            except Exception as e:  # a bad value or a name service hiccup: keep what we had
                self.logger.warning("could not read %s: %s: %s", key, type(e).__name__, e)
                values.append(None)
        start = None
        if not self.controller.started:
            key = names.training_start(self.experiment_name, self.trial_name)
            try:
                start = json.loads(name_resolve.get(key))
                start = {k: int(start[k]) for k in ("step", "version", "consumed", "dropped", "filtered")}
            except name_resolve.NameEntryNotFoundError:
                start = None
            except Exception as e:
                self.logger.warning("could not read %s: %s: %s", key, type(e).__name__, e)
                start = None
        return values[0], values[1], start

    # ---- weight updates ------------------------------------------------------------------
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
        stale = [u for u in self.router.urls if self.router.loaded_version[u] < version]
        t0 = time.monotonic()
        self.logger.info("updating %d servers to weight version %d from %s", len(stale), version, path)
        results = await asyncio.gather(*(self._update_server(u, path, version) for u in stale), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise WeightUpdateError(
                f"{len(failures)} of {len(stale)} generation servers could not load weight version {version}:\n"
                + "\n".join(str(f) for f in failures)
            )
        interrupted = sum(int(r.get("num_paused_requests", 0) or 0) for r in results)
        self.logger.info("all servers hold weight version %d (%.2fs, %d requests interrupted)", version,
                         time.monotonic() - t0, interrupted)  # fmt: skip
        if self.router.version >= version:
            deleted = await asyncio.to_thread(delete_old_weight_dirs, self.cfg.weights_dir, version)
            if deleted:
                self.logger.info("deleted old weights: %s", ", ".join(os.path.basename(d) for d in deleted))

    async def _update_server(self, url: str, path: str, version: int) -> dict:
        attempts = 1 + max(0, self.cfg.weight_update_retries)
        last_error: Exception | None = None
        for attempt in range(1, attempts + 1):
            try:
                result = await self._client.update_weights_from_disk(
                    url, path, version, abort_all_requests=True, timeout_s=self.cfg.weight_update_timeout
                )
            except (GenerationServerError, GenerationServerUnavailable) as e:
                last_error = e
                self.logger.warning("weight update of %s to version %d failed (attempt %d/%d): %s", url, version,
                                    attempt, attempts, e)  # fmt: skip
                if attempt < attempts:
                    await asyncio.sleep(min(2.0 ** (attempt - 1), 10.0))
                continue
            self.router.set_loaded_version(url, version)
            return result
        raise WeightUpdateError(
            f"generation server {url} could not load weight version {version} from {path} "
            f"after {attempts} attempts: {last_error}"
        )

    # ---- HTTP handlers ---------------------------------------------------------------------
    def _handle(self, handler, needs_body: bool = True):
        """Wraps a handler `(body) -> dict`: JSON in and out, 400 on a bad request."""

        async def wrapped(request: web.Request) -> web.Response:
            try:
                body: dict = {}
                if needs_body:
                    try:
                        body = await read_json(request, max_bytes=_MAX_BODY_BYTES, max_depth=_MAX_BODY_DEPTH)
                    except BodyError as e:
                        raise BadRequest(str(e), e.status) from None
                return web.json_response(handler(body))
            except BadRequest as e:
                self.bad_requests += 1
                # The first ones in full; then a sample, so a broken client cannot flood the log.
                if self.bad_requests <= _BAD_REQUESTS_LOGGED or self.bad_requests % 1000 == 0:
                    self.logger.warning("bad request #%d to %s: %s", self.bad_requests, request.path, e)
                return web.json_response({"error": str(e)}, status=e.status)

        return wrapped

    def _allocate_rollout(self, body: dict) -> dict:
        rollout_id = _nonempty(body, "rollout_id")
        qid = _qid(body)
        ok, reason = self.controller.allocate(rollout_id, qid)
        if not ok:
            self._refusals[reason.split(":")[0].split(" (")[0]] += 1
            self._last_refusal = reason
        return {"success": ok, "reason": reason, "version": self.controller.version}

    def _finish_rollout(self, body: dict) -> dict:
        rollout_id = _nonempty(body, "rollout_id")
        n_trajectories = _count(body, "n_trajectories", minimum=0, default=None)
        n_tokens = _count(body, "n_tokens", minimum=0, default=0)
        try:
            self.controller.finish(rollout_id, n_trajectories, n_tokens)
        except KeyError as e:
            raise BadRequest(str(e.args[0])) from None
        return {"success": True}

    def _schedule_request(self, body: dict) -> dict:
        _qid(body)
        n = _count(body, "n")
        previous_url = _field(body, "previous_server_url", str, required=False)
        previous_version = _field(body, "previous_version", int, required=False)
        url, version = self.router.schedule(n, previous_url, previous_version)
        return {"url": url, "version": version}

    def _release_request(self, body: dict) -> dict:
        url = _field(body, "url", str)
        n = _count(body, "n")
        try:
            self.router.release(url, n)
        except KeyError as e:
            raise BadRequest(str(e.args[0])) from None
        return {"success": True}

    def _stop_rollouts(self, body: dict) -> dict:
        if not self.controller.stopped:
            self.logger.info("rollouts stopped: every later allocate_rollout is refused")
        self.controller.stop()
        return {"success": True}

    def _get_model_version(self, body: dict) -> dict:
        return {"version": self.router.version}

    def _rollout_stats(self, body: dict) -> dict:
        return self._stats()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    # ---- logging ------------------------------------------------------------------------------
    def _stats(self) -> dict[str, Any]:
        return {
            **self.controller.stats(),
            "loaded_version": self.router.version,
            "n_servers": len(self.router.urls),
            "server_in_flight": dict(self.router.in_flight),
            "bad_requests": self.bad_requests,
        }

    def _log_refusals(self, now: float) -> None:
        if now - self._last_refusal_log < STATS_LOG_INTERVAL_S:
            return
        self._last_refusal_log = now
        if self._refusals:
            counts = ", ".join(f"{k}: {v}" for k, v in sorted(self._refusals.items()))
            self.logger.info("refused %d rollouts in the last %.0fs (%s); latest: %s", sum(self._refusals.values()),
                             STATS_LOG_INTERVAL_S, counts, self._last_refusal)  # fmt: skip
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
            stats["running"], stats["accepted"], stats["rejected"], stats["dropped"],
            " (stopped)" if stats["stopped"] else "", "" if stats["started"] else " (not started)",
            stats["trainer_version"],
            sorted(set(self.router.loaded_version.values())), list(stats["server_in_flight"].values()),
        )  # fmt: skip
