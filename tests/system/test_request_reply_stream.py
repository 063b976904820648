"""Request-reply stream between a master (this process) and three model-worker
processes (tests/system/stream_child.py reply_server), found through
name_resolve over a real etcd and over the file backend."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import subprocess
import time
import uuid

import numpy as np
import pytest
import zmq

from realrl.base import name_resolve, wire
from realrl.system.request_reply_stream.protocol import Payload
from realrl.system.request_reply_stream.reply_server import NameResolvingReplyServer
from realrl.system.request_reply_stream.request_client import (
    NameResolvingRequestClient,
    RemoteError,
    RequestLost,
)
from tests.conftest import make_nr_config
from tests.system.stream_child import kill, spawn

N_WORKERS = 3
SHARDS = {"actor@dp0": 0, "actor@dp1": 1, "critic@dp0": 2}


def routing_table(n: int) -> dict:
    routing: dict = {i: i for i in range(n)}
    routing.update({f"__data{i}__": i for i in range(n)})
    routing.update({shard: w for shard, w in SHARDS.items() if w < n})
    return routing


@dataclasses.dataclass
class Cluster:
    client: NameResolvingRequestClient
    workers: list[subprocess.Popen]
    config: name_resolve.NameResolveConfig
    experiment: str
    trial: str


def start_cluster(config, n_workers: int, go_file: str | None = None, **client_kwargs) -> Cluster:
    exp, trial = "rr", uuid.uuid4().hex[:8]
    extra = [go_file] if go_file else []
    workers = [spawn(config, "reply_server", exp, trial, str(i), *extra) for i in range(n_workers)]
    try:
        client = NameResolvingRequestClient(
            exp, trial, n_workers, routing_table(n_workers), connect_timeout=60, **client_kwargs
        )
    except BaseException:
        for w in workers:
            kill(w)
        raise
    return Cluster(client, workers, config, exp, trial)


def stop_cluster(cluster: Cluster) -> None:
    cluster.client.close()
    for w in cluster.workers:
        kill(w)


def call(client: NameResolvingRequestClient, *args, **kwargs) -> list:
    """One `call_async` on a loop of its own (the client serves any loop, one at a time)."""
    return asyncio.run(client.call_async(*args, **kwargs))


@pytest.fixture(scope="module", params=["etcd3", "file"])
def cluster(request, tmp_path_factory, etcd_server):
    config = make_nr_config(request.param, tmp_path_factory.mktemp("nr"), etcd_server)
    name_resolve.reconfigure(config)
    c = start_cluster(config, N_WORKERS)
    yield c
    stop_cluster(c)
    name_resolve.reconfigure(name_resolve.NameResolveConfig())


# ---- routing and results -------------------------------------------------------------


def test_routes_by_index_data_rank_and_shard_id(cluster):
    routing = routing_table(N_WORKERS)
    handlers = list(routing)
    datas = [{"i": i, "array": np.arange(i, dtype=np.float32)} for i in range(len(handlers))]
    results = call(cluster.client, handlers, "whoami", datas, timeout=30)
    for handler, data, result in zip(handlers, datas, results):
        assert result["worker"] == routing[handler], handler
        assert result["data"]["i"] == data["i"]
        np.testing.assert_array_equal(result["data"]["array"], data["array"])


def test_unknown_handler_is_a_key_error_listing_the_routes(cluster):
    with pytest.raises(KeyError, match="routing table") as info:
        asyncio.run(cluster.client.request_async([0, "nobody"], "whoami"))
    assert "__data0__" in str(info.value)


def test_remote_exception_carries_type_message_and_traceback(cluster):
    with pytest.raises(RemoteError) as info:
        call(cluster.client, [1], "fail", ["some data"], timeout=30)
    err = info.value
    assert err.remote_type == "ValueError"
    assert "boom: 'some data'" in err.remote_message
    assert "remote_failing_function" in err.remote_traceback
    assert "remote_failing_function" in str(err) and "'fail'" in str(err)
    assert err.worker_index == 1
    # The worker keeps serving.
    assert call(cluster.client, [1], "whoami", timeout=30)[0]["worker"] == 1


def test_unknown_handle_name_and_unsendable_result_become_error_replies(cluster):
    with pytest.raises(RemoteError, match="no handler 'nope'") as info:
        call(cluster.client, [2], "nope", timeout=30)
    assert "whoami" in str(info.value)  # lists what is registered
    with pytest.raises(RemoteError, match="cannot send"):
        call(cluster.client, [2], "unsendable", timeout=30)
    assert call(cluster.client, [2], "echo", [5], timeout=30) == [5]


def test_missing_reply_times_out_naming_the_request(cluster):
    client = cluster.client

    async def block_then_give_up():
        (rid,) = await client.request_async(["__data1__"], "block")
        with pytest.raises(TimeoutError) as info:
            await client.gather_async([rid], timeout=0.3)
        return rid, str(info.value)

    rid, text = asyncio.run(block_then_give_up())
    assert "'block'" in text and "__data1__" in text and rid in text
    # Let it finish; its late reply is dropped and the lane is free again (FIFO).
    call(client, [1], "release", timeout=30)
    (after,) = call(client, [1], "long_echo", ["after"], timeout=30)
    assert after["data"] == "after"
    assert call(client, [1], "whoami", timeout=30)[0]["worker"] == 1


def test_cheap_request_is_answered_while_a_long_one_runs(cluster):
    client = cluster.client
    finished = []  # handle names, in the order their calls returned

    async def one(name):
        (result,) = await client.call_async([0], name, timeout=30)
        finished.append(name)
        return result

    async def main():
        block = asyncio.ensure_future(one("block"))
        who = await one("whoami")
        assert not block.done()  # answered while "block" still waits
        release = asyncio.ensure_future(one("release"))
        return who, await release, await block

    who, released, blocked = asyncio.run(main())
    assert who["worker"] == 0 and released is True
    # "release" is answered inline; "block" can only finish after it.
    assert finished == ["whoami", "release", "block"]
    assert blocked == {"worker": 0, "released": True}


def test_long_requests_run_one_at_a_time_in_order(cluster):
    results = call(cluster.client, [2, 2, 2, 2], "long_echo", ["a", "b", "c", "d"], timeout=30)
    assert [r["data"] for r in results] == ["a", "b", "c", "d"]
    sequence = [r["sequence"] for r in results]
    assert sequence == list(range(sequence[0], sequence[0] + 4))


def test_many_interleaved_requests_gathered_in_another_order(cluster):
    client = cluster.client
    rng = random.Random(0)
    handlers = [rng.choice(list(routing_table(N_WORKERS))) for _ in range(200)]
    names_ = [rng.choice(["whoami", "long_echo"]) for _ in handlers]
    order = list(range(len(handlers)))
    rng.shuffle(order)

    async def main():
        ids = []
        for i, (handler, name) in enumerate(zip(handlers, names_)):
            ids += await client.request_async([handler], name, [i])
        gathered = []
        for chunk in range(0, len(order), 37):  # gather in a different order than sent
            picked = order[chunk : chunk + 37]
            gathered += zip(picked, await client.gather_async([ids[k] for k in picked], timeout=60))
        return gathered

    gathered = asyncio.run(main())
    assert sorted(k for k, _ in gathered) == list(range(len(handlers)))
    for k, result in gathered:
        assert result["data"] == k
        assert result["worker"] == routing_table(N_WORKERS)[handlers[k]]


def test_many_concurrent_async_calls(cluster):
    client = cluster.client
    routing = routing_table(N_WORKERS)
    rng = random.Random(1)
    jobs = [(rng.choice(list(routing)), rng.choice(["whoami", "long_echo"]), i) for i in range(200)]

    async def one(handler, name, i):
        await asyncio.sleep(rng.random() * 0.01)
        (result,) = await client.call_async([handler], name, [{"i": i, "x": np.full(3, i)}], timeout=60)
        return result

    async def main():
        return await asyncio.gather(*(one(*job) for job in jobs))

    results = asyncio.run(main())
    for (handler, _, i), result in zip(jobs, results):
        assert result["worker"] == routing[handler]
        assert result["data"]["i"] == i
        np.testing.assert_array_equal(result["data"]["x"], np.full(3, i))
    # An async timeout is a TimeoutError too, and the loop is not blocked meanwhile.
    ticks = []

    async def ticker():
        while True:
            ticks.append(1)
            await asyncio.sleep(0.01)

    async def timed_out():
        task = asyncio.ensure_future(ticker())
        try:
            with pytest.raises(TimeoutError, match="'block'"):
                await client.call_async([0], "block", timeout=0.3)
        finally:
            task.cancel()
        await client.call_async([0], "release", timeout=30)

    asyncio.run(timed_out())
    assert len(ticks) > 1
    assert call(client, [0], "long_echo", ["drained"], timeout=30)[0]["data"] == "drained"


def test_malformed_messages_are_rejected_and_both_ends_keep_serving(cluster):
    client = cluster.client
    # To the master's reply socket, from a stray peer.
    context = zmq.Context()
    stray = context.socket(zmq.PUSH)
    stray.setsockopt(zmq.LINGER, 1000)
    stray.connect(f"tcp://{client.recv_address}")
    before = client.n_rejected
    stray.send(b"not a message")
    stray.send(wire.dumps({"kind": "reply"}))  # decodes, but is no payload
    stray.close()
    context.term()
    # To a worker, through its request socket.
    (stats_before,) = call(client, [0], "stats", timeout=30)
    worker0 = client._routing_ids[0]
    client._send_sockets[0].send_multipart([worker0, b"\x00garbage"])
    client._send_sockets[0].send_multipart([worker0, b"a", b"b"])
    assert call(client, [0], "whoami", timeout=30)[0]["worker"] == 0
    (stats_after,) = call(client, [0], "stats", timeout=30)
    assert stats_after["n_rejected"] == stats_before["n_rejected"] + 2
    give_up = time.monotonic() + 30
    while client.n_rejected < before + 2 and time.monotonic() < give_up:
        call(client, [1], "whoami", timeout=30)
    assert client.n_rejected == before + 2


def test_a_request_nobody_confirms_is_warned_about_then_fails(tmp_path, etcd_server, realrl_caplog):
    """Worker 0 stalls (SIGSTOP) with a request on its way: the master names
    the unconfirmed request after `warn_after` and fails the call at
    `receipt_timeout`, while a long request that its worker confirmed may run
    past both."""
    config = make_nr_config("etcd3", tmp_path, etcd_server)
    name_resolve.reconfigure(config)
    c = start_cluster(config, 2, warn_after=0.3, receipt_timeout=1.5)
    stalled = c.workers[0]
    try:
        client = c.client

        async def lose_a_request():
            (blocked,) = await client.request_async([1], "block")  # confirmed, then runs until released
            os.kill(stalled.pid, signal.SIGSTOP)
            with pytest.raises(RequestLost) as info:
                await client.call_async([0, 0, 0, 0], "long_echo", ["a", "b", "c", "d"], timeout=60)
            # The confirmed long request was never counted as lost.
            with pytest.raises(TimeoutError) as slow:
                await client.gather_async([blocked], timeout=0.1)
            return str(info.value), slow.value

        text, slow = asyncio.run(lose_a_request())
        assert "'long_echo' request" in text and "model worker 0" in text and "gone or stalled" in text
        warnings = [r.getMessage() for r in realrl_caplog.records if "unanswered for" in r.getMessage()]
        assert warnings and all("'long_echo' request" in w and "to model worker 0" in w for w in warnings)
        assert any("not confirmed by the worker yet" in w for w in warnings)
        lost_id = text.split("request ", 1)[1].split(" ", 1)[0]
        assert any(lost_id in w for w in warnings)
        assert not isinstance(slow, RequestLost)
    finally:
        os.kill(stalled.pid, signal.SIGCONT)
        stop_cluster(c)
        name_resolve.reconfigure(name_resolve.NameResolveConfig())


def test_a_stray_connection_to_a_request_socket_takes_no_request(tmp_path, etcd_server):
    """Issue 33 item 4: a stray PULL (refused at the handshake) and a stray
    DEALER (never addressed) connect to worker 0's request socket; every
    request still reaches worker 0 and is answered, and neither stray gets
    one. (With a PUSH request socket the PULL took every other request and
    the call failed as RequestLost.)"""
    config = make_nr_config("etcd3", tmp_path, etcd_server)
    name_resolve.reconfigure(config)
    c = start_cluster(config, 1, warn_after=0.3, receipt_timeout=2.0)
    context = zmq.Context()
    strays = [context.socket(zmq.PULL), context.socket(zmq.DEALER)]
    strays[1].setsockopt(zmq.ROUTING_ID, b"stray")
    try:
        for stray in strays:
            stray.setsockopt(zmq.LINGER, 0)
            stray.connect(f"tcp://{_master_send_address(c)}")
        time.sleep(0.5)  # both connected (or refused) before the requests go out
        replies = call(c.client, [0] * 20, "echo", [f"m{i}" for i in range(20)], timeout=30)
        assert replies == [f"m{i}" for i in range(20)]
        assert [stray.poll(200) for stray in strays] == [0, 0]
    finally:
        for stray in strays:
            stray.close()
        context.term()
        stop_cluster(c)
        name_resolve.reconfigure(name_resolve.NameResolveConfig())


def _master_send_address(cluster: Cluster) -> str:
    from realrl.base import names

    return name_resolve.get(names.request_reply_stream(cluster.experiment, cluster.trial, "master_send_0"))


# ---- SYN/ACK ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["etcd3"])
def test_syn_ack_runs_only_when_every_worker_has_the_request(backend, tmp_path, etcd_server):
    config = make_nr_config(backend, tmp_path, etcd_server)
    name_resolve.reconfigure(config)
    go_file = str(tmp_path / "go")
    c = start_cluster(config, N_WORKERS, go_file=go_file)  # workers connect but do not serve until go
    try:
        client = c.client
        with pytest.raises(TimeoutError, match="no SYN") as info:
            asyncio.run(client.request_async([0, 1, 2], "mark", no_syn=False, timeout=0.5))
        assert "model worker 0" in str(info.value)
        open(go_file, "w").close()
        # The cancelled request never ran anywhere: each worker counts its first mark.
        assert call(client, [0, 1, 2], "mark", timeout=30, no_syn=False) == [1, 1, 1]
        assert call(client, ["__data0__", "__data1__", "__data2__"], "mark", timeout=30, no_syn=True) == [2, 2, 2]

        async def main():
            return await asyncio.gather(
                client.call_async([0, 1, 2], "mark", timeout=30, no_syn=False),
                client.call_async([0, 1, 2], "whoami", timeout=30, no_syn=False),
            )

        marks, whoami = asyncio.run(main())
        assert marks == [3, 3, 3] and [r["worker"] for r in whoami] == [0, 1, 2]
    finally:
        stop_cluster(c)
        name_resolve.reconfigure(name_resolve.NameResolveConfig())


# ---- connection errors ---------------------------------------------------------------------


def test_master_names_workers_that_never_connect(tmp_path, etcd_server):
    name_resolve.reconfigure(make_nr_config("etcd3", tmp_path, etcd_server))
    try:
        with pytest.raises(TimeoutError, match=r"model workers \[0, 1\] did not connect"):
            NameResolvingRequestClient("rr", uuid.uuid4().hex[:8], 2, {0: 0, 1: 1}, connect_timeout=0.3)
        with pytest.raises(TimeoutError, match="master did not register"):
            NameResolvingReplyServer("rr", uuid.uuid4().hex[:8], 0, connect_timeout=0.3)
        with pytest.raises(ValueError, match="outside"):
            NameResolvingRequestClient("rr", uuid.uuid4().hex[:8], 2, {0: 0, "x": 5}, connect_timeout=0.3)
    finally:
        name_resolve.reconfigure(name_resolve.NameResolveConfig())


def test_payload_validation():
    good = Payload(0, "spec", {"a": 1}).to_wire()
    assert Payload.from_wire(wire.loads(wire.dumps(good))) == Payload.from_wire(good)
    for bad in [
        [1],
        {**good, "kind": "exec"},
        {**good, "id": 5},
        {**good, "handler": [1]},
        {**good, "err": {"type": 1}},
    ]:
        with pytest.raises(ValueError):
            Payload.from_wire(bad)


def test_a_sealed_stream_ignores_forged_replies_and_forged_requests(tmp_path, etcd_server, monkeypatch):
    """docs/design.md §14: with the trial's keys, every control message carries a seal; a
    reply from outside the trial (unsealed, or sealed with another trial's key) is ignored
    and counted, even one naming a request in flight, and so is a request to a worker."""
    from realrl.base import trial_secret
    from realrl.system.push_pull_stream import StreamSeal

    secret = trial_secret.ensure_secret(str(tmp_path / "trial"))
    monkeypatch.setenv("TEST_TRIAL_SECRET", secret)
    trial_secret.install(secret)
    config = make_nr_config("etcd3", tmp_path, etcd_server)
    name_resolve.reconfigure(config)
    c = start_cluster(config, 1, go_file=str(tmp_path / "go"))
    context = zmq.Context()
    try:
        client = c.client
        other = StreamSeal(os.urandom(32), "to-master")

        async def scenario():
            call = asyncio.ensure_future(client.call_async([0], "echo", ["genuine"], timeout=60))
            await asyncio.sleep(0.2)  # the request is in flight; the worker waits for the go file
            (request_id,) = list(client._inflight)
            forged = wire.dumps(Payload(0, "echo", request_id=request_id, result="forged", kind="reply").to_wire())
            stray = context.socket(zmq.PUSH)
            stray.setsockopt(zmq.LINGER, 1000)
            stray.connect(f"tcp://{client.recv_address}")
            stray.send(forged)
            stray.send_multipart([forged, other.tag(forged)])
            stray.close()
            give_up = time.monotonic() + 30
            while client.n_forged < 2 and time.monotonic() < give_up:
                await asyncio.sleep(0.05)
            assert not call.done()
            open(tmp_path / "go", "w").close()
            return await call

        assert asyncio.run(scenario()) == ["genuine"]
        assert client.n_forged == 2 and client.n_rejected == 0
        # A request that does not carry the master's seal never runs on the worker.
        worker0 = client._routing_ids[0]
        request = wire.dumps(Payload(0, "mark", kind="request").to_wire())
        client._send_sockets[0].send_multipart([worker0, request])
        (stats,) = call(client, [0], "stats", timeout=30)
        assert stats["n_forged"] == 1 and call(client, [0], "mark", timeout=30) == [1]
    finally:
        context.term()
        stop_cluster(c)
        name_resolve.reconfigure(name_resolve.NameResolveConfig())
