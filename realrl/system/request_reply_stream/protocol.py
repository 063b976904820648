"""The request-reply stream's messages and the socket plumbing both of its
ends share: `Payload` (one message, checked on arrival), the stream names,
a bounded send, and a receiver that drops and counts malformed messages."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

import zmq

from realrl.base import trial_secret, wire
from realrl.system.push_pull_stream import RateLimitedLog, StreamSeal

BARRIER = "barrier"
REQUEST, ACK, CANCEL, SYN, RECEIVED, REPLY = "request", "ack", "cancel", "syn", "received", "reply"
_KINDS = (REQUEST, ACK, CANCEL, SYN, RECEIVED, REPLY)
DEFAULT_CONNECT_TIMEOUT = 300.0  # seconds for the two ends to find each other
DEFAULT_SEND_TIMEOUT = 30.0  # seconds a send may wait for a full queue or a connection
MASTER_RECV = "master_recv"


def master_send(i: int) -> str:
    """The stream name of the master's requests to model worker i."""
    return f"master_send_{i}"


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


def control_seals() -> tuple[StreamSeal | None, StreamSeal | None]:
    """(the seal of messages to the workers, the seal of messages to the master),
    under this process's trial control key (docs/design.md §14); (None, None)
    when security is off."""
    keys = trial_secret.current()
    if keys is None:
        return None, None
    return StreamSeal(keys.control_key, "to-worker"), StreamSeal(keys.control_key, "to-master")


def sealed(message: bytes, seal: StreamSeal | None) -> list:
    """The frames of one message: it, and its seal when there is one."""
    return [message] if seal is None else [message, seal.tag(message)]


def send_within(socket: zmq.Socket, message: bytes, timeout: float, what: str, seal: StreamSeal | None = None) -> None:
    """Queues `message` (and its seal), waiting up to `timeout` for room or a connection."""
    parts = sealed(message, seal)
    try:
        socket.send_multipart(parts, zmq.NOBLOCK, copy=False)
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
                socket.send_multipart(parts, zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                continue


def send_routed_within(
    socket: zmq.Socket, routing_id: bytes, message: bytes, timeout: float, what: str, seal: StreamSeal | None = None
) -> bool:
    """Queues `message` on a ROUTER socket (ROUTER_MANDATORY) for the peer
    `routing_id`, waiting up to `timeout` for room or for that peer to be
    connected (it may still be completing its handshake, or reconnecting).
    Never sends to anyone else. Returns True if it had to wait."""
    deadline = time.monotonic() + timeout
    waited = False
    parts = [routing_id, *sealed(message, seal)]
    while True:
        try:
            socket.send_multipart(parts, zmq.NOBLOCK, copy=False)
            return waited
        except zmq.Again:
            pass
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
        if time.monotonic() >= deadline:
            raise TimeoutError(f"could not send {what} within {timeout}s (peer not connected or not reading)")
        waited = True
        time.sleep(0.01)


def new_routing_id() -> bytes:
    """A model worker process's identity on its request socket: random, so a
    stray connection cannot be addressed by the master by chance."""
    return uuid.uuid4().hex.encode()


class Receiver:
    """Receive side shared by both ends: checks the seal (with `seal`), decodes,
    validates and counts rejects. A message without the trial's seal is not
    decoded: it is ignored and counted in `n_forged` (docs/design.md §14)."""

    def __init__(self, socket: zmq.Socket, where: str, max_message_bytes: int, seal: StreamSeal | None = None) -> None:
        self.socket = socket
        self.where = where
        self.max_message_bytes = max_message_bytes
        self.seal = seal
        self.n_rejected = 0
        self.n_forged = 0
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
            if self.seal is not None:
                tag = self.socket.recv(copy=False) if frame.more else None
                if tag is not None and tag.more:
                    while self.socket.recv(copy=False).more:
                        pass
                    tag = None
                if tag is None or not self.seal.verify(frame.buffer, tag.buffer):
                    self.n_forged += 1
                    self._log.warning(
                        "%s ignored a message without this trial's seal (%d so far)", self.where, self.n_forged
                    )
                    continue
            elif frame.more:
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
