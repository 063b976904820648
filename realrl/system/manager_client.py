"""The GserverManager's client: the rollout side of its HTTP contract (docs/design.md §6).

Used by the rollout worker (admission: allocate / finish) and the
PartialRolloutManager (routing: schedule / release, `/servers`). Requests and
replies are the typed bodies of `realrl/api/manager_api.py`.
"""

from __future__ import annotations

import asyncio
import collections
from typing import Any, TypeVar

import aiohttp

from realrl.api.manager_api import (
    AllocateRolloutReply,
    AllocateRolloutRequest,
    FailureReply,
    FailureReport,
    FinishRolloutRequest,
    LoadReply,
    LoadReport,
    ModelVersionReply,
    ReleaseRequest,
    RolloutEnd,
    RolloutStats,
    RolloutToAllocate,
    RoutingTable,
    RoutingTableRequest,
    ScheduleReply,
    ScheduleRequest,
    ServersReply,
    SuccessReply,
)
from realrl.base import trial_secret
from realrl.base.http_body import BodyError, from_json, to_json
from realrl.base.logging import getLogger

logger = getLogger(__name__)

_T = TypeVar("_T")


class ManagerError(RuntimeError):
    """The GserverManager rejected a call (HTTP 4xx) or could not be reached."""


def backoff(attempt: int, base_s: float, cap_s: float = 10.0) -> float:
    return min(cap_s, base_s * 2 ** max(0, attempt - 1))


def retryable_status(status: int) -> bool:
    return status >= 500 or status in (408, 429)


class GserverManagerClient:
    """The rollout side of the GserverManager's HTTP contract (docs/design.md §6).

    One aiohttp session per client (bound to the event loop of first use);
    `await close()` when done. Calls that cannot reach the manager, time out or
    get a 5xx are retried `retries` times with backoff; a 4xx raises
    `ManagerError` at once (a bug on our side, e.g. an unknown qid)."""

    def __init__(self, url: str, timeout_s: float = 30.0, retries: int = 3, retry_backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.retry_backoff_s = retry_backoff_s
        self._session: aiohttp.ClientSession | None = None
        self.calls: collections.Counter[str] = collections.Counter()  # requests sent, per path

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=trial_secret.http_headers()
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def call(self, method: str, path: str, payload: dict | None = None, retries: int | None = None) -> Any:
        retries = self.retries if retries is None else retries
        attempt = 0
        while True:
            self.calls[path] += 1
            try:
                async with self._get_session().request(method, f"{self.url}{path}", json=payload) as resp:
                    text = await resp.text()
                    if resp.status < 400:
                        return await resp.json(content_type=None) if text.strip() else None
                    if not retryable_status(resp.status):
                        raise ManagerError(
                            f"gserver manager {self.url}{path} answered HTTP {resp.status}: {text[:500]}"
                        )
                    cause = f"HTTP {resp.status}: {text[:200]}"
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
                cause = f"{type(e).__name__}: {e}"
            attempt += 1
            if attempt > retries:
                raise ManagerError(f"gserver manager {self.url}{path} failed {attempt} times; last error: {cause}")
            logger.warning("gserver manager %s%s failed (%s); retry %d/%d", self.url, path, cause, attempt, retries)
            await asyncio.sleep(backoff(attempt, self.retry_backoff_s))

    async def _typed_call(self, method: str, path: str, reply_type: type[_T], request: Any = None, **kw) -> _T:
        """`call` with a `manager_api` request and reply: a reply outside the
        contract is a ManagerError (the manager and its clients disagree)."""
        reply = await self.call(method, path, to_json(request) if request is not None else None, **kw)
        try:
            return from_json(reply_type, reply)
        except BodyError as e:
            raise ManagerError(f"gserver manager {self.url}{path} answered outside its contract: {e}") from None

    # ---- the endpoints

    # allocate/finish change the manager's state and are retried: the caller's
    # `rollout_id` (unique per episode) makes a repeated call a no-op there.
    async def allocate_rollouts(self, rollouts: list[tuple[str, str]], wait_s: float = 0.0) -> AllocateRolloutReply:
        """Admission for (rollout_id, qid) pairs, in order: `admitted` says
        how many were taken. `wait_s`: while the first is refused, the
        manager waits up to that long for admission to open (a long poll)."""
        request = AllocateRolloutRequest([RolloutToAllocate(r, q) for r, q in rollouts], wait_s)
        return await self._typed_call("POST", "/allocate_rollout", AllocateRolloutReply, request)

    async def finish_rollouts(self, rollouts: list[tuple[str, int, int]]) -> SuccessReply:
        """(rollout_id, n_trajectories, n_tokens) of ended rollouts."""
        request = FinishRolloutRequest([RolloutEnd(r, n, t) for r, n, t in rollouts])
        return await self._typed_call("POST", "/finish_rollout", SuccessReply, request)

    async def schedule_request(
        self,
        qid: str,
        n: int = 1,
        previous_server_url: str | None = None,
        previous_version: int | None = None,
        avoid_urls: list[str] | None = None,
        parts: list[int] | None = None,
    ) -> ScheduleReply:
        """`url` is None when no server is up. `avoid_urls`: servers that just
        failed for this caller. `parts`: the sizes of several callers'
        requests (summing to n), each routed as if alone; the reply's `parts`
        has a server for each."""
        request = ScheduleRequest(
            qid, n, previous_server_url, previous_version, list(avoid_urls or ()), list(parts) if parts else None
        )
        return await self._typed_call("POST", "/schedule_request", ScheduleReply, request)

    async def release_request(
        self, url: str, ticket: int, n: int = 1, retries: int | None = None, n_tokens: int = 0
    ) -> SuccessReply:
        """`ticket`: the schedule's (`ScheduleReply.ticket`); `n_tokens`: what
        the released requests generated (the manager's tokens/s)."""
        request = ReleaseRequest(url, ticket, n, n_tokens)
        return await self._typed_call("POST", "/release_request", SuccessReply, request, retries=retries)

    # Client-side routing (realrl/system/client_routing.py): the callers retry in their own loops.
    async def routing_table(self, after: int = -1, wait_s: float = 0.0) -> RoutingTable:
        """The routing table once its revision is past `after` (a long poll of up to `wait_s`)."""
        return await self._typed_call(
            "POST", "/routing_table", RoutingTable, RoutingTableRequest(after, wait_s), retries=0
        )

    async def report_load(
        self,
        worker_index: int,
        in_flight: dict[str, int],
        started: dict[str, int] | None = None,
        n_tokens: int = 0,
        answered: list[str] | None = None,
    ) -> LoadReply:
        request = LoadReport(worker_index, dict(in_flight), dict(started or {}), n_tokens, list(answered or ()))
        return await self._typed_call("POST", "/report_load", LoadReply, request, retries=0)

    async def report_failures(self, urls: list[str]) -> FailureReply:
        return await self._typed_call("POST", "/report_failures", FailureReply, FailureReport(list(urls)), retries=1)

    async def get_model_version(self) -> int:
        return (await self._typed_call("GET", "/get_model_version", ModelVersionReply)).version

    async def rollout_stats(self) -> RolloutStats:
        return await self._typed_call("GET", "/rollout_stats", RolloutStats)

    async def servers(self, retries: int | None = None) -> ServersReply:
        """Every registered generation server and its state (up, joining, down, retired)."""
        return await self._typed_call("GET", "/servers", ServersReply, retries=retries)
