"""Which server each generation request goes to, as the rollout side sees it (docs/design.md §6).

The partial-rollout manager asks its routing for a server before each
`/generate` and gives the request back after it; the two kinds of routing
answer the same calls (`schedule_request`, `schedule_now`, `release_request`,
`left_routing`, `close`; `schedule_now` picks without waiting where the
routing can, so that the call does not hop through a task of its own):

- `ClientRouting` (`rollout.routing=client`, the default) decides in the
  rollout worker, with no call to the manager on the request's path. The
  manager publishes a routing table (the servers in routing and the weight
  version each holds), which a long poll follows as it changes (a server
  joining, leaving or loading a version reaches every worker within
  milliseconds, instead of at the next poll of `/servers`). Each worker
  sends the manager a snapshot of its requests in flight per server every
  `REPORT_INTERVAL_S` (one request, whatever the call rate) and gets back the
  total over all workers, so least-requests routing sees the other workers'
  load as of a fraction of a second ago and its own exactly. A server that
  fails is reported at once (`/report_failures`): the manager probes it and
  says whether it took it out of routing, as a schedule with `avoid_urls`
  did.
- `ManagerRouting` (`rollout.routing=manager`) asks the manager per request
  (`/schedule_request`, `/release_request`): two HTTP calls on every
  generation call's path. It is the baseline `benchmarks/control_plane.py`
  measures the client-side routing against.

Both route alike: least requests in flight (ties at random among the least
loaded in `ClientRouting`, so workers that see the same table do not herd
onto one server), sticky while the caller's previous server still holds the
caller's weight version, never to a server the caller just saw failing while
another one is up. `ClientRouting` also sends a new request only to servers
that hold the newest version in its table: during a weight update's fan-out a
request sent to a server still to be updated is interrupted when its turn
comes (and an interrupted request resubmitted there, again).
"""

from __future__ import annotations

import asyncio
import collections
import random
import time

from realrl.api.manager_api import RoutedServer, RoutingTable, ScheduledServer, ScheduleReply
from realrl.base.logging import getLogger
from realrl.system.manager_client import GserverManagerClient, ManagerError, backoff

logger = getLogger(__name__)

REPORT_INTERVAL_S = 0.25  # a rollout worker's load report, at most this often (and only while it changed)
REPORT_IDLE_INTERVAL_S = 2.0  # ... and this often anyway, for the other workers' load
TABLE_WAIT_S = 10.0  # one routing_table long poll
FIRST_TABLE_WAIT_S = 10.0  # a schedule waits this long for the first table, then answers "no server"


class ClientRouting:
    """Routes in the rollout worker from the manager's routing table; see the module docstring."""

    def __init__(
        self,
        manager: GserverManagerClient,
        worker_index: int,
        report_interval_s: float = REPORT_INTERVAL_S,
        rng: random.Random | None = None,
    ):
        self.manager = manager
        self.worker_index = worker_index
        self.report_interval_s = report_interval_s
        self.table: RoutingTable | None = None
        self._servers: dict[str, RoutedServer] = {}  # url -> entry of the current table
        self._newest: list[str] | None = None  # the servers holding the newest version (None: to find)
        self._mine: collections.Counter[str] = collections.Counter()  # our requests in flight, per server
        self._others: dict[str, int] = {}  # the other workers' load, per server, from the last report reply
        self._reported: dict[str, int] = {}  # what our last report said
        self._started: collections.Counter[str] = collections.Counter()  # requests sent since the last report
        self._tokens = 0  # generated since the last report
        self._answered: set[str] = set()  # servers that answered since the last report
        self._left: dict[str, asyncio.Future] = {}  # url -> done once it leaves routing
        self._have_table: asyncio.Event | None = None
        self._report_now: asyncio.Event | None = None  # a server got its first request from us: report at once
        self._used: set[str] = set()  # servers we sent a request to
        self._tasks: list[asyncio.Task] = []
        self._rng = rng or random.Random()
        self._tickets = 0

    def _start(self) -> None:
        if not self._tasks:  # (in the event loop of first use)
            self._have_table = asyncio.Event()
            self._report_now = asyncio.Event()
            self._tasks = [asyncio.create_task(self._follow_table()), asyncio.create_task(self._report_loop())]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    # ---- the table --------------------------------------------------------------------------
    async def _follow_table(self) -> None:
        failures = 0
        while True:
            after = self.table.revision if self.table is not None else -1
            try:
                table = await self.manager.routing_table(after, TABLE_WAIT_S)
            except ManagerError as e:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("could not read the manager's routing table (%d in a row): %s", failures, e)
                await asyncio.sleep(backoff(failures, 0.1, cap_s=2.0))
                continue
            failures = 0
            if self.table is None or table.revision != self.table.revision:
                self.set_table(table)

    def set_table(self, table: RoutingTable) -> None:
        """A new table: servers no longer in it left routing (their requests are abandoned)."""
        self.table = table
        servers = {s.url: s for s in table.servers}
        for url, left in self._left.items():
            if url not in servers and not left.done():
                left.set_result(None)
        self._servers, self._newest = servers, None
        self._others = {u: n for u, n in self._others.items() if u in servers}
        if self._have_table is not None:
            self._have_table.set()

    def left_routing(self, url: str) -> asyncio.Future:
        """A future done once `url` leaves routing (a fresh one while it is in
        it), shared by every request on `url`: a plain future, not a task per
        request (a task per generation call, cancelled after it, is garbage the
        collector has to find)."""
        left = self._left.get(url)
        if left is None or left.done():
            left = self._left[url] = asyncio.get_running_loop().create_future()
            if url not in self._servers and self.table is not None:
                left.set_result(None)
        return left

    # ---- load reports -----------------------------------------------------------------------
    async def _report_loop(self) -> None:
        last = 0.0
        while True:
            try:  # (the manager logs when a server that joined got its first request: it hears at once)
                await asyncio.wait_for(self._report_now.wait(), self.report_interval_s)
            except asyncio.TimeoutError:
                pass
            self._report_now.clear()
            snapshot = {u: n for u, n in self._mine.items() if n}
            changed = snapshot != self._reported or self._started or self._tokens or self._answered
            if not changed and time.monotonic() - last < REPORT_IDLE_INTERVAL_S:
                continue
            started, tokens, answered = dict(self._started), self._tokens, sorted(self._answered)
            self._started, self._tokens, self._answered = collections.Counter(), 0, set()
            try:
                reply = await self.manager.report_load(self.worker_index, snapshot, started, tokens, answered)
            except ManagerError as e:  # (sent with the next report)
                self._started.update(started)
                self._tokens += tokens
                logger.warning("could not report the load to the manager: %s", e)
                continue
            last = time.monotonic()
            self._reported = snapshot
            self._others = {u: max(0, n - snapshot.get(u, 0)) for u, n in reply.loads.items() if u in self._servers}

    # ---- the calls of the partial-rollout manager --------------------------------------------
    async def schedule_request(
        self,
        qid: str,
        n: int = 1,
        previous_server_url: str | None = None,
        previous_version: int | None = None,
        avoid_urls: list[str] | None = None,
        parts: list[int] | None = None,
    ) -> ScheduleReply:
        """A server per part (as `GserverManagerClient.schedule_request`),
        picked here; `url` None when no server is up. Only `avoid_urls`
        (servers that just failed for the caller) costs a call to the manager."""
        self._start()
        if self.table is None:
            try:
                await asyncio.wait_for(self._have_table.wait(), FIRST_TABLE_WAIT_S)
            except asyncio.TimeoutError:
                return ScheduleReply(version=0, reason="no routing table from the manager yet")
        down = None
        avoid = set(avoid_urls or ())
        if avoid:
            try:
                down = (await self.manager.report_failures(sorted(avoid))).down
            except ManagerError as e:
                logger.warning("could not report failing servers %s to the manager: %s", sorted(avoid), e)
                down = []
            for url in down:  # out of routing now, whether or not the table has said so yet
                if self._servers.pop(url, None) is not None:
                    self._newest = None
        return self._schedule(n, previous_server_url, previous_version, avoid, parts, down)

    def schedule_now(
        self,
        qid: str,
        n: int = 1,
        previous_server_url: str | None = None,
        previous_version: int | None = None,
        parts: list[int] | None = None,
    ) -> ScheduleReply | None:
        """`schedule_request` without waiting, where it needs nothing but the
        table (None before the first table)."""
        if self.table is None:
            return None
        self._start()
        return self._schedule(n, previous_server_url, previous_version, set(), parts, None)

    def _schedule(
        self,
        n: int,
        previous_server_url: str | None,
        previous_version: int | None,
        avoid: set[str],
        parts: list[int] | None,
        down: list[str] | None,
    ) -> ScheduleReply:
        if not self._servers:
            return ScheduleReply(version=self.table.version, reason=self.table.reason or "no generation server is up")
        picks = []
        for k in parts or [n]:
            url = self._pick(previous_server_url, previous_version, avoid)
            self._mine[url] += k
            self._started[url] += k
            if url not in self._used:
                self._used.add(url)
                self._report_now.set()
            picks.append(ScheduledServer(url, self._servers[url].version))
        self._tickets += 1
        return ScheduleReply(
            url=picks[0].url,
            version=picks[0].version,
            ticket=self._tickets,
            parts=picks if parts is not None else None,
            down=down,
        )

    def _newest_urls(self, avoid: set[str]) -> list[str]:
        """The servers (but `avoid`) that hold the newest version among them. While a weight
        update goes through the servers, a server still to be updated would interrupt a
        request sent to it when its turn comes. (Without `avoid`: kept until the table changes.)"""
        if not avoid and self._newest is not None:
            return self._newest
        candidates = [s for u, s in self._servers.items() if u not in avoid]
        newest = max((s.version for s in candidates), default=None)
        urls = [s.url for s in candidates if s.version == newest]
        if not avoid:
            self._newest = urls
        return urls

    def _pick(self, previous_url: str | None, previous_version: int | None, avoid: set[str]) -> str:
        previous = self._servers.get(previous_url) if previous_url is not None else None
        if previous is not None and previous_url not in avoid and previous.version == previous_version:
            return previous_url
        mine, others = self._mine, self._others
        best: list[str] = []
        least = None
        for url in self._newest_urls(avoid):
            load = mine.get(url, 0) + others.get(url, 0)
            if least is None or load < least:
                least, best = load, [url]
            elif load == least:
                best.append(url)
        if not best:  # every server failed for the caller: any, rather than none
            return self._pick(None, None, set())
        return best[0] if len(best) == 1 else self._rng.choice(best)

    async def release_request(
        self, url: str, ticket: int, n: int = 1, retries: int | None = None, n_tokens: int = 0
    ) -> None:
        """`n` requests on `url` ended, having generated `n_tokens`; the server answered if it generated any."""
        self._mine[url] = max(0, self._mine[url] - n)
        if not self._mine[url]:
            del self._mine[url]
        self._tokens += n_tokens
        if n_tokens:
            self._answered.add(url)


class ManagerRouting:
    """Routes by asking the manager per request; see the module docstring.
    Servers that leave routing are noticed by reading the manager's
    `/servers` every `server_watch_interval` seconds while requests are in
    flight."""

    def __init__(self, manager: GserverManagerClient, server_watch_interval: float = 2.0):
        self.manager = manager
        self.server_watch_interval = server_watch_interval
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._left: dict[str, asyncio.Future] = {}
        self._watch_task: asyncio.Task | None = None

    async def schedule_request(self, qid: str, n: int = 1, *args, parts: list[int] | None = None, **kwargs):
        reply = await self.manager.schedule_request(qid, n, *args, parts=parts, **kwargs)
        for pick, k in zip(reply.parts or [reply], parts or [n]):
            if pick.url is not None:
                self._in_flight[pick.url] += k
        return reply

    def schedule_now(self, *args, **kwargs) -> None:
        """Never at once: every schedule is a request to the manager."""
        return None

    async def release_request(self, url: str, ticket: int, n: int = 1, **kwargs):
        self._in_flight[url] = max(0, self._in_flight[url] - n)
        return await self.manager.release_request(url, ticket, n, **kwargs)

    def left_routing(self, url: str) -> asyncio.Future:
        """Done once the manager reports `url` down or retired (a fresh one: the manager just routed us there)."""
        left = self._left.get(url)
        if left is None or left.done():
            left = self._left[url] = asyncio.get_running_loop().create_future()
        if self._watch_task is None or self._watch_task.done():
            self._watch_task = asyncio.get_running_loop().create_task(self._watch_servers())
        return left

    async def _watch_servers(self) -> None:
        idle_rounds = 0
        while idle_rounds < 5:
            await asyncio.sleep(self.server_watch_interval)
            if not +self._in_flight:
                idle_rounds += 1
                continue
            idle_rounds = 0
            try:
                info = await self.manager.servers(retries=0)
            except ManagerError:
                continue  # a hiccup: the request timeout still applies
            for server in info.servers:
                left = self._left.get(server.url)
                if left is not None and server.state in ("down", "retired") and self._in_flight[server.url]:
                    if not left.done():
                        left.set_result(None)

    async def close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            await asyncio.gather(self._watch_task, return_exceptions=True)
