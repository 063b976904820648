"""A real torch server in a weight broadcast group (docs/design.md §8,
"Broadcast"): it receives each version while it serves the one before,
swaps it in place (requests in flight go on under the new weights, each
token labelled with its version), reports the version only once the whole of it is in place, and
its logprobs are the trainer's."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import urllib.error
import urllib.request

import torch

from realrl.base import trial_secret
from realrl.impl.generation.client import GenerationClient
from realrl.impl.weights.broadcast import GroupSpec, Manifest, Sender, StoreServer, published_tensors
from tests.impl.conftest import load_reference
from tests.impl.weights.models import train_a_little

HOST = "127.0.0.1"
PROBE = [0, 3, 3, 8, 20, 41, 12, 9, 50]


def forward_logprobs(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0].float()
    logprobs = torch.log_softmax(logits, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def test_a_torch_server_takes_versions_over_the_wire_while_it_serves(start_server, tiny_llama_dir, tmp_path):
    secret = trial_secret.ensure_secret(str(tmp_path / "run"))
    keys = trial_secret.install(secret)  # this process's client sends the trial's key
    server = start_server(tiny_llama_dir, "--secret-file", secret)
    trainer = load_reference(tiny_llama_dir)
    store = StoreServer(HOST)
    spec = GroupSpec("realrl-t-e1", HOST, store.port, 2, bucket_bytes=16384, timeout_s=60)
    sender = Sender(spec, keys.weights_group_key, Manifest.of(published_tensors(trainer)), HOST)
    long = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}
    sample = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    versions = {}

    async def go(client: GenerationClient):
        url = server.url
        await client.join_weights_group(url, spec, 1)
        inflight = [asyncio.create_task(client.generate(url, p, long)) for p in ([0, 5], PROBE)]
        while (await client.server_info(url))["num_running_requests"] < 2:
            await asyncio.sleep(0.05)
        for version in (1, 2, 3):  # (the third into the buffer the parameters left at the second)
            train_a_little(trainer, version)
            versions[version] = copy.deepcopy(trainer)
            sender.publish(version, published_tensors(trainer))
            answer = await client.await_weight_version(url, version, 60)
            assert answer.success and answer.weight_version == str(version), answer
            versions[f"out{version}"] = await client.generate(url, PROBE, sample)
        stats = (await client.server_info(url))["stats"]
        assert stats["weight_updates_swapped"] == 3  # by pointer, each into the buffer the one before left
        made = stats["generated_tokens"]
        while (await client.server_info(url))["stats"]["generated_tokens"] < made + 4:  # some under version 3
            await asyncio.sleep(0.05)
        await client.abort_request(url, abort_all=True)
        aborted = await asyncio.gather(*inflight)
        sender.close()
        after_close = await client.await_weight_version(url, 4, 30)
        # An epoch whose sender never comes: the membership ends at the bound the manager sets.
        orphan = dataclasses.replace(spec, name="realrl-t-e2", join_timeout_s=1.0)
        await client.join_weights_group(url, orphan, 1)
        orphaned = await client.await_weight_version(url, 4, 60)
        return aborted, after_close, orphaned

    try:
        aborted, after_close, orphaned = asyncio.run(_with_client(go))
    finally:
        sender.close()
        store.close()
    for res in aborted:  # went on across the swaps, each span under its version
        assert res.finish_reason == "abort" and res.weight_version == "3" and 0 < len(res.output_ids) < 4000
        assert res.output_versions == sorted(res.output_versions) and set(res.output_versions) == {"0", "1", "2", "3"}
    for version in (1, 2, 3):
        out = versions[f"out{version}"]
        assert out.weight_version == str(version)
        expected = forward_logprobs(versions[version], PROBE, out.output_ids)
        torch.testing.assert_close(torch.tensor(out.output_logprobs), expected, atol=1e-4, rtol=0)
    assert not after_close.success and "closed by its sender" in after_close.message
    assert not orphaned.success and "no sender within 1 s" in orphaned.message
    # The routes are the trial's: without its key, 401 before anything is read.
    body = json.dumps({"group_name": "x", "store_host": HOST, "store_port": 1, "world_size": 2, "rank": 1}).encode()
    request = urllib.request.Request(f"{server.url}/join_weights_group", data=body, method="POST")
    try:
        urllib.request.urlopen(request, timeout=10)
        status = 200
    except urllib.error.HTTPError as e:
        status = e.code
    assert status == 401


async def _with_client(fn):
    async with GenerationClient(timeout_s=300) as client:
        return await fn(client)
