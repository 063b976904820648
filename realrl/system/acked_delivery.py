"""Acknowledged delivery over the push-pull stream (docs/design.md §4, §12):
`AckedPusher` keeps a window of messages in flight over one `ZMQPusher`,
matches the puller's acknowledgements to their keys, sends again what stays
unanswered and gives up loudly (`PushNotAcknowledged`). The rollout worker
delivers its trajectories through it."""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import io
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import zmq

from realrl.base import wire
from realrl.system.push_pull_stream import RateLimitedLog, ZMQPusher, logger

ACK_RESEND_S = 30.0  # a message is sent again when unacknowledged this long (then 2x, 4x, ...)
ACK_GIVE_UP_S = 900.0  # ... and everything in flight fails once one is unacknowledged this long
MAX_BATCH = 64  # messages queued together go as one frame, at most this many
WINDOW_BYTES = 64 << 20  # frames sent and not all answered, at most this many bytes (at least one frame)
SPARE_BYTES = 64 << 20  # frame buffers kept for the next frames, at most this many bytes


class PushNotAcknowledged(RuntimeError):
    """No acknowledgement of a pushed message came within `ACK_GIVE_UP_S`."""


class _Request:
    """One `submit`: its messages, and the acknowledgements that came for them."""

    __slots__ = ("future", "messages", "keys", "in_order", "acks", "unanswered", "next")

    def __init__(self, future: concurrent.futures.Future, messages: list, keys: list, in_order: bool):
        self.future, self.messages, self.keys, self.in_order = future, messages, keys, in_order
        self.acks: list = [None] * len(messages)
        self.unanswered = len(messages)
        self.next = 0  # the first message not yet in a frame


class _Member:
    """A message sent in a frame and not yet acknowledged."""

    __slots__ = ("key", "request", "position", "frame", "answered")

    def __init__(self, key: Hashable, request: _Request, position: int):
        self.key, self.request, self.position = key, request, position
        self.frame: _Frame | None = None
        self.answered = False


class _Frame:
    """One zmq message on the wire: one message, or several queued together (a batch)."""

    __slots__ = ("members", "data", "buffer", "trackers", "seq", "first_sent", "next_send", "interval", "unanswered")

    def __init__(self, members: list[_Member], data: memoryview, buffer: io.BytesIO):
        self.members, self.data, self.buffer = members, data, buffer
        self.trackers: list = []  # of the zero-copy sends of `data` (a copy sent again adds one)
        self.seq, self.first_sent, self.next_send, self.interval = -1, 0.0, 0.0, 0.0
        self.unanswered = len(members)
        for member in members:
            member.frame = self

    def sent_out(self) -> bool:
        """Has zmq let go of `data` (every send of it)?"""
        return all(tracker is None or tracker.done for tracker in self.trackers)


class AckedPusher:
    """Delivery with acknowledgements over one `ZMQPusher`, a window of
    messages in flight. `submit(messages, keys)` returns one future for the
    call, which resolves to the list of their acknowledgements: an
    acknowledgement `{"rollout_id", "index", "verdict", ...}` (or a list of
    them: the puller answers a whole pull in one message, in the order it
    received them) answers the oldest message in flight submitted under that
    key `(rollout_id, index)`, and is its entry, whole, in the list. (One
    future per call, not per message: a future, made, resolved and read,
    costs about as much as encoding a trajectory.)

    Messages queued together go as one frame (a batch: the wire list of
    them, which the puller reads as that many messages in order; at most
    `MAX_BATCH`), so a burst of trajectories costs one zmq message, one seal
    and one decode, not one each. A keyless `rejected` (the puller could not
    decode a frame, so it has no key) answers every unanswered message of
    the oldest frame with an unanswered message: the puller answers a
    connection's frames in the order they came, so every message of every
    frame sent before it was answered already (unless an answer was lost in
    a reconnect: then this one is misattributed, and the rejected frame is
    sent again and rejected again later). Messages submitted with
    `in_order=False` each go in a frame of their own.

    One thread of its own is the only one that touches the socket: it sends
    whatever is queued and reads acknowledgements as they come. One message
    per round trip (push, wait for its acknowledgement, push the next) capped
    the stream at two process wake-ups per message, which on a busy machine
    cost more than encoding, sending and decoding it. The window: frames sent
    and not all answered hold at most `window_bytes` (at least one frame);
    more waits in the queue until answers make room. A frame is encoded into
    a buffer that is used again once its frame is answered and zmq let go of
    it (a fresh large buffer per frame is memory the kernel maps and zeroes
    page by page: it cost more than the encoding); the window keeps those
    buffers few. Under back-pressure (the window is full, or the high-water
    marks are) the queue waits, as long as it takes, and the thread still
    reads acknowledgements.

    Each frame sent has its own timers: with a message unacknowledged
    `resend_s` after a send it is sent again whole (then after twice as
    long, ...: an acknowledgement sent to a routing id the puller no longer
    knows, after a reconnect, is lost; the puller answers a second copy
    `duplicate`, and the copies of messages answered meanwhile count as
    acknowledgements of nothing in flight), and once one is unacknowledged
    `give_up_s` after its frame's first send, every future fails with
    `PushNotAcknowledged` (the puller reads nothing, or its answers are
    lost: the owner fails loudly). Acknowledgements of nothing in flight are
    counted (`n_unknown_acks`) and ignored. `should_stop` is asked every
    `poll_s` seconds while something waits; once it says so, or `close()`
    was called, every future not yet resolved fails with RuntimeError (what
    was sent may still be taken by the puller: exactly-once does not rest on
    the future, §12)."""

    def __init__(
        self,
        pusher: ZMQPusher,
        poll_s: float = 1.0,
        should_stop: Callable[[], bool] | None = None,
        log: logging.Logger | None = None,
        resend_s: float = ACK_RESEND_S,
        give_up_s: float = ACK_GIVE_UP_S,
        max_batch: int = MAX_BATCH,
        window_bytes: int = WINDOW_BYTES,
    ) -> None:
        self.pusher = pusher
        self.poll_s = poll_s
        self.resend_s = resend_s
        self.give_up_s = give_up_s
        self.max_batch = max_batch
        self.window_bytes = window_bytes
        self._should_stop = should_stop or (lambda: False)
        self._logger = log or logger
        self._lock = threading.Lock()  # submit() against the thread's exit
        self._queue: collections.deque[_Request] = collections.deque()  # submitted, not all in frames yet
        self._blocked: _Frame | None = None  # encoded, not yet taken by the socket (back-pressure)
        self._waiting: dict[Hashable, collections.deque[_Member]] = {}  # sent, unanswered, by key
        self._unanswered: dict[int, _Frame] = {}  # frames with a message unanswered, by sequence number, in send order
        self._bytes_unanswered = 0  # of those frames
        self._spare: list[tuple[io.BytesIO, int]] = []  # frame buffers free for the next frames, with their size
        self._spare_bytes = 0
        self._returning: collections.deque[_Frame] = collections.deque()  # answered, zmq may still read their data
        self._n_submitted = 0  # messages submitted (under the lock) ...
        self._n_settled = 0  # ... and answered or dropped (the thread)
        self._resends: list[tuple[float, int]] = []  # heap of (when to send again, frame sequence number)
        self._seq = itertools.count()
        self.n_resent = 0  # frames sent again for want of an acknowledgement
        self.n_frames = 0  # frames sent (a batch is one)
        self.n_buffers = 0  # frame buffers made (the others were used again)
        self.n_unknown_acks = 0  # acknowledgements of no message in flight (e.g. of a copy sent again)
        self._resend_log = RateLimitedLog(log=self._logger)
        self._unknown_ack_log = RateLimitedLog(log=self._logger)
        self._closed: str | None = None  # why no more futures are resolved
        self._failure: type[RuntimeError] = RuntimeError  # what the unresolved futures fail with
        self._wake_r, self._wake_w = os.pipe()  # submit() wakes the thread out of its poll
        os.set_blocking(self._wake_w, False)
        self._thread = threading.Thread(target=self._run, name="push", daemon=True)
        self._thread.start()

    @property
    def in_flight(self) -> int:
        """Messages queued or sent and not yet acknowledged."""
        return self._n_submitted - self._n_settled

    def submit(
        self, messages: Sequence[Any], keys: Sequence[Hashable], in_order: bool = True
    ) -> concurrent.futures.Future:
        """Queues `messages`, the i-th under `keys[i]`; the future resolves to the list of
        their acknowledgements (dicts, in the order of `messages`) once every one is
        answered, or fails (closed, exiting, PushNotAcknowledged, a message that does not
        encode: then the rest of the call is not sent). `in_order=False`: the puller may
        answer them after messages sent later (a question it answers once it read what else
        waits), so each goes alone and a keyless rejection is never theirs."""
        messages, keys = list(messages), list(keys)
        if len(messages) != len(keys):
            raise ValueError(f"submit: {len(messages)} messages but {len(keys)} keys")
        future: concurrent.futures.Future = concurrent.futures.Future()
        if not messages:
            future.set_result([])
            return future
        with self._lock:
            if self._closed is not None:
                future.set_exception(self._failure(self._closed))
                return future
            idle = not self._queue  # else the thread is sending and takes this one too
            self._queue.append(_Request(future, messages, keys, in_order))
            self._n_submitted += len(messages)
        if idle:
            try:
                os.write(self._wake_w, b"w")
            except BlockingIOError:  # the pipe is full of wake-ups the thread has not read yet: it will
                pass
        return future

    def close(self, reason: str = "the pusher was closed") -> None:
        """Fails what is still unresolved with `reason` and stops the thread
        (the ZMQPusher stays open: its owner closes it)."""
        with self._lock:
            if self._closed is None:
                self._closed = reason
        try:
            os.write(self._wake_w, b"c")
        except (BlockingIOError, OSError):
            pass
        self._thread.join()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _run(self) -> None:
        socket = self.pusher._socket
        poller = zmq.Poller()
        poller.register(socket, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        blocked_since: float | None = None
        try:
            while True:
                with self._lock:
                    if self._closed is None and self._should_stop():
                        self._closed = "worker exiting while trajectories were waiting for the trainer"
                    if self._closed is not None:
                        break
                now = time.monotonic()
                blocked = self._send_queued(now) or self._send_again(now)
                self._give_up_if_due(now)
                if blocked and blocked_since is None:
                    blocked_since = now
                    poller.modify(socket, zmq.POLLIN | zmq.POLLOUT)
                elif not blocked and blocked_since is not None:
                    blocked_since = None
                    poller.modify(socket, zmq.POLLIN)
                timeout = self.poll_s
                if self._resends and not blocked:  # (blocked: POLLOUT wakes it)
                    timeout = min(timeout, max(0.0, self._resends[0][0] - now))
                events = dict(poller.poll(int(timeout * 1000)))
                if self._wake_r in events:
                    os.read(self._wake_r, 65536)
                if events.get(socket, 0) & zmq.POLLIN:
                    self._read_acks()
                if blocked_since is not None and not events:
                    waited = time.monotonic() - blocked_since
                    if waited % 30 < self.poll_s:
                        self._logger.info("push blocked for %.0fs: the trainer is not pulling (back-pressure)", waited)
        except PushNotAcknowledged as e:
            with self._lock:
                self._closed, self._failure = str(e), PushNotAcknowledged
            self._logger.error("%s", e)
        finally:
            self._resend_log.flush()
            self._unknown_ack_log.flush()
            self._fail_all(self._closed or "the push thread stopped")

    def _send_queued(self, now: float) -> bool:
        """Sends what is queued while the window has room; True if the high-water marks stopped it."""
        while True:
            frame = self._blocked
            if frame is None:
                if self._unanswered and self._bytes_unanswered >= self.window_bytes:
                    return False  # an answer makes room (the thread polls for it)
                frame = self._next_frame()
                if frame is None:
                    return False
            try:
                frame.trackers.append(self.pusher._send(frame.data, 0, track=True))
            except TimeoutError:
                self._blocked = frame  # encoded once: sent as it is once the socket takes it
                return True
            self._blocked = None
            self.n_frames += 1
            frame.seq, frame.first_sent = next(self._seq), now
            frame.interval, frame.next_send = self.resend_s, now + self.resend_s
            for member in frame.members:
                self._waiting.setdefault(member.key, collections.deque()).append(member)
            self._unanswered[frame.seq] = frame
            self._bytes_unanswered += frame.data.nbytes
            heapq.heappush(self._resends, (frame.next_send, frame.seq))

    def _next_frame(self) -> _Frame | None:
        """The next frame of what is queued, encoded (None: nothing queued that is still wanted)."""
        queue = self._queue
        while queue:
            members: list[_Member] = []
            messages: list = []
            while queue and len(members) < self.max_batch:
                request = queue[0]
                # An out-of-order message goes alone: it waits for the next frame untouched
                # (its future is marked running once, when its first message is taken).
                if members and not request.in_order:
                    break
                if request.next == 0 and not request.future.set_running_or_notify_cancel():
                    queue.popleft()  # cancelled (the episode was) before any of it was sent
                    self._n_settled += len(request.messages)
                    continue
                if request.future.done():  # failed: a message of it did not encode
                    queue.popleft()
                    self._n_settled += len(request.messages) - request.next
                    continue
                start = request.next
                stop = (
                    start + 1
                    if not request.in_order
                    else min(len(request.messages), start + self.max_batch - len(members))
                )
                keys = request.keys
                members += [_Member(keys[position], request, position) for position in range(start, stop)]
                messages += request.messages[start:stop]
                request.next = stop
                if stop == len(request.messages):
                    queue.popleft()
                    request.messages = []  # encoded: the frame holds the bytes
                if not request.in_order:
                    break
            if members:
                frame = self._encode(members, messages)
                if frame is not None:
                    return frame
        return None

    def _encode(self, members: list[_Member], messages: list) -> _Frame | None:
        """One frame of these messages: a single one as it is (unless it is itself a list, which
        the puller would read as a batch), several as the list of them. A message that does not
        encode fails its own call only."""
        single = len(messages) == 1 and not isinstance(messages[0], list)
        buffer = self._spare_buffer()
        try:
            return _Frame(members, wire.dump_into(messages[0] if single else messages, buffer), buffer)
        except Exception as e:
            self._spare.append((buffer, 0))  # (nothing holds a view of it)
            if len(messages) == 1:
                self._fail(members[0].request, e)
                self._n_settled += 1
                return None
        good = []  # which of the batch does not encode
        for member, message in zip(members, messages):
            error = _encode_error(message)
            if error is None:
                good.append((member, message))
            else:
                self._fail(member.request, error)
                self._n_settled += 1
        if not good:
            return None
        return self._encode([m for m, _ in good], [message for _, message in good])

    def _spare_buffer(self) -> io.BytesIO:
        returning = self._returning
        while returning and returning[0].sent_out():
            self._recycle(returning.popleft())
        if not self._spare:
            self.n_buffers += 1
            return io.BytesIO()
        buffer, size = self._spare.pop()
        self._spare_bytes -= size
        return buffer

    def _release(self, frame: _Frame) -> None:
        """`frame` is answered: its buffer serves again once zmq let go of it."""
        if frame.sent_out():
            self._recycle(frame)
        else:
            self._returning.append(frame)

    def _recycle(self, frame: _Frame) -> None:
        size = frame.data.nbytes
        frame.data.release()  # (zmq is done with it: nothing else reads it)
        if self._spare_bytes + size <= SPARE_BYTES:
            self._spare.append((frame.buffer, size))
            self._spare_bytes += size
        frame.buffer = None

    def _fail(self, request: _Request, error: BaseException) -> None:
        if not request.future.done():
            request.future.set_exception(error)

    def _send_again(self, now: float) -> bool:
        """Sends again each frame with a message unacknowledged past its timer; True if the
        high-water marks stopped it."""
        resends = self._resends
        while resends and resends[0][0] <= now:
            when, seq = resends[0]
            frame = self._unanswered.get(seq)
            if frame is None or frame.next_send != when:  # answered, or rescheduled since
                heapq.heappop(resends)
                continue
            try:
                frame.trackers.append(self.pusher._send(frame.data, 0, track=True))
            except TimeoutError:
                return True
            heapq.heappop(resends)
            self.n_resent += 1
            frame.interval *= 2
            frame.next_send = now + frame.interval
            heapq.heappush(resends, (frame.next_send, seq))
            self._resend_log.warning(
                "no acknowledgement from the puller at %s of %r for %.0f s: sent it again (%d sent again so far)",
                self.pusher.address,
                next(m.key for m in frame.members if not m.answered),
                now - frame.first_sent,
                self.n_resent,
            )
        return False

    def _give_up_if_due(self, now: float) -> None:
        oldest = next(iter(self._unanswered.values()), None)  # the first sent of those unanswered
        if oldest is not None and now - oldest.first_sent >= self.give_up_s:
            key = next(m.key for m in oldest.members if not m.answered)
            raise PushNotAcknowledged(
                f"the puller at {self.pusher.address} acknowledged nothing of {key!r}, sent "
                f"{now - oldest.first_sent:.0f} s ago ({self.n_resent} copies sent again): it reads nothing, or "
                "its acknowledgements are lost"
            )

    def _read_acks(self) -> None:
        socket = self.pusher._socket
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                acks = self.pusher.wait_ack(0)
            except TimeoutError:
                return
            except wire.WireFormatError as e:
                self._logger.warning("ignoring a malformed acknowledgement: %s", e)
                continue
            for ack in acks if isinstance(acks, list) else [acks]:
                answered = self._answered_by(ack)
                if not answered:
                    self.n_unknown_acks += 1
                    self._unknown_ack_log.warning(
                        "ignoring an acknowledgement of no message in flight (%d so far): %.200r",
                        self.n_unknown_acks,
                        ack,
                    )
                    continue
                for member in answered:
                    self._answer(member, ack)

    def _answered_by(self, ack: Any) -> list[_Member]:
        """The messages in flight `ack` answers: the oldest one of its key, or for a keyless
        rejection every unanswered one of the oldest frame with an in-order message unanswered."""
        if not isinstance(ack, dict):
            return []
        key = (ack.get("rollout_id"), ack.get("index"))
        if key == (None, None) and ack.get("verdict") == "rejected":
            for frame in self._unanswered.values():
                if any(m.request.in_order and not m.answered for m in frame.members):
                    return [m for m in frame.members if not m.answered]
            return []
        members = self._waiting.get(key)
        return [members[0]] if members else []

    def _answer(self, member: _Member, ack: dict) -> None:
        members = self._waiting[member.key]
        members.remove(member)  # (the first of its key, but for a keyless rejection)
        if not members:
            del self._waiting[member.key]
        member.answered = True
        self._n_settled += 1
        frame = member.frame
        frame.unanswered -= 1
        if not frame.unanswered:
            del self._unanswered[frame.seq]
            self._bytes_unanswered -= frame.data.nbytes
            self._release(frame)
        request = member.request
        request.acks[member.position] = ack
        request.unanswered -= 1
        if not request.unanswered and not request.future.done():
            request.future.set_result(request.acks)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            requests = list(self._queue)
            self._queue.clear()
            self._n_settled = self._n_submitted
        frames = list(self._unanswered.values()) + ([self._blocked] if self._blocked is not None else [])
        requests += [m.request for frame in frames for m in frame.members if not m.answered]
        self._blocked = None
        self._waiting.clear()
        self._unanswered.clear()
        self._bytes_unanswered = 0
        self._resends.clear()
        for request in requests:
            self._fail(request, self._failure(reason))  # (not one cancelled before it was sent)


def _encode_error(message: Any) -> Exception | None:
    """Why `message` does not encode (None: it does)."""
    try:
        wire.dumps(message)
    except Exception as e:
        return e
    return None
