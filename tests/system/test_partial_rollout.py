"""The PartialRolloutManager against a real torch server subprocess and a
GserverManager, with the built-in math agent and env: trajectory schema,
behaviour logprobs equal to a fresh forward pass, chunked generation, answers
whose chunk ends on EOS or a stop token, an interruption by a weight update,
and server failures. The server checks the length limit before stop tokens,
as SGLang does (`length_before_eos`); the module's tests run against the torch
server and against it emulating SGLang (`SERVER_MODES`)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import urllib.request
import uuid

import pytest
import torch
from aiohttp import web
from transformers import AutoModelForCausalLM

from realrl.api.agent_api import AgentSettings, PromptRecord, make_agent
from realrl.api.cli_args import TorchServerConfig
from realrl.api.env_api import make_env
from realrl.api.generate_answers import ANSWERS_MEDIA_TYPE
from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest
from realrl.api.manager_api import ScheduledServer, ScheduleReply
from realrl.api.system_api import GenerationServerConfig, GserverManagerConfig
from realrl.base import names, trial_secret
from realrl.base.http_body import to_json
from realrl.impl import agents as _agents  # noqa: F401  (registers the built-in agents)
from realrl.impl import environments as _environments  # noqa: F401
from realrl.impl.generation import GenerationClient, GenerationServerUnavailable, make_client
from realrl.impl.generation.eos import eos_token_ids_in_dir
from realrl.impl.math_data import load_math_jsonl
from realrl.impl.verifiers.math_verifier import MathVerifier
from realrl.launcher.local import WorkerGroup
from realrl.system.client_routing import ManagerRouting
from realrl.system.manager_client import GserverManagerClient
from realrl.system.partial_rollout import EPISODE_PRIORITY, PartialRolloutError, PartialRolloutManager
from tests.impl.conftest import save_perturbed
from tests.system.test_generation_server import ENGINE_MODES, SERVER_MODES
from tests.system.trial_thread import TrialThread

EXP = "rollouttest"


@pytest.fixture(scope="session")
def reference_model(tiny_kit):
    torch.set_num_threads(1)
    return AutoModelForCausalLM.from_pretrained(tiny_kit["model_dir"], dtype=torch.float32).eval()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_group(model_dir: str, length_before_eos: bool = False, mode: str = "torch") -> WorkerGroup:
    torch_cfg = TorchServerConfig(num_threads=1, length_before_eos=length_before_eos, **ENGINE_MODES[mode])
    config = GenerationServerConfig(model_path=model_dir, startup_timeout=180, torch=torch_cfg)
    return WorkerGroup("generation_server", 1, config, env={"OMP_NUM_THREADS": "1"})


def manager_group(**kwargs) -> WorkerGroup:
    return WorkerGroup("gserver_manager", 1, GserverManagerConfig(**kwargs), env={"OMP_NUM_THREADS": "1"})


class HealthOnlyServer:
    """Answers /health and /model_info only, so the manager accepts it as a
    server at start-up; stopped, it leaves a dead URL in the manager's routing."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)

    async def _health(self, request):
        return web.Response(text="ok")

    def _routes(self, app: web.Application) -> None:
        """More routes (subclasses: fake servers that misbehave)."""

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()

        async def model_info(request):
            return web.json_response({"weight_version": "0"})

        app.router.add_get("/health", self._health)
        app.router.add_get("/model_info", model_info)
        self._routes(app)
        self._runner = web.AppRunner(app, shutdown_timeout=0.1)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        self._ready.set()
        self._loop.run_forever()

    def stop(self) -> None:
        if self._thread.is_alive():
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)


@pytest.fixture(scope="module", params=SERVER_MODES)
def trial(request, tmp_path_factory, etcd_server, tiny_kit):
    """generation_server + gserver_manager as real processes, shared by the
    tests of this module (the weight-update test restores the weights). The
    server reports `length` for a request whose last allowed token is EOS, as
    SGLang does: the harder case for the manager."""
    server = server_group(tiny_kit["model_dir"], length_before_eos=True, mode=request.param)
    groups = [server, manager_group(n_servers=1, train_batch_size=4)]
    t = TrialThread(tmp_path_factory.mktemp("prm_trial"), etcd_server.addr, groups, EXP)
    try:
        t.start()
        t.start_training()
        t.manager_url = t.wait_key(names.gen_server_manager(EXP, t.trial))
        t.server_url = t.get(names.gen_server(EXP, t.trial, 0))
        t.mode = request.param
        yield t
    finally:
        t.close()


def manager_stats(url: str) -> dict:
    request = urllib.request.Request(f"{url}/rollout_stats", headers=trial_secret.http_headers())
    with urllib.request.urlopen(request, timeout=30) as resp:
        return json.loads(resp.read())


@pytest.fixture
def verifier():
    v = MathVerifier(n_procs=1)
    yield v
    v.close()


def prompt_records(tiny_kit, n: int) -> list[PromptRecord]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_kit["model_dir"])
    return [
        PromptRecord(
            qid=r["query_id"],
            prompt=r["prompt"],
            prompt_ids=tokenizer.encode(r["prompt"], add_special_tokens=False),
            solutions=r["solutions"],
        )
        for r in load_math_jsonl(tiny_kit["train_path"])[:n]
    ]


async def run_episode(agent, record, env, prm: PartialRolloutManager):
    """What the rollout worker does per episode."""
    return await agent.run_episode(record, env, prm)


def forward_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(output)[:, None]).squeeze(1)


class ObservedManagerClient(GserverManagerClient):
    """The real manager client, keeping a log of what it scheduled. The
    manager schedules only for a running rollout: as a rollout worker would,
    it has each qid admitted first (under a rollout id of its own), and
    `end_rollouts` ends them as rejected (their budget goes back)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.scheduled: list[dict] = []
        self.admitted: dict[str, str] = {}  # qid -> rollout id

    async def schedule_request(
        self, qid, n=1, previous_server_url=None, previous_version=None, avoid_urls=None, parts=None
    ):
        """Logs one entry per part (a group's round), numbered by the call ("call")."""
        if qid not in self.admitted:
            rollout_id = f"{qid}@{uuid.uuid4().hex[:8]}"
            assert (await self.allocate_rollouts([(rollout_id, qid)], wait_s=10)).admitted == 1
            self.admitted[qid] = rollout_id
        reply = await super().schedule_request(qid, n, previous_server_url, previous_version, avoid_urls, parts)
        call = len({s["call"] for s in self.scheduled})
        for size, pick in zip(parts or [n], reply.parts or [reply]):
            self.scheduled.append(
                {
                    "qid": qid,
                    "n": size,
                    "previous_server_url": previous_server_url,
                    "previous_version": previous_version,
                    "call": call,
                    **to_json(reply),
                    **to_json(pick),
                }
            )
        return reply

    async def end_rollouts(self) -> None:
        if self.admitted:
            await self.finish_rollouts([(rollout_id, 0, 0) for rollout_id in self.admitted.values()])
            self.admitted.clear()


async def with_prm(manager_url: str, fn, server_watch_interval: float = 2.0, api: str = "sglang", **prm_kwargs):
    """`fn(prm, manager)` with a partial-rollout manager routed by the
    manager (`ManagerRouting`, so that `manager.scheduled` logs each schedule),
    its servers speaking `api`."""
    manager = ObservedManagerClient(manager_url, retries=1, retry_backoff_s=0.01)
    async with make_client(api, timeout_s=120) as client:
        prm = PartialRolloutManager(ManagerRouting(manager, server_watch_interval), client, **prm_kwargs)
        try:
            return await fn(prm, manager)
        finally:
            await prm.close()
            await manager.end_rollouts()
            await manager.close()


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("chunk", [1 << 30, 2])
def test_agent_episodes_match_a_fresh_forward_pass(tiny_kit, reference_model, trial, verifier, chunk):
    group_size, max_new = 3, 9
    agent = make_agent(
        "single-step",
        AgentSettings(
            tokenizer_path=tiny_kit["model_dir"],
            group_size=group_size,
            gconfig={"max_new_tokens": max_new, "temperature": 1.0},
        ),
    )
    records = prompt_records(tiny_kit, 4)

    async def go(prm, manager):
        episodes = [run_episode(agent, r, make_env("math", verifier=verifier), prm) for r in records]
        return await asyncio.gather(*episodes), prm.stats.pop(), manager.scheduled

    eos_ids = eos_token_ids_in_dir(tiny_kit["model_dir"])  # as the rollout worker does
    assert eos_ids == {tiny_kit["eos"]}
    results, stats, scheduled = asyncio.run(
        with_prm(trial.manager_url, go, new_tokens_per_chunk=chunk, eos_token_ids=eos_ids)
    )
    n_no_eos = 0
    for record, trajectories in zip(records, results):
        assert len(trajectories) == 1
        traj = trajectories[0].validate()
        assert traj.qid == record.qid and traj.group_size == group_size
        for i in range(group_size):
            assert traj.prompt_len[i] == len(record.prompt_ids)
            assert traj.input_ids[i][: traj.prompt_len[i]].tolist() == record.prompt_ids
            out = traj.completion_ids(i).tolist()
            # complete: ended by eos, or used the whole budget
            if traj.no_eos[i]:
                assert len(out) == max_new and tiny_kit["eos"] not in out
                n_no_eos += 1
            else:
                assert out[-1] == tiny_kit["eos"] and tiny_kit["eos"] not in out[:-1] and len(out) <= max_new
            expected = forward_logprobs(reference_model, record.prompt_ids, out)
            torch.testing.assert_close(torch.from_numpy(traj.logprobs[i]), expected, atol=1e-3, rtol=0)
            assert traj.versions[i].tolist() == [0] * len(out)
            assert traj.version_start[i] == traj.version_end[i] == 0
    assert n_no_eos > 0  # the random model rarely emits eos in 9 tokens
    assert stats["interruptions"] == 0 and stats["retries"] == 0
    # A group's answers are generated together: one batched request per round
    # for the answers not finished yet; the episodes' rounds that are ready
    # together (here: the first ones, and the continuations) go as one request.
    first = [s for s in scheduled if s["previous_server_url"] is None]
    assert len(first) == len(records) and all(s["n"] == group_size for s in first)
    assert {s["call"] for s in first} == {0}
    calls = len({s["call"] for s in scheduled})
    assert stats["server_requests"] == calls  # (one server)
    if chunk == 2:
        # an answer that used the whole budget took ceil(9 / 2) = 5 chunks
        assert stats["chunk_continuations"] >= 4 * n_no_eos
        continued = [s for s in scheduled if s["previous_server_url"] is not None]
        assert sum(s["n"] for s in continued) == stats["chunk_continuations"]
        assert len({s["call"] for s in continued}) <= 4  # at most 4 more rounds, the groups' together
        assert all(
            s["url"] == s["previous_server_url"] == trial.server_url and s["previous_version"] == 0 for s in continued
        )
    else:
        assert stats["chunk_continuations"] == 0 and stats["server_requests"] == 1
    assert set(manager_stats(trial.manager_url)["server_in_flight"].values()) == {0}  # every request released


class ObservedClient(GenerationClient):
    """The real client, keeping each batched /generate's priority and size."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.batches: list[tuple[int | None, int]] = []

    async def generate_batch(self, url, input_ids, *args, priority=None, **kwargs):
        self.batches.append((priority, len(input_ids)))
        return await super().generate_batch(url, input_ids, *args, priority=priority, **kwargs)


def test_rounds_of_different_episode_priorities_go_as_one_request_each(tiny_kit, trial, verifier):
    """Episodes started together with two priorities (EPISODE_PRIORITY, which the rollout worker sets in
    each episode's task): their first rounds go as one /generate per priority, each carrying it (SGLang's
    `priority` is one per body), and the server takes them."""
    group_size = 2
    settings = AgentSettings(tokenizer_path=tiny_kit["model_dir"], group_size=group_size, gconfig={"max_new_tokens": 4})
    agent = make_agent("single-step", settings)
    records = prompt_records(tiny_kit, 4)

    async def go():
        manager = ObservedManagerClient(trial.manager_url, retries=1, retry_backoff_s=0.01)
        async with ObservedClient(timeout_s=120) as client:
            prm = PartialRolloutManager(ManagerRouting(manager, 2.0), client)

            async def episode(record, priority):
                EPISODE_PRIORITY.set(priority)  # (this task's own context, as in the rollout worker)
                return await run_episode(agent, record, make_env("math", verifier=verifier), prm)

            try:
                results = await asyncio.gather(*[episode(r, p) for r, p in zip(records, [3, 0, 3, 0])])
                return results, prm.stats.pop(), client.batches
            finally:
                await prm.close()
                await manager.end_rollouts()
                await manager.close()

    results, stats, batches = asyncio.run(go())
    assert all(len(trajectories) == 1 for trajectories in results)
    assert sorted(batches) == [(0, 2 * group_size), (3, 2 * group_size)]
    assert stats["server_requests"] == 2 and stats["retries"] == 0


def server_stats(url: str) -> dict[str, float]:
    """The torch server's counters, from /metrics (emulating SGLang, its
    /get_server_info has SGLang's shape)."""
    with urllib.request.urlopen(urllib.request.Request(f"{url}/metrics", headers=trial_secret.http_headers())) as resp:
        lines = resp.read().decode().splitlines()
    prefix = "realrl_torch_server_"
    return {k[len(prefix) :]: float(v) for k, v in (line.split() for line in lines) if "{" not in k}


def server_finishes(url: str) -> dict:
    stats = server_stats(url)
    return {"stop": stats["finish_stop"], "length": stats["finish_length"]}


def free_token(model, prompt: list[int], k: int, eos: int) -> int:
    """A token f that greedy decoding does not pick after prompt + [f] * (k - 1)."""
    for f in range(2, model.get_input_embeddings().num_embeddings):
        if f == eos:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([prompt + [f] * (k - 1)])).logits[0, -1]
        if logits.max() - logits[f] > 0.1:  # far from a tie (float error is ~1e-5)
            return f
    raise AssertionError("no free token found")


def test_chunk_ending_on_a_stop_token_finishes_the_answer(tiny_kit, reference_model, trial):
    """The server reports `length` for a chunk whose last token is a stop token;
    the answer is finished all the same, and not continued past it."""
    k, group_size = 4, 2
    prompt = prompt_records(tiny_kit, 1)[0].prompt_ids
    # Every id but f is a stop token and stop tokens are banned for the first
    # k - 1 tokens: those are f, and greedy's k-th token is a stop token.
    f = free_token(reference_model, prompt, k, tiny_kit["eos"])
    stops = [t for t in range(reference_model.get_input_embeddings().num_embeddings) if t != f]
    gconfig = GenerationHyperparameters(max_new_tokens=3 * k, min_new_tokens=k - 1, greedy=True, stop_token_ids=stops)
    before = server_finishes(trial.server_url)

    async def go(prm, manager):
        return await prm.generate(GenerationRequest("stop-0", prompt, group_size, gconfig)), prm.stats.pop()

    result, stats = asyncio.run(with_prm(trial.manager_url, go, new_tokens_per_chunk=k))
    for i in range(group_size):
        out = result.output_ids[i]
        assert out[: k - 1] == [f] * (k - 1) and out[-1] != f and len(out) == k, out
        assert not result.no_eos[i]
    assert stats["server_requests"] == 1 and stats["chunk_continuations"] == 0  # one batched request
    after = server_finishes(trial.server_url)  # the server reported length for each (SGLang's order)
    assert (after["length"] - before["length"], after["stop"] - before["stop"]) == (group_size, 0)


@pytest.mark.parametrize("min_new", ["k", "k+1"])
def test_chunk_ending_on_eos_finishes_the_answer(tiny_kit, reference_model, trial, min_new):
    """EOS comes from `eos_token_ids` (here every id, so that a chunk's last token
    is certainly one); it finishes an answer only at or past min_new_tokens."""
    k = 4
    min_new_tokens = k if min_new == "k" else k + 1
    prompt = prompt_records(tiny_kit, 1)[0].prompt_ids
    gconfig = GenerationHyperparameters(max_new_tokens=3 * k, min_new_tokens=min_new_tokens, temperature=1.0)

    async def go(prm, manager):
        return await prm.generate(GenerationRequest(f"eos-{min_new}", prompt, 2, gconfig)), prm.stats.pop()

    every_id = range(reference_model.get_input_embeddings().num_embeddings)
    result, stats = asyncio.run(with_prm(trial.manager_url, go, new_tokens_per_chunk=k, eos_token_ids=every_id))
    for i in range(2):
        n = len(result.output_ids[i])
        assert not result.no_eos[i]
        if min_new_tokens == k:  # the first chunk's last token
            assert n == k
        else:  # the server banned real EOS for one more token: a second chunk, and only one
            assert k < n <= 2 * k
    assert stats["chunk_continuations"] == (0 if min_new_tokens == k else 2)


def test_weight_update_interrupts_and_resumes_without_losing_tokens(tiny_kit, reference_model, trial, tmp_path):
    """A weight update while the answers run: SGLang aborts them and the client
    resubmits what they had; the torch server prefills them again under the new
    weights itself and they go on (no abort, no second request), their tokens
    in per-version spans. Either way each token has its version and that
    version's logprob, and nothing is lost or duplicated."""
    new_dir = str(tmp_path / "weights_v1")
    save_perturbed(tiny_kit["model_dir"], new_dir, seed=7, scale=0.05)
    updated_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    max_new, group_size = 600, 2
    # min_new_tokens = max_new_tokens: eos is masked, every answer runs to the budget
    gconfig = GenerationHyperparameters(max_new_tokens=max_new, min_new_tokens=max_new, temperature=1.0)
    prompt = prompt_records(tiny_kit, 1)[0].prompt_ids
    url = trial.server_url

    async def go(prm, manager):
        t0 = time.monotonic()
        task = asyncio.create_task(prm.generate(GenerationRequest("update-0", prompt, group_size, gconfig)))
        async with GenerationClient(timeout_s=60) as control:
            start = server_stats(url)["generated_tokens"]
            try:
                # Update the server directly (not through the manager) once the
                # answers are under way, and far from done.
                while server_stats(url)["generated_tokens"] < start + 10 * group_size:
                    assert not task.done(), "generation finished before the update"
                    await asyncio.sleep(0.005)
                reply = await control.update_weights_from_disk(url, new_dir, weight_version=1)
                result = await task
                wall = time.monotonic() - t0
            finally:  # the module's other tests expect the original weights as version 0
                await control.update_weights_from_disk(url, tiny_kit["model_dir"], weight_version=0)
        return result, reply, prm.stats.pop(), manager.scheduled, wall

    result, reply, stats, scheduled, wall = asyncio.run(with_prm(trial.manager_url, go))
    # SGLang's scheduler reports 0 (one per data-parallel rank), the torch server what it paused.
    assert reply.num_paused_requests == ([0, 0] if trial.mode == "sglang" else group_size)
    resumed_by_client = trial.mode == "sglang"
    assert stats["interruptions"] == (group_size if resumed_by_client else 0)
    if not resumed_by_client:
        assert stats["server_requests"] == 1  # the one batched /generate, answered when the answers ended
    for i in range(group_size):
        out, versions = result.output_ids[i], result.output_versions[i]
        assert len(out) == len(versions) == len(result.output_logprobs[i]) == max_new  # nothing lost or duplicated
        switch = versions.index(1)
        assert 0 < switch and versions == [0] * switch + [1] * (max_new - switch)
        assert (result.version_start[i], result.version_end[i]) == (0, 1) and result.no_eos[i]
        # Each token's logprob is that of the weights its version names, given
        # the whole prefix: the resumed request continued exactly after the old tokens.
        logprobs = torch.tensor(result.output_logprobs[i])
        old = forward_logprobs(reference_model, prompt, out)
        new = forward_logprobs(updated_model, prompt, out)
        torch.testing.assert_close(logprobs[:switch], old[:switch], atol=1e-3, rtol=0)
        torch.testing.assert_close(logprobs[switch:], new[switch:], atol=1e-3, rtol=0)
        assert not torch.allclose(old[switch:], new[switch:], atol=1e-3)  # the versions are distinguishable
        # The servers' own time for the answer, over the interrupted request and the resumed one.
        assert 0 < result.server_s[i] < wall
    # The resubmissions were sticky: the manager still holds version 0 for the
    # server (it did not drive this update), so it kept them on the same server.
    resumed = [s for s in scheduled if s["previous_server_url"] is not None]
    assert sum(s["n"] for s in resumed) == (group_size if resumed_by_client else 0)  # (together, one request)
    assert all(s["previous_version"] == 0 and s["url"] == url for s in resumed)


def test_request_the_server_refuses_fails_at_once(trial):
    # prompt + budget exceeds the model's 2048 positions: HTTP 400, retrying cannot help
    request = GenerationRequest("long-0", [5] * 2000, 1, GenerationHyperparameters(max_new_tokens=100))

    async def go(prm, manager):
        with pytest.raises(PartialRolloutError, match="refused") as info:
            await prm.generate(request)
        return info.value, prm.stats.pop()

    error, stats = asyncio.run(with_prm(trial.manager_url, go, request_retries=3))
    assert trial.server_url in str(error) and "long-0" in str(error) and "2048" in str(error)
    assert stats["retries"] == 0 and stats["server_requests"] == 1


def test_dead_server_is_retried_then_fails_clearly(tmp_path, etcd_server):
    """The manager routes to a server that went away after start-up: the
    answer waits for a server for `no_server_timeout`, then fails naming it
    and the last server's error."""
    fake = HealthOnlyServer()
    t = TrialThread(tmp_path, etcd_server.addr, [manager_group(n_servers=1)], EXP)
    try:
        t.start()
        t.start_training()
        t.set(names.gen_server(EXP, t.trial, 0), fake.url)
        manager_url = t.wait_key(names.gen_server_manager(EXP, t.trial))
        fake.stop()  # nothing listens there any more
        request = GenerationRequest("dead-0", [5, 6, 7], 2, GenerationHyperparameters(max_new_tokens=4))

        async def go(prm, manager):
            with pytest.raises(PartialRolloutError) as info:
                await prm.generate(request)
            return info.value, prm.stats.pop()

        error, stats = asyncio.run(
            with_prm(manager_url, go, request_retries=2, retry_backoff_s=0.01, no_server_timeout=1.0)
        )
        message = str(error)
        assert fake.url in message and "dead-0" in message and "rollout.no_server_timeout=1" in message
        assert "no generation server was up for 1 s" in message and "unavailable" in message  # the cause
        assert stats["retries"] >= 1 and stats["no_server_waits"] >= 2  # waited for a server before giving up
        assert set(manager_stats(manager_url)["server_in_flight"].values()) == {0}
    finally:
        fake.stop()
        t.close()


def test_a_call_is_abandoned_when_its_server_leaves_routing_and_other_cancels_still_cancel():
    """`_generate_on` runs the call in the caller's task: the server's leaving
    routing ends it with GenerationServerUnavailable (and leaves the task
    usable); a cancellation from elsewhere is still a cancellation."""

    class Routing:
        def __init__(self):
            self.left = None

        def left_routing(self, url):
            self.left = asyncio.get_running_loop().create_future()
            return self.left

    async def go():
        routing = Routing()
        prm = PartialRolloutManager(routing, client=None)

        async def leaves_soon():
            asyncio.get_running_loop().call_later(0.01, lambda: routing.left.set_result(None))
            return await prm._generate_on("http://a", asyncio.sleep(30))

        with pytest.raises(GenerationServerUnavailable, match="out of routing"):
            await leaves_soon()
        await asyncio.sleep(0)  # this task was not left cancelled
        assert asyncio.current_task().cancelling() == 0

        assert await prm._generate_on("http://a", asyncio.sleep(0, result="done")) == "done"
        routing.left.set_result(None)  # the server leaves after the call: nothing of the call reacts
        await asyncio.sleep(0.01)
        assert asyncio.current_task().cancelling() == 0

        task = asyncio.create_task(prm._generate_on("http://a", asyncio.sleep(30)))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())


def test_lora_tokens_are_labelled_at_most_with_their_scheduled_version():
    """A LoRA request names its scheduled version's adapter; a server that
    switched meanwhile reports the new version for the old adapter's tokens
    (SGLang labels tokens with the version current when the request ends):
    the lower of the two, so staleness is not understated. Full weights: the
    version the server reports (it holds those weights)."""
    from realrl.impl.generation.client import GenerateResult

    def result(reported: str) -> GenerateResult:
        return GenerateResult([5], [-1.0], "length", reported, 1, 1)

    lora, full = PartialRolloutManager(None, None, lora=True), PartialRolloutManager(None, None)
    assert lora._token_version(result("2"), scheduled=1) == 1
    assert lora._token_version(result("1"), scheduled=1) == 1
    assert full._token_version(result("2"), scheduled=1) == 2
    assert lora._token_version(result("default"), scheduled=3) == 3  # no version set: the scheduled one


def banned_logprobs(model, prompt: list[int], output: list[int], banned: list[int]) -> torch.Tensor:
    """`forward_logprobs` with the `banned` ids' logits at -inf (an EOS ban before min_new_tokens)."""
    ids = torch.tensor([list(prompt) + list(output)])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logits[:, banned] = float("-inf")
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def generated_tokens(url: str) -> int:
    """Tokens a torch server generated since it started (its /metrics, which every emulation keeps)."""
    request = urllib.request.Request(f"{url}/metrics", headers=trial_secret.http_headers())  # a gated route
    with urllib.request.urlopen(request, timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("realrl_torch_server_generated_tokens "):
                return int(float(line.split()[1]))
    return 0


def test_on_vllm_a_weight_update_interrupts_and_resumes_without_losing_tokens(
    tiny_kit, reference_model, etcd_server, tmp_path
):
    """The same, on vLLM (emulated: 0.33) through its own client: the manager's
    update path there (pause?mode=abort, reload_weights, reset_prefix_cache,
    update_weight_version, resume) interrupts the answers; each comes back with
    its partial tokens, is resumed on the same server, and every token carries
    the version of its `weight_versions` span and that version's logprob."""
    from realrl.impl.generation.vllm_client import VLLMClient

    new_dir = str(tmp_path / "weights_v1")
    save_perturbed(tiny_kit["model_dir"], new_dir, seed=7, scale=0.05)
    updated_model = AutoModelForCausalLM.from_pretrained(new_dir, dtype=torch.float32).eval()
    max_new, group_size = 300, 2
    gconfig = GenerationHyperparameters(max_new_tokens=max_new, min_new_tokens=max_new, temperature=1.0)
    eos = sorted(eos_token_ids_in_dir(tiny_kit["model_dir"]))
    prompt = prompt_records(tiny_kit, 1)[0].prompt_ids
    groups = [
        server_group(tiny_kit["model_dir"], mode="vllm"),
        manager_group(n_servers=1, train_batch_size=4, server_api="vllm"),
    ]
    t = TrialThread(tmp_path / "trial", etcd_server.addr, groups, EXP)
    try:
        t.start()
        t.start_training()
        manager_url = t.wait_key(names.gen_server_manager(EXP, t.trial))
        url = t.get(names.gen_server(EXP, t.trial, 0))

        async def go(prm, manager):
            task = asyncio.create_task(prm.generate(GenerationRequest("vllm-0", prompt, group_size, gconfig)))
            async with VLLMClient(timeout_s=60) as control:
                start = generated_tokens(url)
                while generated_tokens(url) < start + 10 * group_size:
                    assert not task.done(), "generation finished before the update"
                    await asyncio.sleep(0.005)
                await control.load_version(url, new_dir, 1, lora=False)
                return await task, prm.stats.pop(), manager.scheduled

        result, stats, scheduled = asyncio.run(with_prm(manager_url, go, api="vllm"))
    finally:
        t.close()
    assert stats["interruptions"] == group_size
    for i in range(group_size):
        out, versions = result.output_ids[i], result.output_versions[i]
        assert len(out) == len(versions) == len(result.output_logprobs[i]) == max_new
        switch = versions.index(1)
        assert 0 < switch and versions == [0] * switch + [1] * (max_new - switch)
        # vLLM's processed_logprobs come after its logits processors: min_tokens' EOS ban included
        # (vllm/v1/sample/sampler.py: apply_logits_processors, then sample).
        logprobs = torch.tensor(result.output_logprobs[i])
        old, new = (banned_logprobs(m, prompt, out, eos) for m in (reference_model, updated_model))
        torch.testing.assert_close(logprobs[:switch], old[:switch], atol=1e-3, rtol=0)
        torch.testing.assert_close(logprobs[switch:], new[switch:], atol=1e-3, rtol=0)
    resumed = [s for s in scheduled if s["previous_server_url"] is not None]
    assert sum(s["n"] for s in resumed) == group_size and all(s["url"] == url for s in resumed)


class StaleRouting:
    """A routing that answers `stale` first (its table from before the server moved on), then `current`:
    the exact moment a LoRA request is scheduled on an adapter its server unloads."""

    def __init__(self, url: str, stale: int, current: int):
        self.url, self.versions, self.current = url, [stale], current

    def schedule_now(self, *args, **kwargs):
        return None

    async def schedule_request(self, qid, n=1, *args, parts=None, **kwargs):
        version = self.versions.pop(0) if self.versions else self.current
        parts_ = [ScheduledServer(self.url, version)] * len(parts) if parts else None
        return ScheduleReply(version=version, url=self.url, ticket=1, parts=parts_)

    async def release_request(self, *args, **kwargs):
        pass

    def left_routing(self, url):
        return asyncio.get_running_loop().create_future()


def test_a_lora_request_naming_an_adapter_its_server_unloaded_is_scheduled_again(tmp_path):
    """The manager schedules an answer on version 5 of a server that has
    moved on to 7 meanwhile (5 -> 6 -> 7: actor-v5 unloaded): the server
    refuses the adapter (400 `lora_not_loaded`), and instead of failing the
    episode the answer is scheduled again, names actor-v7 and is generated
    there (a fake routing stands in for the manager: the exact moment)."""
    from realrl.impl.generation.sim_server import SimServerConfig, SimServerHost
    from tests.impl.test_sim_server import save_adapter

    for v in (5, 6, 7):
        save_adapter(str(tmp_path / str(v)))

    async def go():
        host = SimServerHost(SimServerConfig(token_latency_s=0.001, output_tokens=4, vocab_size=64))
        await host.start(1)
        try:
            url = host.urls[0]
            async with GenerationClient(timeout_s=30) as client:
                for v in (5, 6, 7):
                    await client.load_version(url, str(tmp_path / str(v)), v, lora=True)
                assert "actor-v5" not in host.engines[0].adapters.adapters
                prm = PartialRolloutManager(StaleRouting(url, 5, 7), client, retry_backoff_s=0.01, lora=True)
                gconfig = GenerationHyperparameters(max_new_tokens=8)
                result = await prm.generate(GenerationRequest("stale-0", [3, 4, 5], 1, gconfig))
                return result, prm.stats.pop(), dict(host.engines[0].rejections)
        finally:
            await host.close()

    result, stats, rejections = asyncio.run(go())
    assert rejections == {"lora_not_loaded": 1}
    assert stats["stale_adapters"] == 1
    assert result.output_ids[0] and set(result.output_versions[0]) == {7}


class CorruptingProxy:
    """Relays every request to `upstream` (a real server) and cuts the last
    byte off its first `bad` columnar /generate answers."""

    def __init__(self, upstream: str, bad: int):
        self.upstream, self.bad, self.corrupted = upstream, bad, 0

    async def relay(self, request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k in ("Accept", "Authorization", "Content-Type")}
        async with self.session.request(
            request.method, f"{self.upstream}{request.path_qs}", data=await request.read(), headers=headers
        ) as resp:
            body, content_type = await resp.read(), resp.content_type
        if request.path == "/generate" and content_type == ANSWERS_MEDIA_TYPE and self.corrupted < self.bad:
            self.corrupted += 1
            body = body[:-1]
        return web.Response(status=resp.status, body=body, content_type=content_type)

    async def __aenter__(self) -> str:
        import aiohttp

        self.session = aiohttp.ClientSession()
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.relay)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc) -> None:
        await self.runner.cleanup()
        await self.session.close()


def test_a_columnar_answer_that_does_not_decode_is_counted_and_retried():
    """The columnar /generate answer (docs/design.md §6) of a server that
    sends a broken one is refused (`MalformedAnswer`, never half-read),
    counted, and retried as a server error: the episode, and the rollout
    worker running it, go on; every answer comes back whole."""
    from realrl.impl.generation.sim_server import SimServerConfig, SimServerHost

    async def go():
        host = SimServerHost(SimServerConfig(token_latency_s=0.001, output_tokens=6, vocab_size=64))
        await host.start(1)
        try:
            proxy = CorruptingProxy(host.urls[0], bad=2)  # the batched answer, then one answer's own
            async with proxy as url, GenerationClient(timeout_s=30) as client:
                prm = PartialRolloutManager(StaleRouting(url, 0, 0), client, retry_backoff_s=0.01)
                gconfig = GenerationHyperparameters(max_new_tokens=8)
                result = await prm.generate(GenerationRequest("bad-0", [3, 4, 5], 4, gconfig))
                return result, prm.stats.pop(), proxy.corrupted
        finally:
            await host.close()

    result, stats, corrupted = asyncio.run(go())
    assert corrupted == 2 and stats["malformed_answers"] == 2
    assert stats["retries"] == 4 + 1  # the batch's four answers, then the one answer
    assert [len(o) for o in result.output_ids] == [6] * 4
    assert all(len(lp) == 6 for lp in result.output_logprobs)
