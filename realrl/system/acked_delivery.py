"""Acknowledged delivery over the push-pull stream (docs/design.md §4, §12):
`AckedPusher` keeps a window of messages in flight over one `ZMQPusher`,
matches the puller's acknowledgements to their keys, sends again what stays
unanswered and gives up loudly (`PushNotAcknowledged`). The rollout worker
delivers its trajectories through it."""

from __future__ import annotations

import collections
import concurrent.futures
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

import zmq

from realrl.base import wire
from realrl.system.push_pull_stream import RateLimitedLog, ZMQPusher, logger

ACK_RESEND_S = 30.0  # a message is sent again when unacknowledged this long (then 2x, 4x, ...)
ACK_GIVE_UP_S = 900.0  # ... and everything in flight fails once one is unacknowledged this long


class PushNotAcknowledged(RuntimeError):
    """No acknowledgement of a pushed message came within `ACK_GIVE_UP_S`."""


class _InFlight:
    """A message sent and not yet acknowledged."""

    __slots__ = ("key", "future", "frame", "in_order", "seq", "first_sent", "next_send", "interval")

    def __init__(
        self,
        key: Hashable,
        future: concurrent.futures.Future,
        frame: Any,
        in_order: bool,
        seq: int,
        now: float,
        resend_s: float,
    ):
        self.key, self.future, self.frame, self.in_order, self.seq = key, future, frame, in_order, seq
        self.first_sent, self.next_send, self.interval = now, now + resend_s, resend_s


class AckedPusher:
    """Delivery with acknowledgements over one `ZMQPusher`, a window of
    messages in flight. An acknowledgement `{"rollout_id", "index",
    "verdict", ...}` (or a list of them: the puller answers a whole pull in
    one message, in the order it received them) resolves the future of the
    oldest message in flight submitted under that key `(rollout_id, index)`
    with the whole acknowledgement. A keyless `rejected` one (the puller
    could not decode a frame, so it has no key) is the oldest unanswered
    message's: the puller answers a connection's messages in the order they
    came, so every message sent before it was answered already (unless its
    answer was lost in a reconnect: then this one is misattributed, and the
    rejected message is sent again and rejected again later).

    One thread of its own is the only one that touches the socket: it sends
    whatever is queued and reads acknowledgements as they come. One message
    per round trip (push, wait for its acknowledgement, push the next) capped
    the stream at two process wake-ups per message, which on a busy machine
    cost more than encoding, sending and decoding it. Under back-pressure (the
    high-water marks are full) the queue waits, as long as it takes, and the
    thread still reads acknowledgements.

    Each message sent has its own timers: unacknowledged `resend_s` after a
    send it is sent again (then after twice as long, ...: an acknowledgement
    sent to a routing id the puller no longer knows, after a reconnect, is
    lost; the puller answers a second copy `duplicate`), and once one is
    unacknowledged `give_up_s` after its first send, every future fails with
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
    ) -> None:
        self.pusher = pusher
        self.poll_s = poll_s
        self.resend_s = resend_s
        self.give_up_s = give_up_s
        self._should_stop = should_stop or (lambda: False)
        self._logger = log or logger
        self._lock = threading.Lock()  # submit() against the thread's exit
        # Submitted, not yet sent: [message, key, future, its frame once encoded, in_order].
        self._queue: collections.deque[list] = collections.deque()
        self._waiting: dict[Hashable, collections.deque[_InFlight]] = {}  # sent, unanswered, by key
        self._unanswered: dict[int, _InFlight] = {}  # the same by sequence number, in the order first sent
        self._resends: list[tuple[float, int]] = []  # heap of (when to send again, sequence number)
        self._seq = itertools.count()
        self.n_resent = 0  # copies sent again for want of an acknowledgement
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
        return len(self._queue) + len(self._unanswered)

    def submit(self, message: Any, key: Hashable, in_order: bool = True) -> concurrent.futures.Future:
        """Queues `message`; the future resolves to the acknowledgement for
        `key` (a dict), or fails (closed, exiting, PushNotAcknowledged, a
        message that does not encode). `in_order=False`: the puller may
        answer it after messages sent later (a question it answers once it
        read what else waits), so a keyless rejection is never its."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed is not None:
                future.set_exception(self._failure(self._closed))
                return future
            idle = not self._queue  # else the thread is sending and takes this one too
            self._queue.append([message, key, future, None, in_order])
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
        """Sends what is queued; True if the high-water marks stopped it."""
        queue = self._queue
        while queue:
            item = queue[0]
            message, key, future, frame, in_order = item
            # Running from here on: a cancel (the episode's) no longer races the result.
            if frame is None and not future.running() and not future.set_running_or_notify_cancel():
                queue.popleft()
                continue
            if frame is None:
                try:  # encoded once: a copy sent again is this frame
                    frame = item[3] = wire.dumps(message)
                except Exception as e:  # a message that does not encode fails its own future only
                    queue.popleft()
                    future.set_exception(e)
                    continue
            try:
                self.pusher._send(frame, 0)
            except TimeoutError:
                return True
            queue.popleft()
            entry = _InFlight(key, future, frame, in_order, next(self._seq), now, self.resend_s)
            self._waiting.setdefault(key, collections.deque()).append(entry)
            self._unanswered[entry.seq] = entry
            heapq.heappush(self._resends, (entry.next_send, entry.seq))
        return False

    def _send_again(self, now: float) -> bool:
        """Sends again each message unacknowledged past its timer; True if the high-water marks stopped it."""
        resends = self._resends
        while resends and resends[0][0] <= now:
            when, seq = resends[0]
            entry = self._unanswered.get(seq)
            if entry is None or entry.next_send != when:  # answered, or rescheduled since
                heapq.heappop(resends)
                continue
            try:
                self.pusher._send(entry.frame, 0)
            except TimeoutError:
                return True
            heapq.heappop(resends)
            self.n_resent += 1
            entry.interval *= 2
            entry.next_send = now + entry.interval
            heapq.heappush(resends, (entry.next_send, seq))
            self._resend_log.warning(
                "no acknowledgement from the puller at %s of %r for %.0f s: sent it again (%d sent again so far)",
                self.pusher.address,
                entry.key,
                now - entry.first_sent,
                self.n_resent,
            )
        return False

    def _give_up_if_due(self, now: float) -> None:
        oldest = next(iter(self._unanswered.values()), None)  # the first sent of those unanswered
        if oldest is not None and now - oldest.first_sent >= self.give_up_s:
            raise PushNotAcknowledged(
                f"the puller at {self.pusher.address} acknowledged nothing of {oldest.key!r}, sent "
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
                entry = self._entry_of(ack)
                if entry is None:
                    self.n_unknown_acks += 1
                    self._unknown_ack_log.warning(
                        "ignoring an acknowledgement of no message in flight (%d so far): %.200r",
                        self.n_unknown_acks,
                        ack,
                    )
                    continue
                entries = self._waiting[entry.key]
                entries.remove(entry)  # (the first of its key, but for a keyless rejection)
                if not entries:
                    del self._waiting[entry.key]
                del self._unanswered[entry.seq]
                entry.future.set_result(ack)

    def _entry_of(self, ack: Any) -> _InFlight | None:
        """The message in flight `ack` answers (None: no such message)."""
        if not isinstance(ack, dict):
            return None
        key = (ack.get("rollout_id"), ack.get("index"))
        if key == (None, None) and ack.get("verdict") == "rejected":
            return next((e for e in self._unanswered.values() if e.in_order), None)
        entries = self._waiting.get(key)
        return entries[0] if entries else None

    def _fail_all(self, reason: str) -> None:
        futures = [item[2] for item in self._queue] + [e.future for e in self._unanswered.values()]
        self._queue.clear()
        self._waiting.clear()
        self._unanswered.clear()
        self._resends.clear()
        for future in futures:
            try:
                future.set_exception(self._failure(reason))
            except concurrent.futures.InvalidStateError:  # cancelled before it was sent
                pass
