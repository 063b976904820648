"""Routing of generation requests over the servers in routing (docs/design.md §6).

Least requests: the server with the fewest requests in flight, ties to the
one that was given fewer in total; sticky while the caller's previous server
still holds the caller's weight version. `RequestRouter` is plain synchronous
state (the clock is passed in); the GserverManager worker calls it from its
HTTP handlers and tells it which servers are in routing
(`realrl/system/server_registry.py`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

from realrl.api.manager_api import MAX_REQUESTS_PER_ROLLOUT


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
        # Grows whenever the servers in routing or their versions change (the
        # routing table's revision, docs/design.md §6); `on_change` is called then.
        self.revision = 0
        self.on_change: Callable[[], None] | None = None

    def _changed(self) -> None:
        self.revision += 1
        if self.on_change is not None:
            self.on_change()

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

    def set_in_flight(self, url: str, n: int) -> None:
        """Client-side routing: `n` requests in flight on `url`, as the rollout
        workers' latest load reports add up (`utilization` integrates from it)."""
        if url not in self.up:
            return
        now = self._clock()
        if n and self._idle_since[url] is not None:
            self._idle_s[url] += now - self._idle_since[url]
            self._idle_since[url] = None
        elif not n and self._idle_since[url] is None:
            self._idle_since[url] = now
        self.in_flight[url] = n

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
        self._changed()
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
        changed = self.loaded_version.get(url) != version
        self.loaded_version[url] = version
        if url in self.up:
            if changed:
                self._changed()
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
        self._changed()

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
        if self.loaded_version.get(url) != version:
            self.loaded_version[url] = version
            if url in self.up:
                self._changed()


class Reservations:
    """Who holds which scheduled requests (docs/design.md §6, "Tickets").

    Each schedule is one ticket, owned by the qid of a running rollout and
    holding `{url: n}`. A release names its ticket and gives back at most
    what the ticket still holds on that server, so a repeated, invented or
    oversized release cannot lower another caller's count. What a ticket
    still holds when its rollout ends (finished, or released because its
    rollout worker restarted) is given back then (`release_qid`), so a dead
    caller's requests do not stay in flight. A qid holds at most
    `max_per_qid` requests. Plain synchronous state, like the router."""

    def __init__(self, max_per_qid: int = MAX_REQUESTS_PER_ROLLOUT):
        self.max_per_qid = max_per_qid
        self._tickets: dict[int, tuple[str, collections.Counter[str]]] = {}  # ticket -> (qid, {url: n})
        self._by_qid: dict[str, set[int]] = collections.defaultdict(set)
        self._held: collections.Counter[str] = collections.Counter()  # qid -> requests held
        self._issued = 0  # tickets are numbered 1, 2, ...

    def room(self, qid: str) -> int:
        """How many more requests `qid` may hold."""
        return self.max_per_qid - self._held[qid]

    def reserve(self, qid: str, counts: dict[str, int]) -> int:
        """A new ticket of `qid` holding `counts` ({url: n}); ValueError past `max_per_qid`."""
        n = sum(counts.values())
        if n > self.room(qid):
            raise ValueError(f"qid {qid!r} would hold {self._held[qid] + n} requests, more than {self.max_per_qid}")
        self._issued += 1
        ticket = self._issued
        self._tickets[ticket] = (qid, collections.Counter(counts))
        self._by_qid[qid].add(ticket)
        self._held[qid] += n
        return ticket

    def release(self, ticket: int, url: str, n: int) -> int:
        """Gives back up to `n` of `ticket`'s requests on `url`: how many it
        held there (0 for a ticket already given back). KeyError for a ticket
        never issued."""
        if not 0 < ticket <= self._issued:
            raise KeyError(f"unknown ticket {ticket}")
        if ticket not in self._tickets:
            return 0
        qid, counts = self._tickets[ticket]
        released = min(n, counts[url])
        counts[url] -= released
        self._held[qid] -= released
        if not +counts:
            self._forget(ticket)
        return released

    def release_qid(self, qid: str) -> dict[str, int]:
        """Ends every ticket of `qid`: what they still held, per server."""
        out: collections.Counter[str] = collections.Counter()
        for ticket in list(self._by_qid.get(qid, ())):
            out.update(+self._tickets[ticket][1])
            self._forget(ticket)
        return dict(out)

    def held(self) -> int:
        """Requests held over all tickets."""
        return sum(self._held.values())

    def _forget(self, ticket: int) -> None:
        qid, counts = self._tickets.pop(ticket)
        self._held[qid] -= sum(counts.values())
        tickets = self._by_qid[qid]
        tickets.discard(ticket)
        if not tickets:
            del self._by_qid[qid]
            del self._held[qid]
