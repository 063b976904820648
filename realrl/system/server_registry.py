"""The generation servers a manager knows, and the state of each (docs/architecture.md,
"Generation servers that come and go").

Every server registered under `names.gen_servers` is in one state:

    joining --brought to the current weights--> up --health checks fail--> down
       ^                                                                    |
       +--------------------------- answers again -------------------------+
    any state --its key removed, or now naming another URL--> retired

"joining": registered, being brought to the current weights; gets no request.
"up": in routing. "down": failed its health checks (a refused or dropped
connection at once, otherwise `failures_to_down` failures in a row); probed on,
and rejoins when it answers again. "retired": no longer registered, not
probed; only a new registration of its URL makes it join again.

While the manager loads weights into a server (`start_loading` ..
`stop_loading`), a failed check that is not a refused or dropped connection
does not count: SGLang's `/health` generates a token, which waits behind a
weight update and then answers 503 (`realrl.impl.generation.backends`). Such
checks are counted as the event `unhealthy_while_loading`.

`ServerRegistry` keeps these states and the `RequestRouter` in step (a server
is in routing iff it is up) and counts the events (down / joined / rejoined /
retired). It is plain synchronous state, the clock passed in: the
GserverManager worker reads the name service, probes servers and loads
weights, tells the registry what it found, and logs what changed.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from collections.abc import Callable
from typing import Literal, NamedTuple

from realrl.api.manager_api import ServerInfo
from realrl.system.router import RequestRouter

State = Literal["joining", "up", "down", "retired"]


@dataclasses.dataclass
class Server:
    """One registered generation server as the manager sees it."""

    index: int
    url: str
    state: State
    since: float  # clock time of the last change of state
    reason: str = ""  # why it is in this state
    failures: int = 0  # health checks failed in a row
    loading: int = 0  # weight loads the manager has in progress on it
    failures_while_loading: int = 0  # failed checks not counted during the current load(s)
    joined: int | None = None  # the weight version it last joined routing with
    first_request_version: int | None = None  # the version it held when first given a request
    answered_at: float | None = None  # clock time a client last reported an answer from it


class RegistryChange(NamedTuple):
    """What a read of the name service asks for: retire `url` (`why`), or join server `index` at `url`."""

    action: Literal["join", "retire"]
    index: int
    url: str
    why: str = ""


class ServerRegistry:
    """Servers 0..len(urls)-1 start up (in routing); later ones join."""

    def __init__(
        self,
        router: RequestRouter,
        urls: list[str],
        failures_to_down: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.router = router
        self.failures_to_down = failures_to_down
        self._clock = clock
        now = clock()
        self.servers: dict[str, Server] = {url: Server(i, url, "up", since=now) for i, url in enumerate(urls)}
        self.registered: dict[int, str] = dict(enumerate(urls))  # server index -> url, as in the name service
        self._indices_up: set[int] = set(range(len(urls)))  # server indices that have been in routing
        # down / joined / rejoined / retired / unhealthy_while_loading
        self.events: collections.Counter[str] = collections.Counter()

    def get(self, url: str) -> Server | None:
        return self.servers.get(url)

    def _set_state(self, server: Server, state: State, reason: str) -> None:
        server.state, server.reason, server.since, server.failures = state, reason, self._clock(), 0

    # ---- the name service ------------------------------------------------------------------
    def read(self, found: dict[int, str]) -> list[RegistryChange]:
        """Compares a read of the name service (index -> url) with what was read
        before: a new index joins, an index at a new URL (a restarted server)
        retires the old URL and joins the new one, a vanished index retires."""
        changes = []
        for index, url in sorted(found.items()):
            old = self.registered.get(index)
            if old == url:
                continue
            if old is not None:
                changes.append(RegistryChange("retire", index, old, f"server {index} registered again at {url}"))
            self.registered[index] = url
            changes.append(RegistryChange("join", index, url))
        for index in sorted(set(self.registered) - set(found)):
            changes.append(RegistryChange("retire", index, self.registered.pop(index), "unregistered"))
        return changes

    # ---- transitions -----------------------------------------------------------------------
    def start_join(self, index: int, url: str) -> Server | None:
        """A new, restarted or recovered server starts joining; None if it is
        already up or joining."""
        server = self.servers.get(url)
        if server is None:
            server = self.servers[url] = Server(index, url, "joining", since=self._clock())
        elif server.state in ("up", "joining"):
            return None
        else:
            self._set_state(server, "joining", "answers again")
        return server

    def finish_join(self, url: str, version: int) -> Literal["joined", "rejoined"] | None:
        """A joining server holds weight `version`: into routing, unless it
        stopped joining meanwhile or is behind the servers in routing (None:
        bring it to the current weights first)."""
        server = self.servers[url]
        if server.state != "joining" or version < self.router.version:
            return None
        event = "rejoined" if server.index in self._indices_up else "joined"
        self.router.add_server(url, version)
        self._set_state(server, "up", "joined")
        server.joined = version
        self._indices_up.add(server.index)
        self.events[event] += 1
        return event

    def start_loading(self, url: str) -> None:
        """The manager starts loading weights into `url` (see the module docstring)."""
        self.servers[url].loading += 1

    def stop_loading(self, url: str) -> int:
        """A load into `url` ended: the failed checks not counted while no
        other load was in progress on it (0 if another one still is)."""
        server = self.servers[url]
        server.loading -= 1
        if server.loading:
            return 0
        ignored, server.failures_while_loading = server.failures_while_loading, 0
        return ignored

    def health_checked(self, url: str, ok: bool, gone: bool) -> Literal["down", "rejoin"] | None:
        """Counts one health check of an up or down server: "down" when it must
        leave routing (`gone`: the connection was refused or dropped; or
        `failures_to_down` failures in a row, not counting those while it
        loads weights), "rejoin" when a down server answers again, otherwise None."""
        server = self.servers.get(url)
        if server is None or server.state not in ("up", "down"):
            return None
        if ok:
            server.failures = 0
            return "rejoin" if server.state == "down" else None
        if server.loading and not gone:
            server.failures_while_loading += 1
            self.events["unhealthy_while_loading"] += 1
            return None
        server.failures += 1
        if server.state == "up" and (gone or server.failures >= self.failures_to_down):
            return "down"
        return None

    def mark_down(self, url: str, reason: str) -> int | None:
        """Takes an up server out of routing: how many requests it had in
        flight (resubmitted by their clients); None if it was not up."""
        server = self.servers.get(url)
        if server is None or server.state != "up":
            return None
        orphaned = self.router.mark_down(url)
        self._set_state(server, "down", reason)
        self.events["down"] += 1
        return orphaned

    def retire(self, url: str, why: str) -> tuple[State, int] | None:
        """The server is gone for good: (the state it was in, how many requests
        it had in flight); None if unknown or already retired."""
        server = self.servers.get(url)
        if server is None or server.state == "retired":
            return None
        was = server.state
        orphaned = self.router.mark_down(url)
        self._set_state(server, "retired", why)
        self.events["retired"] += 1
        return was, orphaned

    def first_requests(self, picks: dict[str, int]) -> list[Server]:
        """Notes the version each picked server (url -> version) held when first
        given a request; returns the ones that joined mid-run and just got their first."""
        first = []
        for url, version in picks.items():
            server = self.servers.get(url)
            if server is not None and server.first_request_version is None:
                server.first_request_version = version
                if server.joined is not None:
                    first.append(server)
        return first

    # ---- views -----------------------------------------------------------------------------
    def answered(self, url: str) -> None:
        """A client reports that `url` answered one of its requests just now."""
        server = self.servers.get(url)
        if server is not None and server.state == "up":
            server.answered_at = self._clock()
            server.failures = 0

    def to_check(self, answered_within: float = 0.0) -> list[str]:
        """The servers health checks watch: up and down ones, but an up
        server that answered a client within `answered_within` seconds
        (passive health: it is busy answering, a probe would tell nothing new)."""
        since = self._clock() - answered_within
        return [
            s.url
            for s in self.servers.values()
            if s.state == "down" or (s.state == "up" and (s.answered_at is None or s.answered_at < since))
        ]

    def up_count(self) -> str:
        registered = sum(1 for s in self.servers.values() if s.state != "retired")
        return f"{len(self.router.up)} of {registered} registered servers up"

    def not_retired(self) -> str:
        """Each server not retired and its state, for a "no server is up" reply."""
        return "; ".join(
            f"{s.index} at {s.url} {s.state}" + (f": {s.reason}" if s.reason else "")
            for s in self.servers.values()
            if s.state != "retired"
        )

    def routed(self) -> str:
        """Requests routed per server, "index: requests" (the state unless up)."""
        return ", ".join(
            f"{s.index}{'' if s.state == 'up' else f' ({s.state})'}: {self.router.total_scheduled.get(s.url, 0)}"
            for s in self.servers.values()
        )

    def describe(self) -> list[ServerInfo]:
        return [
            ServerInfo(
                index=s.index,
                url=s.url,
                state=s.state,
                reason=s.reason,
                in_flight=self.router.in_flight.get(s.url, 0),
                scheduled=self.router.total_scheduled.get(s.url, 0),
                version=self.router.loaded_version.get(s.url),
                first_request_version=s.first_request_version,
            )
            for s in self.servers.values()
        ]
