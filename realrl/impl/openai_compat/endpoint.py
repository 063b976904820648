"""The OpenAI-compatible HTTP endpoint: one aiohttp server per process and
event loop, one base URL per episode (docs/design.md §11; bodies:
realrl/api/openai_api.py).

    POST /episodes/<key>/v1/chat/completions   the episode's chat call (ChatSession.complete)
    GET  /episodes/<key>/v1/models             one model card (some clients list models first)
    POST /rl/episodes                          an external agent takes the next waiting episode
    POST /rl/episodes/<key>/close              ... and ends it with its reward
    POST /judge/v1/chat/completions            the judge model (realrl/impl/judge.py), when one is set
    GET  /health

Every episode of the process shares the server (`shared_endpoint()`): the
first user starts it, the last one leaving stops it. The rollout worker holds
it for its whole life, bound to its node's address and registered under
`chat_endpoint/<i>`, so agents outside realrl can reach it; an evaluation
holds it for its episodes, on 127.0.0.1. Only the process's own agents and
the external agents it invites reach an episode: its key is 144 random bits
in the URL, unknown keys get 404.

Every route but `/health` needs `Authorization: Bearer <the trial's HTTP
key>` when the process holds the trial's keys (docs/design.md §14); the
clients `client()` and `judge_client()` make carry it as their `api_key`, so
an agent's own code does not change. An external agent reads the key from the
trial's secret (`realrl.base.trial_secret`).

Errors are OpenAI's body `{"error": {"message", "type", "param", "code"}}`:
400 for a request the endpoint cannot honour (the client does not retry it),
404 for an unknown or closed episode, 413 for a body over the limit, and 500
with `x-should-retry: false` for a failed generation (a retried call would
record the same turn twice). Refusals are counted by reason (`stats()`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

from aiohttp import web

from realrl.api.openai_api import (
    ChatCompletionRequest,
    CloseEpisodeReply,
    CloseEpisodeRequest,
    ErrorDetail,
    ErrorReply,
    ModelCard,
    ModelList,
    OpenEpisodeReply,
    OpenEpisodeRequest,
)
from realrl.base import trial_secret
from realrl.base.http_auth import BearerGate
from realrl.base.http_body import BodyError, from_json, read_json, to_json
from realrl.base.logging import getLogger
from realrl.impl.openai_compat.chat import ChatSession, completion_chunks

logger = getLogger(__name__)

MAX_BODY_BYTES = 64 << 20  # a long conversation with tool outputs, not a data set
MAX_BODY_DEPTH = 64  # tools' JSON schemas nest
LOOPBACK = "127.0.0.1"
JUDGE_CLIENT_MARGIN_S = 5.0

Middleware = Callable[[web.Request, Callable[[web.Request], Awaitable[web.StreamResponse]]], Awaitable[Any]]


class EpisodeNotFound(BodyError):
    def __init__(self, key: str):
        super().__init__(f"no open episode {key!r} (closed, or never opened here)", status=404, reason="not_found")


class ChatEndpoint:
    """The server. `open(session)` gives an episode its base URL; `close(key)`
    ends it (later calls: 404). `offer(session)` makes an episode wait for an
    external agent (`POST /rl/episodes`)."""

    def __init__(
        self, host: str = LOOPBACK, port: int = 0, middlewares: Iterable[Middleware] = (), api_key: str | None = None
    ):
        self.host, self.port = host, port
        # Every route but /health needs the trial's key when the process has one (docs/design.md §14):
        # the process's own agents get it as their client's api_key, so their code needs no change.
        self.gate = BearerGate(trial_secret.http_api_key())
        self.middlewares = [self.gate.middleware, *middlewares]
        self.api_key = api_key or trial_secret.http_api_key() or "realrl"  # what `client()` sends
        self.url = ""
        self._http_client: Any = None  # shared by the clients of `client()`: a client of its own costs ~60 ms
        self.sessions: dict[str, ChatSession] = {}
        self._offers: asyncio.Queue[ChatSession] | None = None
        self._runner: web.AppRunner | None = None
        self.counters: collections.Counter = collections.Counter()  # calls, refusals by reason, ...
        self.judge: Any = None  # a realrl.impl.judge.Judge serves /judge/v1 when set

    async def start(self) -> str:
        import openai  # noqa: F401  (here, not at an episode's first call: it takes a second)

        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=self.middlewares)
        app.router.add_post("/episodes/{key}/v1/chat/completions", self._chat)
        app.router.add_get("/episodes/{key}/v1/models", self._models)
        app.router.add_post("/rl/episodes", self._open_external)
        app.router.add_post("/rl/episodes/{key}/close", self._close_external)
        app.router.add_get("/health", self._health)
        app.router.add_post("/judge/v1/chat/completions", self._judge_chat)
        # A handler whose client went away is cancelled (its generation with it): a
        # reply the agent gave up on is never recorded, so never trained on.
        self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # the port the OS chose for port 0
        self.url = f"http://{self.host}:{port}"
        self._offers = asyncio.Queue()
        return self.url

    async def close(self) -> None:
        if self._http_client is not None:
            await self._http_client.aclose()
            self._http_client = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def client(self, base_url: str) -> Any:
        """An `openai.AsyncOpenAI` for an episode's `base_url`. It never
        retries (a retried call would be a second turn) and never times out
        (generation waits for admission, weight updates and the servers' own
        retries); its connections are shared with every other client here."""
        import openai

        if self._http_client is None:
            self._http_client = openai.DefaultAsyncHttpx2Client()
        return openai.AsyncOpenAI(
            base_url=base_url, api_key=self.api_key, max_retries=0, timeout=None, http_client=self._http_client
        )

    def judge_client(self) -> Any:
        """An `openai.AsyncOpenAI` for the judge (`self.judge` must be set): it
        never retries, and waits a little longer than the judge's request
        timeout, so a judge that does not answer is given up on here (a 500,
        counted) before the client gives up."""
        import openai

        if self.judge is None:
            raise RuntimeError("no judge is configured (judge.model.path)")
        if self._http_client is None:
            self._http_client = openai.DefaultAsyncHttpx2Client()
        return openai.AsyncOpenAI(
            base_url=self.url + "/judge/v1",
            api_key=self.api_key,
            max_retries=0,
            timeout=self.judge.request_timeout_s + JUDGE_CLIENT_MARGIN_S,
            http_client=self._http_client,
        )

    # ---- episodes ------------------------------------------------------------------
    def open(self, session: ChatSession) -> str:
        """Serves `session`; its base URL (what `openai.AsyncOpenAI(base_url=...)` takes)."""
        self.sessions[session.key] = session
        return self.base_url(session.key)

    def base_url(self, key: str) -> str:
        return f"{self.url}/episodes/{key}/v1"

    def close_session(self, key: str) -> None:
        self.sessions.pop(key, None)

    async def offer(self, session: ChatSession) -> Any:
        """Waits for an external agent to take `session` and close it; its reward."""
        session.closed = asyncio.get_running_loop().create_future()
        await self._offers.put(session)
        return await session.closed

    async def _next_offer(self, wait_s: float) -> ChatSession | None:
        """The oldest episode still waiting for an external agent, waiting up to `wait_s`."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            try:
                session = self._offers.get_nowait()
            except asyncio.QueueEmpty:
                if loop.time() >= deadline:
                    return None
                try:
                    session = await asyncio.wait_for(self._offers.get(), deadline - loop.time())
                except asyncio.TimeoutError:
                    return None
            if session.key in self.sessions and session.closed is not None and not session.closed.done():
                return session  # else its episode ended while it waited

    def stats(self) -> dict[str, int]:
        refused = {"unauthorized": self.gate.refused} if self.gate.refused else {}
        return {**self.counters, **refused}

    # ---- routes --------------------------------------------------------------------
    def _session(self, request: web.Request) -> ChatSession:
        key = request.match_info["key"]
        session = self.sessions.get(key)
        if session is None:
            raise EpisodeNotFound(key)
        return session

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.counters["calls"] += 1
        sent: list[web.StreamResponse] = []

        async def deliver(completion) -> None:  # the turns are recorded once this returned
            sent.append(await _send(request, body, completion))

        try:
            session = self._session(request)
            body = from_json(
                ChatCompletionRequest, await read_json(request, max_bytes=MAX_BODY_BYTES, max_depth=MAX_BODY_DEPTH)
            )
            await session.complete(body, deliver)
        except BodyError as e:
            return self._refuse(e)
        except asyncio.CancelledError:
            self.counters["calls_abandoned"] += 1  # the client went away: nothing recorded
            raise
        except ConnectionError:
            self.counters["calls_abandoned"] += 1
            raise
        except Exception as e:
            self.counters["generation_failures"] += 1
            message = f"generation failed: {type(e).__name__}: {e}"
            return _error(500, ErrorDetail(message, type="server_error"), headers={"x-should-retry": "false"})
        return sent[0]

    async def _judge_chat(self, request: web.Request) -> web.Response:
        """The judge's answer; records nothing. Failures are counted (`judge_failures`)."""
        self.counters["judge_calls"] += 1
        try:
            if self.judge is None:
                raise BodyError("no judge is configured (judge.model.path)", status=404, reason="no_judge")
            body = from_json(ChatCompletionRequest, await read_json(request, max_bytes=MAX_BODY_BYTES))
            completion = await self.judge.complete(body)
        except BodyError as e:
            self.counters["judge_failures"] += 1
            return self._refuse(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.counters["judge_failures"] += 1
            message = f"judge failed: {type(e).__name__}: {e}"
            return _error(500, ErrorDetail(message, type="server_error"), headers={"x-should-retry": "false"})
        return web.json_response(to_json(completion))

    async def _models(self, request: web.Request) -> web.Response:
        try:
            self._session(request)
        except BodyError as e:
            return self._refuse(e)
        return web.json_response(to_json(ModelList([ModelCard("realrl")])))

    async def _open_external(self, request: web.Request) -> web.Response:
        try:
            body = from_json(OpenEpisodeRequest, await read_json(request, max_bytes=1 << 16, allow_empty=True))
        except BodyError as e:
            return self._refuse(e)
        session = await self._next_offer(body.wait_s)
        if session is None:
            return web.json_response(to_json(OpenEpisodeReply()))
        self.counters["external_opened"] += 1
        return web.json_response(
            to_json(OpenEpisodeReply(session.key, self.base_url(session.key), session.qid, session.row))
        )

    async def _close_external(self, request: web.Request) -> web.Response:
        try:
            session = self._session(request)
            body = from_json(CloseEpisodeRequest, await read_json(request, max_bytes=1 << 16))
            if session.closed is None or session.closed.done():
                raise BodyError(f"episode {session.key!r} is not waiting to be closed", status=409, reason="conflict")
        except BodyError as e:
            return self._refuse(e)
        session.closed.set_result(body.reward)
        self.counters["external_closed"] += 1
        return web.json_response(to_json(CloseEpisodeReply(True, len(session.recorder.turns))))

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "episodes": len(self.sessions)})

    def _refuse(self, e: BodyError) -> web.Response:
        self.counters[f"refused_{e.reason}"] += 1
        kind = "not_found_error" if e.status == 404 else "invalid_request_error"
        code = e.reason if e.reason not in ("invalid", "not_found") else None
        return _error(e.status, ErrorDetail(str(e), type=kind, code=code))


async def _send(request: web.Request, body: ChatCompletionRequest, completion: Any) -> web.StreamResponse:
    """Writes the answer (a JSON body, or server-sent events); raises if the
    connection is gone."""
    if not body.stream:
        response = web.json_response(to_json(completion))
        await response.prepare(request)
        await response.write_eof()
        return response
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await response.prepare(request)
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    for chunk in completion_chunks(completion, include_usage):
        await response.write(b"data: " + json.dumps(to_json(chunk)).encode() + b"\n\n")
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


def _error(status: int, detail: ErrorDetail, headers: dict | None = None) -> web.Response:
    return web.json_response(to_json(ErrorReply(detail)), status=status, headers=headers)


# --------------------------------------------------------------------------- one per event loop


@dataclasses.dataclass
class _Shared:
    endpoint: ChatEndpoint
    users: int = 0


_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Shared] = weakref.WeakKeyDictionary()
_STARTING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()


@contextlib.asynccontextmanager
async def shared_endpoint(
    host: str = LOOPBACK, port: int = 0, middlewares: Iterable[Middleware] = ()
) -> AsyncIterator[ChatEndpoint]:
    """This event loop's endpoint while the block runs: started by the first
    user (on `host:port`, with `middlewares`; later users share it as it is),
    stopped when the last one leaves."""
    loop = asyncio.get_running_loop()
    lock = _STARTING.setdefault(loop, asyncio.Lock())
    async with lock:
        shared = _SHARED.get(loop)
        if shared is None:
            endpoint = ChatEndpoint(host, port, middlewares)
            await endpoint.start()
            shared = _SHARED[loop] = _Shared(endpoint)
        shared.users += 1
    try:
        yield shared.endpoint
    finally:
        shared.users -= 1
        if shared.users == 0 and _SHARED.get(loop) is shared:
            del _SHARED[loop]
            await shared.endpoint.close()
