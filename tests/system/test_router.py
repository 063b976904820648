"""RequestRouter: least-requests routing, sticky per weight version, and utilization. Pure, in-process."""

from __future__ import annotations

import pytest

from realrl.system.router import NoServerUp, RequestRouter, Reservations


def test_router_least_requests_ties_and_stickiness():
    r = RequestRouter(["a", "b"], [0, 0])
    # Sequential schedule+release: in-flight ties every time, the total breaks them.
    picks = []
    for _ in range(4):
        url, _ = r.schedule()
        picks.append(url)
        r.release(url)
    assert picks == ["a", "b", "a", "b"]
    assert [r.schedule()[0] for _ in range(4)] == ["a", "b", "a", "b"]  # held: least in flight
    assert r.in_flight == {"a": 2, "b": 2}
    assert r.schedule(3, "a", 0) == ("a", 0)  # sticky while a holds version 0
    assert r.in_flight["a"] == 5
    r.set_loaded_version("a", 1)
    assert r.version == 0  # b still on 0
    assert r.schedule(1, "a", 0) == ("b", 0)  # a changed version: least requests
    assert r.schedule(1, "zzz", 0)[0] == "b"  # an unknown previous server is ignored
    r.release("a", 100)
    assert r.in_flight["a"] == 0  # never below zero
    with pytest.raises(KeyError):
        r.release("zzz")


def test_router_skips_a_down_server_and_absorbs_its_releases():
    clock = [0.0]
    r = RequestRouter(["a", "b"], [0, 0], clock=lambda: clock[0])
    assert [r.schedule()[0] for _ in range(4)] == ["a", "b", "a", "b"]
    clock[0] = 10.0
    assert r.mark_down("a") == 2  # two requests were in flight there
    assert r.mark_down("a") == 0 and r.up_urls == ["b"] and r.in_flight["a"] == 0
    # Nothing goes to a down server: not as least loaded, not sticky.
    assert {r.schedule()[0] for _ in range(5)} == {"b"}
    assert r.schedule(1, "a", 0)[0] == "b"
    r.release("a")
    r.release("a")  # the releases still due from before it went down: absorbed
    r.set_loaded_version("b", 3)
    r.add_server("a", 3)  # back (new weights loaded): its count starts from 0
    assert r.in_flight["a"] == 0 and r.up_urls == ["a", "b"]
    r.release("a")  # one too many is still never below zero
    assert r.schedule()[0] == "a"
    # avoid: another server while one is up; the avoided one when it is the only one
    assert r.schedule(1, None, None, avoid=["a"])[0] == "b"
    assert r.schedule(1, None, None, avoid=["a", "b"])[0] in ("a", "b")
    r.mark_down("a")
    r.mark_down("b")
    with pytest.raises(NoServerUp):
        r.schedule()
    # a new server mid-run
    r.add_server("c", 3)
    assert r.schedule()[0] == "c" and r.urls == ["a", "b", "c"]
    # utilization counts a server only while it is in routing
    clock[0] = 20.0
    u = r.utilization()
    assert u["gen_server_s"] == 10.0 + 10.0 + 10.0  # a and b up from 0 to 10 s, c from 10 to 20 s
    assert u["gen_idle_s"] == 0.0  # each busy all that time
    with pytest.raises(KeyError):
        r.release("zzz")


def test_router_version_never_goes_back_when_servers_leave_and_join():
    r = RequestRouter(["a", "b"], [2, 2])
    r.set_loaded_version("a", 3)  # an update in progress: b still on 2
    assert r.version == 2
    r.mark_down("b")  # the oldest server leaves: the ones up all hold 3
    assert r.version == 3
    with pytest.raises(ValueError, match="older than the servers in routing"):
        r.add_server("b", 2)  # rejoining with old weights would drag admission back
    assert r.version == 3 and not r.is_up("b")
    r.add_server("b", 3)
    assert r.version == 3 and r.is_up("b")
    r.mark_down("a")
    r.mark_down("b")
    assert r.version == 3  # nothing up: stays where it was
    with pytest.raises(ValueError):
        r.add_server("d", 0)
    r.add_server("d", 4)
    assert r.version == 4


def test_reservations_release_exactly_what_was_scheduled():
    res = Reservations(max_per_qid=10)
    t1 = res.reserve("q", {"a": 3, "b": 2})
    t2 = res.reserve("p", {"a": 1})
    assert (t1, t2) == (1, 2) and res.room("q") == 5 and res.held() == 6
    assert res.release(t1, "a", 100) == 3  # at most what the ticket holds there
    assert res.release(t1, "a", 1) == 0  # a repeated release lowers nothing
    assert res.release(t1, "c", 1) == 0  # a server the ticket never had
    assert res.release(t2, "a", 1) == 1
    assert res.release(t2, "a", 1) == 0  # a ticket given back in full
    with pytest.raises(KeyError, match="unknown ticket 3"):
        res.release(3, "a", 1)  # never issued
    with pytest.raises(ValueError, match="more than 10"):
        res.reserve("q", {"a": 9})  # q holds 2 (on b): 11 > 10
    # The rollout ends: what its tickets still hold goes back, once.
    t3 = res.reserve("q", {"a": 4})
    assert res.release_qid("q") == {"b": 2, "a": 4}
    assert res.release_qid("q") == {} and res.release(t3, "a", 4) == 0 and res.held() == 0 and res.room("q") == 10
