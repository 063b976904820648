"""Push-pull stream: rollout workers push trajectories to the trainers' pullers
(docs/design.md §4).

- `ZMQPuller` binds a ROUTER socket (127.0.0.1 in local mode; a free port when
  none is given) and `pull(timeout)` returns a batch of decoded messages;
  `pull_with_senders` also says who sent each, and `acknowledge(sender, obj)`
  answers that sender (docs/design.md §12: a trajectory counts as delivered
  only once the puller acknowledged it).
- `ZMQPusher` connects a DEALER socket; `push(obj, timeout)` blocks when the
  high-water marks (sender's + receiver's, plus the kernel's socket buffers)
  are full, which is how a slow trainer slows the rollout workers down;
  `wait_ack(timeout)` returns the puller's next acknowledgement.
- A puller with `report_rejects` lets its owner answer a frame it rejects
  (`RejectedFrame`) in order with the others; `AckedPusher`
  (realrl/system/acked_delivery.py) delivers over a `ZMQPusher` with many
  messages in flight and acknowledgements matched to keys, and sends what
  was queued together as one frame: a frame that decodes to a list is a
  batch, which the puller returns as its messages, in order.
- Messages travel in `realrl.base.wire` format (msgpack + raw array frames,
  never pickle). A message that does not decode or validate (garbage from a
  stray peer, a bad array frame, an oversized message) is dropped, counted in
  `n_rejected` and logged (rate-limited: `RateLimitedLog`, whose count of
  suppressed lines is reported by the next pull() once its interval has
  passed, or at close); the puller keeps running. (A
  message over twice the size limit is refused by zmq itself, which drops
  that connection instead of buffering it.)
- Sealed (docs/design.md §14): with the trial's stream key (`seal_key`; the
  name-resolving classes take this process's by default), a message is two
  ZMQ frames, the wire message and its seal, AES-GMAC of that frame under
  the key (computed over the buffer itself, no copy), and so is each
  acknowledgement, under a key of its own. A message without a seal, with a
  seal that does not match (tampered, or another trial's key) is refused
  before it is decoded: counted in `n_seal_refused`, apart from `n_rejected`
  and from the ledger, never acknowledged, never trained. An acknowledgement
  whose seal does not match is ignored and counted (`n_acks_refused`).
- `NameResolvingZmqPuller` registers its address under
  `names.push_pull_stream(exp, trial, "puller{i}")`; `NameResolvingZmqPusher`
  picks its puller with `grouping(pusher_count, puller_count)` and waits for
  that key. `puller_count` comes from the configuration, not from discovery,
  so a puller that starts late cannot change which puller a pusher uses.
"""

from __future__ import annotations

import hmac
import logging
import os
import threading
import time
from typing import Any

import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from realrl.base import name_resolve, names, network, trial_secret, wire
from realrl.base.logging import getLogger

logger = getLogger("push_pull_stream")

DEFAULT_HWM = 1000  # messages queued per socket before push blocks
DEFAULT_MAX_PULL = 1000  # messages one pull() returns at most
CLOSE_LINGER_S = 2.0  # a pusher's close() waits at most this long to flush queued messages


class RateLimitedLog:
    """Logs the first event and then at most one line per `interval` seconds;
    the events in between are counted, not logged. The count is always
    reported eventually: appended to the next line logged, or by `flush()`
    (call it when the owner closes) and `maybe_flush()` (call it from the
    owner's poll path: cheap, and logs only once `interval` has passed)."""

    def __init__(self, interval: float = 10.0, log: logging.Logger | None = None) -> None:
        self.interval = interval
        self._logger = log or logger
        self._last = -float("inf")  # when the last line was logged
        self._since = 0.0  # when counting the suppressed ones began (last line or flush)
        self._suppressed = 0
        self._last_suppressed: tuple[str, tuple] | None = None  # (msg, args) of the newest one counted
        self._lock = threading.Lock()  # flush() may come from another thread than warning()

    @property
    def suppressed(self) -> int:
        """Events counted but not yet reported."""
        return self._suppressed

    def warning(self, msg: str, *args: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last < self.interval:
                self._suppressed += 1
                self._last_suppressed = (msg, args)
                return
            if self._suppressed:
                msg += f" ({self._suppressed} similar messages suppressed in the last {now - self._since:.1f} s)"
            self._last = self._since = now
            self._suppressed, self._last_suppressed = 0, None
            self._logger.warning(msg, *args)

    def maybe_flush(self) -> None:
        """Reports the suppressed count once `interval` has passed since the last line."""
        if self._suppressed and time.monotonic() - self._last >= self.interval:
            self.flush()

    def flush(self) -> None:
        """Reports the suppressed count now, if there is one, with the newest suppressed message."""
        with self._lock:
            if not self._suppressed:
                return
            now = time.monotonic()
            msg, args = self._last_suppressed or ("", ())
            self._logger.warning(
                "%d similar messages suppressed in the last %.1f s; the last one: " + msg,
                self._suppressed,
                now - self._since,
                *args,
            )
            self._since, self._suppressed, self._last_suppressed = now, 0, None


class StreamSeal:
    """The seal of one direction of a stream: AES-256-GMAC of a frame (AES-GCM
    with the frame as associated data and nothing to encrypt), a random 96-bit
    nonce then the 16-byte tag: 28 bytes. AES-NI and carry-less multiply make it
    ~7x cheaper than HMAC-SHA256 on a 24 KB trajectory (docs/design.md §4).
    Each direction has a key of its own, derived from the trial's key, so no
    message can be passed off as one of the other direction. Random nonces
    are safe up to 2^32 messages a key (NIST SP 800-38D), far beyond a trial."""

    NONCE_BYTES = 12
    TAG_BYTES = NONCE_BYTES + 16

    def __init__(self, stream_key: bytes, direction: str):
        self._gmac = AESGCM(hmac.digest(stream_key, b"realrl/stream/" + direction.encode(), "sha256"))

    def tag(self, frame: Any) -> bytes:
        """The seal of `frame` (any buffer: bytes, memoryview, a zmq frame's buffer), no copy."""
        nonce = os.urandom(self.NONCE_BYTES)
        return nonce + self._gmac.encrypt(nonce, b"", frame)

    def verify(self, frame: Any, tag: Any) -> bool:
        tag = bytes(tag)  # 28 bytes
        if len(tag) != self.TAG_BYTES:
            return False
        try:
            self._gmac.decrypt(tag[: self.NONCE_BYTES], tag[self.NONCE_BYTES :], frame)
        except InvalidTag:
            return False
        return True


def _seals(seal_key: bytes | None) -> tuple[StreamSeal | None, StreamSeal | None]:
    """(trajectories' seal, acknowledgements' seal), or (None, None) without a key."""
    return (StreamSeal(seal_key, "push"), StreamSeal(seal_key, "ack")) if seal_key else (None, None)


def _trial_stream_key() -> bytes | None:
    keys = trial_secret.current()
    return keys.stream_mac_key if keys is not None else None


def grouping(num_pushers: int, num_pullers: int) -> dict[int, list[int]]:
    """Assigns pushers to pullers in contiguous blocks: puller i gets
    `num_pushers // num_pullers` pushers, and the first `num_pushers %
    num_pullers` pullers one more each. E.g. 7 pushers on 3 pullers ->
    {0: [0, 1, 2], 1: [3, 4], 2: [5, 6]}. With fewer pushers than pullers
    some pullers get none: the master builds each step's batch from what all
    ranks hold together, so a rank needs no pusher of its own."""
    if num_pullers < 1 or num_pushers < 1:
        raise ValueError(f"grouping needs at least one pusher and one puller, got {num_pushers} and {num_pullers}")
    per_puller, remainder = divmod(num_pushers, num_pullers)
    groups: dict[int, list[int]] = {}
    start = 0
    for puller in range(num_pullers):
        size = per_puller + (1 if puller < remainder else 0)
        groups[puller] = list(range(start, start + size))
        start += size
    return groups


def puller_of(pusher_index: int, num_pushers: int, num_pullers: int) -> int:
    """The puller `grouping` assigns `pusher_index` to."""
    if not 0 <= pusher_index < num_pushers:
        raise ValueError(f"pusher_index {pusher_index} is out of range for {num_pushers} pushers")
    for puller, pushers in grouping(num_pushers, num_pullers).items():
        if pusher_index in pushers:
            return puller
    raise AssertionError("unreachable: grouping covers every pusher")


class ZMQPusher:
    """Connects a DEALER socket to a puller at `host:port` (one peer: every
    message goes to that puller, and its acknowledgements come back here)."""

    def __init__(self, host: str, port: int, hwm: int = DEFAULT_HWM, seal_key: bytes | None = None) -> None:
        self.address = f"{host}:{port}"
        self._seal, self._ack_seal = _seals(seal_key)
        self.n_acks_refused = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.SNDHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, int(CLOSE_LINGER_S * 1000))  # zmq's default waits forever
        self._socket.connect(f"tcp://{self.address}")
        self.n_pushed = 0

    def push(self, obj: Any, timeout: float | None = None) -> None:
        """Sends `obj` (see `realrl.base.wire` for what may be sent). Blocks
        while the queues are full; with `timeout` (seconds) raises TimeoutError
        if the message could not be queued in time (it is then not sent).
        `obj` is serialized into a new buffer first, so the caller may modify
        it as soon as push returns."""
        message = wire.dumps(obj)
        if timeout is not None:
            self._send(message, timeout)
            return
        self._send_parts(message, 0)
        self.n_pushed += 1

    def wait_ack(self, timeout: float) -> Any:
        """The puller's next acknowledgement (decoded), waiting up to `timeout`
        seconds; TimeoutError if none came. A malformed one raises WireFormatError;
        one whose seal does not match is ignored and counted (`n_acks_refused`)."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = max(0.0, deadline - time.monotonic())
            if not self._socket.poll(int(remaining * 1000), zmq.POLLIN):
                raise TimeoutError(f"no acknowledgement from the puller at {self.address} within {timeout}s")
            parts = self._socket.recv_multipart(copy=False)
            if self._ack_seal is None:
                return wire.loads(parts[0])
            if len(parts) == 2 and self._ack_seal.verify(parts[0].buffer, parts[1].buffer):
                return wire.loads(parts[0])
            self.n_acks_refused += 1
            logger.warning("pusher to %s ignored an acknowledgement without a valid seal", self.address)

    def _send(self, message: Any, timeout: float, track: bool = False) -> zmq.MessageTracker | None:
        """One message, within `timeout` seconds (TimeoutError: the queues are full). `track`:
        returns the tracker of the zero-copy send of `message`, done once zmq let go of its bytes."""
        seal = None if self._seal is None else self._seal.tag(message)  # (once: a retry sends the same)
        deadline = time.monotonic() + timeout
        while True:
            try:
                tracker = self._send_parts(message, zmq.NOBLOCK, seal, track)
                break
            except zmq.Again:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._socket.poll(max(1, int(remaining * 1000)), zmq.POLLOUT):
                    raise TimeoutError(
                        f"push to {self.address} timed out after {timeout}s: the puller is not "
                        "reading (high-water mark reached)"
                    ) from None
        self.n_pushed += 1
        return tracker

    def _send_parts(
        self, message: Any, flags: int, seal: bytes | None = None, track: bool = False
    ) -> zmq.MessageTracker | None:
        """One message: the wire frame, then its seal (zmq delivers a multipart message whole or
        not at all: once it took the first part it takes the rest). Unsealed, one `send`:
        `send_multipart` costs a few µs of Python per message."""
        if self._seal is None:
            return self._socket.send(message, flags=flags, copy=False, track=track)
        seal = self._seal.tag(message) if seal is None else seal
        tracker = self._socket.send(message, flags=flags | zmq.SNDMORE, copy=False, track=track)
        self._socket.send(seal, flags=flags, copy=False)
        return tracker

    def close(self, linger: float = CLOSE_LINGER_S) -> None:
        """Closes the socket, first trying for up to `linger` seconds to
        deliver what is still queued (bounded, so close never hangs)."""
        if not self._socket.closed:
            self._socket.close(linger=int(linger * 1000))
            self._context.term()


class RejectedFrame:
    """In `ZMQPuller.pull_with_senders`'s result (with `report_rejects`): a
    frame that did not decode, in its place among the messages."""

    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def __repr__(self) -> str:
        return f"RejectedFrame({self.reason!r})"


class ZMQPuller:
    """Binds a ROUTER socket on `host:port` (a free port chosen by the OS when
    `port` is None) and decodes what arrives; it may answer each sender."""

    def __init__(
        self,
        host: str = network.LOOPBACK,
        port: int | None = None,
        hwm: int = DEFAULT_HWM,
        max_message_bytes: int = wire.DEFAULT_MAX_MESSAGE_BYTES,
        max_pull: int = DEFAULT_MAX_PULL,
        seal_key: bytes | None = None,
        report_rejects: bool = False,
    ) -> None:
        """`report_rejects`: `pull_with_senders` returns a frame it rejects
        as `(sender, RejectedFrame(reason))` in its place among the messages,
        so that its sender can be answered in order (`pull` never does)."""
        if host in ("0.0.0.0", "*", ""):
            raise ValueError(f"refusing to bind {host!r}: bind a concrete address (127.0.0.1 in local mode)")
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.RCVHWM, hwm)
        self._socket.setsockopt(zmq.LINGER, 0)  # a puller has nothing to flush
        # Memory backstop: zmq drops a peer whose message exceeds twice the limit before
        # buffering it. Messages between the limit and that are received, rejected and counted.
        self._socket.setsockopt(zmq.MAXMSGSIZE, 2 * max_message_bytes)
        try:
            self._socket.bind(f"tcp://{host}:{'*' if port is None else port}")
        except zmq.ZMQError:
            self._socket.close()
            self._context.term()
            raise
        endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)  # tcp://host:port
        self.host = host
        self.port = int(endpoint.rsplit(":", 1)[1])
        self.address = f"{host}:{self.port}"
        self.max_message_bytes = max_message_bytes
        self.max_pull = max_pull
        self.n_received = 0
        self.n_rejected = 0
        self.report_rejects = report_rejects
        self._seal, self._ack_seal = _seals(seal_key)
        self.n_seal_refused = 0  # no seal, or one that does not match: not from this trial
        self._reject_log = RateLimitedLog()
        self._rcvtimeo_ms: int | None = None

    def pull(self, timeout: float = 1.0, max_count: int | None = None) -> list:
        """Waits up to `timeout` seconds for a message, then also takes every
        message already queued (up to `max_count`, default `max_pull`).
        Returns the decoded messages, [] if none arrived in time."""
        return [msg for _, msg in self.pull_with_senders(timeout, max_count) if not isinstance(msg, RejectedFrame)]

    def pull_with_senders(self, timeout: float = 1.0, max_count: int | None = None) -> list[tuple[bytes, Any]]:
        """`pull`, each message with its sender's routing id (for `acknowledge`)."""
        limit = self.max_pull if max_count is None else max_count
        socket = self._socket
        # Wait in a blocking recv with a receive timeout, then look at EVENTS before each
        # further recv: both are far cheaper per message than poll() plus the zmq.Again
        # exception a non-blocking recv raises on an empty queue.
        timeout_ms = max(0, int(timeout * 1000))
        if timeout_ms != self._rcvtimeo_ms:
            socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
            self._rcvtimeo_ms = timeout_ms
        out: list[tuple[bytes, Any]] = []
        rejected_before = self.n_rejected
        try:
            sender = socket.recv(copy=True)  # ROUTER: the peer's routing id, then its frames
        except zmq.Again:
            self._reject_log.maybe_flush()
            return out
        while True:
            frame = socket.recv(copy=False) if socket.getsockopt(zmq.RCVMORE) else None
            if frame is None:
                self._reject(sender, "an empty message", out)
            elif self._seal is not None:
                tag = socket.recv(copy=False) if frame.more else None
                if tag is not None and tag.more:  # more than a frame and its seal: drain the rest
                    while socket.recv(copy=False).more:
                        pass
                    tag = None
                if tag is None or not self._seal.verify(frame.buffer, tag.buffer):
                    # (not answered: an unsealed sender is not of this trial)
                    self._refuse_seal("no seal" if tag is None else "a seal that does not match")
                else:
                    self._take(sender, frame, out)
            elif frame.more:  # streams send one frame per message: a multipart one is not ours
                while socket.recv(copy=False).more:  # the rest of a multipart message is already here
                    pass
                self._reject(sender, "a multipart message (realrl streams send single frames)", out)
            else:
                self._take(sender, frame, out)
            if len(out) >= limit or not socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                break
            try:
                sender = socket.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
        self.n_received += len(out) - (self.n_rejected - rejected_before if self.report_rejects else 0)
        self._reject_log.maybe_flush()
        return out

    def _take(self, sender: bytes, frame: Any, out: list) -> None:
        """Decodes one frame into `out`: a list is a batch, its messages in order (`AckedPusher`
        sends what was queued together as one frame); anything else one message."""
        try:
            message = wire.loads(frame, self.max_message_bytes)
        except wire.WireFormatError as e:
            self._reject(sender, str(e), out)
            return
        if type(message) is list:
            out.extend((sender, m) for m in message)
        else:
            out.append((sender, message))

    def has_queued(self) -> bool:
        """Is a message waiting to be read (from any sender)?"""
        return bool(self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def acknowledge(self, sender: bytes, obj: Any) -> None:
        """Sends `obj` back to `sender` (dropped if that peer is gone or not reading)."""
        ack = wire.dumps(obj)
        parts = [sender, ack] if self._ack_seal is None else [sender, ack, self._ack_seal.tag(ack)]
        try:
            self._socket.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            pass

    def _refuse_seal(self, what: str) -> None:
        self.n_seal_refused += 1
        self._reject_log.warning(
            "puller %s refused a message with %s (%d refused so far): not from this trial",
            self.address,
            what,
            self.n_seal_refused,
        )

    def _reject(self, sender: bytes, reason: str, out: list) -> None:
        self.n_rejected += 1
        self._reject_log.warning(
            "puller %s rejected a malformed message (%d rejected so far): %s", self.address, self.n_rejected, reason
        )
        if self.report_rejects:  # its sender is answered in its turn, not left waiting
            out.append((sender, RejectedFrame(reason)))

    def close(self) -> None:
        self._reject_log.flush()
        if not self._socket.closed:
            self._socket.close()
            self._context.term()


class NameResolvingZmqPuller(ZMQPuller):
    """A puller registered as `push_pull_stream/puller{puller_index}`."""

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        puller_index: int,
        host: str | None = None,
        bind_retries: int = 5,
        **kwargs: Any,
    ) -> None:
        host = host or network.bind_address("local")
        kwargs.setdefault("seal_key", _trial_stream_key())  # this process's trial key (None: unsealed)
        for attempt in range(bind_retries):
            # A port claimed in name_resolve, so no other process of the trial is handed it.
            port = network.find_free_port(experiment_name, trial_name, host=host)
            try:
                super().__init__(host, port, **kwargs)
                break
            except zmq.ZMQError as e:  # taken by a process outside the trial meanwhile
                if attempt == bind_retries - 1:
                    raise
                logger.info("port %d was taken (%s), trying another", port, e)
        self.name = names.push_pull_stream(experiment_name, trial_name, f"puller{puller_index}")
        # replace=True: a restarted puller takes over its index.
        name_resolve.add(self.name, self.address, replace=True)
        logger.info("puller %d listening on %s", puller_index, self.address)

    def close(self) -> None:
        if not self._socket.closed:
            try:
                name_resolve.delete(self.name)
            except name_resolve.NameEntryNotFoundError:
                pass
            except Exception as e:  # name service already gone at shutdown
                logger.debug("could not delete %s: %s", self.name, e)
        super().close()


class NameResolvingZmqPusher(ZMQPusher):
    """A pusher connected to the puller `grouping` assigns it to."""

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        pusher_index: int,
        pusher_count: int,
        puller_count: int,
        timeout: float = 300.0,
        **kwargs: Any,
    ) -> None:
        self.puller_index = puller_of(pusher_index, pusher_count, puller_count)
        key = names.push_pull_stream(experiment_name, trial_name, f"puller{self.puller_index}")
        try:
            address = name_resolve.wait(key, timeout=timeout)
        except TimeoutError:
            raise TimeoutError(
                f"pusher {pusher_index}: puller {self.puller_index} did not register {key!r} within {timeout}s"
            ) from None
        host, port = address.rsplit(":", 1)
        kwargs.setdefault("seal_key", _trial_stream_key())
        super().__init__(host, int(port), **kwargs)
        logger.info("pusher %d -> puller %d at %s", pusher_index, self.puller_index, address)
