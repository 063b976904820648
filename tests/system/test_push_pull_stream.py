"""Push-pull stream over real sockets: pusher processes found through
name_resolve (etcd3 and file backends), back-pressure, and malformed input."""

from __future__ import annotations

import logging
import struct
import threading
import time
import uuid

import msgpack
import numpy as np
import pytest
import zmq

from realrl.base import name_resolve, wire
from realrl.system.acked_delivery import AckedPusher, PushNotAcknowledged
from realrl.system.push_pull_stream import (
    NameResolvingZmqPuller,
    NameResolvingZmqPusher,
    RateLimitedLog,
    StreamSeal,
    ZMQPuller,
    ZMQPusher,
    grouping,
    puller_of,
)
from tests.conftest import make_nr_config
from tests.system.stream_child import kill, message, spawn


@pytest.fixture(params=["etcd3", "file"])
def nr_config(request, tmp_path, etcd_server):
    config = make_nr_config(request.param, tmp_path, etcd_server)
    name_resolve.reconfigure(config)
    yield config
    name_resolve.reconfigure(name_resolve.NameResolveConfig())


def pull_until(pullers: list, total: int, patience: float = 60.0) -> list[list]:
    """Pulls from every puller until `total` messages came in (or gives up after `patience` s)."""
    got: list[list] = [[] for _ in pullers]
    give_up = time.monotonic() + patience
    while sum(map(len, got)) < total and time.monotonic() < give_up:
        for i, puller in enumerate(pullers):
            got[i] += puller.pull(timeout=0.02)
    return got


# ---- grouping -----------------------------------------------------------------------


def test_grouping_is_contiguous_with_remainder_first():
    assert grouping(7, 3) == {0: [0, 1, 2], 1: [3, 4], 2: [5, 6]}
    assert grouping(6, 3) == {0: [0, 1], 1: [2, 3], 2: [4, 5]}
    assert grouping(3, 3) == {0: [0], 1: [1], 2: [2]}
    assert grouping(5, 1) == {0: [0, 1, 2, 3, 4]}
    for pushers in range(1, 30):
        for pullers in range(1, pushers + 1):
            groups = grouping(pushers, pullers)
            flat = [p for i in range(pullers) for p in groups[i]]
            assert flat == list(range(pushers))  # contiguous blocks, in puller order
            sizes = [len(groups[i]) for i in range(pullers)]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
            assert all(puller_of(p, pushers, pullers) == i for i in groups for p in groups[i])


def test_fewer_pushers_than_pullers_leaves_some_pullers_without_pushers():
    # Fine: the master takes a step's batch from all ranks together.
    assert grouping(2, 3) == {0: [0], 1: [1], 2: []}
    assert puller_of(1, 2, 3) == 1
    with pytest.raises(ValueError, match="at least one"):
        grouping(3, 0)


def test_pusher_times_out_naming_the_missing_puller(nr_config):
    with pytest.raises(TimeoutError, match="puller 1 did not register"):
        NameResolvingZmqPusher("pp", uuid.uuid4().hex[:8], 3, 4, 2, timeout=0.3)


# ---- many pusher processes -> pullers -------------------------------------------------


def test_five_pusher_processes_to_two_pullers_exactly_once_in_order(nr_config):
    exp, trial = "pp", uuid.uuid4().hex[:8]
    n_pushers, n_pullers, n_messages = 5, 2, 40
    # Pushers start first: they wait for their puller's key to appear.
    children = [
        spawn(nr_config, "pusher", exp, trial, str(i), str(n_pushers), str(n_pullers), str(n_messages))
        for i in range(n_pushers)
    ]
    pullers = []
    try:
        pullers = [NameResolvingZmqPuller(exp, trial, j) for j in range(n_pullers)]
        for j, puller in enumerate(pullers):
            assert puller.address.startswith("127.0.0.1:")
            assert name_resolve.get(puller.name) == puller.address
        got = pull_until(pullers, n_pushers * n_messages)
        # Nothing more arrives: every message was delivered once.
        for puller in pullers:
            assert puller.pull(timeout=0.2) == []
        groups = grouping(n_pushers, n_pullers)
        for j, messages in enumerate(got):
            by_pusher: dict[int, list[int]] = {}
            for msg in messages:
                by_pusher.setdefault(msg["pusher"], []).append(msg["seq"])
                expected = message(msg["pusher"], msg["seq"])
                np.testing.assert_array_equal(msg["tokens"], expected["tokens"])
                assert msg["tokens"].dtype == np.int32
                np.testing.assert_array_equal(msg["logprobs"], expected["logprobs"])
                assert msg["meta"] == expected["meta"]
            assert sorted(by_pusher) == groups[j]  # only its own group
            for seqs in by_pusher.values():
                assert seqs == list(range(n_messages))  # exactly once, in order
            assert pullers[j].n_received == len(messages) and pullers[j].n_rejected == 0
        for i, child in enumerate(children):
            out, _ = child.communicate(timeout=60)
            assert child.returncode == 0
            assert f"to puller {puller_of(i, n_pushers, n_pullers)}" in out
    finally:
        for child in children:
            kill(child)
        for puller in pullers:
            puller.close()
    # close() takes the address back out of name_resolve
    with pytest.raises(name_resolve.NameEntryNotFoundError):
        name_resolve.get(pullers[0].name)


# ---- back-pressure -------------------------------------------------------------------


def test_back_pressure_times_out_then_resumes_without_loss():
    puller = ZMQPuller(hwm=2)
    pusher = ZMQPusher("127.0.0.1", puller.port, hwm=2)
    big = np.arange(64 * 1024, dtype=np.int32)  # 256 KiB: kernel buffers fill after a few dozen
    try:
        pushed = 0
        with pytest.raises(TimeoutError, match="high-water mark"):
            while pushed < 5000:
                pusher.push({"seq": pushed, "x": big}, timeout=0.2)
                pushed += 1
        assert 0 < pushed < 5000
        # The reader comes back: everything queued arrives, then pushing works again.
        got = pull_until([puller], pushed)[0]
        for seq in range(pushed, pushed + 5):
            pusher.push({"seq": seq, "x": big}, timeout=10)
        got += pull_until([puller], 5)[0]
        assert [m["seq"] for m in got] == list(range(pushed + 5))
        np.testing.assert_array_equal(got[-1]["x"], big)
        assert puller.n_rejected == 0
    finally:
        pusher.close(linger=0)
        puller.close()


# ---- acknowledged delivery ------------------------------------------------------------------


def _pull_with_senders_until(puller, total: int, patience: float = 30.0) -> list:
    got: list = []
    give_up = time.monotonic() + patience
    while len(got) < total and time.monotonic() < give_up:
        got += puller.pull_with_senders(timeout=0.05)
    return got


def test_acked_pusher_keeps_a_window_in_flight_and_matches_one_batched_ack_to_each_key(realrl_caplog):
    """Five messages of one submit reach the puller before it acknowledged any
    (one round trip per message would deliver one); one acknowledgement
    message listing their verdicts, out of order and with a stranger's key
    among them, resolves the call's one future with each message's own
    verdict in its place."""
    puller = ZMQPuller()
    pusher = ZMQPusher("127.0.0.1", puller.port)
    delivery = AckedPusher(pusher, poll_s=0.1)
    try:
        five = delivery.submit(
            [{"rollout_id": "0:0:1", "index": i} for i in range(5)], [("0:0:1", i) for i in range(5)]
        )
        got = _pull_with_senders_until(puller, 5)
        assert sorted(m["index"] for _, m in got) == list(range(5))
        assert not five.done() and delivery.in_flight == 5
        sender = got[0][0]
        acks = [{"rollout_id": "0:0:1", "index": i, "verdict": f"v{i}"} for i in (3, 0, 4, 1, 2)]
        puller.acknowledge(sender, [*acks[:2], {"rollout_id": "9:9:9", "index": 0, "verdict": "taken"}, *acks[2:]])
        assert [a["verdict"] for a in five.result(timeout=10)] == [f"v{i}" for i in range(5)]
        assert delivery.in_flight == 0
        assert "no message in flight" in realrl_caplog.text and delivery.n_unknown_acks == 1
        one = delivery.submit([{"rollout_id": "0:0:2", "index": 0}], [("0:0:2", 0)])  # a single dict answers one
        sender, _ = _pull_with_senders_until(puller, 1)[0]
        puller.acknowledge(sender, {"rollout_id": "0:0:2", "index": 0, "verdict": "taken"})
        assert [a["verdict"] for a in one.result(timeout=10)] == ["taken"]
    finally:
        delivery.close()
        pusher.close(linger=0)
        puller.close()


def test_acked_pusher_fails_what_waits_once_stopped_or_closed():
    """An unacknowledged message's future fails when the owner says stop
    (checked every poll_s) or closes; a submit after close fails at once."""
    puller = ZMQPuller()
    pusher = ZMQPusher("127.0.0.1", puller.port)
    stop = False
    delivery = AckedPusher(pusher, poll_s=0.05, should_stop=lambda: stop)
    try:
        waiting = delivery.submit([{"index": 0}], [("0:0:1", 0)])
        assert len(_pull_with_senders_until(puller, 1)) == 1
        stop = True
        with pytest.raises(RuntimeError, match="exiting"):
            waiting.result(timeout=10)
        delivery.close("closed for the test")
        with pytest.raises(RuntimeError, match="exiting"):  # the first reason stays
            delivery.submit([{"index": 1}], [("0:0:1", 1)]).result(timeout=1)
    finally:
        delivery.close()
        pusher.close(linger=0)
        puller.close()


@pytest.mark.parametrize("n_ids", [5_000, 25_000])  # 20 KB frames (zmq copies them), 100 KB (zero-copy sends)
def test_frames_in_flight_stay_within_the_window_and_their_buffers_serve_again(n_ids):
    """Twelve messages, a frame each, through a window of 250 KB: the pusher
    sends frames while those sent and unanswered hold less than the window
    (three frames), and the next one only once an answer made room; each
    arrives with its own content (a buffer serves the next frame once its
    frame is answered and zmq let go of it: a frame copied by zmq at once, a
    zero-copy one once its send is done)."""
    puller = ZMQPuller()
    pusher = ZMQPusher("127.0.0.1", puller.port)
    window = 3 * 4 * n_ids - 1  # (the third frame is sent with less than the window in flight)
    delivery = AckedPusher(pusher, poll_s=0.05, max_batch=1, window_bytes=window)
    try:
        keys = [("0:0:1", i) for i in range(12)]
        messages = [{"rollout_id": k[0], "index": k[1], "ids": np.full(n_ids, k[1], np.int32)} for k in keys]
        twelve = delivery.submit(messages, keys)
        got = _pull_with_senders_until(puller, 3)
        assert [m["index"] for _, m in got] == [0, 1, 2]
        assert puller.pull_with_senders(timeout=0.3) == [] and delivery.n_frames == 3  # the window is full
        received = [m for _, m in got]
        while len(received) < 12:
            sender = got[0][0]
            puller.acknowledge(sender, [ack((m["rollout_id"], m["index"]), "taken") for _, m in got])
            got = _pull_with_senders_until(puller, 1)
            assert 1 <= len(got) <= 3  # never more than the window in flight
            received += [m for _, m in got]
        puller.acknowledge(got[0][0], [ack((m["rollout_id"], m["index"]), "taken") for _, m in got])
        assert [a["index"] for a in twelve.result(timeout=10)] == list(range(12))
        assert [m["index"] for m in received] == list(range(12))
        for m in received:
            assert m["ids"].shape == (n_ids,) and (m["ids"] == m["index"]).all()
        if n_ids == 5_000:  # copied at once: exactly the window's buffers serve every frame
            assert delivery.n_buffers == 3
        assert delivery.n_frames == 12 and delivery.in_flight == 0
    finally:
        delivery.close()
        pusher.close(linger=0)
        puller.close()


# ---- malformed input ---------------------------------------------------------------------


def _marker(index: int, dtype_code: int, shape: tuple) -> msgpack.ExtType:
    return msgpack.ExtType(1, struct.pack(f"<IBB{len(shape)}q", index, dtype_code, len(shape), *shape))


def _raw_message(structure, *frames: bytes) -> bytes:
    head = b"RL" + bytes([wire.VERSION]) + msgpack.packb(structure)
    return wire.join_frames([head, *frames])


def test_garbage_oversized_and_bad_arrays_are_rejected_and_the_puller_keeps_going():
    puller = ZMQPuller(max_message_bytes=1 << 20)
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{puller.address}")
    try:
        bad = [
            [b"garbage"],
            [b"two", b"parts"],  # a multipart message
            [wire.join_frames([b"RL" + bytes([wire.VERSION]) + b"\xc1"])],  # invalid msgpack
            [_raw_message({"x": _marker(1, 99, (4,))}, b"\0" * 4)],  # dtype not whitelisted
            [_raw_message({"x": _marker(1, 3, (5,))}, b"\0" * 16)],  # 5 int32 need 20 bytes
            [_raw_message({"x": _marker(1, 3, (-1, -4))}, b"\0" * 16)],  # negative dims
            [_raw_message({"x": _marker(2, 3, (4,))}, b"\0" * 16)],  # points past the frames
            [wire.dumps({"x": np.zeros(300_000, np.float32)})],  # 1.2 MB > 1 MiB limit
            [wire.dumps({"x": 1})[:-1]],  # truncated
        ]
        for parts in bad:
            raw.send_multipart(parts)
        raw.send(wire.dumps({"good": np.arange(3, dtype=np.int64)}))
        got = []
        give_up = time.monotonic() + 30
        while not got and time.monotonic() < give_up:
            got = puller.pull(timeout=0.1)
        assert len(got) == 1
        np.testing.assert_array_equal(got[0]["good"], [0, 1, 2])
        assert puller.n_rejected == len(bad)
        assert puller.n_received == 1
        # Still healthy for a real pusher afterwards.
        pusher = ZMQPusher("127.0.0.1", puller.port)
        pusher.push({"after": True}, timeout=5)
        assert pull_until([puller], 1)[0] == [{"after": True}]
        pusher.close()
    finally:
        raw.close()
        context.term()
        puller.close()


def test_rate_limited_log_reports_what_it_suppressed_on_flush(realrl_caplog):
    log = RateLimitedLog(interval=3600.0)
    for i in range(3):
        log.warning("bad message %d: %s", i, "why")
    assert [r.getMessage() for r in realrl_caplog.records] == ["bad message 0: why"]
    assert log.suppressed == 2
    log.maybe_flush()  # the interval has not passed: nothing yet
    assert len(realrl_caplog.records) == 1
    log.flush()
    assert len(realrl_caplog.records) == 2
    summary = realrl_caplog.records[-1]
    assert summary.levelno == logging.WARNING
    assert summary.getMessage().startswith("2 similar messages suppressed in the last ")
    assert summary.getMessage().endswith("s; the last one: bad message 2: why")
    log.flush()  # nothing pending: nothing logged
    assert len(realrl_caplog.records) == 2 and log.suppressed == 0


def test_rate_limited_log_maybe_flush_reports_once_the_interval_passed(realrl_caplog):
    log = RateLimitedLog(interval=3600.0)
    log.warning("first")
    log.warning("second")
    log.maybe_flush()
    assert len(realrl_caplog.records) == 1
    log.interval = 0.0  # as if the interval had passed
    log.maybe_flush()
    assert [r.getMessage().split(" in the last")[0] for r in realrl_caplog.records] == [
        "first",
        "1 similar messages suppressed",
    ]
    log.maybe_flush()
    assert len(realrl_caplog.records) == 2


def test_puller_reports_its_suppressed_rejects_at_close(realrl_caplog):
    puller = ZMQPuller()
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{puller.address}")
    try:
        for _ in range(3):
            raw.send(b"garbage")
        give_up = time.monotonic() + 30
        while puller.n_rejected < 3 and time.monotonic() < give_up:
            puller.pull(timeout=0.1)
        assert puller.n_rejected == 3
        rejects = [r.getMessage() for r in realrl_caplog.records if "rejected" in r.getMessage()]
        assert len(rejects) == 1 and "(1 rejected so far)" in rejects[0]  # the other two are suppressed
    finally:
        raw.close()
        context.term()
        puller.close()
    last = realrl_caplog.records[-1].getMessage()
    assert last.startswith("2 similar messages suppressed") and "(3 rejected so far)" in last


def test_puller_refuses_wildcard_bind():
    with pytest.raises(ValueError, match="0.0.0.0"):
        ZMQPuller(host="0.0.0.0")


def test_pusher_close_does_not_hang_without_a_puller():
    pusher = ZMQPusher("127.0.0.1", 1)  # nobody listens there
    pusher.push({"x": 1}, timeout=1)  # queued locally
    pusher.close(linger=0.1)


# ---- acknowledged pushes ---------------------------------------------------------------


class FakePuller:
    """A fake puller (a real ROUTER socket, in a thread): after each message
    it receives (a frame holding a list is a batch of them), `respond(received)`
    (every message so far, decoded) says what to send back to its sender now:
    None nothing (as when an acknowledgement went to a routing id lost in a
    reconnect), else one acknowledgement message (a dict, or a list as
    PullerStreamDataset sends). `frames` counts the frames."""

    def __init__(self, respond):
        self.respond = respond
        self.received: list = []
        self.frames = 0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.port = self._socket.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if not self._socket.poll(20):
                continue
            sender, frame = self._socket.recv_multipart()
            self.frames += 1
            message = wire.loads(frame)
            for m in message if isinstance(message, list) else [message]:
                self.received.append(m)
                answer = self.respond(list(self.received))
                if answer is not None:
                    self._socket.send_multipart([sender, wire.dumps(answer)])

    def close(self):
        self._stop.set()
        self._thread.join()
        self._socket.close()
        self._context.term()


def ack(key, verdict, **more):
    return {"rollout_id": key[0], "index": key[1], "verdict": verdict, **more}


def acked_delivery(respond, cls=AckedPusher, **kwargs):
    puller = FakePuller(respond)
    pusher = ZMQPusher("127.0.0.1", puller.port)
    return puller, pusher, cls(pusher, poll_s=0.05, **kwargs)


class HeldAckedPusher(AckedPusher):
    """Sends nothing until `release` is set: what was submitted meanwhile goes as one frame."""

    def __init__(self, *args, **kwargs):
        self.release = threading.Event()
        super().__init__(*args, **kwargs)

    def _send_queued(self, now):
        return super()._send_queued(now) if self.release.is_set() else False


def close_all(puller, pusher, delivery):
    delivery.close()
    pusher.close(linger=0)
    puller.close()


def test_each_frame_in_flight_is_sent_again_on_its_own_timer_and_a_copys_answer_ends_it():
    """Two trajectories in flight, a frame each; the first one's acknowledgement never
    comes (lost in a reconnect), the second's does, then one of nothing in
    flight (counted, ignored). Only the first is sent again once its own
    timer ran out, and the puller's `duplicate` for that copy resolves it."""
    a, b = ("0:0:7", 0), ("0:0:7", 1)

    def respond(received):
        keys = [(m["rollout_id"], m["index"]) for m in received]
        if len(keys) == 2:  # b, after a (unanswered)
            return [ack(b, "taken"), ack(("0:0:3", 0), "duplicate")]
        if len(keys) == 3:  # a sent again
            return [ack(keys[2], "duplicate")]
        return None

    puller, pusher, delivery = acked_delivery(respond, resend_s=0.3, give_up_s=60, max_batch=1)
    try:
        first = delivery.submit([{"rollout_id": a[0], "index": a[1]}], [a])
        second = delivery.submit([{"rollout_id": b[0], "index": b[1]}], [b])
        assert second.result(timeout=10) == [ack(b, "taken")]
        assert first.result(timeout=10) == [ack(a, "duplicate")]
        assert [(m["rollout_id"], m["index"]) for m in puller.received] == [a, b, a]
        assert delivery.n_resent == 1 and delivery.n_unknown_acks == 1 and delivery.in_flight == 0
    finally:
        close_all(puller, pusher, delivery)


def test_a_window_never_acknowledged_fails_loudly_after_its_bound():
    """Nothing is ever answered: each message is sent again on its timer,
    then every future in flight fails with PushNotAcknowledged naming the
    puller, and a later submit fails at once (the worker fails loudly)."""
    puller, pusher, delivery = acked_delivery(lambda received: None, resend_s=0.1, give_up_s=0.6)
    try:
        futures = [delivery.submit([{"index": i}], [("0:0:1", i)]) for i in range(3)]
        for future in futures:
            with pytest.raises(PushNotAcknowledged, match=f"127.0.0.1:{puller.port} acknowledged nothing"):
                future.result(timeout=10)
        with pytest.raises(PushNotAcknowledged):
            delivery.submit([{"index": 3}], [("0:0:1", 3)]).result(timeout=1)
        assert len(puller.received) >= 6 and delivery.n_resent >= 1  # each sent again meanwhile
    finally:
        close_all(puller, pusher, delivery)


def test_a_keyless_rejection_is_the_oldest_unanswered_messages_and_futures_carry_the_whole_acknowledgement():
    """Three messages in flight, answered in one list once all three came:
    the first's verdict, a `rejected` without a key (the puller could not
    decode the second), the third's. The rejection resolves the second, the
    oldest unanswered when it is read (not the newest); a `held` answer,
    with its count, resolves the question's future whole."""
    keys = [("0:0:1", 0), ("0:0:1", 1), ("0:0:1", 2)]

    def respond(received):
        if len(received) == 3:
            return [ack(keys[0], "taken"), ack((None, None), "rejected"), ack(keys[2], "taken")]
        if len(received) == 4:
            return [ack(("0:0:1", None), "held", held=2)]
        return None

    puller, pusher, delivery = acked_delivery(respond, max_batch=1)  # a frame each
    try:
        futures = [delivery.submit([{"i": i}], [key]) for i, key in enumerate(keys)]
        assert [f.result(timeout=10)[0]["verdict"] for f in futures] == ["taken", "rejected", "taken"]
        assert futures[1].result() == [ack((None, None), "rejected")]
        held = delivery.submit([{"held_of": "0:0:1"}], [("0:0:1", None)])
        assert held.result(timeout=10) == [ack(("0:0:1", None), "held", held=2)]
        assert delivery.n_unknown_acks == 0 and delivery.in_flight == 0
    finally:
        close_all(puller, pusher, delivery)


def test_messages_queued_together_go_as_one_frame_and_a_keyless_rejection_answers_all_of_it():
    """Five messages queued while the pusher's thread is held go as one frame
    (a batch: the puller reads five messages, in order); each is answered on
    its own. Then two frames: a message alone, and a batch of three that the
    puller cannot decode: its keyless `rejected` answers every message of
    that batch (the oldest frame with a message unanswered), not the one
    answered before it; the real puller takes a batch as its messages."""
    keys = [("0:0:1", i) for i in range(5)]
    puller, pusher, delivery = acked_delivery(
        lambda received: [ack(key, "taken") for key in keys] if len(received) == 5 else None, cls=HeldAckedPusher
    )
    try:
        futures = [delivery.submit([{"rollout_id": k[0], "index": k[1]}], [k]) for k in keys]
        delivery.release.set()
        assert [f.result(timeout=10)[0]["verdict"] for f in futures] == ["taken"] * 5
        assert puller.frames == 1 and [m["index"] for m in puller.received] == list(range(5))
        assert delivery.n_frames == 1 and delivery.in_flight == 0
    finally:
        close_all(puller, pusher, delivery)

    def respond(received):  # the message alone, then a rejection of the batch behind it
        return [ack(("0:0:2", 0), "taken"), ack((None, None), "rejected")] if len(received) == 1 else None

    puller, pusher, delivery = acked_delivery(respond, cls=HeldAckedPusher)
    try:
        alone = delivery.submit([{"rollout_id": "0:0:2", "index": 0}], [("0:0:2", 0)], in_order=False)
        batch = delivery.submit(
            [{"rollout_id": "0:0:3", "index": i} for i in range(3)], [("0:0:3", i) for i in range(3)]
        )
        delivery.release.set()
        assert alone.result(timeout=10)[0]["verdict"] == "taken"
        assert batch.result(timeout=10) == [ack((None, None), "rejected")] * 3
        assert delivery.n_frames == 2 and delivery.n_unknown_acks == 0 and delivery.in_flight == 0
    finally:
        close_all(puller, pusher, delivery)
    real = ZMQPuller()
    pusher = ZMQPusher("127.0.0.1", real.port)
    try:
        pusher.push([{"index": 0}, {"index": 1}])
        pusher.push({"index": 2})
        got = _pull_with_senders_until(real, 3)
        assert [m for _, m in got] == [{"index": 0}, {"index": 1}, {"index": 2}] and real.n_received == 3
    finally:
        pusher.close(linger=0)
        real.close()


def test_an_out_of_order_question_queued_behind_messages_goes_in_the_next_frame():
    """A rollout worker's question (`in_order=False`) queued behind its
    trajectories while the thread is held: the trajectories go as one frame,
    the question alone in the next, and both are answered. (The question's
    future was once marked running when the first frame stopped at it, and
    again for the second: the push thread died and the rollout worker with it.)"""
    keys = [("0:0:1", 0), ("0:0:1", 1)]

    def respond(received):
        if len(received) == 2:
            return [ack(key, "taken") for key in keys]
        if len(received) == 3:
            return [ack(("0:0:1", None), "held", held=2)]
        return None

    puller, pusher, delivery = acked_delivery(respond, cls=HeldAckedPusher)
    try:
        trajectories = delivery.submit([{"rollout_id": k[0], "index": k[1]} for k in keys], keys)
        question = delivery.submit([{"held_of": "0:0:1"}], [("0:0:1", None)], in_order=False)
        delivery.release.set()
        assert [a["verdict"] for a in trajectories.result(timeout=10)] == ["taken", "taken"]
        assert question.result(timeout=10) == [ack(("0:0:1", None), "held", held=2)]
        assert puller.frames == 2 and delivery.n_frames == 2 and delivery.in_flight == 0
    finally:
        close_all(puller, pusher, delivery)


def test_a_puller_reporting_rejects_returns_them_in_their_place_among_the_messages():
    """With `report_rejects`, a frame that does not decode comes back from
    pull_with_senders where it arrived (so its sender's answers keep its
    order); it is counted in n_rejected, not n_received; pull() leaves it out."""
    puller = ZMQPuller(report_rejects=True)
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{puller.address}")
    try:
        for part in (wire.dumps({"i": 0}), b"garbage", wire.dumps({"i": 2})):
            raw.send(part)
        got = _pull_with_senders_until(puller, 3)
        assert [m if isinstance(m, dict) else type(m).__name__ for _, m in got] == [
            {"i": 0},
            "RejectedFrame",
            {"i": 2},
        ]
        assert puller.n_rejected == 1 and puller.n_received == 2
        raw.send(b"garbage")
        raw.send(wire.dumps({"i": 4}))
        plain = []
        give_up = time.monotonic() + 30
        while not plain and time.monotonic() < give_up:
            plain += puller.pull(timeout=0.05)
        assert plain == [{"i": 4}] and puller.n_rejected == 2
    finally:
        raw.close()
        context.term()
        puller.close()


def test_a_sealed_stream_takes_only_what_the_trials_key_sealed_and_ignores_forged_acks():
    """docs/design.md §14: unsealed, tampered and other-trial messages are refused before
    decoding, counted apart from `n_rejected`, never acknowledged; forged acks are ignored."""
    key = b"k" * 32
    puller = ZMQPuller(seal_key=key)
    pusher = ZMQPusher("127.0.0.1", puller.port, seal_key=key)
    context = zmq.Context()
    raw = context.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(f"tcp://{puller.address}")
    try:
        good = wire.dumps({"trajectory": np.arange(4, dtype=np.int32)})
        tampered = bytearray(good)
        tampered[-1] ^= 1
        seal, other = StreamSeal(key, "push"), StreamSeal(b"o" * 32, "push")
        for parts in (
            [good],  # no seal
            [good, other.tag(good)],  # another trial's key
            [bytes(tampered), seal.tag(good)],  # tampered after sealing
            [good, seal.tag(good)[:-1]],  # a cut seal
            [good, seal.tag(good), b"more"],  # three frames
            [good, StreamSeal(key, "ack").tag(good)],  # the acknowledgements' seal
        ):
            raw.send_multipart(parts)
        pusher.push({"from": "the trial"}, timeout=5)
        # Two connections, so no order between them: pull until all seven arrived (or the bound).
        got = []
        give_up = time.monotonic() + 30
        while (not got or puller.n_seal_refused < 6) and time.monotonic() < give_up:
            got += puller.pull_with_senders(timeout=0.1)
        assert [msg for _, msg in got] == [{"from": "the trial"}]
        assert puller.n_seal_refused == 6 and puller.n_rejected == 0 and puller.n_received == 1
        assert not raw.poll(100)  # nothing refused was acknowledged

        # A sealed ack arrives; a forged one (unsealed, or sealed as a trajectory) is ignored, counted.
        forged = wire.dumps({"verdict": "taken"})
        router = puller._socket
        router.send_multipart([got[0][0], forged])
        router.send_multipart([got[0][0], forged, seal.tag(forged)])
        puller.acknowledge(got[0][0], {"verdict": "duplicate"})
        assert pusher.wait_ack(timeout=10) == {"verdict": "duplicate"}
        assert pusher.n_acks_refused == 2
    finally:
        raw.close()
        context.term()
        pusher.close(linger=0)
        puller.close()


def test_an_unsealed_pusher_gets_nothing_into_a_sealed_puller():
    puller = ZMQPuller(seal_key=b"k" * 32)
    pusher = ZMQPusher("127.0.0.1", puller.port)  # no key: an outsider's pusher
    try:
        for i in range(3):
            pusher.push({"i": i}, timeout=5)
        give_up = time.monotonic() + 30
        while puller.n_seal_refused < 3 and time.monotonic() < give_up:
            assert puller.pull(timeout=0.1) == []
        assert puller.n_seal_refused == 3 and puller.n_received == 0
    finally:
        pusher.close(linger=0)
        puller.close()
