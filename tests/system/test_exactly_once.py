"""Exactly once at the trainer's puller (docs/design.md §12), through real
sockets and a real etcd: a trajectory counts as delivered only once the
puller acknowledged it; a second copy of a rollout's trajectory is dropped
and counted; a trajectory of no admitted rollout is foreign; and the fault
points fire once per trial."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time
import uuid

import numpy as np
import pytest

from realrl.api.trajectory import Trajectory
from realrl.base import faults, name_resolve
from realrl.base.name_resolve import NameResolveConfig
from realrl.system.acked_delivery import AckedPusher
from realrl.system.push_pull_stream import NameResolvingZmqPusher, ZMQPusher
from realrl.system.stream_dataset import PullerStreamDataset
from tests.conftest import make_nr_config
from tests.system.trial_thread import wait_until

_BIRTH = itertools.count()


def trajectory(rollout_id: str, index: int = 0, qid: str = "q@0", size: int | None = None) -> Trajectory:
    return Trajectory(
        qid=qid,
        task="math",
        birth_time=float(next(_BIRTH)),
        input_ids=[np.array([3, 4, 5, 6], np.int32)],
        prompt_len=[2],
        logprobs=[np.full(2, -1.0, np.float32)],
        versions=[np.zeros(2, np.int32)],
        version_start=[0],
        version_end=[0],
        reward=[1.0],
        no_eos=[False],
        rollout_id=rollout_id,
        index=index,
        rollout_size=index + 1 if size is None else size,
    )


@pytest.fixture
def stream(tmp_path, etcd_server):
    name_resolve.reconfigure(make_nr_config("etcd3", tmp_path, etcd_server))
    trial = uuid.uuid4().hex[:8]
    dataset = PullerStreamDataset("once", trial, 0, vocab_size=10)
    pusher = NameResolvingZmqPusher("once", trial, 0, 1, 1, timeout=30)
    try:
        yield dataset, pusher
    finally:
        pusher.close(linger=0)
        dataset.close()
        name_resolve.reconfigure(NameResolveConfig())


def push_acked(pusher, message) -> dict:
    pusher.push(message, timeout=10)
    return one_ack(pusher.wait_ack(timeout=10))


def one_ack(acks: list) -> dict:
    """The acknowledgement of a pull that took one message (a list of one verdict)."""
    assert isinstance(acks, list) and len(acks) == 1, acks
    return acks[0]


def test_a_message_counts_as_delivered_only_once_the_puller_acknowledged_it(stream):
    """While the puller does not read (its buffer is full: back-pressure), a
    queued trajectory gets no acknowledgement; once it is buffered, it does."""
    dataset, pusher = stream
    dataset.max_buffered = 1
    assert push_acked(pusher, trajectory("0:0:1").to_wire()) == {"rollout_id": "0:0:1", "index": 0, "verdict": "taken"}
    pusher.push(trajectory("0:0:2").to_wire(), timeout=10)  # queued: the puller stopped reading
    with pytest.raises(TimeoutError):
        pusher.wait_ack(timeout=1.0)
    assert dataset.stats()["buffered"] == 1
    items, _ = dataset.inventory(0, 10)
    dataset.take([k for k, *_ in items])
    dataset.max_buffered = 10
    assert one_ack(pusher.wait_ack(timeout=10)) == {"rollout_id": "0:0:2", "index": 0, "verdict": "taken"}
    assert dataset.stats()["buffered"] == 1


def test_trajectory_keys_and_their_verdicts(stream):
    """A second copy of a key taken (trained since, or still buffered) is a
    duplicate; another index of the same rollout is not; no rollout id, or
    one that is not `<worker>:<epoch>:<row>`, is foreign; a schema break is
    invalid. None of those is buffered, each is acknowledged and counted, and
    the puller's accounting adds up."""
    dataset, pusher = stream
    first = push_acked(pusher, trajectory("0:1:7").to_wire())
    items, _ = dataset.inventory(0, 10)
    assert [t.key for t in dataset.take([k for k, *_ in items])] == [("0:1:7", 0)]  # trained
    verdicts = [
        push_acked(pusher, trajectory("0:1:7").to_wire())["verdict"],  # generated again: a second copy
        push_acked(pusher, trajectory("0:1:7", index=1).to_wire())["verdict"],
        push_acked(pusher, trajectory("0:1:7", index=1).to_wire())["verdict"],  # still buffered: a copy too
        push_acked(pusher, trajectory("").to_wire())["verdict"],
        push_acked(pusher, trajectory("0:1:7:nonce").to_wire())["verdict"],
        push_acked(pusher, {"hello": "world"})["verdict"],
        push_acked(pusher, 42)["verdict"],
    ]
    assert first["verdict"] == "taken"
    assert verdicts == ["duplicate", "taken", "duplicate", "foreign", "foreign", "invalid", "invalid"]
    s = dataset.stats()
    assert (s["duplicates_dropped"], s["foreign"], s["invalid"], s["taken"], s["buffered"]) == (2, 2, 2, 1, 1)
    assert (
        s["received"]
        == s["wire_rejected"]
        + s["invalid"]
        + s["foreign"]
        + s["duplicates_dropped"]
        + s["taken"]
        + s["dropped_stale"]
        + s["buffered"]
    )
    # A checkpoint's buffer restored into a new puller: its keys are known there too, as restored
    # (the resumed trial counted them: a rollout's finish must not count their copies again).
    dataset.restore([trajectory("0:2:3")])
    assert push_acked(pusher, trajectory("0:2:3").to_wire())["verdict"] == "restored"
    assert push_acked(pusher, trajectory("0:1:7").to_wire())["verdict"] == "duplicate"  # taken since


def test_a_rollout_generated_again_learns_what_its_predecessor_delivered(stream):
    """A rollout whose worker died after delivering it is generated again; if
    the agent now rejects it (or returns fewer trajectories), what the
    predecessor delivered is still in the trainer's hands and must count in
    its finish: the puller answers `held_of` with how many of the rollout's
    trajectories it took (trained or buffered), outside its accounting."""
    dataset, pusher = stream
    for index in (0, 1):
        assert push_acked(pusher, trajectory("0:3:5", index=index).to_wire())["verdict"] == "taken"
    items, _ = dataset.inventory(0, 1)
    dataset.take([k for k, *_ in items])  # one trained, one buffered
    before = dataset.stats()
    assert push_acked(pusher, {"held_of": "0:3:5"}) == {
        "rollout_id": "0:3:5",
        "index": None,
        "verdict": "held",
        "held": 2,
    }
    assert push_acked(pusher, {"held_of": "0:3:6"})["held"] == 0
    assert dataset.stats() == before  # a question, not a trajectory


def test_a_partly_delivered_rollout_is_not_done_at_a_checkpoint_and_its_restored_copies_are_not_counted_again(stream):
    """Issue 45 defect 6. An agent returned two trajectories for rollout
    0:4:2: the puller took the first, back-pressure holds the second, and a
    checkpoint is taken at that moment. It must not hold the rollout as done
    (it did: a buffered or trained trajectory marked its rollout, so a resumed
    trial never generated it again and the second trajectory was lost); a
    one-trajectory rollout taken before it is done. Resumed into a new puller,
    the rollout is generated again: the copy of its first trajectory is
    answered `restored` (the checkpoint's counts hold it: its finish, and
    `held_of`, must not count it again), its second is taken, and the rollout
    is complete: what the trainers hold is the checkpoint's plus the finish's."""
    dataset, pusher = stream
    dataset.max_buffered = 2
    assert push_acked(pusher, trajectory("0:4:1").to_wire())["verdict"] == "taken"
    assert push_acked(pusher, trajectory("0:4:2", 0, size=2).to_wire())["verdict"] == "taken"
    pusher.push(trajectory("0:4:2", 1, size=2).to_wire(), timeout=10)  # held back: the puller stopped reading
    buffered, seen, complete = dataset.checkpoint()  # the checkpoint, at that moment
    assert [t.key for t in buffered] == [("0:4:1", 0), ("0:4:2", 0)] and dataset.stats()["received"] == 2
    assert complete.is_done("0:4:1") and not complete.is_done("0:4:2")

    resumed = PullerStreamDataset("once", f"resumed-{uuid.uuid4().hex[:8]}", 0, vocab_size=10)
    host, port = resumed.address.rsplit(":", 1)
    delivery = AckedPusher(ZMQPusher(host, int(port)), poll_s=0.05)
    try:
        resumed.restore(buffered, seen)
        both = [trajectory("0:4:2", i, size=2) for i in (0, 1)]
        again = delivery.submit([t.to_wire() for t in both], [t.key for t in both])
        assert [a["verdict"] for a in again.result(timeout=10)] == ["restored", "taken"]
        assert delivery.submit([{"held_of": "0:4:2"}], [("0:4:2", None)]).result(timeout=10)[0]["held"] == 1
        finish_counts = 1  # the rollout worker's finish: `taken` and `duplicate` verdicts, not `restored`
        assert resumed.stats()["buffered"] == len(buffered) + finish_counts
        assert resumed.stats()["duplicates_dropped"] == 1
        assert resumed.checkpoint()[2].is_done("0:4:2")
    finally:
        delivery.close()
        delivery.pusher.close(linger=0)
        resumed.close()


def _loopback_queues_empty(port: int) -> bool:
    """Has every byte sent over the TCP connections to `port` left the
    kernel's queues (/proc/net/tcp: each end's send and receive queue 0)? Then
    the puller's zmq I/O thread holds it: each message is in its connection's
    pipe, waiting for the puller to read it."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    mine = [r for r in rows if int(r[1].split(":")[1], 16) == port or int(r[2].split(":")[1], 16) == port]
    return bool(mine) and all(int(q, 16) == 0 for r in mine for q in r[4].split(":"))


def test_a_held_of_question_counts_a_predecessors_frame_still_queued_at_the_puller(stream):
    """Defect 7's narrow race. A rollout worker delivered trajectory 0 of
    rollout 0:5:99 after twenty others and died; its frames still wait at the
    puller (back-pressure: it reads nothing) when its successor, generating
    the rollout again, asks `held_of`. The puller reads its connections in
    turn, so the question is read before the predecessor's last frame; it is
    answered only once nothing else waits, and counts that frame (before: 0,
    and the rollout's finish counted one trajectory too few)."""
    dataset, predecessor = stream
    dataset.max_buffered = 0  # back-pressure: the puller reads nothing
    for row in range(20):
        predecessor.push(trajectory(f"0:5:{row}").to_wire(), timeout=10)
    predecessor.push(trajectory("0:5:99").to_wire(), timeout=10)
    predecessor.close(linger=10)  # dead: what it sent is on its way to the puller, or there
    host, port = dataset.address.rsplit(":", 1)
    successor = AckedPusher(ZMQPusher(host, int(port)), poll_s=0.05)
    try:
        held = successor.submit([{"held_of": "0:5:99"}], [("0:5:99", None)], in_order=False)
        wait_until(lambda: _loopback_queues_empty(int(port)), 30, "both connections' frames at the puller")
        dataset.max_buffered = 100  # it reads again: both connections in turn
        assert held.result(timeout=10)[0]["held"] == 1
        assert dataset.stats()["buffered"] == 21
    finally:
        successor.close()
        successor.pusher.close(linger=0)


_FAULT_CHILD = """
import sys
from realrl.base import faults
print(faults.point(sys.argv[1]), flush=True)
"""


def test_fault_points_fire_once_per_trial_across_processes(tmp_path, monkeypatch):
    """Armed through the environment, as the launcher passes it to workers:
    `kill` SIGKILLs the first process that reaches the point and no later
    one; `fail:<s>` fails every hit during s seconds from the first, in any
    process, then never again; unarmed points do nothing."""
    env = {
        **os.environ,
        faults.FAULTS_ENV: "a.kill=kill,b.fail=fail:2,c.hold=hold:0.01",
        faults.FAULTS_DIR_ENV: str(tmp_path),
    }

    def child(name: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _FAULT_CHILD, name], env=env, capture_output=True, text=True)

    first, second = child("a.kill"), child("a.kill")
    assert first.returncode == -9 and second.returncode == 0 and second.stdout.strip() == "False"
    assert faults.fired("a.kill") is False  # not armed in this process's environment
    t0 = time.time()
    assert [child("b.fail").stdout.strip() for _ in range(2)] == ["True", "True"]
    time.sleep(max(0.0, 2.2 - (time.time() - t0)))
    assert child("b.fail").stdout.strip() == "False"
    assert child("unarmed").stdout.strip() == "False" and child("c.hold").stdout.strip() == "False"
    assert sorted(os.listdir(tmp_path)) == ["a.kill", "b.fail", "c.hold"]
    monkeypatch.setenv(faults.FAULTS_DIR_ENV, str(tmp_path))
    assert faults.fired("a.kill") and not faults.fired("unarmed")
    monkeypatch.setenv(faults.FAULTS_ENV, "broken")
    with pytest.raises(ValueError, match="REALRL_FAULTS"):
        faults.point("x")


def test_a_gate_holds_its_process_until_the_test_opens_it(tmp_path):
    """`gate`: the first process to reach the point waits there (its marker says
    it arrived) until `open_gate`; a later hit passes (the point fired)."""
    env = {**os.environ, faults.FAULTS_ENV: "g=gate", faults.FAULTS_DIR_ENV: str(tmp_path)}
    held = subprocess.Popen([sys.executable, "-c", _FAULT_CHILD, "g"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "g").exists():
            assert held.poll() is None and time.monotonic() < deadline  # a hang guard
            time.sleep(0.02)
        assert held.poll() is None  # arrived, and waits
        assert subprocess.run([sys.executable, "-c", _FAULT_CHILD, "g"], env=env, timeout=60).returncode == 0
        assert held.poll() is None
        faults.open_gate(str(tmp_path), "g")
        out, _ = held.communicate(timeout=60)
        assert held.returncode == 0 and out.strip() == "False"
    finally:
        held.kill()
        held.wait()


_KILL_RACE_CHILD = """
import logging, threading
from realrl.base import faults

polled = threading.Event()


def follower():  # another thread's point armed after the one that kills
    while True:
        faults.point("y.kill")
        polled.set()


class WaitForTheFollower(logging.Handler):
    # The moment between x.kill's marker and its kill: let the follower poll its point there.
    def emit(self, record):
        if "x.kill" in record.getMessage():
            polled.clear()
            polled.wait(2)


logging.getLogger("realrl").addHandler(WaitForTheFollower())
threading.Thread(target=follower, daemon=True).start()
polled.wait(10)
faults.point("x.kill")
"""


def test_a_point_armed_after_a_kill_does_not_fire_in_the_dying_process(tmp_path):
    """x kills its process; y, armed after x, is polled by another thread of
    the same process exactly while x logs between its marker and its kill.
    y must not fire there (it would use up its one firing in a process that
    is about to die, and the test ordering the faults loses a fault)."""
    env = {
        **os.environ,
        faults.FAULTS_ENV: "x.kill=kill,y.kill=kill;after=x.kill",
        faults.FAULTS_DIR_ENV: str(tmp_path),
    }
    proc = subprocess.run([sys.executable, "-c", _KILL_RACE_CHILD], env=env, capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["x.kill"], proc.stderr
