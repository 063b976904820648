"""A model worker's end of the request-reply stream: `NameResolvingReplyServer`.

It connects a DEALER (with a random routing id) to the master's
`master_send_<i>` and a PUSH to `master_recv`, joins the barrier (under
`<i>:<routing id>`), and answers requests from the thread that
calls `serve()`, the only one that touches its sockets (zmq sockets are not
thread-safe). Handlers are registered as:

- cheap (`long_running=False`, e.g. `spec`, `fetch`, `stats`): run inline in
  `serve()`, on the serving thread, and are answered at once;
- long (`long_running=True`, e.g. `train_step`, `inference`, `save`): run one
  at a time, in arrival order, on a single background thread. It hands each
  encoded reply back through a queue and rings a pipe that `serve()` polls,
  and `serve()` sends it. Meanwhile `serve()` keeps answering cheap requests,
  so a master can e.g. ask for stats while a train step runs. Cheap handlers
  must therefore not touch state a long handler is changing.
"""

from __future__ import annotations

import dataclasses
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import zmq

from realrl.base import name_resolve, names, wire
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
    REQUEST,
    SYN,
    Payload,
    Receiver,
    control_seals,
    master_send,
    new_routing_id,
    send_within,
)

logger = getLogger("request_reply_stream")

_REPLY_LINGER_MS = 1000  # a closing worker still flushes its last replies for this long


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
        for stream in (master_send(worker_index), MASTER_RECV):
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
        # A DEALER with a random identity: the master's ROUTER sends only to the
        # identity this worker registers in the barrier (docs/design.md §4).
        self.routing_id = new_routing_id()
        recv_socket = self._context.socket(zmq.DEALER)
        recv_socket.setsockopt(zmq.ROUTING_ID, self.routing_id)
        recv_socket.setsockopt(zmq.LINGER, 0)
        recv_socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
        recv_socket.connect(f"tcp://{requests_address}")
        self._send_socket = self._context.socket(zmq.PUSH)
        self._send_socket.setsockopt(zmq.LINGER, _REPLY_LINGER_MS)
        self._send_socket.connect(f"tcp://{replies_address}")
        self._to_worker, self._to_master = control_seals()  # docs/design.md §14
        self._receiver = Receiver(recv_socket, f"model worker {worker_index}", max_message_bytes, self._to_worker)
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
        self._barrier_key = name_resolve.add_subentry(key(BARRIER), f"{worker_index}:{self.routing_id.decode()}")
        logger.info("model worker %d connected to the master (%s, %s)", worker_index, requests_address, replies_address)

    @property
    def n_rejected(self) -> int:
        return self._receiver.n_rejected

    @property
    def n_forged(self) -> int:
        """Messages ignored for want of this trial's seal (docs/design.md §14)."""
        return self._receiver.n_forged

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
        send_within(self._send_socket, message, self.send_timeout, f"the reply to {what!r}", self._to_master)

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
