"""The drop rule of a weight group's epoch, both protocols
(realrl/system/weight_drops.py, docs/design.md §8) over a real sealed store on
127.0.0.1: when a member may be dropped, what a drop tells the sender, and the
lag rule's clock. The protocols' members, stalled and dropped for real:
tests/system/test_weight_broadcast.py."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from realrl.impl.weights.broadcast import GroupSpec, StoreServer, connect_store
from realrl.system.weight_drops import Drops, Lag

HOST, KEY = "127.0.0.1", b"k" * 32


@pytest.fixture
def epoch():
    """An epoch of three members: its spec, and its store's clients (the manager's, the sender's)."""
    server = StoreServer(HOST)
    spec = GroupSpec("realrl-t-e1", HOST, server.port, 4, timeout_s=30)
    yield spec, connect_store(spec, KEY), connect_store(spec, KEY)
    server.close()


def test_a_member_is_dropped_only_once_the_groups_formed_and_while_another_goes_on(epoch):
    spec, owner, sender = epoch
    formed = False
    drops = Drops(spec, {"a": 1, "b": 2, "c": 3}, 5.0, None, lambda: owner, lambda: formed)
    assert not drops.drop("a", "down")  # the groups still form: the epoch is abandoned instead
    formed = True
    assert drops.drop("a", "down") and sender.get("drop/1") == b"dropped"  # (sealed: the sender reads it)
    assert drops.drop("a", "down again") and drops.dropped == {"a"}
    assert drops.drop("b", "down") and not drops.drop("c", "down")  # the last member left: no epoch without it
    assert drops.dropped == {"a", "b"} and not sender.check(["drop/3"])
    tree = dataclasses.replace(spec, member_groups="one")
    one = Drops(tree, {"a": 1, "b": 2}, 5.0, None, lambda: owner, lambda: True)
    assert not one.drop("a", "down")  # one group of all: it cannot go on without a member
    gone_by = {"b": "could not join"}  # (SGLang: the members it lost, those dropped too)
    lost = Drops(spec, {"a": 1, "b": 2, "c": 3}, 5.0, None, lambda: owner, lambda: True, lambda: gone_by)
    lost.on_drop = lambda url, why: gone_by.update({url: why})
    assert not lost.drop("b", "down") and lost.drop("c", "down") and gone_by["c"] == "down"
    assert not lost.drop("a", "down")  # every other member lost


def test_the_lag_rule_drops_a_member_its_peers_wait_for_only_while_a_newer_version_waits(epoch):
    spec, owner, sender = epoch
    out: list[tuple[str, str]] = []
    verdict = lambda url, why: out.append((url, why))  # noqa: E731 (the manager: out of routing)
    drops = Drops(spec, {"a": 1, "b": 2, "c": 3}, 0.3, verdict, lambda: owner, lambda: True)
    lag, newer = Lag(drops, 5), lambda: drops.newer_waits(0)

    async def scenario() -> None:
        assert not await lag.check(False, ["c"], newer)  # its peers do not hold version 5 yet
        assert not await lag.check(True, ["c"], newer)  # they do: the clock starts
        await asyncio.sleep(0.2)
        assert not await lag.check(False, ["c"], newer)  # (a peer no longer holds it: the clock stops)
        await asyncio.sleep(0.2)
        assert not await lag.check(True, ["c"], newer)  # 0.4 s since the start, 0 s since the peers hold it
        await asyncio.sleep(0.35)
        assert not await lag.check(True, ["c"], newer)  # past the bound, but no newer version waits
        sender.set("next/0", b"6")  # the sender holds version 6 while it still feeds announcement 0
        assert await lag.check(True, ["c"], newer)

    asyncio.run(scenario())
    assert out == [("c", "version 5 not in place 0.3 s after its peers, a newer waits")]
    assert drops.dropped == {"c"} and sender.get("drop/3") == b"dropped"
    assert newer() and not drops.newer_waits(1)
    sender.set("v/2", b"7")  # announced: a newer one waits for announcement 1 too
    assert drops.newer_waits(1)
