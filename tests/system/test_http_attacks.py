"""Nobody outside the trial steers it over HTTP (docs/design.md §14): from a
process that does not hold the trial's secret, every route but /health of the
manager, a generation server, the chat endpoint and its judge route answers
401 and changes nothing; with the key, a weight path outside the trial's
weights directory is still refused."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import urllib.request

import pytest

from realrl.api.system_api import GserverManagerConfig
from realrl.base import names, trial_secret
from realrl.impl.generation.client import GenerationClient, GenerationServerError
from realrl.impl.openai_compat.endpoint import ChatEndpoint
from realrl.launcher.local import WorkerGroup
from tests.system.test_generation_server import EXP, server_config, tiny_model_dir  # noqa: F401
from tests.system.trial_thread import TrialThread

# The outsider: a process of its own that knows the URLs (they are in etcd, or found by a port
# scan) but not the secret. It prints each request's status.
OUTSIDER = r"""
import json, sys, urllib.request, urllib.error
out = []
for method, url, body in json.loads(sys.argv[1]):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    request.add_header("Authorization", "Bearer " + "0" * 64)  # a guess
    if "health" in url:
        request.remove_header("Authorization")
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            out.append(r.status)
    except urllib.error.HTTPError as e:
        out.append(e.code)
print(json.dumps(out))
"""


def outsider(requests: list[tuple[str, str, dict | None]]) -> list[int]:
    env = {k: v for k, v in os.environ.items() if k != "REALRL_TRIAL_SECRET"}
    done = subprocess.run([sys.executable, "-c", OUTSIDER, json.dumps(requests)], capture_output=True, env=env)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout)


def get_json(url: str) -> dict:
    with urllib.request.urlopen(urllib.request.Request(url, headers=trial_secret.http_headers()), timeout=30) as r:
        return json.load(r)


def metric(url: str, name: str) -> float:
    request = urllib.request.Request(url + "/metrics", headers=trial_secret.http_headers())
    with urllib.request.urlopen(request, timeout=30) as r:
        lines = r.read().decode().splitlines()
    return float(next(line.split()[-1] for line in lines if line.startswith(name + " ")))


def test_manager_and_server_routes_refuse_an_outsider_and_weights_load_only_from_the_trial(
    tmp_path,
    etcd_server,
    tiny_model_dir,  # noqa: F811
):
    weights_dir = tmp_path / "weights"
    weights_dir.mkdir()
    shutil.copytree(tiny_model_dir, weights_dir / "1")  # the trainer's version 1
    evil = str(tmp_path / "evil")  # another model, outside the trial's weights
    shutil.copytree(tiny_model_dir, evil)
    os.symlink(evil, weights_dir / "2")  # inside by name, outside once resolved
    manager_cfg = GserverManagerConfig(n_servers=1, train_batch_size=2, weights_dir=str(weights_dir))
    groups = [
        WorkerGroup("generation_server", 1, server_config(tiny_model_dir, weights_dir=str(weights_dir))),
        WorkerGroup("gserver_manager", 1, manager_cfg),
    ]
    trial = TrialThread(tmp_path, etcd_server.addr, groups, EXP).start()
    try:
        trial.start_training()
        manager = trial.wait_key(names.gen_server_manager(EXP, trial.trial))
        server = trial.repo.get(names.gen_server(EXP, trial.trial, 0))
        before = get_json(manager + "/rollout_stats")
        attacks = [
            ("POST", f"{manager}/stop_rollouts", {}),
            ("POST", f"{manager}/reset_rollout_worker", {"worker_index": 0}),
            ("POST", f"{manager}/allocate_rollout", {"rollout_id": "x", "qid": "x"}),
            ("GET", f"{manager}/rollout_stats", None),
            ("POST", f"{server}/abort_request", {"abort_all": True}),
            ("POST", f"{server}/pause_generation", {}),
            ("POST", f"{server}/update_weights_from_disk", {"model_path": evil, "weight_version": "9"}),
            ("POST", f"{server}/load_lora_adapter", {"lora_name": "a", "lora_path": evil}),
            ("POST", f"{server}/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 1}}),
            ("GET", f"{server}/get_server_info", None),
            ("GET", f"{manager}/health", None),
            ("GET", f"{server}/health", None),
        ]
        assert outsider(attacks) == [401] * 10 + [200, 200]
        after = get_json(manager + "/rollout_stats")
        assert not after["stopped"] and after["admitted"] == before["admitted"] == 0
        assert after["unauthorized"] == 4
        assert metric(server, "realrl_torch_server_unauthorized_requests") == 6

        async def loads() -> list:
            async with GenerationClient(timeout_s=60) as client:  # the trial's own client: it has the key
                refused = []
                for path in (evil, str(weights_dir / "2"), str(weights_dir / ".." / "evil")):
                    with pytest.raises(GenerationServerError) as e:
                        await client.update_weights_from_disk(server, path, weight_version=9)
                    refused.append(e.value.status)
                await client.update_weights_from_disk(server, str(weights_dir / "1"), weight_version=1)
                return refused + [await client.weight_version(server)]

        assert asyncio.run(loads()) == [400, 400, 400, "1"]
    finally:
        trial.close()


def test_chat_endpoint_and_judge_routes_refuse_an_outsider(tmp_path):
    keys = trial_secret.install(trial_secret.ensure_secret(str(tmp_path)))

    async def main() -> tuple[list[int], int, dict]:
        endpoint = ChatEndpoint()
        url = await endpoint.start()
        try:
            statuses = await asyncio.to_thread(
                outsider,
                [
                    ("POST", f"{url}/rl/episodes", {"wait_s": 0}),
                    ("POST", f"{url}/episodes/abc/v1/chat/completions", {"model": "m", "messages": []}),
                    ("GET", f"{url}/episodes/abc/v1/models", None),
                    ("POST", f"{url}/judge/v1/chat/completions", {"model": "m", "messages": []}),
                    ("GET", f"{url}/health", None),
                ],
            )
            # The process's own agents pass: their client carries the key as its api_key.
            assert endpoint.api_key == keys.http_api_key
            client = endpoint.client(endpoint.base_url("abc"))
            import openai

            with pytest.raises(openai.NotFoundError):  # past the gate: no such episode
                await client.models.list()
            return statuses, endpoint.gate.refused, endpoint.stats()
        finally:
            await endpoint.close()

    statuses, refused, stats = asyncio.run(main())
    assert statuses == [401, 401, 401, 401, 200]
    assert refused == 4 and stats["unauthorized"] == 4 and "calls" not in stats
