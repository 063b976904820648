"""SGLang's distributed weight update (docs/design.md §8, "Broadcast"): a real
torch server emulating SGLang 0.5.16 / 0.5.23 answers SGLang's routes
(`/init_weights_update_group`, `/update_weights_from_distributed` with
`load_format: flattened_bucket`, 0.5.23's `/begin_weight_update` ...
`/end_weight_update`, `/destroy_weights_update_group`), and the manager's
driver (`SGLangDriver`) takes it through versions sent by a real trainer-side
`Sender` over a real gloo group: the server's version changes once the whole
version is in place, and what it then generates equals, bit for bit, what it
generates after loading the same version from disk. The routes are behind
the trial's key; malformed bodies are 400 and counted."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
import torch

from realrl.base import trial_secret
from realrl.impl.generation.client import GenerationClient
from realrl.impl.weights.broadcast import GroupSpec, Manifest, Sender, StoreServer, published_tensors
from realrl.system.model_worker import publish_weights
from realrl.system.weight_broadcast_sglang import SGLangDriver
from tests.impl.conftest import load_reference
from tests.impl.weights.models import train_a_little
from tests.impl.weights.test_torch_server_group import PROBE, forward_logprobs

HOST = "127.0.0.1"
GREEDY = {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}


def _post(url: str, route: str, body: dict, headers: dict) -> tuple[int, dict | str]:
    request = urllib.request.Request(
        url + route,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **headers},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        text = e.read().decode()
        try:
            return e.code, json.loads(text)
        except ValueError:
            return e.code, text


@pytest.mark.parametrize("release", ["0.5.16", "0.5.23"])
def test_an_sglang_server_takes_versions_over_its_own_routes_bit_exact_with_the_disk_path(
    start_server, tiny_llama_dir, tmp_path, release
):
    secret = trial_secret.ensure_secret(str(tmp_path / "run"))
    keys = trial_secret.install(secret)  # this process's client sends the trial's key
    server = start_server(tiny_llama_dir, "--secret-file", secret, "--emulate-sglang", release)
    url = server.url
    trainer = load_reference(tiny_llama_dir)
    store = StoreServer(HOST)
    spec = GroupSpec("realrl-s-e1", HOST, store.port, 2, bucket_bytes=16384, timeout_s=60, protocol="sglang")
    manifest = Manifest.of(published_tensors(trainer), packed=True)
    assert len(manifest.bucket_entries(spec.bucket_bytes)) > 2  # a version is several calls
    auth = trial_secret.http_headers()

    async def go(client: GenerationClient):
        driver = SGLangDriver(spec, {url: 1}, client, keys.weights_group_key)
        sender = Sender(spec, keys.weights_group_key, manifest, HOST)
        out = {}
        try:
            for version in (1, 2):
                train_a_little(trainer, version)
                sender.publish(version, published_tensors(trainer))
                ok, why = await driver.await_version(url, version, 120)
                assert ok, why
                out[version] = await client.generate(url, PROBE, GREEDY)
        finally:
            sender.close()
        await asyncio.wait_for(driver._task, 60)  # the sender closed the group: the driver destroys it
        # The same version from disk: the same tokens and logprobs, bit for bit.
        path = publish_weights(trainer, str(tmp_path / "weights"), 2)
        await client.update_weights_from_disk(url, path, 2, True)
        out["disk"] = await client.generate(url, PROBE, GREEDY)
        return out, driver

    try:
        out, driver = asyncio.run(_with_client(go))
    finally:
        store.close()
    assert driver.held == {url: 2} and not driver.lost and not driver.failed
    assert out[1].weight_version == "1" and out[2].weight_version == "2"
    assert out[2].output_ids == out["disk"].output_ids and out[2].output_logprobs == out["disk"].output_logprobs
    expected = forward_logprobs(trainer, PROBE, out[2].output_ids)
    torch.testing.assert_close(torch.tensor(out[2].output_logprobs), expected, atol=1e-4, rtol=0)
    assert out[1].output_logprobs != out[2].output_logprobs

    # SGLang's own refusals, as its source answers them.
    bucket = {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]], "group_name": "nope"}
    destroyed = _post(url, "/destroy_weights_update_group", {"group_name": spec.name}, auth)
    assert destroyed == (400, {"success": False, "message": "The group to be destroyed does not exist."})
    if release == "0.5.23":
        assert _post(url, "/update_weights_from_distributed", bucket, auth) == (
            400,
            {
                "success": False,
                "message": "update_weights_from_distributed must run between begin_weight_update() and "
                "end_weight_update()",
            },
        )
        assert _post(url, "/end_weight_update", {}, auth)[0] == 400
        assert _post(url, "/begin_weight_update", {}, auth)[0] == 200
        assert _post(url, "/begin_weight_update", {}, auth)[0] == 400  # one session at a time
        status, answer = _post(url, "/update_weights_from_distributed", bucket, auth)
        assert status == 400 and answer["message"].startswith("Failed to receive weights: Group nope not in")
        assert _post(url, "/end_weight_update", {}, auth)[0] == 200
    else:
        assert _post(url, "/begin_weight_update", {}, auth)[0] == 404  # not in 0.5.16
    # Malformed bodies: 400 before anything runs, counted.
    for body in (
        {**bucket, "dtypes": ["float32", "float32"]},
        {**bucket, "dtypes": ["float33"]},
        {**bucket, "shapes": [[-1]]},
        {"names": []},
    ):
        status, _ = _post(url, "/update_weights_from_distributed", body, auth)
        assert status == 400, body
    assert _post(url, "/init_weights_update_group", {"master_address": HOST}, auth)[0] == 400
    metrics = urllib.request.urlopen(urllib.request.Request(url + "/metrics", headers=auth), timeout=10).read()
    assert b'realrl_torch_server_rejections{reason="invalid"} 3' in metrics, metrics
    # Behind the trial's key, like every route but /health.
    assert _post(url, "/init_weights_update_group", {}, {})[0] == 401
    assert _post(url, "/update_weights_from_distributed", bucket, {})[0] == 401

    if release == "0.5.16":  # (the same route in both)
        # A group that never forms (the sender waits for rank 1, which never comes, before it
        # forms the server's group, rank 2's): SGLang would wait torch's 30 minutes in the
        # rendezvous; the driver abandons the epoch at the spec's timeout_s (the manager then
        # closes the epoch's store) and the server's init fails at once.
        late = StoreServer(HOST)
        never = GroupSpec("realrl-s-e2", HOST, late.port, 3, timeout_s=2, join_timeout_s=30, protocol="sglang")
        abandoned: list[str] = []

        def abandon(name: str, why: str) -> None:
            abandoned.append(why)
            late.close()

        async def never_forms(client: GenerationClient):
            driver = SGLangDriver(never, {url: 2}, client, keys.weights_group_key, on_abandon=abandon)
            sender = Sender(never, keys.weights_group_key, manifest, HOST)
            try:
                await asyncio.wait_for(driver._task, 60)
            finally:
                sender.close(timeout_s=5)
            return driver

        driver = asyncio.run(_with_client(never_forms))
        assert abandoned == ["the group did not form within 2 s"]
        assert driver.lost[url] == "not in the group within 2 s"
        log = tmp_path / "server0.log"
        for _ in range(600):  # (the server's init, on its helper thread, ends once the store is gone)
            if "Failed to initialize custom process group" in log.read_text():
                break
            time.sleep(0.05)
        assert "Failed to initialize custom process group" in log.read_text()


async def _with_client(fn):
    async with GenerationClient(timeout_s=300) as client:
        return await fn(client)
