"""Request-reply stream: control messages between the master and the model
workers (docs/design.md §4).

Sockets. The master (`NameResolvingRequestClient`) binds one PUSH socket per
model worker (`master_send_{i}`) and one PULL socket for all replies
(`master_recv`), and registers their addresses under
`names.request_reply_stream(exp, trial, ...)`. Each worker
(`NameResolvingReplyServer`) connects a PULL to its `master_send_{i}` and a
PUSH to `master_recv`, then adds itself to the `barrier` subtree; the master
waits until every worker is there. Messages are `realrl.base.wire` buffers of
a `Payload` (never pickle) with one of four kinds:

    master -> worker: "request", "ack", "cancel"      worker -> master: "syn", "received", "reply"

Routing. A request names a handler: a worker index, a model-shard id string
or `"__data{dp}__"` (the head of data-parallel rank dp); the master's
`handler_routing` maps each handler to a worker index.

SYN/ACK. By default (`no_syn=True`) a worker runs a request as soon as it
arrives. With `no_syn=False` the worker answers "syn" on receipt and holds
the request; the master waits for the syn of every target worker and then
sends each an "ack", on which the worker runs it. A collective operation
(e.g. a train step with an all-reduce) therefore starts only once every
worker has the request. If a syn is missing when the timeout expires, the
master sends "cancel" to the workers that did answer, and nothing runs.

Threads on the worker side. zmq sockets are not thread-safe, so only the
thread that calls `serve()` touches them. Handlers are registered as:

- cheap (`long_running=False`, e.g. `spec`, `fetch`, `stats`): run inline in
  `serve()`, on the serving thread, and are answered at once;
- long (`long_running=True`, e.g. `train_step`, `inference`, `save`): run one
  at a time, in arrival order, on a single background thread. It hands each
  encoded reply back through a queue and rings a pipe that `serve()` polls,
  and `serve()` sends it. Meanwhile `serve()` keeps answering cheap requests,
  so a master can e.g. ask for stats while a train step runs. Cheap handlers
  must therefore not touch state a long handler is changing.

A handler's exception becomes an error reply (type, message, traceback); the
master raises it as `RemoteError`. Malformed messages are dropped, counted in
`n_rejected` and logged; both ends keep running. Every wait has a timeout.

Lost requests. A worker confirms every request it takes: a cheap one by its
reply, a long one by "received" as it queues it (a SYN/ACK one by its syn).
A request that nobody confirms (its worker died, or a stray process connected
to the worker's request socket took it) is warned about after `warn_after`
seconds, naming the worker and the request, and fails the call after
`receipt_timeout`; a confirmed one may run up to the call's own timeout (a
train step of a large model takes minutes), with a warning every
`RUNNING_WARN_INTERVAL` seconds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import queue
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from realrl.base import name_resolve, names, network, wire
from realrl.base.logging import getLogger
from realrl.system.push_pull_stream import RateLimitedLog

logger = getLogger("request_reply_stream")

BARRIER = "barrier"
REQUEST, ACK, CANCEL, SYN, RECEIVED, REPLY = "request", "ack", "cancel", "syn", "received", "reply"
_KINDS = (REQUEST, ACK, CANCEL, SYN, RECEIVED, REPLY)
DEFAULT_CONNECT_TIMEOUT = 300.0  # seconds for the two ends to find each other
DEFAULT_SEND_TIMEOUT = 30.0  # seconds a send may wait for a full queue or a connection
DEFAULT_WARN_AFTER = 10.0  # seconds without a worker's confirmation before we say so
DEFAULT_RECEIPT_TIMEOUT = 60.0  # seconds without it before the call fails
RUNNING_WARN_INTERVAL = 600.0  # seconds between "still running" warnings of a confirmed request
_WAIT_SLICE = 0.5  # seconds: how often a waiting call looks at its requests' age
_REPLY_LINGER_MS = 1000  # a closing worker still flushes its last replies for this long


def _master_send(i: int) -> str:
    return f"master_send_{i}"


_MASTER_RECV = "master_recv"


@dataclasses.dataclass
class Payload:
    """One message of the stream. Requests carry `data`; replies carry
    `result`, or `err` = {"type", "message", "traceback"} of the remote exception."""

    handler: int | str
    handle_name: str
    data: Any = None
    no_syn: bool = True
    request_id: str = dataclasses.field(default_factory=lambda: uuid.uuid4().hex)
    result: Any = None
    err: dict | None = None
    kind: str = REQUEST

    def to_wire(self) -> dict:
        return {
            "kind": self.kind,
            "id": self.request_id,
            "handler": self.handler,
            "name": self.handle_name,
            "data": self.data,
            "no_syn": self.no_syn,
            "result": self.result,
            "err": self.err,
        }

    @staticmethod
    def from_wire(msg: Any) -> Payload:
        """Validates a decoded message; raises ValueError if it is not a Payload."""
        if not isinstance(msg, dict):
            raise ValueError(f"payload must be a dict, got {type(msg).__name__}")
        kind, request_id, handler, name = msg.get("kind"), msg.get("id"), msg.get("handler"), msg.get("name")
        if kind not in _KINDS:
            raise ValueError(f"unknown payload kind {kind!r}")
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("payload without a request id")
        if not isinstance(handler, (int, str)) or isinstance(handler, bool):
            raise ValueError(f"bad handler {handler!r}")
        if not isinstance(name, str):
            raise ValueError(f"bad handle name {name!r}")
        no_syn = msg.get("no_syn", True)
        if not isinstance(no_syn, bool):
            raise ValueError(f"bad no_syn {no_syn!r}")
        err = msg.get("err")
        if err is not None and not (
            isinstance(err, dict) and all(isinstance(err.get(k), str) for k in ("type", "message", "traceback"))
        ):
            raise ValueError("bad error field")
        return Payload(handler, name, msg.get("data"), no_syn, request_id, msg.get("result"), err, kind)


class RequestLost(TimeoutError):
    """No worker confirmed a request within the receipt timeout."""


class RemoteError(Exception):
    """A handler raised on the worker. str() includes the remote traceback."""

    def __init__(self, payload: Payload, worker_index: int | None = None) -> None:
        err = payload.err or {}
        self.handler = payload.handler
        self.handle_name = payload.handle_name
        self.request_id = payload.request_id
        self.worker_index = worker_index
        self.remote_type = err.get("type", "?")
        self.remote_message = err.get("message", "")
        self.remote_traceback = err.get("traceback", "")
        super().__init__(
            f"{self.handle_name!r} on handler {self.handler!r} (model worker {worker_index}, request "
            f"{self.request_id}) raised {self.remote_type}: {self.remote_message}\n"
            f"--- remote traceback ---\n{self.remote_traceback}"
        )


def _bind_claimed_port(socket: zmq.Socket, host: str, experiment_name: str, trial_name: str, tries: int = 5) -> str:
    """Binds `socket` to a port claimed in name_resolve for this trial; returns host:port."""
    for attempt in range(tries):
        port = network.find_free_port(experiment_name, trial_name, host=host)
        try:
            socket.bind(f"tcp://{host}:{port}")
            return f"{host}:{port}"
        except zmq.ZMQError:  # taken by a process outside the trial meanwhile
            if attempt == tries - 1:
                raise
    raise AssertionError("unreachable")


def _send(socket: zmq.Socket, message: bytes, timeout: float, what: str) -> None:
    """Queues `message`, waiting up to `timeout` for room or a connection."""
    try:
        socket.send(message, zmq.NOBLOCK, copy=False)
        return
    except zmq.Again:
        pass
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"could not send {what} within {timeout}s (peer not connected or not reading)")
        if socket.poll(max(1, int(remaining * 1000)), zmq.POLLOUT):
            try:
                socket.send(message, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                continue


class _Receiver:
    """Receive side shared by both ends: decodes, validates and counts rejects."""

    def __init__(self, socket: zmq.Socket, where: str, max_message_bytes: int) -> None:
        self.socket = socket
        self.where = where
        self.max_message_bytes = max_message_bytes
        self.n_rejected = 0
        self._log = RateLimitedLog()

    def receive_all(self) -> list[Payload]:
        """Every payload already queued (does not wait)."""
        out = []
        while True:
            try:
                frame = self.socket.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                self._log.maybe_flush()  # the suppressed count, once its interval has passed
                return out
            if frame.more:
                while self.socket.recv(copy=False).more:
                    pass
                self.reject("a multipart message (this stream sends single frames)")
                continue
            try:
                out.append(Payload.from_wire(wire.loads(frame, self.max_message_bytes)))
            except ValueError as e:  # WireFormatError is a ValueError
                self.reject(str(e))

    def reject(self, reason: str) -> None:
        self.n_rejected += 1
        self._log.warning("%s rejected a malformed message (%d so far): %s", self.where, self.n_rejected, reason)

    def flush_log(self) -> None:
        """Reports the rejects the rate-limited log has not yet (call at close)."""
        self._log.flush()


# ---- master side -------------------------------------------------------------------


class NameResolvingRequestClient:
    """The master's end. Single-threaded: use it from one thread (or one
    asyncio loop); many requests may be in flight at once."""

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        n_subscribers: int,
        handler_routing: dict[int | str, int],
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
        host: str | None = None,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        warn_after: float = DEFAULT_WARN_AFTER,
        receipt_timeout: float = DEFAULT_RECEIPT_TIMEOUT,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        """`interrupt()` is called while waiting for the workers to connect;
        it raises to give up (e.g. when the trial ends meanwhile)."""
        bad = {h: w for h, w in handler_routing.items() if not (isinstance(w, int) and 0 <= w < n_subscribers)}
        if bad:
            raise ValueError(f"handler_routing maps to workers outside 0..{n_subscribers - 1}: {bad}")
        bad_keys = [h for h in handler_routing if not isinstance(h, (int, str)) or isinstance(h, bool)]
        if bad_keys:
            raise ValueError(f"handlers are worker indices (int) or ids (str), got {bad_keys}")
        self.n_subscribers = n_subscribers
        self.routing = dict(handler_routing)
        self.send_timeout = send_timeout
        self.warn_after = warn_after
        self.receipt_timeout = receipt_timeout
        self._interrupt = interrupt
        host = host or network.bind_address("local")
        key = lambda stream: names.request_reply_stream(experiment_name, trial_name, stream)  # noqa: E731

        # Entries from an earlier master of this trial would fake connected workers.
        name_resolve.clear_subtree(key(BARRIER))
        self._context = zmq.Context()
        self._send_sockets: list[zmq.Socket] = []
        self._keys: list[str] = []
        try:
            for i in range(n_subscribers):
                sock = self._context.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)  # nothing to flush: an unsent request is a failed request
                self._send_sockets.append(sock)
                address = _bind_claimed_port(sock, host, experiment_name, trial_name)
                name_resolve.add(key(_master_send(i)), address, replace=True)
                self._keys.append(key(_master_send(i)))
            recv_socket = self._context.socket(zmq.PULL)
            recv_socket.setsockopt(zmq.LINGER, 0)
            recv_socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)  # memory backstop, see push_pull_stream
            self.recv_address = _bind_claimed_port(recv_socket, host, experiment_name, trial_name)
            name_resolve.add(key(_MASTER_RECV), self.recv_address, replace=True)
            self._keys.append(key(_MASTER_RECV))
            self._receiver = _Receiver(recv_socket, f"master {self.recv_address}", max_message_bytes)
            self._recv_socket = recv_socket
            self._wait_for_workers(key(BARRIER), connect_timeout)
        except BaseException:
            self._context.destroy(linger=0)  # closes every socket made so far
            for k in self._keys:
                try:
                    name_resolve.delete(k)
                except Exception:
                    pass
            raise

        self._inflight: dict[str, tuple[int | str, str, int]] = {}  # request id -> (handler, handle name, worker)
        self._sent_at: dict[str, float] = {}  # request id -> when it was sent
        self._received: set[str] = set()  # confirmed by the worker (received, syn or reply)
        self._warned_at: dict[str, float] = {}  # request id -> when we last warned about it
        self._replies: dict[str, Payload] = {}  # arrived, not yet collected (insertion = arrival order)
        self._syns: set[str] = set()
        self._waiters: dict[tuple[str, str], asyncio.Future] = {}  # (kind, request id) -> future
        self._pump_task: asyncio.Task | None = None
        self._async_socket: tuple[asyncio.AbstractEventLoop, zmq.asyncio.Socket] | None = None
        logger.info("request client: %d model workers connected, replies on %s", n_subscribers, self.recv_address)

    @property
    def n_rejected(self) -> int:
        return self._receiver.n_rejected

    def in_flight(self) -> list[tuple[str, int, float, bool]]:
        """Requests sent and not yet collected, oldest first: (handle name,
        model worker, seconds since sent, confirmed by the worker)."""
        now = time.monotonic()
        out = [
            (name, worker, now - self._sent_at.get(rid, now), rid in self._received)
            for rid, (_, name, worker) in list(self._inflight.items())
        ]
        return sorted(out, key=lambda r: -r[2])

    def _wait_for_workers(self, barrier: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            present = set()
            for value in name_resolve.get_subtree(barrier):
                if value.isdigit():
                    present.add(int(value))
            missing = sorted(set(range(self.n_subscribers)) - present)
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"model workers {missing} did not connect to the request stream within {timeout}s")
            if self._interrupt is not None:
                self._interrupt()
            time.sleep(0.05)

    # ---- sending ------------------------------------------------------------------
    def _route(self, handler: int | str) -> int:
        try:
            return self.routing[handler]
        except (KeyError, TypeError):
            raise KeyError(f"no route for handler {handler!r}; routing table: {self.routing}") from None

    def _prepare_requests(
        self, handlers: Sequence[int | str], handle_name: str, datas: Sequence[Any] | None, no_syn: bool
    ) -> list[tuple[Payload, bytes, int]]:
        """Routes and encodes every request before any is sent: (payload, message, worker)."""
        if datas is None:
            datas = [None] * len(handlers)
        if len(datas) != len(handlers):
            raise ValueError(f"{len(handlers)} handlers but {len(datas)} datas")
        workers = [self._route(h) for h in handlers]
        payloads = [Payload(h, handle_name, d, no_syn) for h, d in zip(handlers, datas)]
        return [(p, wire.dumps(p.to_wire()), w) for p, w in zip(payloads, workers)]

    def _track(self, payload: Payload, worker: int) -> None:
        self._inflight[payload.request_id] = (payload.handler, payload.handle_name, worker)
        self._sent_at[payload.request_id] = time.monotonic()

    def _send_requests(
        self, handlers: Sequence[int | str], handle_name: str, datas: Sequence[Any] | None, no_syn: bool
    ) -> list[str]:
        prepared = self._prepare_requests(handlers, handle_name, datas, no_syn)
        for payload, message, worker in prepared:
            self._track(payload, worker)
            _send(self._send_sockets[worker], message, self.send_timeout, f"{handle_name!r} to model worker {worker}")
        return [p.request_id for p, _, _ in prepared]

    async def _send_requests_async(
        self, handlers: Sequence[int | str], handle_name: str, datas: Sequence[Any] | None, no_syn: bool
    ) -> list[str]:
        """`_send_requests` that waits for a full queue or a missing peer (a
        worker that just died) without blocking the event loop, so the
        caller can be cancelled meanwhile."""
        prepared = self._prepare_requests(handlers, handle_name, datas, no_syn)
        for payload, message, worker in prepared:
            self._track(payload, worker)
            socket, what = self._send_sockets[worker], f"{handle_name!r} to model worker {worker}"
            deadline = time.monotonic() + self.send_timeout
            while True:
                try:
                    socket.send(message, zmq.NOBLOCK, copy=False)
                    break
                except zmq.Again:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"could not send {what} within {self.send_timeout}s (peer not connected or not reading)"
                        ) from None
                    await asyncio.sleep(0.02)
        return [p.request_id for p, _, _ in prepared]

    def _send_control(self, kind: str, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            handler, handle_name, worker = self._inflight[rid]
            message = wire.dumps(Payload(handler, handle_name, request_id=rid, kind=kind).to_wire())
            _send(
                self._send_sockets[worker],
                message,
                self.send_timeout,
                f"{kind} of {handle_name!r} to model worker {worker}",
            )

    def request(
        self,
        handlers: Sequence[int | str],
        handle_name: str,
        datas: Sequence[Any] | None = None,
        no_syn: bool = True,
        timeout: float = DEFAULT_SEND_TIMEOUT,
    ) -> list[str]:
        """Sends one request per handler (`datas[i]` to `handlers[i]`) and
        returns their ids. With `no_syn=False`, returns only after every target
        worker has confirmed receipt and been told to start (SYN/ACK)."""
        ids = self._send_requests(handlers, handle_name, datas, no_syn)
        if not no_syn:
            deadline = time.monotonic() + timeout
            while True:
                self._drain()
                missing = [rid for rid in ids if rid not in self._syns]
                if not missing:
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise self._syn_timeout(ids, missing, timeout)
                self._recv_socket.poll(max(1, int(remaining * 1000)), zmq.POLLIN)
            self._syns.difference_update(ids)
            self._send_control(ACK, ids)
        return ids

    def _syn_timeout(self, ids: list[str], missing: list[str], timeout: float) -> TimeoutError:
        """Cancels the requests on every target worker (a late one drops it on
        arrival) and forgets them."""
        try:
            self._send_control(CANCEL, ids)
        except TimeoutError as e:
            logger.warning("could not cancel %d requests: %s", len(ids), e)
        what = [f"handler {self._inflight[rid][0]!r} (model worker {self._inflight[rid][2]})" for rid in missing]
        name = self._inflight[ids[0]][1]
        self._forget(ids)
        return TimeoutError(f"no SYN for {name!r} from {', '.join(what)} within {timeout}s; request cancelled")

    # ---- receiving ----------------------------------------------------------------
    def _drain(self) -> None:
        for payload in self._receiver.receive_all():
            rid = payload.request_id
            if rid not in self._inflight:
                if payload.kind != RECEIVED:  # a late confirmation of a request we gave up on says nothing new
                    logger.warning(
                        "dropped a %s for unknown or abandoned request %s (%r)", payload.kind, rid, payload.handle_name
                    )
                continue
            if payload.kind in (REPLY, SYN, RECEIVED):
                self._received.add(rid)
            if payload.kind == REPLY:
                self._replies[rid] = payload
            elif payload.kind == SYN:
                self._syns.add(rid)
            elif payload.kind == RECEIVED:
                continue
            else:
                self._receiver.reject(f"a {payload.kind!r} message sent to the master")
                continue
            waiter = self._waiters.get((payload.kind, rid))
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    def _forget(self, ids: Sequence[str]) -> None:
        for rid in ids:
            self._inflight.pop(rid, None)
            self._replies.pop(rid, None)
            self._syns.discard(rid)
            self._untrack(rid)

    def _untrack(self, rid: str) -> None:
        self._sent_at.pop(rid, None)
        self._received.discard(rid)
        self._warned_at.pop(rid, None)

    def _describe(self, rid: str) -> str:
        handler, handle_name, worker = self._inflight[rid]
        where = f"model worker {worker}" if handler == worker else f"handler {handler!r} (model worker {worker})"
        return f"{handle_name!r} request {rid} to {where}"

    def _check_unanswered(self, ids: Sequence[str]) -> None:
        """Warns about requests of `ids` that are still unanswered after
        `warn_after` (naming each), and raises RequestLost for those no
        worker confirmed within `receipt_timeout`."""
        now = time.monotonic()
        lost, slow = [], []
        for rid in ids:
            if rid in self._replies or rid not in self._sent_at:
                continue
            age = now - self._sent_at[rid]
            received = rid in self._received
            if not received and age > self.receipt_timeout:
                lost.append(rid)
            elif age > (self.warn_after if not received else RUNNING_WARN_INTERVAL):
                if now - self._warned_at.get(rid, -float("inf")) >= (
                    self.warn_after if not received else RUNNING_WARN_INTERVAL
                ):
                    self._warned_at[rid] = now
                    slow.append((rid, age, received))
        if lost:
            what = "; ".join(self._describe(rid) for rid in lost)
            self._forget(ids)  # late replies are dropped when they come
            raise RequestLost(
                f"no model worker confirmed {what} within {self.receipt_timeout:.0f}s: the worker is gone, or "
                "another process is connected to its request socket and took the request"
            )
        for rid, age, received in slow:
            state = "received and still running" if received else "not confirmed by the worker yet"
            logger.warning("%s unanswered for %.0fs (%s)", self._describe(rid), age, state)

    def _reply_timeout(self, ids: list[str], missing: list[str], timeout: float) -> TimeoutError:
        what = "; ".join(
            f"handler {self._inflight[rid][0]!r} (model worker {self._inflight[rid][2]}) "
            f"{self._inflight[rid][1]!r} request {rid}"
            for rid in missing
        )
        self._forget(ids)  # late replies are dropped when they come
        return TimeoutError(f"no reply within {timeout}s from {what}")

    def _collect(self, request_ids: Sequence[str]) -> list[Any]:
        replies = [self._replies.pop(rid) for rid in request_ids]
        workers = [self._inflight.pop(rid)[2] for rid in request_ids]
        for rid in request_ids:
            self._untrack(rid)
        for payload, worker in zip(replies, workers):
            if payload.err is not None:
                raise RemoteError(payload, worker)
        return [p.result for p in replies]

    def poll(self, timeout: float = 1.0) -> Payload:
        """The next reply to any request, in arrival order (errors are
        returned, not raised: look at `.err`). Raises TimeoutError if none
        arrives within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            if self._replies:
                rid = next(iter(self._replies))
                self._inflight.pop(rid, None)
                self._untrack(rid)
                return self._replies.pop(rid)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no reply within {timeout}s ({len(self._inflight)} requests in flight)")
            self._recv_socket.poll(max(1, int(remaining * 1000)), zmq.POLLIN)

    def gather(self, request_ids: Sequence[str], timeout: float) -> list[Any]:
        """The results of `request_ids`, in that order. Raises RemoteError for
        the first that failed remotely, TimeoutError naming what is missing."""
        request_ids = list(request_ids)
        deadline = time.monotonic() + timeout
        while True:
            self._drain()
            missing = [rid for rid in request_ids if rid not in self._replies]
            if not missing:
                return self._collect(request_ids)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise self._reply_timeout(request_ids, missing, timeout)
            self._check_unanswered(request_ids)
            self._recv_socket.poll(max(1, int(min(remaining, _WAIT_SLICE) * 1000)), zmq.POLLIN)

    def call(
        self,
        handlers: Sequence[int | str],
        handle_name: str,
        datas: Sequence[Any] | None = None,
        timeout: float = 300.0,
        no_syn: bool = True,
    ) -> list[Any]:
        """request + gather; `timeout` covers the whole call."""
        deadline = time.monotonic() + timeout
        ids = self.request(handlers, handle_name, datas, no_syn, timeout=timeout)
        return self.gather(ids, max(0.0, deadline - time.monotonic()))

    # ---- asyncio ------------------------------------------------------------------
    def _ensure_pump(self) -> None:
        """One task per loop waits on the reply socket and wakes the waiters."""
        loop = asyncio.get_running_loop()
        if self._pump_task is not None and not self._pump_task.done() and self._pump_task.get_loop() is loop:
            return
        if self._async_socket is None or self._async_socket[0] is not loop:
            # A shadow of the same socket, registered with this loop. Never closed
            # itself: closing a shadow closes the socket it shadows.
            self._async_socket = (loop, zmq.asyncio.Socket.from_socket(self._recv_socket))
        self._pump_task = loop.create_task(self._pump(self._async_socket[1]))

    async def _pump(self, async_socket: zmq.asyncio.Socket) -> None:
        try:
            while self._waiters:
                await async_socket.poll(100, zmq.POLLIN)
                self._drain()
        except Exception as e:  # wake every waiter with the failure rather than hang them
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(e)
            raise

    async def _wait_async(
        self, kind: str, ids: list[str], arrived: Callable[[str], bool], deadline: float
    ) -> list[str]:
        """Waits until `arrived(rid)` for every id or the deadline; returns the missing ids."""
        self._drain()
        loop = asyncio.get_running_loop()
        waiting = {rid: loop.create_future() for rid in ids if not arrived(rid)}
        if not waiting:
            return []
        for rid, fut in waiting.items():
            self._waiters[(kind, rid)] = fut
        try:
            self._ensure_pump()
            pending = set(waiting.values())
            while pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                _, pending = await asyncio.wait(pending, timeout=min(remaining, _WAIT_SLICE))
                if pending:
                    self._check_unanswered(ids)
        finally:
            for rid, fut in waiting.items():
                if self._waiters.get((kind, rid)) is fut:
                    del self._waiters[(kind, rid)]
        for fut in waiting.values():
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()
        self._drain()
        return [rid for rid in waiting if not arrived(rid)]

    async def gather_async(self, request_ids: Sequence[str], timeout: float) -> list[Any]:
        """`gather` for the master's asyncio loop: other coroutines run while it waits."""
        request_ids = list(request_ids)
        missing = await self._wait_async(REPLY, request_ids, self._replies.__contains__, time.monotonic() + timeout)
        if missing:
            raise self._reply_timeout(request_ids, missing, timeout)
        return self._collect(request_ids)

    async def request_async(
        self,
        handlers: Sequence[int | str],
        handle_name: str,
        datas: Sequence[Any] | None = None,
        no_syn: bool = True,
        timeout: float = DEFAULT_SEND_TIMEOUT,
    ) -> list[str]:
        """`request` whose sending and SYN/ACK wait (no_syn=False) do not block the loop."""
        ids = await self._send_requests_async(handlers, handle_name, datas, no_syn)
        if not no_syn:
            missing = await self._wait_async(SYN, ids, self._syns.__contains__, time.monotonic() + timeout)
            if missing:
                raise self._syn_timeout(ids, missing, timeout)
            self._syns.difference_update(ids)
            self._send_control(ACK, ids)
        return ids

    async def call_async(
        self,
        handlers: Sequence[int | str],
        handle_name: str,
        datas: Sequence[Any] | None = None,
        timeout: float = 300.0,
        no_syn: bool = True,
    ) -> list[Any]:
        """`call` for the master's asyncio loop; many may run concurrently."""
        deadline = time.monotonic() + timeout
        ids = await self.request_async(handlers, handle_name, datas, no_syn, timeout=timeout)
        return await self.gather_async(ids, max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        if self._context.closed:
            return
        self._receiver.flush_log()
        if self._pump_task is not None and not self._pump_task.done():
            try:
                self._pump_task.cancel()
            except RuntimeError:  # its loop is already closed
                pass
        for key in self._keys:
            try:
                name_resolve.delete(key)
            except Exception as e:  # gone already, or the name service is down at shutdown
                logger.debug("could not delete %s: %s", key, e)
        self._context.destroy(linger=0)


# ---- worker side -------------------------------------------------------------------


@dataclasses.dataclass
class _Handler:
    fn: Callable[[Any], Any]
    long_running: bool


class NameResolvingReplyServer:
    """A model worker's end. Call `serve()` from one thread, repeatedly."""

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        worker_index: int,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        send_timeout: float = DEFAULT_SEND_TIMEOUT,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        """`interrupt()` is called while waiting for the master's addresses;
        it raises to give up (e.g. when the trial ends meanwhile)."""
        self.worker_index = worker_index
        self.send_timeout = send_timeout
        key = lambda stream: names.request_reply_stream(experiment_name, trial_name, stream)  # noqa: E731
        deadline = time.monotonic() + connect_timeout
        addresses = []
        for stream in (_master_send(worker_index), _MASTER_RECV):
            while True:
                try:
                    addresses.append(
                        name_resolve.wait(key(stream), timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                    )
                    break
                except TimeoutError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(
                            f"model worker {worker_index}: the master did not register its request "
                            f"stream within {connect_timeout}s"
                        ) from None
                    if interrupt is not None:
                        interrupt()
        requests_address, replies_address = addresses
        self._context = zmq.Context()
        recv_socket = self._context.socket(zmq.PULL)
        recv_socket.setsockopt(zmq.LINGER, 0)
        recv_socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
        recv_socket.connect(f"tcp://{requests_address}")
        self._send_socket = self._context.socket(zmq.PUSH)
        self._send_socket.setsockopt(zmq.LINGER, _REPLY_LINGER_MS)
        self._send_socket.connect(f"tcp://{replies_address}")
        self._receiver = _Receiver(recv_socket, f"model worker {worker_index}", max_message_bytes)
        self._recv_socket = recv_socket

        # The long-running lane: a FIFO of (payload, fn) for one thread, which puts
        # encoded replies on `_finished` and writes a byte to the pipe `serve()` polls.
        self._bell_read, self._bell_write = os.pipe()
        os.set_blocking(self._bell_read, False)
        self._poller = zmq.Poller()
        self._poller.register(recv_socket, zmq.POLLIN)
        self._poller.register(self._bell_read, zmq.POLLIN)
        self._long_queue: queue.Queue = queue.Queue()
        self._finished: queue.Queue = queue.Queue()
        self._long_thread: threading.Thread | None = None
        self._long_busy = False

        self._handlers: dict[str, _Handler] = {}
        self._awaiting_ack: dict[str, Payload] = {}
        self.n_handled = 0
        self._closed = False
        self._barrier_key = name_resolve.add_subentry(key(BARRIER), str(worker_index))
        logger.info("model worker %d connected to the master (%s, %s)", worker_index, requests_address, replies_address)

    @property
    def n_rejected(self) -> int:
        return self._receiver.n_rejected

    @property
    def n_pending(self) -> int:
        """Long-running requests queued or running."""
        return self._long_queue.qsize() + (1 if self._long_busy else 0)

    def register(self, handle_name: str, fn: Callable[[Any], Any], long_running: bool = False) -> None:
        """`fn(data) -> result` answers requests named `handle_name`."""
        self._handlers[handle_name] = _Handler(fn, long_running)
        if long_running and self._long_thread is None:
            self._long_thread = threading.Thread(target=self._long_loop, name="reply-server-long", daemon=True)
            self._long_thread.start()

    # ---- handling -----------------------------------------------------------------
    def _reply(self, payload: Payload, fn: Callable[[Any], Any]) -> bytes:
        """Runs `fn` and returns the encoded reply (result or error)."""
        reply = Payload(payload.handler, payload.handle_name, request_id=payload.request_id, kind=REPLY)
        try:
            reply.result = fn(payload.data)
            return wire.dumps(reply.to_wire())
        except Exception as e:  # the handler failed, or its result cannot be sent
            reply.result = None
            tb = traceback.format_exc()
            logger.warning(
                "handler %r failed on model worker %d: %s: %s",
                payload.handle_name,
                self.worker_index,
                type(e).__name__,
                e,
            )
            reply.err = {"type": type(e).__name__, "message": str(e), "traceback": tb}
            return wire.dumps(reply.to_wire())

    def _long_loop(self) -> None:
        while True:
            item = self._long_queue.get()
            if item is None:
                return
            payload, fn = item
            self._long_busy = True
            try:
                message = self._reply(payload, fn)
            except BaseException as e:  # SystemExit etc. in a handler must not kill the lane silently
                reply = Payload(payload.handler, payload.handle_name, request_id=payload.request_id, kind=REPLY)
                reply.err = {"type": type(e).__name__, "message": str(e), "traceback": traceback.format_exc()}
                message = wire.dumps(reply.to_wire())
            self._long_busy = False
            self._finished.put(message)
            try:
                os.write(self._bell_write, b"x")
            except OSError:  # closed: the server is shutting down
                return

    def _dispatch(self, payload: Payload) -> int:
        """Runs or queues a request; returns 1 if it was answered now."""
        handler = self._handlers.get(payload.handle_name)
        if handler is None:
            reply = Payload(payload.handler, payload.handle_name, request_id=payload.request_id, kind=REPLY)
            reply.err = {
                "type": "KeyError",
                "message": f"model worker {self.worker_index} has no handler {payload.handle_name!r}; "
                f"registered: {sorted(self._handlers)}",
                "traceback": "",
            }
            self._send(wire.dumps(reply.to_wire()), payload.handle_name)
            return 1
        if handler.long_running:
            self._long_queue.put((payload, handler.fn))
            # The reply may be minutes away: confirm now, so the master can tell
            # a long request from a lost one.
            received = Payload(payload.handler, payload.handle_name, request_id=payload.request_id, kind=RECEIVED)
            self._send(wire.dumps(received.to_wire()), payload.handle_name)
            return 0
        self._send(self._reply(payload, handler.fn), payload.handle_name)
        return 1

    def _send(self, message: bytes, what: str) -> None:
        _send(self._send_socket, message, self.send_timeout, f"the reply to {what!r}")

    def _send_finished(self) -> int:
        n = 0
        while True:
            try:
                message = self._finished.get_nowait()
            except queue.Empty:
                return n
            self._send(message, "a long-running request")
            n += 1

    def _handle_incoming(self) -> int:
        n = 0
        for payload in self._receiver.receive_all():
            rid = payload.request_id
            if payload.kind == REQUEST:
                if payload.no_syn:
                    n += self._dispatch(payload)
                else:
                    self._awaiting_ack[rid] = payload
                    syn = Payload(payload.handler, payload.handle_name, request_id=rid, kind=SYN)
                    self._send(wire.dumps(syn.to_wire()), payload.handle_name)
            elif payload.kind == ACK:
                held = self._awaiting_ack.pop(rid, None)
                if held is None:
                    self._receiver.reject(f"an ack for unknown request {rid}")
                else:
                    n += self._dispatch(held)
            elif payload.kind == CANCEL:  # a SYN/ACK request the master gave up on: never run it
                self._awaiting_ack.pop(rid, None)
            else:
                self._receiver.reject(f"a {payload.kind!r} message sent to a worker")
        return n

    def serve(self, timeout: float = 0.05) -> int:
        """Waits up to `timeout` seconds for requests (or finished long
        requests), handles everything that is there, and returns the number
        of requests answered in this call."""
        handled = self._send_finished()
        if not handled:
            ready = dict(self._poller.poll(max(0, int(timeout * 1000))))
            if self._bell_read in ready:
                try:
                    while os.read(self._bell_read, 4096):
                        pass
                except BlockingIOError:
                    pass
        handled += self._send_finished()
        handled += self._handle_incoming()
        self.n_handled += handled
        return handled

    def close(self, join_timeout: float = 5.0) -> None:
        """Stops the long-running lane (waiting up to `join_timeout` for the
        request it runs), deregisters and closes the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._long_thread is not None:
            self._long_queue.put(None)
            self._long_thread.join(join_timeout)
            if self._long_thread.is_alive():
                logger.warning("model worker %d: a long-running request is still running at close", self.worker_index)
        try:
            self._send_finished()
        except TimeoutError:
            pass
        try:
            name_resolve.delete(self._barrier_key)
        except Exception as e:
            logger.debug("could not delete %s: %s", self._barrier_key, e)
        self._receiver.flush_log()
        self._recv_socket.close()
        self._send_socket.close()  # flushes replies for up to _REPLY_LINGER_MS
        self._context.term()
        os.close(self._bell_read)
        if self._long_thread is None or not self._long_thread.is_alive():
            os.close(self._bell_write)  # else the lane may still ring it; the fd must not be reused
