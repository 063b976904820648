"""The generation server manager's HTTP API: every request and reply body (docs/design.md §6).

The manager (`realrl/system/gserver_manager.py`) parses each request once with
`realrl.base.http_body.from_json` and answers `to_json` of a reply; its
clients (`GserverManagerClient` in `realrl/system/partial_rollout.py`, the
rollout worker) build requests and read replies through the same classes, so
a field renamed on one side breaks a test, not a run. A body that does not fit
is a `BodyError`: HTTP 400 naming the field.

    POST /allocate_rollout      AllocateRolloutRequest (or its single form) -> AllocateRolloutReply
    POST /finish_rollout        FinishRolloutRequest (or its single form)   -> SuccessReply
    POST /reset_rollout_worker  ResetRolloutWorkerRequest                   -> ResetRolloutWorkerReply
    POST /schedule_request      ScheduleRequest                             -> ScheduleReply
    POST /release_request       ReleaseRequest                              -> SuccessReply
    POST /routing_table         RoutingTableRequest                         -> RoutingTable
    POST /report_load           LoadReport                                  -> LoadReply
    POST /report_failures       FailureReport                               -> FailureReply
    POST /stop_rollouts         (no body)                                   -> SuccessReply
    GET  /get_model_version                                                 -> ModelVersionReply
    GET  /rollout_stats                                                     -> RolloutStats
    GET  /rejected_rollouts                                                 -> RejectedRolloutsReply
    GET  /servers                                                           -> ServersReply
    GET  /health                                                            -> HealthReply
    a refused request (400, 413)                                            -> ErrorReply
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from realrl.base.http_body import BodyError, from_json, rule

# The longest allocate_rollout long poll a client may ask for, in seconds.
MAX_ALLOCATE_WAIT_S = 10.0
# What one rollout may hold scheduled at once (a group's answers, or an agent's
# parallel calls, are far fewer); it bounds one schedule's `n`, and so its `parts`.
MAX_REQUESTS_PER_ROLLOUT = 4096

_field = dataclasses.field


# --------------------------------------------------------------------------- rollouts


@dataclasses.dataclass
class RolloutToAllocate:
    """One rollout asking for admission: its caller-chosen id (allocate is
    idempotent per id) and its prompt."""

    rollout_id: str = _field(metadata=rule(nonempty=True))
    qid: str = _field(metadata=rule(nonempty=True))


@dataclasses.dataclass
class AllocateOneRollout(RolloutToAllocate):
    """The single form of `/allocate_rollout`: one rollout's fields inline."""

    wait_s: float = _field(default=0.0, metadata=rule(min=0, max=MAX_ALLOCATE_WAIT_S))


@dataclasses.dataclass
class AllocateRolloutRequest:
    """Admission for `rollouts`, in order. While the first is refused the
    manager holds the call up to `wait_s` seconds for admission to open."""

    rollouts: list[RolloutToAllocate] = _field(metadata=rule(nonempty=True))
    wait_s: float = _field(default=0.0, metadata=rule(min=0, max=MAX_ALLOCATE_WAIT_S))

    @classmethod
    def from_body(cls, body: Any) -> AllocateRolloutRequest:
        """The list form, or the single form (`AllocateOneRollout`) as a list of one."""
        if isinstance(body, dict) and "rollouts" not in body:
            one = from_json(AllocateOneRollout, body)
            return cls([RolloutToAllocate(one.rollout_id, one.qid)], one.wait_s)
        return from_json(cls, body)


@dataclasses.dataclass
class AllocateRolloutReply:
    """`admitted`: how many of the rollouts, in order, admission took;
    `reason`: why the next one was refused (null when all were taken);
    `version`: the weight version admission counts with."""

    success: bool
    admitted: int
    version: int
    reason: str | None = _field(default=None, metadata=rule(keep_null=True))


@dataclasses.dataclass
class RolloutEnd:
    """A rollout that ended: the trajectories it pushed (0: the agent rejected
    the prompt) and the tokens it generated."""

    rollout_id: str = _field(metadata=rule(nonempty=True))
    n_trajectories: int = _field(metadata=rule(min=0))
    n_tokens: int = _field(default=0, metadata=rule(min=0))


@dataclasses.dataclass
class FinishRolloutRequest:
    """Rollouts that ended together; finish is idempotent per `rollout_id`."""

    rollouts: list[RolloutEnd] = _field(metadata=rule(nonempty=True))

    @classmethod
    def from_body(cls, body: Any) -> FinishRolloutRequest:
        """The list form, or the single form (one `RolloutEnd`) as a list of one."""
        if isinstance(body, dict) and "rollouts" not in body:
            return cls([from_json(RolloutEnd, body)])
        return from_json(cls, body)


@dataclasses.dataclass
class ResetRolloutWorkerRequest:
    """A rollout worker (re)starting under `worker_index`."""

    worker_index: int = _field(metadata=rule(min=0))


@dataclasses.dataclass
class ResetRolloutWorkerReply:
    """Its earlier processes' running rollouts, released (`rollout_ids` and
    their `qids`: generated again under the same ids), and `done`: the
    rollouts this manager saw finished (never generated again), as a ledger
    (`realrl.system.ledger.Ledger.to_wire`: bitmaps, whatever their number)."""

    qids: list[str]
    rollout_ids: list[str] = _field(default_factory=list)
    done: dict[str, Any] = _field(default_factory=dict)


@dataclasses.dataclass
class SuccessReply:
    success: bool = True


# --------------------------------------------------------------------------- routing


@dataclasses.dataclass
class ScheduleRequest:
    """A server for `n` requests of prompt `qid` (a running rollout's): sticky to
    `previous_server_url` while it holds `previous_version`; `avoid_urls`: servers
    that just failed for the caller. `parts`: the sizes of several callers'
    requests (summing to `n`), each routed as if it came alone."""

    qid: str = _field(metadata=rule(nonempty=True))
    n: int = _field(default=1, metadata=rule(min=1, max=MAX_REQUESTS_PER_ROLLOUT))
    previous_server_url: str | None = None
    previous_version: int | None = None
    avoid_urls: list[str] = _field(default_factory=list)
    parts: list[int] | None = _field(default=None, metadata=rule(nonempty=True))

    def __post_init__(self):
        if self.parts is not None and not (all(k >= 1 for k in self.parts) and sum(self.parts) == self.n):
            raise BodyError("field 'parts' must be a non-empty list of counts >= 1 that sum to 'n'")


@dataclasses.dataclass
class ScheduledServer:
    """Where one part of a ScheduleRequest goes, and the version that server holds."""

    url: str
    version: int


@dataclasses.dataclass
class ScheduleReply:
    """`url` null: no server is up (`reason` says why). `parts`: one
    ScheduledServer per requested part (only when parts were asked for).
    `down`: the `avoid_urls` the manager has taken out of routing (only when
    some were named). `ticket`: what the release of these requests names
    (null when no server is up)."""

    version: int
    url: str | None = _field(default=None, metadata=rule(keep_null=True))
    ticket: int | None = None
    parts: list[ScheduledServer] | None = None
    down: list[str] | None = None
    reason: str | None = None


@dataclasses.dataclass
class ReleaseRequest:
    """`n` requests of schedule `ticket` on server `url` ended, having
    generated `n_tokens` together. The manager gives back at most what the
    ticket still holds there."""

    url: str
    ticket: int = _field(metadata=rule(min=1))
    n: int = _field(default=1, metadata=rule(min=1, max=MAX_REQUESTS_PER_ROLLOUT))
    n_tokens: int = _field(default=0, metadata=rule(min=0))


# Client-side routing (docs/design.md §6, `realrl/system/client_routing.py`): the
# manager publishes which servers are in routing and their versions; rollout
# workers route each request themselves and report their load in batches.

# The longest routing_table long poll a client may ask for, in seconds.
MAX_TABLE_WAIT_S = 30.0
# A worker's requests in flight on one server, at most (a report above it is refused).
MAX_REPORTED_LOAD = 1 << 20


@dataclasses.dataclass
class RoutingTableRequest:
    """The routing table once its `revision` is past `after` (a long poll
    of up to `wait_s` seconds; the current table at once when it already is)."""

    after: int = _field(default=-1, metadata=rule(min=-1))
    wait_s: float = _field(default=0.0, metadata=rule(min=0, max=MAX_TABLE_WAIT_S))


@dataclasses.dataclass
class RoutedServer:
    """A server in routing, the weight version it holds, and the requests all
    rollout workers reported in flight on it."""

    url: str
    version: int
    load: int = 0


@dataclasses.dataclass
class RoutingTable:
    """Every server in routing. `revision` grows whenever a server joins or
    leaves routing or loads a version; `version`: what every server in
    routing holds (the oldest while an update runs). No server up: `servers`
    is empty and `reason` says why."""

    revision: int
    version: int
    servers: list[RoutedServer]
    reason: str | None = None


@dataclasses.dataclass
class LoadReport:
    """What rollout worker `worker_index` has in flight now, per server (a
    snapshot: it replaces the worker's previous report); `started`: requests it
    sent to each server since its previous report; `n_tokens`: tokens its
    requests generated since then; `answered`: servers that answered one of
    its requests since then (a server answering needs no health check)."""

    worker_index: int = _field(metadata=rule(min=0))
    in_flight: dict[str, int] = _field(default_factory=dict)
    started: dict[str, int] = _field(default_factory=dict)
    n_tokens: int = _field(default=0, metadata=rule(min=0))
    answered: list[str] = _field(default_factory=list)

    def __post_init__(self):
        for name in ("in_flight", "started"):
            for url, n in getattr(self, name).items():
                if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= MAX_REPORTED_LOAD:
                    raise BodyError(f"field {name!r}: {url!r}: {n!r} is not a count in 0..{MAX_REPORTED_LOAD}")


@dataclasses.dataclass
class LoadReply:
    """The requests in flight per server in routing, over all rollout workers' latest reports."""

    loads: dict[str, int]


@dataclasses.dataclass
class FailureReport:
    """Servers that just failed for the caller: the manager probes them now."""

    urls: list[str] = _field(metadata=rule(nonempty=True))


@dataclasses.dataclass
class FailureReply:
    """Which of the reported servers are out of routing after their probes
    (a probe that takes longer than a second is not waited for)."""

    down: list[str]


@dataclasses.dataclass
class ModelVersionReply:
    """The weight version every server in routing holds."""

    version: int


# --------------------------------------------------------------------------- status


@dataclasses.dataclass
class RolloutStats:
    """Admission counts (docs/design.md §7), routing state, and the servers'
    cumulative utilization (`RequestRouter.utilization`)."""

    running: int
    accepted: int
    rejected: int
    dropped: int
    admitted: int
    version: int
    trainer_version: int
    n_tokens: int
    started: bool
    stopped: bool
    loaded_version: int
    n_servers: int  # in routing
    server_in_flight: dict[str, int]
    server_events: dict[str, int]  # down / joined / rejoined / retired
    bad_requests: int
    unauthorized: int  # requests refused 401 (no or wrong trial key, docs/design.md §14)
    gen_idle_s: float
    gen_server_s: float
    gen_tokens: int
    gen_clock_s: float


@dataclasses.dataclass
class RejectedRolloutsReply:
    """The rollouts the agent rejected (this manager process), as a ledger
    (`Ledger.to_wire`: bitmaps, whatever their number): the recovery ledger."""

    rejected: dict[str, Any] = _field(default_factory=dict)


@dataclasses.dataclass
class ServerInfo:
    """One registered generation server (`realrl/system/server_registry.py`)."""

    index: int
    url: str
    state: Literal["joining", "up", "down", "retired"]
    reason: str  # why it is in this state
    in_flight: int
    scheduled: int  # requests routed to it in total
    version: int | None = _field(default=None, metadata=rule(keep_null=True))  # held now (null: never in routing)
    first_request_version: int | None = _field(default=None, metadata=rule(keep_null=True))


@dataclasses.dataclass
class ServersReply:
    version: int
    servers: list[ServerInfo]
    events: dict[str, int]


@dataclasses.dataclass
class HealthReply:
    status: str = "ok"


@dataclasses.dataclass
class ErrorReply:
    """The body of every 4xx: what was wrong, naming the field."""

    error: str
