"""GserverManager worker: admission, routing and weight updates (docs/design.md §2, §6-§8).

One manager per trial sits between the rollout workers and the generation
servers. It serves this HTTP API (the contract with the rollout side; JSON,
127.0.0.1 in local mode, base URL under `names.gen_server_manager`):

    POST /allocate_rollout {"rollout_id", "qid", "wait_s"=0} -> {"success", "admitted", "reason", "version"}
                                                               (refused: waits up to wait_s, at most
                                                               MAX_ALLOCATE_WAIT_S, for admission to open)
                           {"rollouts": [{"rollout_id", "qid"}, ...], "wait_s"=0}
                                                            -> the same; `admitted`: how many of the list, in
                                                               order, admission took (waits for the first)
    POST /finish_rollout   {"rollout_id", "n_trajectories", "n_tokens"} -> {"success": true}
                           {"rollouts": [{"rollout_id", "n_trajectories", "n_tokens"}, ...]}
    POST /reset_rollout_worker {"worker_index"}             -> {"qids", "furthest"}  (its earlier process's
                                                               running rollouts, released; the furthest
                                                               [epoch, position] it got admitted)
    POST /schedule_request {"qid", "n"=1, "previous_server_url", "previous_version", "avoid_urls"=[]}
                                                            -> {"url", "version"[, "down"]}
                           {..., "parts": [n, ...]} (requests of several callers at once, each part routed
                                                    as if alone) -> {..., "parts": [{"url", "version"}, ...]}
    POST /release_request  {"url", "n"=1, "n_tokens"=0}     -> {"success": true}
    GET  /get_model_version                                 -> {"version"}
    POST /stop_rollouts                                     -> {"success": true}
    GET  /rollout_stats, GET /rejected_qids (the recovery ledger), GET /health
    GET  /servers                                           -> {"version", "servers": [...], "events"}

`/rollout_stats` also carries the generation servers' utilization
(`RequestRouter.utilization`: cumulative idle server-seconds, server-seconds,
generated tokens; `n_tokens` of a release is what those requests generated),
which the master turns into the per-step `perf/gen_idle_ratio` and
`perf/gen_tokens_per_s` (docs/observability.md).

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
`model_version/actor` and `dropped_samples` every `poll_interval`. When the
trainer's version v is newer than what the servers hold, every server loads `<weights_dir>/<v>` concurrently
(`update_weights_from_disk`, in-flight requests aborted; 1 + weight_update_retries
attempts per server, each within weight_update_timeout). A server that still
fails stops the trial with a message naming it. Intermediate versions are
skipped. Once all servers hold v, the directories `<weights_dir>/<u>` for
u < v are deleted (nothing else in weights_dir is touched).

Servers come and go (docs/architecture.md, "Generation servers that come and
go"). The manager reads the registry (`names.gen_servers`) every second: a
server registered under a new index, or again under an index at a new URL
(a restarted one), *joins*: once healthy it is brought to
`max(router version, trainer version)` (`update_weights_from_disk`) and only
then put into routing, so `version`, and with it admission, never goes back.
Every server is health-checked (`/health` every health_check_interval, within
health_check_timeout): a refused or dropped connection, or
health_check_failures failures in a row, take it out of routing (logged once,
counted in `server_events`); its in-flight requests are resubmitted by their
clients, and a down server that answers again rejoins the same way. A client
that just failed on servers names them in `avoid_urls`: they are probed at
once, another server is picked while one is up, and `down` says which of them
the manager has taken out of routing. With no server up, `url` is null (the
client counts that as a failure). A weight update skips servers that left
routing meanwhile; `GET /servers` lists every server's state.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable
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
REGISTRY_POLL_S = 1.0  # seconds between reads of the generation server registry
MAX_ALLOCATE_WAIT_S = 10.0  # the longest allocate_rollout long poll a client may ask for
AVOID_PROBE_WAIT_S = 1.0  # a schedule_request naming failed servers waits this long at most for their probes
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
        self.rejected_qids: list[str] = []  # their qids (this process), for the recovery ledger
        self.admitted = 0  # episodes admitted by this process
        self.n_tokens = 0
        self.stopped = False
        self._running: dict[str, str] = {}  # rollout_id -> qid
        self._finished: collections.OrderedDict[str, int] = collections.OrderedDict()  # rollout_id -> trajectories
        self._furthest: dict[int, tuple[int, int]] = {}  # rollout worker -> furthest (epoch, position) admitted

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
        if not within_staleness_bound(
            self.accepted, self.dropped, self.running, self.train_batch_size, self.max_head_offpolicyness, self.version
        ):
            return False, (
                f"staleness bound: (accepted {self.accepted} - dropped {self.dropped} + running {self.running})"
                f" // train_batch_size {self.train_batch_size} > max_head_offpolicyness"
                f" {self.max_head_offpolicyness} + version {self.version}"
            )
        self._running[rollout_id] = qid
        self.admitted += 1
        self._note_position(rollout_id)
        return True, None

    def _note_position(self, rollout_id: str) -> None:
        """Rollout ids `<worker>:<epoch>:<position>:<nonce>` (rollout workers'):
        the furthest (epoch, position) admitted per worker, for `release_worker`."""
        parts = rollout_id.split(":")
        if len(parts) == 4 and all(p.isdigit() for p in parts[:3]):
            worker, epoch, position = (int(p) for p in parts[:3])
            self._furthest[worker] = max(self._furthest.get(worker, (epoch, position)), (epoch, position))

    def is_known(self, rollout_id: str) -> bool:
        """Running, or finished recently enough for a repeated finish to be a no-op."""
        return rollout_id in self._running or rollout_id in self._finished

    def finish(self, rollout_id: str, n_trajectories: int, n_tokens: int = 0) -> None:
        """Rollout `rollout_id` ended with `n_trajectories` accepted
        trajectories (0: the agent rejected the prompt, which gives its budget
        back). KeyError if it was never admitted; a repeated call is a no-op."""
        if rollout_id in self._finished:
            return
        if rollout_id not in self._running:
            raise KeyError(f"no running rollout with id {rollout_id!r}")
        qid = self._running.pop(rollout_id)
        self._finished[rollout_id] = n_trajectories
        if len(self._finished) > FINISHED_IDS_KEPT:
            self._finished.popitem(last=False)
        if n_trajectories:
            self.accepted += n_trajectories
        else:
            self.rejected += 1
            self.rejected_qids.append(qid)
        self.n_tokens += n_tokens

    def release_worker(self, worker_index: int) -> tuple[list[str], tuple[int, int] | None]:
        """Forgets the running rollouts of rollout worker `worker_index` (rollout
        ids start with `<index>:`): (their qids, the furthest (epoch, position)
        it had admitted, or None)."""
        gone = [rid for rid in self._running if rid.split(":", 1)[0] == str(worker_index)]
        return [self._running.pop(rid) for rid in gone], self._furthest.get(worker_index)

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


class NoServerUp(RuntimeError):
    """No generation server is in routing (all down, or still rejoining)."""


class RequestRouter:
    """Least-requests routing with stickiness per weight version.

    `in_flight[url]` counts requests handed to a server and not yet released;
    `loaded_version[url]` is the weight version the server holds now.

    Servers come and go (docs/architecture.md, "Generation servers that come
    and go"): `add_server(url, version)` puts a new or rejoining server into
    routing, `mark_down(url)` takes one out. A server that is down gets no new
    request and no longer holds `version` back; the releases still due for the
    requests it had in flight (their answers are resubmitted elsewhere) are
    absorbed, so its count starts from 0 if it comes back. A server joins only
    holding at least `version`, so `version` never goes back.

    It also keeps the figures of `utilization()`: per server, the seconds it
    had no request in flight (integrated at each schedule and release), and
    the tokens generated (reported with each release)."""

    def __init__(
        self, urls: list[str], loaded_versions: list[int] | None = None, clock: Callable[[], float] = time.monotonic
    ):
        if not urls:
            raise ValueError("RequestRouter needs at least one server")
        if len(set(urls)) != len(urls):
            raise ValueError(f"duplicate server URLs: {urls}")
        self.urls = list(urls)  # every server ever known, up or not
        self.in_flight = {url: 0 for url in urls}
        self.total_scheduled = {url: 0 for url in urls}
        versions = loaded_versions if loaded_versions is not None else [0] * len(urls)
        self.loaded_version = dict(zip(urls, versions))
        self.up: set[str] = set(urls)
        self._orphaned = {url: 0 for url in urls}  # releases still due from before the server went down
        self._version_floor = min(versions)
        self._clock = clock
        self._started = clock()
        self._idle_s = {url: 0.0 for url in urls}  # completed idle periods
        self._idle_since: dict[str, float | None] = {url: self._started for url in urls}  # None while busy or down
        self._up_s = {url: 0.0 for url in urls}  # completed periods in routing
        self._up_since: dict[str, float | None] = {url: self._started for url in urls}  # None while down
        self.generated_tokens = 0

    @property
    def up_urls(self) -> list[str]:
        """The servers in routing, in the order they first joined."""
        return [u for u in self.urls if u in self.up]

    def is_up(self, url: str) -> bool:
        return url in self.up

    @property
    def version(self) -> int:
        """The version every server in routing has loaded (the oldest one
        while an update runs). It never goes back: with no server up it stays
        where it was."""
        versions = [self.loaded_version[u] for u in self.up]
        if versions:
            self._version_floor = max(self._version_floor, min(versions))
        return self._version_floor

    def schedule(
        self,
        n: int = 1,
        previous_server_url: str | None = None,
        previous_version: int | None = None,
        avoid: Iterable[str] = (),
    ) -> tuple[str, int]:
        """Pick a server for `n` requests: (url, version it holds). `avoid`:
        servers that just failed for this caller; another server is picked
        while one is up. NoServerUp when none is."""
        if not self.up:
            raise NoServerUp("no generation server is up")
        avoid = set(avoid)
        url = previous_server_url
        if (
            url not in self.up
            or url in avoid
            or previous_version is None
            or self.loaded_version[url] != previous_version
        ):
            candidates = [u for u in self.up_urls if u not in avoid] or self.up_urls
            url = min(candidates, key=lambda u: (self.in_flight[u], self.total_scheduled[u]))
        since = self._idle_since[url]
        if since is not None:  # idle until now
            self._idle_s[url] += self._clock() - since
            self._idle_since[url] = None
        self.in_flight[url] += n
        self.total_scheduled[url] += n
        return url, self.loaded_version[url]

    def release(self, url: str, n: int = 1, n_tokens: int = 0) -> None:
        """`n` requests on `url` ended, having generated `n_tokens` together."""
        if url not in self.in_flight:
            raise KeyError(f"unknown server {url!r}; servers: {self.urls}")
        absorbed = min(n, self._orphaned[url])  # requests from before the server went down
        self._orphaned[url] -= absorbed
        self.in_flight[url] = max(0, self.in_flight[url] - (n - absorbed))
        self.generated_tokens += n_tokens
        if url in self.up and self.in_flight[url] == 0 and self._idle_since[url] is None:
            self._idle_since[url] = self._clock()

    def mark_down(self, url: str) -> int:
        """Takes `url` out of routing; returns how many requests it had in
        flight (their releases, still due, are absorbed). No-op if not up."""
        if url not in self.up:
            return 0
        now = self._clock()
        self.up.discard(url)
        orphaned, self.in_flight[url] = self.in_flight[url], 0
        self._orphaned[url] += orphaned
        if self._idle_since[url] is not None:
            self._idle_s[url] += now - self._idle_since[url]
            self._idle_since[url] = None
        self._up_s[url] += now - self._up_since[url]
        self._up_since[url] = None
        return orphaned

    def add_server(self, url: str, version: int) -> None:
        """Puts `url` (new, or back after being down) into routing, holding
        weight `version`. ValueError if that is older than `version`: admission
        would go back."""
        current = self.version
        if version < current:
            raise ValueError(
                f"server {url} holds weight version {version}, older than the servers in routing "
                f"({current}): load version {current} first"
            )
        self.loaded_version[url] = version
        if url in self.up:
            return
        now = self._clock()
        if url not in self.in_flight:
            self.urls.append(url)
            self.in_flight[url] = 0
            self.total_scheduled[url] = 0
            self._orphaned[url] = 0
            self._idle_s[url] = 0.0
            self._up_s[url] = 0.0
        self.up.add(url)
        self._idle_since[url] = now if self.in_flight[url] == 0 else None
        self._up_since[url] = now

    def utilization(self) -> dict[str, float]:
        """Cumulative figures since the router started: `gen_idle_s`, the
        seconds summed over servers that a server had no request in flight;
        `gen_server_s`, the seconds summed over servers (so the idle ratio over
        an interval is the difference of the one over the difference of the
        other); `gen_tokens`, tokens generated; `gen_clock_s`, seconds elapsed.
        A server counts only while it is in routing."""
        now = self._clock()
        idle = sum(self._idle_s.values()) + sum(now - s for s in self._idle_since.values() if s is not None)
        server_s = sum(self._up_s.values()) + sum(now - s for s in self._up_since.values() if s is not None)
        return {
            "gen_idle_s": idle,
            "gen_server_s": server_s,
            "gen_tokens": self.generated_tokens,
            "gen_clock_s": now - self._started,
        }

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


def _list_of_objects(body: dict, name: str) -> list[dict]:
    """The non-empty list of objects under `name`, or the body itself as a
    one-element list when it has no such field (the single form)."""
    if name not in body:
        return [body]
    items = _field(body, name, list)
    if not items or not all(isinstance(item, dict) for item in items):
        raise BadRequest(f"field {name!r} must be a non-empty list of objects")
    return items


def _count(body: dict, name: str, minimum: int = 1, default: int | None = 1) -> int:
    """An int field >= minimum; required when `default` is None."""
    n = _field(body, name, int, required=default is None, default=default)
    if n < minimum:
        raise BadRequest(f"field {name!r} must be >= {minimum}, got {n}")
    return n


@dataclasses.dataclass
class _Server:
    """One registered generation server as the manager sees it (`state`:
    joining | up | down | retired; see GserverManager._init_server_registry)."""

    index: int
    url: str
    state: str
    since: float = 0.0  # time.monotonic() of the last change of state
    reason: str = ""  # why it is in this state
    failures: int = 0  # health checks failed in a row
    joined: int | None = None  # the weight version it last joined routing with
    first_request_version: int | None = None  # the version it held when first given a request

    def set_state(self, state: str, reason: str) -> None:
        self.state, self.reason, self.since, self.failures = state, reason, time.monotonic(), 0


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
        # Set (and replaced) whenever admission may have opened: waiting allocations try again.
        self._admission_changed = asyncio.Event()
        self._admission_state: tuple = ()
        self._last_refusal = ""
        self._update_task: asyncio.Task | None = None
        self._runner: web.AppRunner | None = None
        self._client: GenerationClient | None = None
        self._last_read = 0.0
        self._last_stats_log = time.monotonic()
        self._last_refusal_log = time.monotonic()
        self._last_logged_stats: dict | None = None
        self._init_server_registry()
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
        self.logger.info(
            "%d generation servers healthy, weight versions %s: %s", len(self.server_urls), versions, self.server_urls
        )
        self._start_server_registry(self.server_urls)

        app = web.Application(client_max_size=_MAX_BODY_BYTES)
        app.router.add_post("/allocate_rollout", self._handle(self._allocate_rollout))
        app.router.add_post("/finish_rollout", self._handle(self._finish_rollout))
        app.router.add_post("/schedule_request", self._handle(self._schedule_request))
        app.router.add_post("/release_request", self._handle(self._release_request))
        app.router.add_post("/stop_rollouts", self._handle(self._stop_rollouts, needs_body=False))
        app.router.add_post("/reset_rollout_worker", self._handle(self._reset_rollout_worker))
        app.router.add_get("/get_model_version", self._handle(self._get_model_version, needs_body=False))
        app.router.add_get("/rollout_stats", self._handle(self._rollout_stats, needs_body=False))
        app.router.add_get("/rejected_qids", self._handle(self._rejected_qids, needs_body=False))
        app.router.add_get("/servers", self._handle(self._servers_info, needs_body=False))
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
            url,
            self.cfg.train_batch_size,
            self.cfg.max_head_offpolicyness,
            self.cfg.max_concurrent_rollouts,
        )

    async def _teardown_async(self) -> None:
        if self._update_task is not None and not self._update_task.done():
            self._update_task.cancel()
            await asyncio.gather(self._update_task, return_exceptions=True)
        await self._stop_server_registry()
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
                self._update_task = asyncio.create_task(self._update_weights(self.controller.trainer_version))
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

    def _read_trainer_state(self) -> tuple[int | None, int | None, dict | None]:
        """(trainer version, dropped samples, training start); a missing count
        is 0, a missing start or an unreadable value None."""
        values: list = []
        for key in (
            names.model_version(self.experiment_name, self.trial_name, "actor"),
            names.dropped_samples(self.experiment_name, self.trial_name),
        ):
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
        self.logger.info("updating %d servers to weight version %d from %s", len(stale), version, path)
        results = await asyncio.gather(*(self._update_server(u, path, version) for u in stale), return_exceptions=True)
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            raise WeightUpdateError(
                f"{len(failures)} of {len(stale)} generation servers could not load weight version {version}:\n"
                + "\n".join(str(f) for f in failures)
            )
        interrupted = sum(int(r.get("num_paused_requests", 0) or 0) for r in results if r is not None)
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

    async def _update_server(self, url: str, path: str, version: int) -> dict | None:
        """Loads `version` on `url`; None if the server left routing meanwhile."""
        attempts = 1 + max(0, self.cfg.weight_update_retries)
        last_error: Exception | None = None
        for attempt in range(1, attempts + 1):
            try:
                result = await self._client.update_weights_from_disk(
                    url, path, version, abort_all_requests=True, timeout_s=self.cfg.weight_update_timeout
                )
            except (GenerationServerError, GenerationServerUnavailable) as e:
                last_error = e
                if isinstance(e, GenerationServerUnavailable):
                    await self._check_server(url)  # a dead server leaves routing now
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
            self.router.set_loaded_version(url, version)
            return result
        if not self.router.is_up(url):
            return None
        raise WeightUpdateError(
            f"generation server {url} could not load weight version {version} from {path} "
            f"after {attempts} attempts: {last_error}"
        )

    # ---- servers that come and go ------------------------------------------------------------
    # docs/architecture.md, "Generation servers that come and go". Every server
    # registered under names.gen_servers is in one state: "joining" (registered,
    # being brought to the current weights; gets no request), "up" (in routing),
    # "down" (failed its health checks; probed on, and rejoins when it answers
    # again) or "retired" (its key was removed or now names another URL).
    def _init_server_registry(self) -> None:
        self._servers: dict[str, _Server] = {}  # url -> state
        self._registered: dict[int, str] = {}  # server index -> url, as in name_resolve
        self._server_tasks: dict[str, asyncio.Task] = {}  # url -> its join task
        self._probe_tasks: dict[str, asyncio.Task] = {}  # url -> an immediate health probe
        self._health_task: asyncio.Task | None = None
        self._last_registry_read = 0.0
        self._indices_up: set[int] = set()  # server indices that have been in routing
        self.server_events: collections.Counter[str] = collections.Counter()  # down / joined / rejoined / retired

    def _start_server_registry(self, urls: list[str]) -> None:
        now = time.monotonic()
        for index, url in enumerate(urls):
            self._registered[index] = url
            self._servers[url] = _Server(index, url, "up", since=now)
            self._indices_up.add(index)
        self._health_task = asyncio.create_task(self._health_loop())

    async def _stop_server_registry(self) -> None:
        tasks = [
            t
            for t in (self._health_task, *self._server_tasks.values(), *self._probe_tasks.values())
            if t is not None and not t.done()
        ]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.router is not None:
            scheduled = self.router.total_scheduled
            counts = ", ".join(
                f"{s.index}{'' if s.state == 'up' else f' ({s.state})'}: {scheduled.get(s.url, 0)}"
                for s in self._servers.values()
            )
            self.logger.info(
                "requests routed per server (index: requests): %s; server events: %s",
                counts,
                dict(self.server_events) or "none",
            )

    def _trial_ending(self) -> bool:
        """Rollouts stopped and none running: the servers exit with the trial
        (until the last rollout finished, faults are still handled)."""
        return self.controller.stopped and self.controller.running == 0

    def _up_count(self) -> str:
        registered = sum(1 for s in self._servers.values() if s.state != "retired")
        return f"{len(self.router.up)} of {registered} registered servers up"

    async def _poll_servers(self, now: float) -> None:
        """Picks up servers registered, re-registered or unregistered since the last read."""
        for task in [self._health_task, *self._server_tasks.values()]:
            if task is not None and task.done() and not task.cancelled():
                task.result()  # a bug there must not pass silently: it stops the worker
        if now - self._last_registry_read < REGISTRY_POLL_S or self._trial_ending():
            return  # servers unregister as the trial ends: not a change to act on
        self._last_registry_read = now
        try:
            registered = await asyncio.to_thread(self._read_registry)
        except Exception as e:  # a name service hiccup: keep what we know
            self.logger.warning("could not read the generation server registry: %s: %s", type(e).__name__, e)
            return
        for index, url in sorted(registered.items()):
            old = self._registered.get(index)
            if old == url:
                continue
            if old is not None:
                self._retire(old, f"server {index} registered again at {url}")
            self._registered[index] = url
            self._start_join(index, url)
        for index in sorted(set(self._registered) - set(registered)):
            self._retire(self._registered.pop(index), "unregistered")

    def _read_registry(self) -> dict[int, str]:
        root = names.gen_servers(self.experiment_name, self.trial_name)
        found = {}
        for key in name_resolve.find_subtree(root):
            suffix = key[len(root) :].strip("/")
            if not suffix.isdigit():
                continue
            try:
                found[int(suffix)] = name_resolve.get(key)
            except name_resolve.NameEntryNotFoundError:
                pass  # unregistered between listing and reading
        return found

    def _retire(self, url: str, why: str) -> None:
        server = self._servers.get(url)
        if server is None or server.state == "retired":
            return
        was_up = server.state == "up"
        orphaned = self.router.mark_down(url)
        server.set_state("retired", why)
        task = self._server_tasks.pop(url, None)
        if task is not None and not task.done():
            task.cancel()
        self.server_events["retired"] += 1
        if was_up:
            self.logger.warning(
                "generation server %d at %s left routing (%s); %d requests it had in flight go to "
                "the other servers; %s",
                server.index,
                url,
                why,
                orphaned,
                self._up_count(),
            )
        else:
            self.logger.info("generation server %d at %s (%s) is gone: %s", server.index, url, server.state, why)

    def _mark_down(self, url: str, reason: str) -> None:
        server = self._servers.get(url)
        if server is None or server.state != "up":
            return
        orphaned = self.router.mark_down(url)
        server.set_state("down", reason)
        self.server_events["down"] += 1
        self.logger.warning(
            "generation server %d at %s is down (%s): out of routing; %d requests it had in flight "
            "go to the other servers; %s",
            server.index,
            url,
            reason,
            orphaned,
            self._up_count(),
        )

    def _start_join(self, index: int, url: str) -> None:
        """Brings a new, restarted or recovered server to the current weights,
        then puts it into routing (`_join`)."""
        server = self._servers.get(url)
        if server is not None and server.state in ("up", "joining"):
            return
        if server is None:
            server = self._servers[url] = _Server(index, url, "joining", since=time.monotonic())
            self.logger.info("generation server %d registered at %s: joining", index, url)
        else:
            server.set_state("joining", "answers again")
        self._server_tasks[url] = asyncio.create_task(self._join(server))

    async def _join(self, server: _Server) -> None:
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
                if version < target:
                    if not self.cfg.weights_dir:
                        raise WeightUpdateError(f"server holds version {version} < {target} and weights_dir is empty")
                    path = os.path.join(self.cfg.weights_dir, str(target))
                    self.logger.info(
                        "generation server %d at %s holds weight version %d: loading version %d before "
                        "it takes requests",
                        server.index,
                        url,
                        version,
                        target,
                    )
                    await self._client.update_weights_from_disk(
                        url, path, target, abort_all_requests=True, timeout_s=self.cfg.weight_update_timeout
                    )
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
            if server.state != "joining" or version < self.router.version:
                continue  # (no await from the check to add_server below)
            rejoin = server.index in self._indices_up
            self.router.add_server(url, version)
            server.set_state("up", "joined")
            server.joined = version
            self._indices_up.add(server.index)
            self.server_events["rejoined" if rejoin else "joined"] += 1
            self.logger.info(
                "generation server %d at %s %s routing at weight version %d after %.1fs (trainer version %d); %s",
                server.index,
                url,
                "rejoined" if rejoin else "joined",
                version,
                time.monotonic() - t0,
                self.controller.trainer_version,
                self._up_count(),
            )
            return

    async def _health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.health_check_interval)
            urls = [s.url for s in self._servers.values() if s.state in ("up", "down")]
            await asyncio.gather(*(self._check_server(u) for u in urls))

    async def _check_server(self, url: str) -> None:
        """One health check: a refused or dropped connection, or
        health_check_failures failures in a row, take the server out of
        routing; a down server that answers again rejoins."""
        server = self._servers.get(url)
        if server is None:
            return
        probe = await self._client.probe(url, self.cfg.health_check_timeout)
        if server.state not in ("up", "down") or self._trial_ending():
            return  # servers leaving now is the trial ending, not a fault
        if probe.ok:
            server.failures = 0
            if server.state == "down":
                self._start_join(server.index, url)
            return
        server.failures += 1
        if server.state == "up" and (probe.gone or server.failures >= self.cfg.health_check_failures):
            how = "" if probe.gone else f", {server.failures} health checks failed in a row"
            self._mark_down(url, f"{probe.reason}{how}")

    def _probe_soon(self, url: str) -> asyncio.Task:
        """A client reported `url` failing: check it now, not at the next round
        (one probe at a time per server)."""
        task = self._probe_tasks.get(url)
        if task is None or task.done():
            task = self._probe_tasks[url] = asyncio.get_running_loop().create_task(self._check_server(url))
        return task

    def _servers_info(self, body: dict) -> dict:
        return {
            "version": self.router.version,
            "servers": [
                {
                    "index": s.index,
                    "url": s.url,
                    "state": s.state,
                    "reason": s.reason,
                    "version": self.router.loaded_version.get(s.url),
                    "in_flight": self.router.in_flight.get(s.url, 0),
                    "scheduled": self.router.total_scheduled.get(s.url, 0),
                    "first_request_version": s.first_request_version,
                }
                for s in self._servers.values()
            ],
            "events": dict(self.server_events),
        }

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
                result = handler(body)
                if asyncio.iscoroutine(result):
                    result = await result
                return web.json_response(result)
            except BadRequest as e:
                self.bad_requests += 1
                # The first ones in full; then a sample, so a broken client cannot flood the log.
                if self.bad_requests <= _BAD_REQUESTS_LOGGED or self.bad_requests % 1000 == 0:
                    self.logger.warning("bad request #%d to %s: %s", self.bad_requests, request.path, e)
                return web.json_response({"error": str(e)}, status=e.status)

        return wrapped

    async def _allocate_rollout(self, body: dict) -> dict:
        """Admits one rollout, or a list in order (as many as admission
        allows: one call per batch of prompts instead of one per prompt).
        A long poll: while the first is refused and `wait_s` > 0, admission
        is tried again whenever it may have opened (a new version, a
        finished, dropped or released rollout), until `wait_s` has passed.
        The rollout worker thus starts the next rollouts as soon as it may,
        without polling; a repeated call for the same id admits nothing new."""
        wanted = [(_nonempty(r, "rollout_id"), _qid(r)) for r in _list_of_objects(body, "rollouts")]
        wait_s = _field(body, "wait_s", (int, float), required=False, default=0)
        if not 0 <= wait_s <= MAX_ALLOCATE_WAIT_S:
            raise BadRequest(f"field 'wait_s' must be in [0, {MAX_ALLOCATE_WAIT_S}], got {wait_s}")
        deadline = time.monotonic() + wait_s
        admitted, reason = self._admit(wanted)
        while not admitted and not self.controller.stopped:
            changed = self._admission_changed
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                await asyncio.wait_for(changed.wait(), remaining)
            except asyncio.TimeoutError:
                pass
            admitted, reason = self._admit(wanted)
        if admitted < len(wanted):
            self._refusals[reason.split(":")[0].split(" (")[0]] += 1
            self._last_refusal = reason
        return {"success": admitted > 0, "admitted": admitted, "reason": reason, "version": self.controller.version}

    def _admit(self, wanted: list[tuple[str, str]]) -> tuple[int, str | None]:
        """How many of `wanted` admission takes, in order; the first refusal's reason (None: all taken)."""
        for k, (rollout_id, qid) in enumerate(wanted):
            ok, reason = self.controller.allocate(rollout_id, qid)
            if not ok:
                return k, reason
        return len(wanted), None

    def _wake_allocations(self) -> None:
        self._admission_changed.set()
        self._admission_changed = asyncio.Event()

    def _reset_rollout_worker(self, body: dict) -> dict:
        """A rollout worker (re)starting: its earlier process's running
        rollouts are gone. Their slots go back to admission; their qids go to
        the new process, which generates them again."""
        index = _count(body, "worker_index", minimum=0, default=None)
        qids, furthest = self.controller.release_worker(index)
        self._wake_allocations()
        if qids:
            self.logger.warning(
                "rollout worker %d restarted: %d running rollouts released, to be generated again", index, len(qids)
            )
        return {"qids": qids, "furthest": list(furthest) if furthest else None}

    def _finish_rollout(self, body: dict) -> dict:
        finished = [
            (
                _nonempty(r, "rollout_id"),
                _count(r, "n_trajectories", minimum=0, default=None),
                _count(r, "n_tokens", minimum=0, default=0),
            )
            for r in _list_of_objects(body, "rollouts")
        ]
        unknown = [rid for rid, _, _ in finished if not self.controller.is_known(rid)]
        if unknown:  # before any is finished: a rejected call changes nothing
            raise BadRequest(f"no running rollout with id {unknown[0]!r}")
        for rollout_id, n_trajectories, n_tokens in finished:
            self.controller.finish(rollout_id, n_trajectories, n_tokens)
        self._wake_allocations()
        return {"success": True}

    async def _schedule_request(self, body: dict) -> dict:
        """A server for `n` requests; with `parts`, a server for each part in
        turn (the requests of several groups sent at once: each part is
        routed as if it came alone, so they spread over the servers)."""
        _qid(body)
        n = _count(body, "n")
        sizes = _field(body, "parts", list, required=False)
        if sizes is not None and not (
            sizes and all(isinstance(k, int) and not isinstance(k, bool) and k >= 1 for k in sizes) and sum(sizes) == n
        ):
            raise BadRequest("field 'parts' must be a non-empty list of counts >= 1 that sum to 'n'")
        previous_url = _field(body, "previous_server_url", str, required=False)
        previous_version = _field(body, "previous_version", int, required=False)
        avoid = _field(body, "avoid_urls", list, required=False, default=[])
        if not all(isinstance(u, str) for u in avoid):
            raise BadRequest("field 'avoid_urls' must be a list of strings")
        # Servers that just failed for the caller: check them now (a dead one
        # answers at once; a slow one does not hold the caller up for long).
        probes = [self._probe_soon(u) for u in dict.fromkeys(avoid) if self.router.is_up(u)]
        if probes:
            await asyncio.wait([asyncio.shield(p) for p in probes], timeout=AVOID_PROBE_WAIT_S)
        down = [u for u in avoid if not self.router.is_up(u)]
        try:
            picks = [self.router.schedule(k, previous_url, previous_version, avoid) for k in sizes or [n]]
        except NoServerUp as e:  # (none is up: the first part already finds that)
            servers = "; ".join(
                f"{s.index} at {s.url} {s.state}" + (f": {s.reason}" if s.reason else "")
                for s in self._servers.values()
                if s.state != "retired"
            )
            return {
                "url": None,
                "version": self.router.version,
                "reason": f"{e} ({servers or 'none registered'})",
                "down": down,
            }
        for url, version in dict(picks).items():
            server = self._servers.get(url)
            if server is not None and server.first_request_version is None:
                server.first_request_version = version
                if server.joined is not None:  # joined mid-run: say when it starts serving
                    self.logger.info(
                        "generation server %d at %s got its first request (weight version %d, trainer version %d)",
                        server.index,
                        url,
                        version,
                        self.controller.trainer_version,
                    )
        url, version = picks[0]
        parts = {"parts": [{"url": u, "version": v} for u, v in picks]} if sizes is not None else {}
        return {"url": url, "version": version, **parts, **({"down": down} if avoid else {})}

    def _release_request(self, body: dict) -> dict:
        url = _field(body, "url", str)
        n = _count(body, "n")
        n_tokens = _count(body, "n_tokens", minimum=0, default=0)  # generated by these requests
        try:
            self.router.release(url, n, n_tokens)
        except KeyError as e:
            raise BadRequest(str(e.args[0])) from None
        return {"success": True}

    def _stop_rollouts(self, body: dict) -> dict:
        if not self.controller.stopped:
            self.logger.info("rollouts stopped: every later allocate_rollout is refused")
        self.controller.stop()
        self._wake_allocations()
        return {"success": True}

    def _get_model_version(self, body: dict) -> dict:
        return {"version": self.router.version}

    def _rejected_qids(self, body: dict) -> dict:
        return {"qids": list(self.controller.rejected_qids)}

    def _rollout_stats(self, body: dict) -> dict:
        # utilization() changes with the clock: not in _stats(), whose changes trigger a log line
        return {**self._stats(), **self.router.utilization()}

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    def _progress_info(self) -> dict:
        c = self.controller
        if not c.started:
            admission = "not started"
        elif c.stopped:
            admission = "stopped"
        elif c.running >= c.max_concurrent_rollouts:
            admission = "full"
        elif not within_staleness_bound(
            c.accepted, c.dropped, c.running, c.train_batch_size, c.max_head_offpolicyness, c.version
        ):
            admission = "staleness bound"
        else:
            admission = "open"
        return {
            "running": c.running,
            "accepted": c.accepted,
            "rejected": c.rejected,
            "admission": admission,
            "version": c.version,
            "trainer_version": c.trainer_version,
        }

    # ---- logging ------------------------------------------------------------------------------
    def _stats(self) -> dict[str, Any]:
        return {
            **self.controller.stats(),
            "loaded_version": self.router.version,
            "n_servers": len(self.router.up),  # in routing
            "server_in_flight": dict(self.router.in_flight),
            "server_events": dict(self.server_events),  # down / joined / rejoined / retired
            "bad_requests": self.bad_requests,
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
