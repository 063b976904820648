"""The master's end of the request-reply stream: `NameResolvingRequestClient`.

It binds a ROUTER socket per model worker and one PULL for every reply,
registers them in name_resolve and waits until each worker has joined the
barrier, naming the routing id of its connection: requests go to that
connection only, so a stray one to a request socket gets none (a PULL is
refused at the handshake, a DEALER is never addressed). Requests are
routed by handler (a worker index, `"__data<dp>__"` or a shard id) and
awaited on the master's asyncio loop: one pump task per loop drains the
reply socket and wakes the waiting calls. Every wait has a timeout; a
request no worker confirms is warned about and then fails as
`RequestLost`, and a handler's exception is raised here as `RemoteError`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq
import zmq.asyncio

from realrl.base import name_resolve, names, network, wire
from realrl.base.logging import getLogger
from realrl.system.request_reply_stream.protocol import (
    ACK,
    BARRIER,
    CANCEL,
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_SEND_TIMEOUT,
    MASTER_RECV,
    RECEIVED,
    REPLY,
    SYN,
    Payload,
    Receiver,
    control_seals,
    master_send,
    send_routed_within,
)

logger = getLogger("request_reply_stream")

DEFAULT_WARN_AFTER = 10.0  # seconds without a worker's confirmation before we say so
DEFAULT_RECEIPT_TIMEOUT = 60.0  # seconds without it before the call fails
RUNNING_WARN_INTERVAL = 600.0  # seconds between "still running" warnings of a confirmed request
_WAIT_SLICE = 0.5  # seconds: how often a waiting call looks at its requests' age


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


class NameResolvingRequestClient:
    """The master's end, used from one asyncio loop at a time; many requests
    may be in flight at once."""

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
        self._routing_ids: dict[int, bytes] = {}  # worker -> the routing id of its request connection
        self._barrier_read_at = 0.0
        self._keys: list[str] = []
        try:
            for i in range(n_subscribers):
                sock = self._context.socket(zmq.ROUTER)
                sock.setsockopt(zmq.LINGER, 0)  # nothing to flush: an unsent request is a failed request
                sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a peer not connected fails, never drops
                # Workers never send on it: what a stray peer sends is bounded, then dropped.
                sock.setsockopt(zmq.MAXMSGSIZE, 4096)
                sock.setsockopt(zmq.RCVHWM, 16)
                self._send_sockets.append(sock)
                address = _bind_claimed_port(sock, host, experiment_name, trial_name)
                name_resolve.add(key(master_send(i)), address, replace=True)
                self._keys.append(key(master_send(i)))
            recv_socket = self._context.socket(zmq.PULL)
            recv_socket.setsockopt(zmq.LINGER, 0)
            recv_socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)  # memory backstop, see push_pull_stream
            self.recv_address = _bind_claimed_port(recv_socket, host, experiment_name, trial_name)
            name_resolve.add(key(MASTER_RECV), self.recv_address, replace=True)
            self._keys.append(key(MASTER_RECV))
            self._to_worker, self._to_master = control_seals()  # docs/design.md §14
            self._receiver = Receiver(recv_socket, f"master {self.recv_address}", max_message_bytes, self._to_master)
            self._recv_socket = recv_socket
            self._barrier = key(BARRIER)
            self._wait_for_workers(self._barrier, connect_timeout)
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

    @property
    def n_forged(self) -> int:
        """Replies ignored for want of this trial's seal (docs/design.md §14)."""
        return self._receiver.n_forged

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
            self._read_barrier(barrier)
            missing = sorted(set(range(self.n_subscribers)) - set(self._routing_ids))
            if not missing:
                return
            if time.monotonic() >= deadline:
                raise TimeoutError(f"model workers {missing} did not connect to the request stream within {timeout}s")
            if self._interrupt is not None:
                self._interrupt()
            time.sleep(0.05)

    def _read_barrier(self, barrier: str) -> None:
        """The routing id each worker registered ("<worker index>:<routing
        id>"); a restarted worker registers a new one."""
        for value in name_resolve.get_subtree(barrier):
            index, _, routing_id = value.partition(":")
            if index.isdigit() and int(index) < self.n_subscribers and routing_id:
                self._routing_ids[int(index)] = routing_id.encode()

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

    async def _send_requests(
        self, handlers: Sequence[int | str], handle_name: str, datas: Sequence[Any] | None, no_syn: bool
    ) -> list[str]:
        """Routes, encodes and sends one request per handler. Waits for a full
        queue or a missing peer (a worker that just died) without blocking the
        event loop, so the caller can be cancelled meanwhile."""
        prepared = self._prepare_requests(handlers, handle_name, datas, no_syn)
        for payload, message, worker in prepared:
            self._track(payload, worker)
            what = f"{handle_name!r} to model worker {worker}"
            deadline = time.monotonic() + self.send_timeout
            while True:
                try:  # (one non-blocking try; the waiting happens here, off the event loop's back)
                    send_routed_within(
                        self._send_sockets[worker], self._routing_ids[worker], message, 0, what, self._to_worker
                    )
                    break
                except TimeoutError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"could not send {what} within {self.send_timeout}s (peer not connected or not reading)"
                        ) from None
                    if time.monotonic() - self._barrier_read_at > 1.0:  # the worker may have restarted
                        self._barrier_read_at = time.monotonic()
                        await asyncio.to_thread(self._read_barrier, self._barrier)
                    await asyncio.sleep(0.02)
        return [p.request_id for p, _, _ in prepared]

    def _send_control(self, kind: str, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            handler, handle_name, worker = self._inflight[rid]
            message = wire.dumps(Payload(handler, handle_name, request_id=rid, kind=kind).to_wire())
            send_routed_within(
                self._send_sockets[worker],
                self._routing_ids[worker],
                message,
                self.send_timeout,
                f"{kind} of {handle_name!r} to model worker {worker}",
                self._to_worker,
            )

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
                f"no model worker confirmed {what} within {self.receipt_timeout:.0f}s: the worker is gone or stalled"
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

    async def _wait(self, kind: str, ids: list[str], arrived: Callable[[str], bool], deadline: float) -> list[str]:
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
        """The results of `request_ids`, in that order; other coroutines run
        while it waits. Raises RemoteError for the first that failed remotely,
        TimeoutError naming what is missing."""
        request_ids = list(request_ids)
        missing = await self._wait(REPLY, request_ids, self._replies.__contains__, time.monotonic() + timeout)
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
        """Sends one request per handler (`datas[i]` to `handlers[i]`) and
        returns their ids. With `no_syn=False`, returns only after every target
        worker has confirmed receipt and been told to start (SYN/ACK)."""
        ids = await self._send_requests(handlers, handle_name, datas, no_syn)
        if not no_syn:
            missing = await self._wait(SYN, ids, self._syns.__contains__, time.monotonic() + timeout)
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
        """request_async + gather_async; `timeout` covers the whole call. Many
        may run concurrently."""
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
