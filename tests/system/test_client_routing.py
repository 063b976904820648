"""Client-side routing (realrl/system/client_routing.py) against a real manager process.

The manager runs as a worker of a real trial (etcd, the launcher); its
generation servers are simulated ones (`realrl.impl.generation.sim_server`:
real HTTP endpoints, real weight loads from disk) in this test's event loop;
two `ClientRouting`s stand for two rollout workers, over the real manager
client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import urllib.request

from realrl.api.manager_api import RoutedServer, RoutingTable
from realrl.api.system_api import GserverManagerConfig
from realrl.base import names, trial_secret
from realrl.impl.generation.sim_server import SimServerHost
from realrl.launcher.local import WorkerGroup
from realrl.system.client_routing import ClientRouting
from realrl.system.manager_client import GserverManagerClient
from tests.impl.test_sim_server import save_weights, sim_config
from tests.system.trial_thread import TrialThread, wait_until

EXP = "client-routing"
HEALTH_S = 0.3  # the manager's health_check_interval here


def rollout_stats(manager_url: str) -> dict:
    request = urllib.request.Request(manager_url + "/rollout_stats", headers=trial_secret.http_headers())
    with urllib.request.urlopen(request, timeout=10) as resp:
        return json.load(resp)


async def until(predicate, timeout: float = 30.0, what: str = "condition") -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def manager_trial(tmp_path, etcd_addr: str, urls: list[str]):
    """A trial with a manager (two rollout workers' worth) over the servers at `urls`."""
    save_weights(str(tmp_path / "weights" / "0"), 4)
    cfg = GserverManagerConfig(
        n_servers=len(urls),
        train_batch_size=2,
        weights_dir=str(tmp_path / "weights"),
        poll_interval=0.05,
        health_check_interval=HEALTH_S,
        n_rollout_workers=2,
    )
    trial = TrialThread(tmp_path, etcd_addr, [WorkerGroup("gserver_manager", 1, cfg)], EXP)
    await asyncio.to_thread(trial.start)
    try:
        await asyncio.to_thread(wait_until, lambda: trial.launcher.worker_pids, 60, "the manager process")
        for i, url in enumerate(urls):
            await asyncio.to_thread(trial.set, names.gen_server(EXP, trial.trial, i), url)
        manager_url = await asyncio.to_thread(trial.wait_key, names.gen_server_manager(EXP, trial.trial))
        await asyncio.to_thread(trial.start_training)
        yield trial, manager_url
    finally:
        await asyncio.to_thread(trial.close)


def test_workers_route_from_the_table_and_balance_by_each_others_reported_load(tmp_path, etcd_server):
    async def go():
        host = SimServerHost(sim_config())
        urls = await host.start(3)
        try:
            async with manager_trial(tmp_path, etcd_server.addr, urls) as (trial, manager_url):
                await scenario(trial, manager_url, host, urls)
        finally:
            await host.close()

    async def scenario(trial, manager_url, host, urls):
        client = GserverManagerClient(manager_url, retries=1, retry_backoff_s=0.01)
        w0 = ClientRouting(client, 0, report_interval_s=0.05)
        w1 = ClientRouting(client, 1, report_interval_s=0.05)
        try:
            # The table: every server, at version 0. Worker 0 puts 5 requests on one server...
            first = await w0.schedule_request("q0", 5)
            assert first.version == 0 and {s.url for s in w0.table.servers} == set(urls)
            busy = first.url
            await until(lambda: rollout_stats(manager_url)["server_in_flight"][busy] == 5, what="w0's report")
            # ... which worker 1 learns from the reply to its own report, and routes around.
            await w1.schedule_request("q1", 1)  # (starts worker 1; one request somewhere)
            await until(lambda: w1._others.get(busy) == 5, what="w1 to see w0's load")
            reply = await w1.schedule_request("q2", 4, parts=[1, 1, 1, 1])
            assert busy not in {p.url for p in reply.parts}
            # Sticky while the previous server holds the previous version, even onto the busy one.
            sticky = await w1.schedule_request("q3", 1, previous_server_url=busy, previous_version=0)
            assert sticky.url == busy
            await until(lambda: sum(rollout_stats(manager_url)["server_in_flight"].values()) == 11, what="totals")

            # Passive health: a server that keeps answering a worker's requests is not probed.
            answering = next(u for u in urls if u != busy)
            before = {u: host.by_server[u]["/health"] for u in urls}
            for _ in range(int(6 * HEALTH_S / 0.05)):
                w0._mine[answering] += 1
                await w0.release_request(answering, 0, n_tokens=3)
                await asyncio.sleep(0.05)
            checks = {u: host.by_server[u]["/health"] - before[u] for u in urls}
            assert checks[answering] <= 1 and min(checks[u] for u in urls if u != answering) >= 4, checks
            assert all(s.state == "up" for s in (await client.servers()).servers)

            # A new version: the table says so within moments; stickiness to version 0 ends.
            save_weights(str(tmp_path / "weights" / "1"), 4)
            await asyncio.to_thread(trial.set, names.model_version(EXP, trial.trial, "actor"), "1")
            await until(lambda: w0.table.version == 1 and w1.table.version == 1, what="version 1 in the tables")
            assert {s.version for s in w0.table.servers} == {1}
            moved = await w0.schedule_request("q4", 1, previous_server_url=busy, previous_version=0)
            assert moved.version == 1

            # A server dies: the worker that saw it fail reports it, the manager probes it and takes it
            # out at once, the next pick avoids it, and the table tells every worker.
            dead = answering
            left = w1.left_routing(dead)
            await host._runners[urls.index(dead)].cleanup()
            reply = await w0.schedule_request("q5", 1, avoid_urls=[dead])
            assert reply.down == [dead] and reply.url != dead
            await asyncio.wait_for(asyncio.shield(left), 10)
            assert dead not in {s.url for s in w1.table.servers}
            for i in range(6):
                assert (await w1.schedule_request(f"q6-{i}", 1)).url != dead

            # A rollout worker restarting: its predecessor's requests in flight leave the manager's counts.
            await w0.close()  # (its process died)
            await client.call("POST", "/reset_rollout_worker", {"worker_index": 0})
            up = {s.url for s in w1.table.servers}
            w1_load = sum(n for u, n in w1._mine.items() if u in up)
            await until(
                lambda: sum(rollout_stats(manager_url)["server_in_flight"].values()) == w1_load,
                what="only worker 1's load to stay",
            )
        finally:
            await w0.close()
            await w1.close()
            await client.close()

    asyncio.run(go())


def test_during_a_fan_out_new_requests_go_to_servers_holding_the_newest_version():
    """Servers a, b updated to version 2, c still on 1: c gets nothing new
    however idle it is, and a sticky request on c's version stays there."""
    routing = ClientRouting(manager=None, worker_index=0)
    table = [RoutedServer("http://a", 2, 0), RoutedServer("http://b", 2, 0), RoutedServer("http://c", 1, 0)]
    routing.set_table(RoutingTable(revision=7, version=1, servers=table))
    routing._mine.update({"http://a": 5, "http://b": 3})
    assert routing._pick(None, None, set()) == "http://b"  # least loaded of the updated ones
    assert routing._pick("http://c", 1, set()) == "http://c"  # sticky: c still holds its version
    assert routing._pick(None, None, {"http://a", "http://b"}) == "http://c"  # all updated ones failed
    routing.set_table(RoutingTable(revision=8, version=2, servers=[*table[:2], RoutedServer("http://c", 2, 0)]))
    assert routing._pick(None, None, set()) == "http://c"  # updated too, and idle
