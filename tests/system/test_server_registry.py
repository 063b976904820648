"""ServerRegistry: the generation servers' states (joining, up, down, retired)
kept in step with the RequestRouter. Pure, in-process, on a hand-moved clock."""

from __future__ import annotations

import pytest

from realrl.api.manager_api import ServerInfo
from realrl.system.router import RequestRouter
from realrl.system.server_registry import RegistryChange, ServerRegistry


def registry(urls=("a", "b"), versions=None, failures_to_down=3):
    clock = [0.0]
    router = RequestRouter(list(urls), versions or [0] * len(urls), clock=lambda: clock[0])
    return ServerRegistry(router, list(urls), failures_to_down, clock=lambda: clock[0]), router, clock


def states(reg: ServerRegistry) -> dict[str, str]:
    return {url: s.state for url, s in reg.servers.items()}


def test_start_up_servers_are_up_and_health_failures_take_one_down():
    reg, router, clock = registry(failures_to_down=3)
    assert states(reg) == {"a": "up", "b": "up"} and reg.to_check() == ["a", "b"]
    router.schedule()  # one request in flight on a
    assert reg.health_checked("a", ok=False, gone=False) is None
    assert reg.health_checked("a", ok=True, gone=False) is None  # a success resets the count
    assert [reg.health_checked("a", ok=False, gone=False) for _ in range(3)] == [None, None, "down"]
    clock[0] = 5.0
    assert reg.mark_down("a", "timed out") == 1  # the request it had in flight
    assert reg.get("a").state == "down" and reg.get("a").since == 5.0 and reg.get("a").reason == "timed out"
    assert not router.is_up("a") and reg.up_count() == "1 of 2 registered servers up"
    assert reg.mark_down("a", "again") is None  # not up: nothing
    assert reg.health_checked("b", ok=False, gone=True) == "down"  # a refused connection: at once
    assert reg.events == {"down": 1}


def test_failures_while_loading_weights_do_not_count_unless_the_connection_is_refused():
    """SGLang's /health waits behind a weight update and then answers 503."""
    reg, _, _ = registry(failures_to_down=2)
    reg.health_checked("a", ok=False, gone=False)  # one failure before the load: kept
    reg.start_loading("a")
    reg.start_loading("a")  # two loads overlap (a join's and an update's)
    assert [reg.health_checked("a", ok=False, gone=False) for _ in range(5)] == [None] * 5
    assert reg.stop_loading("a") == 0  # another load still runs
    assert reg.health_checked("a", ok=False, gone=False) is None
    assert reg.stop_loading("a") == 6  # the failed checks not counted, for the log
    assert reg.get("a").failures == 1 and reg.events == {"unhealthy_while_loading": 6}
    assert reg.health_checked("a", ok=False, gone=False) == "down"  # loaded: counted again
    reg.start_loading("b")
    assert reg.health_checked("b", ok=False, gone=True) == "down"  # nothing listens: at once, loading or not


def test_a_down_server_that_answers_again_rejoins_once_it_holds_the_version():
    reg, router, _ = registry(versions=[2, 2])
    reg.mark_down("a", "gone")
    router.set_loaded_version("b", 3)
    assert reg.health_checked("a", ok=False, gone=False) is None  # still down
    assert reg.health_checked("a", ok=True, gone=False) == "rejoin"
    server = reg.start_join(0, "a")
    assert server is reg.get("a") and server.state == "joining" and server.reason == "answers again"
    assert reg.start_join(0, "a") is None  # already joining
    assert reg.health_checked("a", ok=True, gone=False) is None  # joining: not health-checked
    assert reg.to_check() == ["b"]
    assert reg.finish_join("a", 2) is None  # behind the servers in routing: load version 3 first
    assert not router.is_up("a")
    assert reg.finish_join("a", 3) == "rejoined"
    assert router.is_up("a") and router.loaded_version["a"] == 3 and reg.get("a").joined == 3
    assert reg.finish_join("a", 3) is None  # up: no second join
    assert reg.events == {"down": 1, "rejoined": 1}


def test_the_name_service_read_joins_new_servers_and_retires_gone_ones():
    reg, router, _ = registry()
    assert reg.read({0: "a", 1: "b"}) == []
    changes = reg.read({0: "a2", 1: "b", 2: "c"})  # 0 restarted at a new URL, 2 is new
    assert changes == [
        RegistryChange("retire", 0, "a", "server 0 registered again at a2"),
        RegistryChange("join", 0, "a2"),
        RegistryChange("join", 2, "c"),
    ]
    assert reg.read({0: "a2", 1: "b", 2: "c"}) == []  # nothing new
    assert reg.read({0: "a2", 2: "c"}) == [RegistryChange("retire", 1, "b", "unregistered")]
    assert reg.registered == {0: "a2", 2: "c"}


def test_join_retire_and_first_requests():
    reg, router, _ = registry()
    router.schedule()  # a
    assert reg.retire("a", "unregistered") == ("up", 1)  # was up, one request in flight
    assert reg.retire("a", "again") is None and reg.get("a").state == "retired"
    assert reg.health_checked("a", ok=True, gone=False) is None and reg.to_check() == ["b"]  # retired: not probed
    assert reg.start_join(0, "a") is reg.get("a") and reg.get("a").state == "joining"  # registered again
    reg.retire("a", "unregistered")
    server = reg.start_join(2, "c")
    assert server.state == "joining" and reg.get("c") is server
    assert reg.retire("c", "unregistered") == ("joining", 0)  # never in routing
    assert reg.finish_join("c", 0) is None  # it stopped joining
    reg.start_join(3, "d")
    assert reg.finish_join("d", 0) == "joined" and reg.up_count() == "2 of 2 registered servers up"
    # The version each server held at its first request; mid-run joiners are reported.
    assert [s.url for s in reg.first_requests({"b": 0, "d": 0})] == ["d"]  # b was up from the start
    assert reg.first_requests({"d": 0}) == []  # once
    assert reg.get("b").first_request_version == 0
    assert reg.not_retired() == "1 at b up; 3 at d up: joined"
    assert reg.events == {"retired": 3, "joined": 1}


def test_describe_lists_every_server_with_its_routing_figures():
    reg, router, _ = registry()
    router.schedule()
    router.schedule()
    router.release("b")
    reg.mark_down("b", "gone")
    reg.start_join(2, "c")
    assert reg.describe() == [
        ServerInfo(index=0, url="a", state="up", reason="", in_flight=1, scheduled=1, version=0),
        ServerInfo(index=1, url="b", state="down", reason="gone", in_flight=0, scheduled=1, version=0),
        ServerInfo(index=2, url="c", state="joining", reason="", in_flight=0, scheduled=0, version=None),
    ]
    assert reg.routed() == "0: 1, 1 (down): 1, 2 (joining): 0"


@pytest.mark.parametrize("state", ["up", "down"])
def test_health_checks_only_count_while_up(state):
    reg, _, _ = registry(failures_to_down=2)
    if state == "down":
        reg.mark_down("a", "gone")
    results = [reg.health_checked("a", ok=False, gone=False) for _ in range(4)]
    assert results == ([None, "down", "down", "down"] if state == "up" else [None] * 4)
