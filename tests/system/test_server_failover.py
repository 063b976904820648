"""Generation servers that come and go, seen from the rollout side: a
PartialRolloutManager against a GserverManager routing over a real torch
server (a GenerationServer worker) and a fake one that dies or hangs
(docs/architecture.md, "Generation servers that come and go").

In a module of its own: a TrialThread's launcher owns the process-global
name_resolve, so these trials must not overlap test_partial_rollout's
module-wide trial."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.request

from aiohttp import web

from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest
from realrl.base import names, trial_secret
from tests.system.test_partial_rollout import (  # noqa: F401  (tiny_kit: a fixture)
    EXP,
    HealthOnlyServer,
    manager_group,
    manager_stats,
    server_group,
    with_prm,
)
from tests.system.trial_thread import TrialThread


class HangingServer(HealthOnlyServer):
    """Answers /health and /model_info until `hang()`; from then on every
    request (health checks, /generate) waits forever: a server that stops
    answering without dying."""

    def __init__(self):
        self.hanging = threading.Event()
        super().__init__()

    async def _wait_if_hanging(self) -> None:
        while self.hanging.is_set():
            await asyncio.sleep(0.1)

    async def _health(self, request):
        await self._wait_if_hanging()
        return web.Response(text="ok")

    def _routes(self, app: web.Application) -> None:
        async def generate(request):
            await self._wait_if_hanging()
            return web.json_response({"error": "never reached"}, status=500)

        app.router.add_post("/generate", generate)

    def stop(self) -> None:
        self.hanging.clear()
        super().stop()


class NonBatchingServer(HealthOnlyServer):
    """A server that does not take SGLang's list form: a batched /generate is
    answered 200 with one object; a single request is passed on to the real
    server at `upstream`."""

    upstream: str | None = None

    def _routes(self, app: web.Application) -> None:
        import aiohttp

        async def generate(request):
            body = await request.json()
            if isinstance(body["input_ids"][0], list):
                return web.json_response({"output_ids": [], "meta_info": {"finish_reason": None}})
            async with aiohttp.ClientSession(headers=trial_secret.http_headers()) as session:
                async with session.post(f"{self.upstream}/generate", json=body) as resp:
                    return web.json_response(await resp.json(), status=resp.status)

        app.router.add_post("/generate", generate)


def two_server_trial(tmp_path, etcd_server, tiny_kit, fake_url: str, mode: str, **manager_kwargs) -> TrialThread:
    """A real server (index 0; `mode`: the torch server, or it emulating SGLang)
    and `fake_url` (index 1) behind one manager."""
    groups = [
        server_group(tiny_kit["model_dir"], mode=mode),
        manager_group(n_servers=2, train_batch_size=4, **manager_kwargs),
    ]
    t = TrialThread(tmp_path, etcd_server.addr, groups, EXP)
    t.start()
    t.start_training()
    t.set(names.gen_server(EXP, t.trial, 1), fake_url)
    t.manager_url = t.wait_key(names.gen_server_manager(EXP, t.trial))
    t.server_url = t.get(names.gen_server(EXP, t.trial, 0))
    return t


def two_groups(t: TrialThread, prefix: str) -> tuple[dict, list[dict]]:
    """Two groups of 4 answers at once with no retry allowed (the manager
    routes the second to the server the first left idle); every answer must
    come back complete. Returns (generation stats, the manager's scheduling replies)."""
    requests = [
        GenerationRequest(f"{prefix}-{i}", [5, 6, 7], 4, GenerationHyperparameters(max_new_tokens=4)) for i in range(2)
    ]

    async def go(prm, manager):
        results = await asyncio.gather(*(prm.generate(r) for r in requests))
        return results, prm.stats.pop(), manager.scheduled

    results, stats, scheduled = asyncio.run(with_prm(t.manager_url, go, request_retries=0, retry_backoff_s=0.01))
    assert [[len(o) for o in result.output_ids] for result in results] == [[4] * 4] * 2
    return stats, scheduled


def manager_servers(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(f"{url}/servers", headers=trial_secret.http_headers())) as resp:
        return {s["url"]: s for s in json.loads(resp.read())["servers"]}


# The failover tests run the live server as the torch server only: what they prove is the
# manager's and the client's (the same code whatever the live server is); the live server
# emulating SGLang serves, is routed to and takes weights in test_gserver_manager's
# test_routing_and_weight_updates_across_two_servers[sglang] and test_partial_rollout's [sglang] tests.
def test_a_dead_server_cannot_use_up_the_retries_while_another_is_up(tmp_path, etcd_server, tiny_kit):
    """No retry at all is allowed, and one of two groups is first routed to a
    server that is gone: each of its answers is resubmitted to the live one,
    because the manager, probing the server the client names, reports it out
    of routing."""
    fake = HealthOnlyServer()
    # No periodic health check during the test: only the clients' reports take the server out.
    t = two_server_trial(tmp_path, etcd_server, tiny_kit, fake.url, "torch", health_check_interval=3600)
    try:
        fake.stop()
        stats, scheduled = two_groups(t, "dead")
        assert any(s["url"] == fake.url for s in scheduled)  # a group went to the dead server first
        assert stats["server_losses"] >= 1 and stats["server_losses"] == stats["retries"]
        servers = manager_servers(t.manager_url)
        assert servers[fake.url]["state"] == "down" and servers[t.server_url]["state"] == "up"
        assert manager_stats(t.manager_url)["server_in_flight"] == {t.server_url: 0, fake.url: 0}
    finally:
        fake.stop()
        t.close()


def test_requests_on_a_server_that_stops_answering_move_to_another(tmp_path, etcd_server, tiny_kit):
    """A server that hangs (its connections stay open) fails its health
    checks: the manager takes it out of routing and the requests waiting on it
    are resubmitted at once, long before request_timeout."""
    fake = HangingServer()
    t = two_server_trial(
        tmp_path,
        etcd_server,
        tiny_kit,
        fake.url,
        "torch",
        health_check_interval=0.5,
        health_check_timeout=0.5,
        health_check_failures=2,
    )
    try:
        fake.hanging.set()
        # Two groups: the manager routes the second to the hanging server.
        requests = [
            GenerationRequest(f"hang-{i}", [5, 6, 7], 4, GenerationHyperparameters(max_new_tokens=4)) for i in range(2)
        ]

        async def go(prm, manager):
            t0 = asyncio.get_running_loop().time()
            results = await asyncio.gather(*(prm.generate(r) for r in requests))
            return results, prm.stats.pop(), manager.scheduled, asyncio.get_running_loop().time() - t0

        results, stats, scheduled, elapsed = asyncio.run(
            with_prm(
                t.manager_url,
                go,
                request_retries=1,
                retry_backoff_s=0.01,
                request_timeout=600,
                server_watch_interval=0.2,
            )
        )
        assert [[len(o) for o in result.output_ids] for result in results] == [[4] * 4] * 2
        assert elapsed < 120  # abandoned when the manager took the server out, not at the 600 s timeout
        if any(s["url"] == fake.url for s in scheduled):  # (the first health checks may have been faster)
            assert stats["server_losses"] >= 1
        assert manager_servers(t.manager_url)[fake.url]["state"] == "down"
        log = open(t.launcher.log_path("gserver_manager", 0)).read()
        assert f"generation server 1 at {fake.url} is down (/health did not answer within 0.5s" in log
    finally:
        fake.stop()
        t.close()


def test_a_server_that_cannot_batch_gets_its_answers_one_by_one(tmp_path, etcd_server, tiny_kit):
    """A batched /generate answered with something other than a list (a
    server without SGLang's list form) is not a failure: the group's answers
    go one by one, nothing is counted against the retries, every answer is
    complete."""
    fake = NonBatchingServer()
    # (the torch server only: the fake relays single requests to it, where SGLang does not differ)
    t = two_server_trial(tmp_path, etcd_server, tiny_kit, fake.url, "torch", health_check_interval=3600)
    try:
        fake.upstream = t.server_url
        stats, scheduled = two_groups(t, "nobatch")
        assert any(s["url"] == fake.url and s["n"] == 4 for s in scheduled)  # a group's batch went there
        # (Taken as a final error, the malformed answer would have failed the episode.)
        assert stats["retries"] == 0 and stats["server_losses"] == 0
        assert manager_stats(t.manager_url)["server_in_flight"] == {t.server_url: 0, fake.url: 0}
    finally:
        fake.stop()
        t.close()


def test_answers_wait_for_the_only_server_while_it_restarts(tmp_path, etcd_server, tiny_kit):
    """Issue 33 item 6: the only server dies; its worker restarts it. An
    answer asked for meanwhile, with no retry allowed, waits for the server
    to come back (the manager answers "no server is up" in between) instead
    of failing, and comes back complete."""
    import psutil

    groups = [server_group(tiny_kit["model_dir"]), manager_group(n_servers=1, health_check_interval=0.2)]
    t = TrialThread(tmp_path, etcd_server.addr, groups, EXP)
    try:
        t.start()
        t.start_training()
        t.manager_url = t.wait_key(names.gen_server_manager(EXP, t.trial))
        old_url = t.get(names.gen_server(EXP, t.trial, 0))
        (server,) = psutil.Process(t.launcher.worker_pids[0]).children()
        server.kill()
        for _ in range(600):  # until the manager has taken it out of routing
            if manager_servers(t.manager_url)[old_url]["state"] != "up":
                break
            time.sleep(0.05)
        assert manager_servers(t.manager_url)[old_url]["state"] != "up"
        request = GenerationRequest("wait-0", [5, 6, 7], 2, GenerationHyperparameters(max_new_tokens=4))

        async def go(prm, manager):
            result = await prm.generate(request)
            return result, prm.stats.pop()

        result, stats = asyncio.run(
            with_prm(t.manager_url, go, request_retries=0, retry_backoff_s=0.05, no_server_timeout=120)
        )
        assert [len(o) for o in result.output_ids] == [4, 4]
        assert stats["no_server_waits"] >= 1 and stats["retries"] == 0
        servers = manager_servers(t.manager_url)
        assert servers[old_url]["state"] in ("down", "retired")
        assert [s["index"] for s in servers.values() if s["state"] == "up"] == [0]
    finally:
        t.close()
