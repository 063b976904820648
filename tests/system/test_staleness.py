"""StalenessController: admission under the staleness bound (docs/design.md §7). Pure, in-process."""

from __future__ import annotations

import pytest

from realrl.system import staleness
from realrl.system.staleness import StalenessController, within_staleness_bound


def test_staleness_formula():
    # (accepted - dropped + running) // B <= eta + version
    assert within_staleness_bound(0, 0, 3, 4, 0, 0)
    assert not within_staleness_bound(0, 0, 4, 4, 0, 0)
    assert not within_staleness_bound(2, 0, 2, 4, 0, 0)  # finished-and-accepted count
    assert within_staleness_bound(2, 1, 2, 4, 0, 0)  # drops give budget back
    assert not within_staleness_bound(4, 0, 0, 4, 0, 0)
    assert within_staleness_bound(4, 0, 3, 4, 0, 1)  # a new version opens B more ...
    assert not within_staleness_bound(4, 0, 4, 4, 0, 1)  # ... and no more


def started(train_batch_size: int, eta: int, cap: int) -> StalenessController:
    c = StalenessController(train_batch_size=train_batch_size, max_head_offpolicyness=eta, max_concurrent_rollouts=cap)
    c.start()
    return c


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_controller_admits_at_most_eta_plus_one_batches_per_version(eta):
    c = started(4, eta, 1000)
    admitted = [i for i in range(100) if c.allocate(f"r{i}", f"q{i}")[0]]
    assert len(admitted) == (eta + 1) * 4 == c.running
    ok, reason = c.allocate("x")
    assert not ok and reason.startswith("staleness bound: (accepted 0 - dropped 0 + running")
    for i in admitted[:3]:  # accepted finishes keep using the budget
        c.finish(f"r{i}", n_trajectories=1, n_tokens=5)
    assert not c.allocate("x")[0]
    c.finish(f"r{admitted[3]}", n_trajectories=0)  # agent-filtered: budget back
    assert c.allocate("r")[0] and not c.allocate("x")[0]
    c.dropped = 2  # the trainer dropped two stale ones
    assert c.allocate("d1")[0] and c.allocate("d2")[0] and not c.allocate("x")[0]
    c.version = 1  # every server holds version 1
    assert sum(c.allocate(f"v{i}")[0] for i in range(10)) == 4
    assert (c.accepted, c.rejected, c.n_tokens) == (3, 1, 15)
    with pytest.raises(KeyError, match="no running rollout with id 'nope'"):
        c.finish("nope", n_trajectories=1)


def test_controller_counts_trajectories_not_episodes():
    """An agent that returns k trajectories per episode uses k units of budget."""
    c = started(4, 0, 1000)
    assert c.allocate("a")[0] and c.allocate("b")[0]
    c.finish("a", n_trajectories=3)
    assert c.accepted == 3 and not c.allocate("c")[0]  # 3 accepted + 1 running: a batch is full
    c.finish("b", n_trajectories=0)  # rejected by the agent: its budget is back
    assert c.allocate("c")[0] and not c.allocate("d")[0]


def test_controller_allocate_and_finish_are_idempotent_per_rollout_id():
    c = started(100, 0, 2)
    assert c.allocate("r1", "q")[0] and c.allocate("r1", "q")[0]  # a retried allocate: still one slot
    assert c.running == 1 and c.admitted == 1
    assert c.allocate("r2", "q")[0]  # one prompt twice in flight, under two ids
    assert c.allocate("r3", "other") == (False, "max_concurrent_rollouts reached (2)")
    assert c.allocate("r1")[0]  # a retry still answers True at the cap
    c.finish("r1", n_trajectories=1, n_tokens=4)
    c.finish("r1", n_trajectories=1, n_tokens=4)  # a retried finish: no error, not counted twice
    assert (c.running, c.accepted, c.n_tokens) == (1, 1, 4)
    assert c.allocate("r1")[0] and c.running == 1  # a late retry of the allocate changes nothing
    c.stop()
    assert c.allocate("q") == (False, "rollouts stopped")


def test_controller_admits_nothing_before_start_and_resumes_from_the_checkpoint_counts():
    c = StalenessController(train_batch_size=16, max_head_offpolicyness=2, max_concurrent_rollouts=1000)
    assert c.allocate("early") == (False, "waiting for the trainer: training has not started")
    # Recovered at version 4 after 64 consumed and 10 dropped (docs/design.md §7): an
    # uninterrupted run would hold (2 + 4 + 1) * 16 - 64 = 48 more.
    c.start(accepted=64 + 10, rejected=3)
    c.dropped, c.version = 10, 4
    assert sum(c.allocate(f"r{i}")[0] for i in range(200)) == 48


def test_allocate_many_takes_a_prefix_in_order_and_says_why_it_stopped():
    c = started(100, 0, 3)
    assert c.allocate_many([("a", "qa"), ("b", "qb")]) == (2, None)
    assert c.allocate_many([("a", "qa"), ("c", "qc"), ("d", "qd"), ("e", "qe")]) == (
        2,
        "max_concurrent_rollouts reached (3)",
    )  # "a" again is a no-op that still counts as taken; "d" hits the cap, "e" is not tried
    assert c.running == 3 and c.admitted == 3
    assert c.allocate_many([]) == (0, None)


def test_finish_many_is_all_or_nothing():
    c = started(100, 0, 10)
    c.allocate_many([("a", "qa"), ("b", "qb")])
    with pytest.raises(KeyError, match="no running rollout with id 'zzz'"):
        c.finish_many([("a", 1, 5), ("zzz", 1, 5), ("b", 0, 0)])
    assert (c.running, c.accepted, c.rejected, c.n_tokens) == (2, 0, 0, 0)  # nothing finished
    c.finish_many([("a", 2, 5), ("b", 0, 1)])
    assert (c.running, c.accepted, c.rejected, c.n_tokens) == (0, 2, 1, 6)
    c.finish_many([("a", 2, 5)])  # a retry of a finished one: a no-op
    assert (c.accepted, c.n_tokens) == (2, 6)


def test_admission_names_why_it_is_closed():
    c = StalenessController(train_batch_size=2, max_head_offpolicyness=0, max_concurrent_rollouts=3)
    assert c.admission() == "not started"
    c.start()
    assert c.admission() == "open"
    c.allocate_many([("a", "q"), ("b", "q")])
    assert c.admission() == "staleness bound"
    c.version = 1
    c.allocate("c")
    assert c.admission() == "full"
    c.stop()
    assert c.admission() == "stopped"


def test_nothing_past_the_trials_last_batch_is_admitted():
    """With a trial budget (total_train_steps x train_batch_size) admission
    closes once accepted - dropped + running reaches it, whatever the
    staleness bound allows; agent rejections and trainer drops give it back."""
    c = StalenessController(
        train_batch_size=4, max_head_offpolicyness=4, max_concurrent_rollouts=100, max_trajectories=6
    )
    c.start()
    assert sum(c.allocate(f"r{i}")[0] for i in range(20)) == 6  # the bound alone would admit 20
    ok, reason = c.allocate("x")
    assert not ok and reason.startswith("trial budget: accepted 0 - dropped 0 + running 6 >= total_train_steps")
    assert c.admission() == "trial budget"
    c.finish("r0", n_trajectories=1)
    c.finish("r1", n_trajectories=0)  # rejected by the agent: one back
    assert c.allocate("a")[0] and not c.allocate("x")[0]
    c.dropped = 1  # one dropped as stale: one back
    assert c.allocate("b")[0] and not c.allocate("x")[0]
    with pytest.raises(ValueError, match="max_trajectories"):
        StalenessController(1, 0, 1, max_trajectories=0)


def test_release_worker_frees_its_rollouts_and_done_says_what_it_finished():
    """Rollout ids `<worker>:<epoch>:<row>`: a restarted rollout worker gets
    its predecessor's running rollouts back (ids and qids, generated again
    under the same ids); `done` holds those finished (rejected ones too),
    never to be generated again; other workers' rollouts stay."""
    c = started(100, 0, 100)
    for rid, qid in [("0:1:5", "p5"), ("0:2:1", "p1"), ("0:1:9", "p9"), ("0:1:7", "p7"), ("1:3:3", "o"), ("f", "f")]:
        assert c.allocate(rid, qid)[0]
    c.finish("0:1:9", 1)
    c.finish("0:1:7", 0)  # rejected by the agent: done as well
    assert c.release_worker(0) == (["0:1:5", "0:2:1"], ["p5", "p1"])
    assert [c.done.is_done(r) for r in ("0:1:7", "0:1:9", "0:1:5", "0:2:1")] == [True, True, False, False]
    assert c.running == 2 and c.allocate("0:1:5", "p5")[0]  # the slot is back; the same id is admitted again
    assert c.release_worker(1) == (["1:3:3"], ["o"])
    assert c.release_worker(7) == ([], [])  # never admitted anything


def test_finished_ids_are_remembered_up_to_a_bound(monkeypatch):
    monkeypatch.setattr(staleness, "FINISHED_IDS_KEPT", 2)
    c = started(100, 0, 100)
    for rid in ("a", "b", "c"):
        c.allocate(rid)
        c.finish(rid, 1)
    assert not c.is_known("a") and c.is_known("b") and c.is_known("c")  # the oldest forgotten
    c.finish("c", 1)  # still idempotent for recent ones
    assert c.accepted == 3


@pytest.mark.parametrize(
    "bad", [dict(train_batch_size=0), dict(max_head_offpolicyness=-1), dict(max_concurrent_rollouts=0)]
)
def test_impossible_settings_are_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        StalenessController(**{"train_batch_size": 1, "max_head_offpolicyness": 0, "max_concurrent_rollouts": 1, **bad})
