"""The GserverManager worker with real processes (local launcher, real etcd,
real torch servers, real HTTP); its state classes have their own tests
(test_staleness.py, test_router.py, test_server_registry.py).

Admission trials share one torch server (started once per module, registered
under each trial's `gen_servers/0`); the routing / weight-update trial runs
the whole generation side: two GenerationServer workers and the manager."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import aiohttp
import psutil
import pytest
from aiohttp import web

from realrl.api.system_api import GserverManagerConfig
from realrl.base import names, network, trial_secret
from realrl.impl.generation import GenerationClient, make_client
from realrl.launcher.local import WorkerGroup
from realrl.system.gserver_manager import delete_old_weight_dirs
from tests.system.test_generation_server import (
    EXP,
    SERVER_API,
    SERVER_MODES,
    build_tiny_model,
    server_config,
)
from tests.system.test_partial_rollout import HealthOnlyServer
from tests.system.trial_thread import TrialThread, wait_until

B = 2  # train_batch_size in the worker tests


# ---------------------------------------------------------------- weights on disk, in-process


def test_delete_old_weight_dirs_only_touches_old_versions_and_keeps_the_newest(tmp_path):
    for name in ("0", "1", "2", "3", ".tmp-4-abcd", "notes"):
        (tmp_path / name).mkdir()
    (tmp_path / "1" / "model.safetensors").write_text("x")
    (tmp_path / "README").write_text("keep")
    os.symlink(tmp_path / "notes", tmp_path / "0123")  # a link named like a version: never followed
    deleted = delete_old_weight_dirs(str(tmp_path), 2)
    assert sorted(os.path.basename(d) for d in deleted) == ["0", "1"]
    assert sorted(os.listdir(tmp_path)) == [".tmp-4-abcd", "0123", "2", "3", "README", "notes"]
    # weights.transport=broadcast: version 5 has no directory (it went over the wire); the newest written stays.
    deleted = delete_old_weight_dirs(str(tmp_path), 5)
    assert [os.path.basename(d) for d in deleted] == ["2"]
    assert sorted(os.listdir(tmp_path)) == [".tmp-4-abcd", "0123", "3", "README", "notes"]


def test_a_resume_removes_the_versions_after_its_checkpoint(tmp_path):
    """Broadcast writes versions on demand only: a resumed trainer removes a previous launch's
    later directories, which a server would otherwise load as the resumed trial's (§8)."""
    from realrl.system.model_worker import remove_versions_after

    for name in ("3", "4", "5", ".tmp-6-abcd", "notes"):
        (tmp_path / name).mkdir()
    os.symlink(tmp_path / "notes", tmp_path / "9")  # a link named like a version: never followed
    removed = remove_versions_after(str(tmp_path), 4)
    assert [os.path.basename(p) for p in removed] == ["5"]
    assert sorted(os.listdir(tmp_path)) == [".tmp-6-abcd", "3", "4", "9", "notes"]
    assert remove_versions_after(str(tmp_path / "missing"), 4) == []


def test_republishing_a_version_replaces_it_whole(tmp_path, tiny_model):
    """Recovery publishes its checkpoint's version again: the directory is
    replaced (renamed aside first, never half-deleted) and nothing is left over."""
    from realrl.system.model_worker import publish_weights

    _, other = build_tiny_model(seed=3)
    first = publish_weights(tiny_model, str(tmp_path), 5)
    second = publish_weights(other, str(tmp_path), 5)
    assert first == second and sorted(os.listdir(tmp_path)) == ["5"]
    from safetensors.torch import load_file

    shard = next(f for f in os.listdir(second) if f.endswith(".safetensors"))
    loaded = load_file(os.path.join(second, shard))
    name = next(iter(loaded))
    assert torch_equal(loaded[name], other.state_dict()[name])


def torch_equal(a, b) -> bool:
    import torch

    return bool(torch.equal(a.cpu(), b.detach().cpu()))


# ---------------------------------------------------------------- worker fixtures


@pytest.fixture(scope="module")
def tiny_model():
    return build_tiny_model(seed=1)[1]


class TorchServer:
    """A real torch server subprocess in its own process group (not a worker's)."""

    def __init__(self, root, model_dir: str, *args: str, env: dict | None = None):
        self.port = network.find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(root / f"server-{self.port}.log", "wb")
        cmd = [sys.executable, "-m", "realrl.impl.generation.torch_server", "--model-path", model_dir]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), "--num-threads", "1", *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        try:
            asyncio.run(_wait_healthy(self.url, self.proc))
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory, tiny_model):
    """One real torch server the admission trials share."""
    from realrl.system.model_worker import publish_weights

    root = tmp_path_factory.mktemp("shared_server")
    server = TorchServer(root, publish_weights(tiny_model, str(root / "weights"), 0))
    try:
        yield server.url
    finally:
        server.kill()


async def _wait_healthy(url: str, proc: subprocess.Popen) -> None:
    async with GenerationClient() as client:
        for _ in range(600):
            assert proc.poll() is None, "the torch server died at startup"
            if await client.health(url, timeout_s=5):
                return
            await asyncio.sleep(0.2)
    pytest.fail("the torch server never got healthy")


FRESH = {"step": 0, "version": 0, "consumed": 0, "dropped": 0, "filtered": 0}  # training_start of a new trial


def start_manager_trial(
    tmp_path, etcd_addr: str, server_url: str, start: dict | None = FRESH, **manager_kw
) -> tuple[TrialThread, str]:
    """A trial with only a manager; the shared server is registered as its server 0."""
    cfg = GserverManagerConfig(
        n_servers=1, train_batch_size=B, weights_dir=str(tmp_path / "weights"), poll_interval=0.05, **manager_kw
    )
    trial = TrialThread(tmp_path, etcd_addr, [WorkerGroup("gserver_manager", 1, cfg)], EXP).start()
    wait_until(lambda: trial.launcher.worker_pids or not trial.thread.is_alive(), 60, "the manager process")
    # After the launcher cleared the trial's keys, before the manager looks.
    trial.set(names.gen_server(EXP, trial.trial, 0), server_url)
    manager_url = trial.wait_key(names.gen_server_manager(EXP, trial.trial))
    if start is not None:  # what the master writes when training starts
        trial.set(names.training_start(EXP, trial.trial), json.dumps(start))

        def started() -> bool:
            request = urllib.request.Request(manager_url + "/rollout_stats", headers=trial_secret.http_headers())
            with urllib.request.urlopen(request, timeout=10) as resp:
                return json.load(resp)["started"]

        wait_until(started, 60, "the manager to open admission")
    return trial, manager_url


class Manager:
    """The rollout side of the HTTP contract, as a test client."""

    def __init__(self, session: aiohttp.ClientSession, url: str):
        self.session, self.url = session, url

    async def call(self, method: str, path: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
        kwargs = {"data": raw} if raw is not None else ({"json": body} if body is not None else {})
        async with self.session.request(method, self.url + path, **kwargs) as resp:
            return resp.status, await resp.json(content_type=None)

    async def post(self, path: str, body=None) -> dict:
        status, reply = await self.call("POST", path, body if body is not None else {})
        assert status == 200, reply
        return reply

    async def get(self, path: str) -> dict:
        status, reply = await self.call("GET", path)
        assert status == 200, reply
        return reply

    async def allocate(self, qid: str) -> dict:
        """One rollout of prompt `qid`, whose rollout id is the qid itself."""
        return await self.post("/allocate_rollout", {"rollout_id": qid, "qid": qid})

    async def schedule(self, body: dict) -> dict:
        """`/schedule_request` for a running rollout of `body["qid"]` (admitted
        first if it is not running, rollout id = qid), ticket left out of the reply."""
        await self.post("/allocate_rollout", {"rollout_id": body["qid"], "qid": body["qid"], "wait_s": 10})
        reply = await self.post("/schedule_request", body)
        self.tickets = getattr(self, "tickets", {})
        self.tickets[body["qid"]] = reply.pop("ticket")
        return reply

    async def release(self, qid: str, url: str, n: int = 1) -> dict:
        """Releases `n` requests on `url` of the last schedule of `qid`."""
        return await self.post("/release_request", {"url": url, "ticket": self.tickets[qid], "n": n})

    async def finish(self, qid: str, accepted: bool) -> dict:
        return await self.post("/finish_rollout", {"rollout_id": qid, "n_trajectories": int(accepted), "n_tokens": 3})

    async def wait_stats(self, key: str, value) -> dict:
        for _ in range(1200):
            stats = await self.get("/rollout_stats")
            if stats[key] == value:
                return stats
            await asyncio.sleep(0.05)
        pytest.fail(f"rollout_stats[{key!r}] never became {value!r}: {stats}")


def run_with_manager(url: str, scenario):
    async def main():
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout, headers=trial_secret.http_headers()) as session:
            return await scenario(Manager(session, url))

    return asyncio.run(main())


# ---------------------------------------------------------------- worker tests


@pytest.mark.parametrize("eta", [0, 1, 4])
def test_admission_with_concurrent_clients(tmp_path, etcd_server, shared_server, tiny_model, eta):
    from realrl.system.model_worker import publish_weights

    n_clients, per_client = 3, 4
    publish_weights(tiny_model, str(tmp_path / "weights"), 1)
    trial, url = start_manager_trial(tmp_path, etcd_server.addr, shared_server, max_head_offpolicyness=eta)

    async def scenario(m: Manager):
        refusals: list[str] = []

        async def client(c: int) -> list[str]:  # tries to keep `per_client` rollouts running
            held = []
            for k in range(per_client):
                reply = await m.allocate(f"c{c}-{k}")
                assert reply["version"] == 0
                if reply["success"]:
                    assert reply["reason"] is None
                    held.append(f"c{c}-{k}")
                else:
                    refusals.append(reply["reason"])
            return held

        held = [q for qs in await asyncio.gather(*(client(c) for c in range(n_clients))) for q in qs]
        limit = (eta + 1) * B
        assert len(held) == min(n_clients * per_client, limit) == limit
        assert len(refusals) == n_clients * per_client - limit
        assert all(r.startswith("staleness bound: ") for r in refusals), refusals
        assert (await m.get("/rollout_stats"))["running"] == limit

        # Finished and accepted rollouts still count: nothing new before a new version.
        await m.finish(held.pop(), accepted=True)
        assert not (await m.allocate("late"))["success"]
        # An agent-rejected rollout gives its budget back (exactly one).
        await m.finish(held.pop(), accepted=False)
        assert (await m.allocate("after-reject"))["success"]
        assert not (await m.allocate("late"))["success"]
        # So does a trainer drop.
        trial.set(names.dropped_samples(EXP, trial.trial), "1")
        await m.wait_stats("dropped", 1)
        assert (await m.allocate("after-drop"))["success"]
        assert not (await m.allocate("late"))["success"]
        # The trainer's version advances and the server loads it: B more.
        trial.set(names.model_version(EXP, trial.trial, "actor"), "1")
        await m.wait_stats("version", 1)
        more = [(await m.allocate(f"v1-{i}"))["success"] for i in range(B + 2)]
        assert more == [True] * B + [False, False]
        stats = await m.get("/rollout_stats")
        assert (stats["accepted"], stats["rejected"], stats["dropped"]) == (1, 1, 1)
        assert stats["running"] == limit - 2 + 1 + 1 + B
        status, reply = await m.call("POST", "/finish_rollout", {"rollout_id": "never-allocated", "n_trajectories": 1})
        assert status == 400 and "never-allocated" in reply["error"]

    try:
        run_with_manager(url, scenario)
        assert trial.complete() == 0
        log = open(trial.launcher.log_path("gserver_manager", 0)).read()
        assert "rollouts: running" in log  # the stats line
    finally:
        trial.close()


def test_a_refused_allocation_waits_for_admission_to_open(tmp_path, etcd_server, shared_server, tiny_model):
    """allocate_rollout with wait_s is a long poll: refused, it is held until
    admission opens (a rollout's budget given back, a new version the server
    holds) and then admits; with nothing changing it answers the refusal when
    wait_s has passed; a bad wait_s is a 400."""
    from realrl.system.model_worker import publish_weights

    publish_weights(tiny_model, str(tmp_path / "weights"), 1)
    trial, url = start_manager_trial(tmp_path, etcd_server.addr, shared_server, max_head_offpolicyness=0)
    loop_time = lambda: asyncio.get_running_loop().time()  # noqa: E731

    async def scenario(m: Manager):
        assert all([(await m.allocate(f"r{i}"))["success"] for i in range(B)])  # the budget of version 0
        t0 = loop_time()
        refused = await m.post("/allocate_rollout", {"rollout_id": "w0", "qid": "w0", "wait_s": 0.5})
        assert not refused["success"] and refused["reason"].startswith("staleness bound")
        assert loop_time() - t0 >= 0.5  # it waited the whole time (nothing opened)

        waiting = asyncio.ensure_future(m.post("/allocate_rollout", {"rollout_id": "w1", "qid": "w1", "wait_s": 10}))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await m.finish("r0", accepted=False)  # an agent-rejected rollout gives its slot back
        assert (await asyncio.wait_for(waiting, 5))["success"]

        waiting = asyncio.ensure_future(m.post("/allocate_rollout", {"rollout_id": "w2", "qid": "w2", "wait_s": 10}))
        await asyncio.sleep(0.3)
        assert not waiting.done()
        trial.set(names.model_version(EXP, trial.trial, "actor"), "1")  # the server loads it: B more
        assert (await asyncio.wait_for(waiting, 8))["success"]
        assert (await m.get("/rollout_stats"))["version"] == 1

        for bad in (-1, 1e9, "1", True):
            status, reply = await m.call("POST", "/allocate_rollout", {"rollout_id": "b", "qid": "b", "wait_s": bad})
            assert status == 400 and "wait_s" in reply["error"], (bad, reply)
        stats = await m.get("/rollout_stats")
        assert stats["running"] == B - 1 + 2 and stats["admitted"] == B + 2  # nothing admitted twice or by a bad call

    try:
        run_with_manager(url, scenario)
        assert trial.complete() == 0
    finally:
        trial.close()


def test_the_trial_ends_without_waiting_out_the_long_polls(tmp_path, etcd_server, shared_server):
    """A routing-table poll and a refused allocation, both waiting, are answered
    as the trial ends: the manager's HTTP cleanup waits for running handlers,
    so a poll left waiting held every trial's end for its wait_s (~10 s)."""
    trial, url = start_manager_trial(tmp_path, etcd_server.addr, shared_server, max_head_offpolicyness=0)

    async def scenario(m: Manager):
        loop = asyncio.get_running_loop()
        assert all([(await m.allocate(f"r{i}"))["success"] for i in range(B)])  # the budget of version 0
        revision = (await m.post("/routing_table", {}))["revision"]
        sent = loop.time()
        polls = [
            asyncio.ensure_future(m.call("POST", "/routing_table", {"after": revision, "wait_s": 30})),
            asyncio.ensure_future(m.call("POST", "/allocate_rollout", {"rollout_id": "w", "qid": "w", "wait_s": 10})),
        ]
        await asyncio.sleep(0.5)
        assert not any(p.done() for p in polls)  # both wait
        code = await asyncio.to_thread(trial.complete)
        (table_status, table), (allocate_status, refused) = await asyncio.gather(*polls)
        return code, loop.time() - sent, table_status, table, allocate_status, refused, revision

    try:
        code, elapsed, table_status, table, allocate_status, refused, revision = run_with_manager(url, scenario)
        assert code == 0
        assert table_status == 200 and table["revision"] == revision  # answered unchanged, before its 30 s
        assert allocate_status == 200 and not refused["success"]
        assert elapsed < 20  # well before the routing poll's 30 s (it held the end that long before)
    finally:
        trial.close()


def test_admission_waits_for_training_start_and_for_servers_to_hold_the_version(
    tmp_path, etcd_server, shared_server, tiny_model
):
    """A recovered trial (training starts at version 4 after 4 batches consumed
    and 1 dropped): nothing is admitted before the master says where training
    starts, nothing for version 4 before the server holds it, and then exactly
    what an uninterrupted run would hold. Allocate and finish are idempotent
    under duplicated requests."""
    from realrl.system.model_worker import publish_weights

    trial, url = start_manager_trial(
        tmp_path, etcd_server.addr, shared_server, start=None, max_head_offpolicyness=0, weight_update_retries=6
    )

    async def scenario(m: Manager):
        reply = await m.allocate("early")
        assert reply["reason"] == "waiting for the trainer: training has not started"
        # What the master publishes after recovering (version 4's weights are not on disk yet).
        trial.set(names.model_version(EXP, trial.trial, "actor"), "4")
        trial.set(names.dropped_samples(EXP, trial.trial), "1")
        trial.set(
            names.training_start(EXP, trial.trial),
            json.dumps({"step": 4, "version": 4, "consumed": 4 * B, "dropped": 1, "filtered": 0}),
        )
        await m.wait_stats("started", True)
        await m.wait_stats("trainer_version", 4)
        for i in range(3):  # the server cannot load version 4 yet: no budget for it
            assert not (await m.allocate(f"too-early-{i}"))["success"]
            await asyncio.sleep(0.3)
        publish_weights(tiny_model, str(tmp_path / "weights"), 4)
        await m.wait_stats("version", 4)
        # (η + version + 1) * B - consumed = (0 + 4 + 1) * 2 - 8 = 2 rollouts.
        replies = [await m.allocate(f"r{i}") for i in range(4)]
        assert [r["success"] for r in replies] == [True, True, False, False]
        # Duplicated requests (a client retrying a call whose reply it lost).
        await m.finish("r0", accepted=True)
        both = await asyncio.gather(m.finish("r1", accepted=True), m.finish("r1", accepted=True))
        assert both == [{"success": True}] * 2
        stats = await m.get("/rollout_stats")
        assert (stats["running"], stats["accepted"], stats["admitted"]) == (0, 4 * B + 1 + 2, 2)
        trial.set(names.dropped_samples(EXP, trial.trial), "2")  # one more dropped: one more slot
        await m.wait_stats("dropped", 2)
        body = {"rollout_id": "dup", "qid": "q"}
        both = await asyncio.gather(m.post("/allocate_rollout", body), m.post("/allocate_rollout", body))
        assert [r["success"] for r in both] == [True, True]
        stats = await m.get("/rollout_stats")
        assert (stats["running"], stats["admitted"]) == (1, 3)  # one slot, not two

    try:
        run_with_manager(url, scenario)
        assert trial.complete() == 0
    finally:
        trial.close()


def test_cap_stop_bad_requests_and_failed_weight_update(tmp_path, etcd_server, shared_server, capfd):
    trial, url = start_manager_trial(
        tmp_path,
        etcd_server.addr,
        shared_server,
        max_head_offpolicyness=4,
        max_concurrent_rollouts=3,
        weight_update_retries=1,
    )

    async def scenario(m: Manager):
        replies = [await m.allocate(f"q{i}") for i in range(5)]
        assert [r["success"] for r in replies] == [True, True, True, False, False]
        assert replies[3]["reason"] == "max_concurrent_rollouts reached (3)"
        await m.finish("q0", accepted=True)
        assert (await m.allocate("q5"))["success"]

        # Routing with one server, and the version it holds.
        reply = await m.schedule({"qid": "q1", "n": 2, "previous_server_url": None, "previous_version": None})
        assert reply["url"] == shared_server and isinstance(reply["version"], int)
        assert (await m.get("/rollout_stats"))["server_in_flight"] == {shared_server: 2}
        assert await m.release("q1", shared_server, 2) == {"success": True}
        assert (await m.get("/get_model_version"))["version"] == reply["version"]

        bad = [
            ("POST", "/allocate_rollout", None, b"{not json"),
            ("POST", "/allocate_rollout", [1, 2], None),
            ("POST", "/allocate_rollout", {}, None),
            ("POST", "/allocate_rollout", {"rollout_id": "r", "qid": 7}, None),
            ("POST", "/allocate_rollout", {"qid": "q"}, None),
            ("POST", "/finish_rollout", {"rollout_id": "q1"}, None),
            ("POST", "/finish_rollout", {"rollout_id": "q1", "n_trajectories": "1"}, None),
            ("POST", "/finish_rollout", {"rollout_id": "q1", "n_trajectories": -1}, None),
            ("POST", "/finish_rollout", {"rollout_id": "unknown", "n_trajectories": 1}, None),
            ("POST", "/schedule_request", {"qid": "q1", "n": 0}, None),
            ("POST", "/schedule_request", {"qid": "q1", "previous_version": "0"}, None),
            ("POST", "/release_request", {"url": "http://127.0.0.1:1", "n": 1}, None),
            ("POST", "/release_request", {"n": True, "url": shared_server}, None),
            ("POST", "/allocate_rollout", None, b'{"rollout_id": "r", "qid": NaN}'),
            # The list forms: validated whole before anything is admitted or finished.
            ("POST", "/allocate_rollout", {"rollouts": []}, None),
            ("POST", "/allocate_rollout", {"rollouts": "q9"}, None),
            ("POST", "/allocate_rollout", {"rollouts": [{"rollout_id": "q9", "qid": "q9"}, 5]}, None),
            ("POST", "/allocate_rollout", {"rollouts": [{"rollout_id": "q9", "qid": "q9"}, {"qid": "q"}]}, None),
            (
                "POST",
                "/finish_rollout",
                {
                    "rollouts": [
                        {"rollout_id": "q1", "n_trajectories": 1},
                        {"rollout_id": "unknown", "n_trajectories": 1},
                    ]
                },
                None,
            ),
            ("POST", "/schedule_request", {"qid": "q1", "n": 3, "parts": [1, 1]}, None),
            ("POST", "/schedule_request", {"qid": "q1", "n": 2, "parts": [2, 0]}, None),
            ("POST", "/schedule_request", {"qid": "q1", "n": 2, "parts": [True, 1]}, None),
            ("POST", "/schedule_request", {"qid": "q1", "n": 2, "parts": ["1", 1]}, None),
        ]
        for method, path, body, raw in bad:
            status, reply = await m.call(method, path, body, raw)
            assert status == 400 and isinstance(reply.get("error"), str), (path, body, raw, status, reply)
        # Nesting that used to end in a RecursionError (HTTP 500).
        nested = [
            ("/allocate_rollout", b"[" * 100_000 + b"]" * 100_000),
            ("/finish_rollout", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
            ("/schedule_request", b'{"qid": ' + b"[" * 100_000),
            ("/release_request", b'{"url": "x", "n": ' + b"[" * 20 + b"]" * 20 + b"}"),
        ]
        for path, raw in nested:
            status, reply = await m.call("POST", path, raw=raw)
            assert status == 400 and "nested deeper than" in reply["error"], (path, raw[:40], status, reply)
        assert (await m.call("GET", "/health"))[0] == 200
        stats = await m.get("/rollout_stats")
        assert stats["bad_requests"] == len(bad) + len(nested)
        assert (stats["running"], stats["accepted"]) == (3, 1)  # nothing changed by the bad requests

        assert await m.post("/stop_rollouts") == {"success": True}
        reply = await m.allocate("after-stop")
        assert reply == {"success": False, "admitted": 0, "reason": "rollouts stopped", "version": 0}
        await m.finish("q1", accepted=True)  # rollouts in flight still finish

    try:
        run_with_manager(url, scenario)
        # A version whose weights do not exist: the server refuses, the manager
        # retries, then fails and the trial stops, saying which server and why.
        trial.set(names.model_version(EXP, trial.trial, "actor"), "7")
        assert trial.join() == 1
        assert trial.launcher.failed_worker == "gserver_manager/0"
        err = capfd.readouterr().err
        missing = os.path.join(str(tmp_path / "weights"), "7")
        assert f"generation server {shared_server} could not load weight version 7 from {missing}" in err
        assert "after 2 attempts" in err  # 1 + weight_update_retries
    finally:
        trial.close()


def test_batched_allocate_and_finish(tmp_path, etcd_server, shared_server):
    # A rollout worker offers a batch of prompts in one call and reports
    # episodes that ended together in one call.
    trial, url = start_manager_trial(
        tmp_path, etcd_server.addr, shared_server, max_head_offpolicyness=4, max_concurrent_rollouts=5
    )

    def batch(*qids: str) -> dict:
        return {"rollouts": [{"rollout_id": q, "qid": q} for q in qids]}

    async def scenario(m: Manager):
        reply = await m.post("/allocate_rollout", batch(*(f"q{i}" for i in range(7))))
        assert (reply["success"], reply["admitted"]) == (True, 5)  # in order, up to the cap
        assert reply["reason"] == "max_concurrent_rollouts reached (5)"
        assert (await m.post("/allocate_rollout", batch("q0", "q1")))["admitted"] == 2  # repeated: a no-op
        assert (await m.get("/rollout_stats"))["running"] == 5
        done = {
            "rollouts": [
                {"rollout_id": "q0", "n_trajectories": 1, "n_tokens": 3},
                {"rollout_id": "q1", "n_trajectories": 0},
            ]
        }
        assert await m.post("/finish_rollout", done) == {"success": True}
        assert await m.post("/finish_rollout", done) == {"success": True}  # repeated: a no-op
        stats = await m.get("/rollout_stats")
        assert (stats["running"], stats["accepted"], stats["rejected"]) == (3, 1, 1)

        # A long poll for a batch is answered when the first fits: here when
        # a finish makes room for one.
        waiting = asyncio.ensure_future(m.post("/allocate_rollout", {**batch("q5", "q6", "q7"), "wait_s": 5}))
        await m.post("/allocate_rollout", batch("q7", "q8"))  # fills the cap meanwhile
        await asyncio.sleep(0.3)
        assert not waiting.done()
        await m.finish("q2", accepted=True)
        reply = await waiting
        assert (reply["success"], reply["admitted"]) == (True, 1)

    try:
        run_with_manager(url, scenario)
    finally:
        trial.close()


def test_schedules_belong_to_running_rollouts_and_release_exactly_what_they_hold(tmp_path, etcd_server, shared_server):
    """Junk cannot bend routing (issue 33 items 3, 5; issue 24 item 5): a
    schedule needs a running rollout's qid and stays within what one rollout
    may hold; a release gives back at most what its ticket holds; a rollout
    that ends, or whose worker restarts, gives back what its tickets still
    hold; a worker index the trial does not have is refused."""
    trial, url = start_manager_trial(tmp_path, etcd_server.addr, shared_server, n_rollout_workers=2)
    s = shared_server

    async def in_flight(m: Manager) -> int:
        return (await m.get("/rollout_stats"))["server_in_flight"][s]

    async def scenario(m: Manager):
        for rollout_id, qid in (("0:0:1:aa", "qa"), ("1:0:2:bb", "qb")):
            assert (await m.post("/allocate_rollout", {"rollout_id": rollout_id, "qid": qid}))["admitted"] == 1
        refused = [
            ({"qid": "nobody"}, 409),  # no running rollout
            ({"qid": "qa", "n": 2**62}, 400),
            ({"qid": "qa", "n": 10_000, "parts": [1] * 10_000}, 400),
        ]
        for body, status in refused:
            got, reply = await m.call("POST", "/schedule_request", body)
            assert got == status and "field" in reply["error"], (body, got, reply)
        ta = (await m.post("/schedule_request", {"qid": "qa", "n": 3}))["ticket"]
        tb = (await m.post("/schedule_request", {"qid": "qb", "n": 2}))["ticket"]
        assert await in_flight(m) == 5
        await m.post("/release_request", {"url": s, "ticket": ta, "n": 100})
        assert await in_flight(m) == 2  # qa's 3, not 100
        await m.post("/release_request", {"url": s, "ticket": ta, "n": 1})
        assert await in_flight(m) == 2  # a repeated release lowers nothing
        got, reply = await m.call("POST", "/release_request", {"url": s, "ticket": 999, "n": 1})
        assert got == 400 and "ticket" in reply["error"]
        # What one rollout may hold: 4096 requests.
        await m.post("/schedule_request", {"qid": "qa", "n": 4096})
        got, _ = await m.call("POST", "/schedule_request", {"qid": "qa", "n": 1})
        assert got == 409 and await in_flight(m) == 4098
        await m.finish("0:0:1:aa", accepted=False)  # its schedules end with it
        assert await in_flight(m) == 2
        # Worker 1 restarts: its running rollout is released, and so are its schedules.
        reply = await m.post("/reset_rollout_worker", {"worker_index": 1})
        assert reply["qids"] == ["qb"] and await in_flight(m) == 0
        await m.post("/release_request", {"url": s, "ticket": tb, "n": 2})  # the dead worker's late release
        assert await in_flight(m) == 0
        for index in (2, 999, 2**70):
            got, reply = await m.call("POST", "/reset_rollout_worker", {"worker_index": index})
            assert got == 400 and "worker_index" in reply["error"], (index, got, reply)
        stats = await m.get("/rollout_stats")
        assert stats["bad_requests"] == len(refused) + 2 + 3 and stats["running"] == 0

    try:
        run_with_manager(url, scenario)
        assert trial.complete() == 0
    finally:
        trial.close()


@pytest.mark.parametrize("mode", SERVER_MODES)
def test_routing_and_weight_updates_across_two_servers(tmp_path, etcd_server, tiny_model, mode):
    from realrl.system.model_worker import publish_weights

    weights_dir = tmp_path / "weights"
    publish_weights(tiny_model, str(weights_dir), 0)
    model_dir = publish_weights(tiny_model, str(tmp_path / "model"), 0)  # the initial model (kept: restarts use it)
    (weights_dir / "notes.txt").write_text("not a version")
    (weights_dir / ".tmp-2-abcd").mkdir()  # a publish in progress
    manager_cfg = GserverManagerConfig(
        n_servers=2,
        train_batch_size=B,
        max_head_offpolicyness=1,
        weights_dir=str(weights_dir),
        poll_interval=0.05,
        server_api=SERVER_API[mode],
    )
    groups = [
        WorkerGroup("generation_server", 2, server_config(model_dir, mode)),
        WorkerGroup("gserver_manager", 1, manager_cfg),
    ]
    trial = TrialThread(tmp_path, etcd_server.addr, groups, EXP).start()
    trial.start_training()

    async def scenario(m: Manager):
        a, b = (trial.repo.get(names.gen_server(EXP, trial.trial, i)) for i in range(2))
        # Least requests spreads load over both servers.
        picks = [await m.schedule({"qid": f"q{i}"}) for i in range(4)]
        assert sorted(p["url"] for p in picks) == sorted([a, a, b, b]) and {p["version"] for p in picks} == {0}
        assert (await m.get("/rollout_stats"))["server_in_flight"] == {a: 2, b: 2}
        for i, p in enumerate(picks):
            await m.release(f"q{i}", p["url"])
            await m.finish(f"q{i}", accepted=False)
        # Sticky while the version is unchanged, even onto the busier server.
        for _ in range(3):
            reply = await m.schedule({"qid": "s", "previous_server_url": a, "previous_version": 0})
            assert reply == {"url": a, "version": 0}
        assert (await m.schedule({"qid": "t"}))["url"] == b  # least requests
        assert (await m.get("/rollout_stats"))["server_in_flight"] == {a: 3, b: 1}
        # Several groups in one call: each part is routed as if alone (least requests, in turn).
        reply = await m.schedule({"qid": "u", "n": 7, "parts": [3, 2, 2]})
        assert [p["url"] for p in reply["parts"]] == [b, a, b] and reply["url"] == b
        assert (await m.get("/rollout_stats"))["server_in_flight"] == {a: 5, b: 6}
        await m.release("u", a, 2)
        await m.release("u", b, 5)

        # The trainer publishes version 1: every server loads it.
        _, new_model = build_tiny_model(seed=2)
        publish_weights(new_model, str(weights_dir), 1)
        trial.set(names.model_version(EXP, trial.trial, "actor"), "1")
        for _ in range(1200):
            if (await m.get("/get_model_version"))["version"] == 1:
                break
            await asyncio.sleep(0.05)
        assert (await m.get("/get_model_version"))["version"] == 1
        async with make_client(SERVER_API[mode], timeout_s=60) as client:
            assert [await client.weight_version(u) for u in (a, b)] == ["1", "1"]
            result = await client.generate(a, [5, 6, 7], {"max_new_tokens": 2, "ignore_eos": True})
            assert result.weight_version == "1"
        stats = await m.get("/rollout_stats")
        assert (stats["trainer_version"], stats["loaded_version"]) == (1, 1)
        # Version 0 is no longer used by any server: deleted; the rest untouched.
        for _ in range(200):
            if not (weights_dir / "0").exists():
                break
            await asyncio.sleep(0.05)
        assert sorted(os.listdir(weights_dir)) == [".tmp-2-abcd", "1", "notes.txt"]

        # Stickiness to the old version is released: least requests picks b.
        reply = await m.schedule({"qid": "s", "previous_server_url": a, "previous_version": 0})
        assert reply == {"url": b, "version": 1}
        # ... and holds again under the new version.
        reply = await m.schedule({"qid": "s", "previous_server_url": a, "previous_version": 1})
        assert reply == {"url": a, "version": 1}

        # Server a's process dies: out of routing at once (a client names it in avoid_urls), restarted
        # by its worker on model_path (version 0), brought to version 1 by the manager before it is
        # routed to again: the version admission uses never goes back.
        in_flight_a = (await m.get("/rollout_stats"))["server_in_flight"][a]
        assert in_flight_a > 0
        (server_a,) = psutil.Process(trial.launcher.worker_pids[0]).children()
        server_a.kill()
        reply = await m.schedule({"qid": "f", "avoid_urls": [a]})
        assert reply["url"] == b  # another server while one is up
        seen_versions, rejoined = set(), None
        for _ in range(2400):
            seen_versions.add((await m.get("/get_model_version"))["version"])
            servers = (await m.get("/servers"))["servers"]
            if any(s["url"] == a and s["state"] != "up" for s in servers):
                assert (await m.schedule({"qid": "g"}))["url"] != a  # never to a down server
            rejoined = next((s for s in servers if s["index"] == 0 and s["url"] != a and s["state"] == "up"), None)
            if rejoined:
                break
            await asyncio.sleep(0.05)
        assert rejoined is not None and rejoined["version"] == 1, servers
        assert seen_versions == {1}
        assert next(s for s in servers if s["url"] == a)["state"] in ("down", "retired")
        async with make_client(SERVER_API[mode], timeout_s=60) as client:
            assert await client.weight_version(rejoined["url"]) == "1"
        await m.finish("s", accepted=False)  # its schedules on a end with it: absorbed
        stats = await m.get("/rollout_stats")
        assert stats["server_in_flight"][a] == 0 and stats["n_servers"] == 2 and stats["loaded_version"] == 1
        assert stats["server_events"]["rejoined"] == 1

    try:
        url = trial.wait_key(names.gen_server_manager(EXP, trial.trial), timeout=180)
        run_with_manager(url, scenario)
        assert trial.complete() == 0
        log = open(trial.launcher.log_path("gserver_manager", 0)).read()
        assert "all servers hold weight version 1" in log and "deleted old weights: 0" in log
        assert "holds weight version 0: loading version 1 before it takes requests" in log
        assert len(re.findall(r"generation server 0 at \S+ (is down|left routing)", log)) == 1
    finally:
        trial.close()


def test_failed_health_checks_do_not_count_while_a_server_loads_weights(tmp_path, etcd_server, tiny_model):
    """SGLang's /health generates a token, so it waits behind a weight update
    and answers 503 (emulated: SGLang 0.5.16 with its health check timing out
    after 1 s, and the update held at a gate for as long as the test needs).
    Checks that fail during the load are not counted: the server stays in
    routing. A server whose /health fails otherwise (here: paused) still
    leaves routing, and rejoins once it answers."""
    from realrl.system.model_worker import publish_weights

    model_dir = publish_weights(tiny_model, str(tmp_path / "model"), 0)
    publish_weights(tiny_model, str(tmp_path / "weights"), 1)
    gate = tmp_path / "gate"
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"}
    env["SGLANG_HEALTH_CHECK_TIMEOUT"] = "1"
    server = TorchServer(tmp_path, model_dir, "--emulate-sglang", "0.5.16", "--weight-load-gate", str(gate), env=env)
    trial = None

    async def state_and_events(m: Manager) -> tuple[str, dict]:
        reply = await m.get("/servers")
        return reply["servers"][0]["state"], reply["events"]

    async def wait_for(m: Manager, what: str, predicate) -> tuple[str, dict]:
        for _ in range(1200):
            state, events = await state_and_events(m)
            if predicate(state, events):
                return state, events
            await asyncio.sleep(0.05)
        pytest.fail(f"never {what}: {state} {events}")

    async def scenario(m: Manager):
        trial.set(names.model_version(EXP, trial.trial, "actor"), "1")  # the manager's update waits at the gate

        def three_ignored(state, events) -> bool:
            assert state == "up" and "down" not in events, (state, events)  # in routing all along
            return events.get("unhealthy_while_loading", 0) >= 3  # more than health_check_failures

        await wait_for(m, "3 failed checks during the load", three_ignored)
        async with GenerationClient(timeout_s=30) as client:
            probe = await client.probe(server.url, timeout_s=10)
            assert not probe.ok and "HTTP 503" in probe.reason  # what the manager saw
            gate.touch()
            await m.wait_stats("loaded_version", 1)
            assert "down" not in (await state_and_events(m))[1]

            await client.pause_generation(server.url)
            await wait_for(m, "down while paused", lambda state, events: state == "down")
            await client.continue_generation(server.url)
            _, events = await wait_for(m, "back in routing", lambda state, events: state == "up")
            assert events["down"] == events["rejoined"] == 1

    try:
        trial, url = start_manager_trial(
            tmp_path,
            etcd_server.addr,
            server.url,
            health_check_interval=0.2,
            health_check_timeout=5,
            health_check_failures=2,
        )
        run_with_manager(url, scenario)
        assert trial.complete() == 0
        log = open(trial.launcher.log_path("gserver_manager", 0)).read()
        assert re.search(r"health checks failed while it loaded weight version 1 \(not counted", log), log[-3000:]
        assert len(re.findall(r"generation server 0 at \S+ is down", log)) == 1  # the pause, not the load
    finally:
        if trial is not None:
            trial.close()
        server.kill()


class LoadingServer(HealthOnlyServer):
    """A fake server whose /health always answers: it loads any weight
    version at once, or, `wedged`, never answers a load (its update hangs)."""

    def __init__(self, wedged: bool):
        self.wedged = wedged
        self.loads = 0
        super().__init__()

    def _routes(self, app: web.Application) -> None:
        async def update(request):
            self.loads += 1
            if self.wedged:
                await asyncio.Event().wait()
            return web.json_response({"success": True, "message": "", "num_paused_requests": 0})

        app.router.add_post("/update_weights_from_disk", update)


def test_a_server_whose_weight_load_never_completes_leaves_routing_and_admission_goes_on(tmp_path, etcd_server):
    """Of two servers, one never completes its load of version 1 (its
    /health still answers): past weight_update_timeout it leaves routing as a
    dead one would, the other serves version 1, admission opens for it and
    the trial goes on (before: 1 + weight_update_retries timeouts, then the
    trial stopped)."""
    good, wedged = LoadingServer(wedged=False), LoadingServer(wedged=True)
    trial = None

    async def scenario(m: Manager):
        trial.set(names.gen_server(EXP, trial.trial, 1), wedged.url)
        for _ in range(1200):
            if [s["state"] for s in (await m.get("/servers"))["servers"]] == ["up", "up"]:
                break
            await asyncio.sleep(0.05)
        trial.set(names.model_version(EXP, trial.trial, "actor"), "1")
        for _ in range(1200):
            reply = await m.get("/servers")
            if reply["version"] == 1:
                break
            await asyncio.sleep(0.05)
        assert reply["version"] == 1, reply
        states = {s["url"]: s for s in reply["servers"]}
        assert states[good.url]["state"] == "up" and states[good.url]["version"] == 1
        assert states[wedged.url]["state"] != "up" and reply["events"]["down"] >= 1
        assert (await m.get("/get_model_version"))["version"] == 1
        assert (await m.allocate("q-after"))["success"]

    try:
        trial, url = start_manager_trial(
            tmp_path,
            etcd_server.addr,
            good.url,
            weight_update_timeout=1,
            weight_update_retries=3,
            health_check_interval=0.2,
        )
        run_with_manager(url, scenario)
        assert trial.complete() == 0
        log = open(trial.launcher.log_path("gserver_manager", 0)).read()
        assert re.search(r"generation server 1 at \S+ is down \(weight version 1 was not loaded", log), log[-3000:]
        assert good.loads == 1
    finally:
        if trial is not None:
            trial.close()
        good.stop()
        wedged.stop()


def test_a_vllm_server_whose_reload_fails_leaves_routing_until_a_reload_succeeds(tmp_path, etcd_server, tiny_model):
    """vLLM reloads weights layer by layer: a reload that fails leaves them
    half written, and the manager cannot restart the server (vLLM has no
    route for it, and its /health stays 200). Emulated (0.33): the update to
    version 1 from a checkpoint that fails to load takes the server out of
    routing, saying why, instead of retrying it in routing and then stopping
    the trial; once the checkpoint is whole, the server rejoins at version 1,
    and version 2 loads while it stays in routing."""
    from realrl.impl.generation.vllm_client import VLLMClient
    from realrl.system.model_worker import publish_weights

    model_dir = publish_weights(tiny_model, str(tmp_path / "model"), 0)
    checkpoint = os.path.join(publish_weights(tiny_model, str(tmp_path / "weights"), 1), "model.safetensors")
    whole = open(checkpoint, "rb").read()
    with open(checkpoint, "wb") as f:
        f.write(whole[:64])  # a load of it fails part way
    server = TorchServer(tmp_path, model_dir, "--emulate-vllm", "0.33")
    trial = None

    async def server_state(m: Manager, predicate) -> dict:
        for _ in range(1200):
            (info,) = (await m.get("/servers"))["servers"]
            if predicate(info):
                return info
            await asyncio.sleep(0.05)
        pytest.fail(f"the server never got there: {info}")

    async def scenario(m: Manager):
        trial.set(names.model_version(EXP, trial.trial, "actor"), "1")
        # Out of routing, with its reason (the manager's log, below): counted as an event, since by
        # the next poll the state may read `joining` again (it answers health checks; the load retries).
        for _ in range(1200):
            if (await m.get("/servers"))["events"].get("down", 0) >= 1:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the server never left routing: {await m.get('/servers')}")
        with open(checkpoint, "wb") as f:
            f.write(whole)
        up = await server_state(m, lambda s: s["state"] == "up")
        assert up["version"] == 1 and (await m.get("/servers"))["events"]["rejoined"] == 1
        # The next version loads in routing (pause -> reload_weights -> reset -> version -> resume).
        publish_weights(build_tiny_model(seed=2)[1], str(tmp_path / "weights"), 2)
        trial.set(names.model_version(EXP, trial.trial, "actor"), "2")
        await server_state(m, lambda s: s["version"] == 2)
        async with VLLMClient(timeout_s=60) as client:  # resumed: it serves version 2
            result = await client.generate(server.url, [5, 6, 7], {"max_new_tokens": 2, "ignore_eos": True})
        assert result.output_versions == ["2", "2"]
        assert (await m.get("/servers"))["events"].get("down", 0) >= 1

    try:
        trial, url = start_manager_trial(
            tmp_path, etcd_server.addr, server.url, server_api="vllm", health_check_interval=0.2
        )
        run_with_manager(url, scenario)
        assert trial.complete() == 0
        log = open(trial.launcher.log_path("gserver_manager", 0)).read()
        assert re.search(
            r"generation server 0 at \S+ is down \(weight version 1 was not loaded: "
            r".*reload_weights from.*half written",
            log,
        )
    finally:
        if trial is not None:
            trial.close()
        server.kill()
