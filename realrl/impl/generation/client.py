"""One async HTTP client for every generation server (the torch server and SGLang).

Every caller of a generation server (the partial-rollout manager, the gserver
manager, tests, benchmarks) goes through `GenerationClient`. It keeps one
`aiohttp.ClientSession` (one connection pool) per client object; a client is
bound to the event loop it is first used on, and must be closed explicitly
(`await client.close()` or `async with GenerationClient() as client:`).

It sticks to SGLang's native field names (docs/design.md §6), so it drives a real SGLang
server unchanged:

    async with GenerationClient(timeout_s=600) as client:
        await client.wait_healthy(url, timeout_s=120)
        result = await client.generate(url, prompt_ids, {"max_new_tokens": 64, "temperature": 1.0})
        result.output_ids, result.output_logprobs, result.finish_reason, result.weight_version

Errors: an HTTP error status raises `GenerationServerError(status, message, url)`;
a server that cannot be reached (refused, reset, timed out) raises
`GenerationServerUnavailable(url, reason)`. A failed weight update (`success:
false`) raises `GenerationServerError` too: it must never pass silently.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from realrl.base.logging import getLogger

logger = getLogger(__name__)


class GenerationServerError(RuntimeError):
    """The server answered with an error status (or refused an operation)."""

    def __init__(self, status: int, message: str, url: str):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.url = url


class GenerationServerUnavailable(ConnectionError):
    """The server could not be reached or did not answer in time."""

    def __init__(self, url: str, reason: str):
        super().__init__(f"generation server {url} unavailable: {reason}")
        self.url = url
        self.reason = reason


@dataclass
class GenerateResult:
    """One completion. `output_logprobs[i]` is the behaviour logprob of
    `output_ids[i]` (empty if logprobs were not requested)."""

    output_ids: list[int]
    output_logprobs: list[float]
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str
    prompt_tokens: int
    completion_tokens: int
    rid: str | None = None
    matched_stop: int | None = None
    meta_info: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def aborted(self) -> bool:
        return self.finish_reason == "abort"

    @classmethod
    def from_response(cls, response: dict[str, Any]) -> GenerateResult:
        meta = response.get("meta_info") or {}
        pairs = meta.get("output_token_logprobs") or []
        output_ids = response.get("output_ids")
        if output_ids is None:  # some SGLang versions only return the ids with the logprobs
            output_ids = [int(p[1]) for p in pairs]
        reason = meta.get("finish_reason")
        if isinstance(reason, dict):
            reason_type, matched = reason.get("type"), reason.get("matched")
        else:  # None (SGLang, aborted) or a bare string
            reason_type, matched = reason, None
        version = meta.get("weight_version")
        return cls(
            output_ids=[int(t) for t in output_ids],
            output_logprobs=[float(p[0]) for p in pairs],
            finish_reason=str(reason_type or "abort"),
            weight_version="" if version is None else str(version),
            prompt_tokens=int(meta.get("prompt_tokens", 0)),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            rid=meta.get("id"),
            matched_stop=matched if isinstance(matched, int) else None,
            meta_info=meta,
        )


@dataclass
class HealthProbe:
    """What one `GenerationClient.probe` found: `ok`, else `reason`, and
    `gone` when nothing answers at that address any more."""

    ok: bool
    reason: str = ""
    gone: bool = False


def _normalise(url: str) -> str:
    url = url.rstrip("/")
    return url if "://" in url else f"http://{url}"


class GenerationClient:
    """Async client with a shared connection pool; see the module docstring."""

    def __init__(self, timeout_s: float = 3600.0, max_connections: int = 0, connect_timeout_s: float = 10.0):
        # max_connections=0: no pool limit (long generations hold connections for minutes).
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is not None and not self._session.closed:
            if loop is not self._loop:
                raise RuntimeError(
                    "this GenerationClient belongs to another event loop; create one client per event loop"
                )
            return self._session
        connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0)
        self._session = aiohttp.ClientSession(connector=connector)
        self._loop = loop
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None
        self._loop = None

    async def _request(
        self,
        method: str,
        url: str,
        path: str,
        payload: Any = None,
        timeout_s: float | None = None,
        ok_statuses: tuple[int, ...] = (),
    ) -> Any:
        """Send one request; return the decoded JSON body (None if empty)."""
        full = f"{_normalise(url)}{path}"
        timeout = aiohttp.ClientTimeout(
            total=self.timeout_s if timeout_s is None else timeout_s, sock_connect=self.connect_timeout_s
        )
        session = self._get_session()
        try:
            async with session.request(method, full, json=payload, timeout=timeout) as resp:
                text = await resp.text()
                status = resp.status
        except asyncio.TimeoutError as e:
            raise GenerationServerUnavailable(url, f"{method} {path} timed out") from e
        except aiohttp.ClientError as e:
            raise GenerationServerUnavailable(url, f"{method} {path}: {type(e).__name__}: {e}") from e
        body: Any = None
        if text.strip():
            try:
                body = await asyncio.to_thread(_loads, text) if len(text) > 1 << 20 else _loads(text)
            except ValueError:
                body = text
        if status >= 400 and status not in ok_statuses:
            message = body.get("error") or body.get("message") if isinstance(body, dict) else body
            raise GenerationServerError(status, str(message or text), url)
        return body

    # ---- generation

    async def generate(
        self,
        url: str,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        return_logprob: bool = True,
        rid: str | None = None,
        timeout_s: float | None = None,
    ) -> GenerateResult:
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params),
            "return_logprob": return_logprob,
        }
        if rid is not None:
            payload["rid"] = rid
        body = await self._request("POST", url, "/generate", payload, timeout_s)
        if not isinstance(body, dict):
            raise GenerationServerError(200, f"unexpected /generate response: {str(body)[:200]}", url)
        return GenerateResult.from_response(body)

    async def generate_batch(
        self,
        url: str,
        input_ids: list[list[int]],
        sampling_params: dict[str, Any] | list[dict[str, Any]],
        return_logprob: bool = True,
        rids: list[str] | None = None,
        timeout_s: float | None = None,
    ) -> list[GenerateResult]:
        """One batched `/generate` (SGLang's list-of-prompts form): one result
        per prompt, in order; the response comes when every prompt is done.
        `sampling_params`: one dict for all, or one per prompt."""
        payload: dict[str, Any] = {
            "input_ids": [list(p) for p in input_ids],
            "sampling_params": (
                [dict(p) for p in sampling_params] if isinstance(sampling_params, list) else dict(sampling_params)
            ),
            "return_logprob": return_logprob,
        }
        if rids is not None:
            payload["rid"] = list(rids)
        body = await self._request("POST", url, "/generate", payload, timeout_s)
        if not isinstance(body, list) or len(body) != len(input_ids) or not all(isinstance(b, dict) for b in body):
            raise GenerationServerError(200, f"unexpected batched /generate response: {str(body)[:200]}", url)
        return [GenerateResult.from_response(b) for b in body]

    # ---- control

    async def update_weights_from_disk(
        self,
        url: str,
        model_path: str,
        weight_version: str | int | None,
        abort_all_requests: bool = True,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        """Load new weights on the server; returns `{success, message,
        num_paused_requests}`; raises GenerationServerError if it failed."""
        payload: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        body = await self._request("POST", url, "/update_weights_from_disk", payload, timeout_s, ok_statuses=(400,))
        if not isinstance(body, dict) or not body.get("success"):
            message = body.get("message") if isinstance(body, dict) else body
            raise GenerationServerError(400, f"weight update failed: {message}", url)
        return body

    async def pause_generation(self, url: str) -> Any:
        return await self._request("POST", url, "/pause_generation", {})

    async def continue_generation(self, url: str) -> Any:
        return await self._request("POST", url, "/continue_generation", {})

    async def abort_request(self, url: str, rid: str | None = None, abort_all: bool = False) -> Any:
        if rid is None and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        payload: dict[str, Any] = {"abort_all": abort_all}
        if rid is not None:
            payload["rid"] = rid
        return await self._request("POST", url, "/abort_request", payload)

    async def flush_cache(self, url: str) -> Any:
        return await self._request("POST", url, "/flush_cache")

    # ---- status

    async def health(self, url: str, timeout_s: float = 5.0) -> bool:
        """True if /health answers 200; False on any error."""
        try:
            await self._request("GET", url, "/health", timeout_s=timeout_s)
            return True
        except (GenerationServerError, GenerationServerUnavailable):
            return False

    async def probe(self, url: str, timeout_s: float = 5.0) -> HealthProbe:
        """One /health check that says why it failed, and whether the server
        is gone (connection refused or dropped: nothing listens there) rather
        than slow or unhealthy."""
        full = f"{_normalise(url)}/health"
        timeout = aiohttp.ClientTimeout(total=timeout_s, sock_connect=min(timeout_s, self.connect_timeout_s))
        try:
            async with self._get_session().get(full, timeout=timeout) as resp:
                await resp.read()
                if resp.status == 200:
                    return HealthProbe(True)
                return HealthProbe(False, f"/health answered HTTP {resp.status}")
        except asyncio.TimeoutError:
            return HealthProbe(False, f"/health did not answer within {timeout_s:g}s")
        except (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, ConnectionError) as e:
            return HealthProbe(False, f"{type(e).__name__}: {e}", gone=True)
        except aiohttp.ClientError as e:
            return HealthProbe(False, f"{type(e).__name__}: {e}")

    async def model_info(self, url: str) -> dict[str, Any]:
        try:
            return await self._request("GET", url, "/model_info")
        except GenerationServerError as e:
            if e.status != 404:
                raise
            return await self._request("GET", url, "/get_model_info")  # older SGLang

    async def weight_version(self, url: str) -> str:
        info = await self.model_info(url)
        return str(info.get("weight_version", ""))

    async def server_info(self, url: str) -> dict[str, Any]:
        return await self._request("GET", url, "/get_server_info")

    async def wait_healthy(self, url: str, timeout_s: float, poll_s: float = 0.5) -> None:
        """Poll /health until it answers 200; TimeoutError after timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            if await self.health(url, timeout_s=max(0.5, min(5.0, deadline - time.monotonic()))):
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"generation server {url} not healthy after {timeout_s:.0f}s")
            await asyncio.sleep(poll_s)


def _loads(text: str) -> Any:
    import json

    return json.loads(text)
