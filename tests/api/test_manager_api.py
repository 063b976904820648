"""The manager's HTTP contracts: what goes on the wire, both forms of the
batched calls, and bad bodies refused with the field named."""

from __future__ import annotations

import pytest

from realrl.api import manager_api as api
from realrl.base.http_body import BodyError, from_json, to_json


def refused(parse, body) -> str:
    with pytest.raises(BodyError) as e:
        parse(body)
    assert e.value.status == 400
    return str(e.value)


def test_allocate_single_and_list_forms():
    one = api.AllocateRolloutRequest.from_body({"rollout_id": "r", "qid": "q", "wait_s": 2})
    assert one == api.AllocateRolloutRequest([api.RolloutToAllocate("r", "q")], 2.0)
    many = {"rollouts": [{"rollout_id": "r", "qid": "q"}, {"rollout_id": "s", "qid": "q"}], "wait_s": 0.5}
    assert to_json(api.AllocateRolloutRequest.from_body(many)) == many
    assert api.AllocateRolloutRequest.from_body({"rollouts": [{"rollout_id": "r", "qid": "q"}]}).wait_s == 0.0
    reply = api.AllocateRolloutReply(success=True, admitted=1, version=3)
    assert to_json(reply) == {"success": True, "admitted": 1, "version": 3, "reason": None}  # reason: always there
    assert from_json(api.AllocateRolloutReply, to_json(reply)) == reply


def test_finish_single_and_list_forms():
    assert api.FinishRolloutRequest.from_body({"rollout_id": "r", "n_trajectories": 0}) == api.FinishRolloutRequest(
        [api.RolloutEnd("r", 0, 0)]
    )
    many = {"rollouts": [{"rollout_id": "r", "n_trajectories": 2, "n_tokens": 7}]}
    assert to_json(api.FinishRolloutRequest.from_body(many)) == many


@pytest.mark.parametrize(
    "body, field",
    [
        ([1, 2], "the request body must be a JSON object"),
        ({}, "missing field 'rollout_id'"),
        ({"rollout_id": "r", "qid": 7}, "field 'qid' must be a string"),
        ({"rollout_id": "", "qid": "q"}, "field 'rollout_id' must be a non-empty string"),
        ({"qid": "q"}, "missing field 'rollout_id'"),
        ({"rollout_id": "r", "qid": "q", "wait_s": -1}, "field 'wait_s' must be >= 0"),
        ({"rollout_id": "r", "qid": "q", "wait_s": 1e9}, "field 'wait_s' must be <= 10.0"),
        ({"rollout_id": "r", "qid": "q", "wait_s": True}, "field 'wait_s' must be a finite number"),
        ({"rollout_id": "r", "qid": "q", "typo": 1}, "unknown field(s) 'typo'"),
        ({"rollouts": []}, "field 'rollouts' must be a non-empty list"),
        ({"rollouts": "q9"}, "field 'rollouts' must be a list"),
        ({"rollouts": None}, "missing field 'rollouts'"),
        ({"rollouts": [{"rollout_id": "q9", "qid": "q9"}, 5]}, "field 'rollouts[1]' must be a JSON object"),
        ({"rollouts": [{"rollout_id": "q9", "qid": "q9"}, {"qid": "q"}]}, "missing field 'rollouts[1].rollout_id'"),
    ],
)
def test_bad_allocate_bodies_name_the_field(body, field):
    assert field in refused(api.AllocateRolloutRequest.from_body, body)


@pytest.mark.parametrize(
    "body, field",
    [
        ({"rollout_id": "q1"}, "missing field 'n_trajectories'"),
        ({"rollout_id": "q1", "n_trajectories": "1"}, "field 'n_trajectories' must be an integer"),
        ({"rollout_id": "q1", "n_trajectories": -1}, "field 'n_trajectories' must be >= 0"),
        ({"rollout_id": "q1", "n_trajectories": 1, "n_tokens": -3}, "field 'n_tokens' must be >= 0"),
        ({"rollouts": [{"rollout_id": "q1", "n_trajectories": 1.5}]}, "field 'rollouts[0].n_trajectories'"),
    ],
)
def test_bad_finish_bodies_name_the_field(body, field):
    assert field in refused(api.FinishRolloutRequest.from_body, body)


def test_schedule_request_and_reply():
    request = from_json(api.ScheduleRequest, {"qid": "q", "n": 7, "parts": [3, 2, 2], "previous_server_url": None})
    assert request == api.ScheduleRequest("q", 7, parts=[3, 2, 2])
    assert to_json(request) == {"qid": "q", "n": 7, "avoid_urls": [], "parts": [3, 2, 2]}
    assert from_json(api.ScheduleRequest, {"qid": "q"}) == api.ScheduleRequest("q", 1)
    routed = api.ScheduleReply(version=1, url="a", parts=[api.ScheduledServer("a", 1), api.ScheduledServer("b", 1)])
    assert to_json(routed) == {
        "version": 1,
        "url": "a",
        "parts": [{"url": "a", "version": 1}, {"url": "b", "version": 1}],
    }
    assert from_json(api.ScheduleReply, to_json(routed)) == routed
    nowhere = api.ScheduleReply(version=1, reason="no generation server is up", down=[])
    assert to_json(nowhere) == {"version": 1, "url": None, "down": [], "reason": "no generation server is up"}


@pytest.mark.parametrize(
    "body, field",
    [
        ({"qid": "q1", "n": 0}, "field 'n' must be >= 1"),
        ({"qid": "q1", "n": 2**70}, "field 'n' is out of range"),
        ({"qid": "q1", "n": 4097}, "field 'n' must be <= 4096"),
        ({"qid": "q1", "n": 10_000, "parts": [1] * 10_000}, "field 'n' must be <= 4096"),
        ({"qid": "q1", "previous_version": "0"}, "field 'previous_version' must be int"),
        ({"qid": "q1", "avoid_urls": ["a", 1]}, "field 'avoid_urls[1]' must be a string"),
        ({"qid": "q1", "n": 3, "parts": [1, 1]}, "field 'parts' must be a non-empty list of counts >= 1 that sum"),
        ({"qid": "q1", "n": 2, "parts": [2, 0]}, "field 'parts' must be a non-empty list of counts >= 1 that sum"),
        ({"qid": "q1", "n": 2, "parts": []}, "field 'parts' must be a non-empty list"),
        ({"qid": "q1", "n": 2, "parts": [True, 1]}, "field 'parts' must be list[int]"),
        ({"qid": "q1", "n": 2, "parts": ["1", 1]}, "field 'parts' must be list[int]"),
        ({"qid": "q1", "n": 2, "parts": [1, "1"]}, "field 'parts[1]' must be an integer"),
    ],
)
def test_bad_schedule_bodies_name_the_field(body, field):
    assert field in refused(lambda b: from_json(api.ScheduleRequest, b), body)


def test_release_and_reset():
    assert from_json(api.ReleaseRequest, {"url": "a", "ticket": 3}) == api.ReleaseRequest("a", 3, 1, 0)
    assert "field 'n' must be an integer" in refused(
        lambda b: from_json(api.ReleaseRequest, b), {"url": "a", "ticket": 3, "n": True}
    )
    assert "missing field 'ticket'" in refused(lambda b: from_json(api.ReleaseRequest, b), {"url": "a"})
    assert "field 'n' must be <= 4096" in refused(
        lambda b: from_json(api.ReleaseRequest, b), {"url": "a", "ticket": 3, "n": 4097}
    )
    assert "missing field 'worker_index'" in refused(lambda b: from_json(api.ResetRolloutWorkerRequest, b), {})
    assert "must be >= 0" in refused(lambda b: from_json(api.ResetRolloutWorkerRequest, b), {"worker_index": -1})
    assert to_json(api.ResetRolloutWorkerReply(qids=[])) == {"qids": [], "rollout_ids": [], "done": {}}
    done = {"1": {"rows": 3, "bits": "IA=="}}  # epoch 1, row 2 (Ledger.to_wire)
    reply = from_json(api.ResetRolloutWorkerReply, {"qids": ["q@1"], "rollout_ids": ["0:1:4"], "done": done})
    assert (reply.rollout_ids, reply.done) == (["0:1:4"], done)


def test_status_replies_round_trip():
    assert to_json(api.ErrorReply("missing field 'qid'")) == {"error": "missing field 'qid'"}
    info = api.ServerInfo(index=0, url="a", state="joining", reason="", in_flight=0, scheduled=0)
    servers = api.ServersReply(version=2, servers=[info], events={"joined": 1})
    wire = to_json(servers)
    assert wire["servers"][0]["version"] is None and wire["servers"][0]["first_request_version"] is None
    assert from_json(api.ServersReply, wire) == servers
    assert "field 'servers[0].state' must be one of" in refused(
        lambda b: from_json(api.ServersReply, b), {**wire, "servers": [{**wire["servers"][0], "state": "gone"}]}
    )
    stats = api.RolloutStats(
        **dict.fromkeys(("running", "accepted", "rejected", "dropped", "admitted", "version", "trainer_version"), 0),
        n_tokens=0,
        started=True,
        stopped=False,
        loaded_version=0,
        n_servers=1,
        server_in_flight={"a": 0},
        server_events={},
        bad_requests=0,
        unauthorized=0,
        gen_idle_s=1.5,
        gen_server_s=2.0,
        gen_tokens=3,
        gen_clock_s=2,
    )
    assert from_json(api.RolloutStats, to_json(stats)) == stats
    assert "unknown field(s) 'renamed'" in refused(
        lambda b: from_json(api.RolloutStats, b), {**to_json(stats), "renamed": 1}
    )
