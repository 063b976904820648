"""The torch server emulating vLLM (`--emulate-vllm VERSION`), driven by
`VLLMClient`, as a real subprocess: vLLM's routes, bodies and refusals as its
source shows them (`realrl.api.vllm_api` cites the files)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch

from realrl.base import trial_secret
from realrl.impl.generation.client import GenerationServerError, ServerWeightsBroken
from realrl.impl.generation.vllm_client import VLLMClient
from tests.impl.conftest import load_reference, save_perturbed
from tests.impl.test_torch_server import PROMPTS, forward_logprobs, run, stop_at_token_k, wait_until

LONG = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}  # never finishes during a test


def post(url: str, path: str, body) -> tuple[int, dict | str]:
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **trial_secret.http_headers()}
    req = urllib.request.Request(f"{url}{path}", data, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def get(url: str, path: str):
    request = urllib.request.Request(f"{url}{path}", headers=trial_secret.http_headers())
    with urllib.request.urlopen(request, timeout=30) as resp:
        text = resp.read()
    return json.loads(text) if text else None


def generated_tokens(url: str) -> int:
    """Tokens the server has generated since it started (its /metrics)."""
    request = urllib.request.Request(f"{url}/metrics", headers=trial_secret.http_headers())
    with urllib.request.urlopen(request, timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return int(
        float(next(line.split()[1] for line in lines if line.startswith("realrl_torch_server_generated_tokens ")))
    )


def server_load(url: str) -> int:
    return get(url, "/load")["server_load"]


async def with_vllm(fn):
    async with VLLMClient(timeout_s=300) as client:
        return await fn(client)


def test_generation_bodies_versions_and_exact_aborts(start_server, tiny_llama_dir, reference_model):
    """One prompt per request; the sampled token's logprob (processed: the
    unfiltered one without filters); one weight-version span per version;
    `stop_reason` names a stop token, not EOS; an abort ends the exact id
    only (`generate-tokens-<id>`); a 404 for a model that is not served; a
    group (`generate_batch`, one request per prompt) whose one request fails
    ends the others."""
    server = start_server(tiny_llama_dir, "--emulate-vllm", "0.33")
    url = server.url
    sample = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    stop_k = stop_at_token_k(reference_model, PROMPTS[1], 4)

    async def go(client: VLLMClient):
        one = await client.generate(url, PROMPTS[0], sample, rid="q")
        batch = await client.generate_batch(url, [PROMPTS[1], PROMPTS[2]], sample)
        stopped = await client.generate(url, PROMPTS[1], stop_k)
        held = {rid: asyncio.create_task(client.generate(url, PROMPTS[0], LONG, rid=rid)) for rid in ("a/1", "a/10")}
        await asyncio.to_thread(wait_until, lambda: server_load(url) == 2, 60, "two running")
        await client.abort_request(url, rid="a/1")
        aborted = await held["a/1"]
        assert not held["a/10"].done()  # exact ids, no prefixes
        await client.abort_request(url, abort_all=True)
        other = await held["a/10"]
        # A group whose one request fails: the others end with it, on the server too. (The same id
        # twice: whichever comes second is refused because the first is running, the exact moment.)
        start = generated_tokens(url)
        with pytest.raises(GenerationServerError, match="is already running"):
            await client.generate_batch(url, [PROMPTS[0], PROMPTS[1]], LONG, rids=["dup", "dup"])
        await asyncio.to_thread(wait_until, lambda: server_load(url) == 0, 120, "the group's other request ended")
        assert generated_tokens(url) - start < LONG["max_new_tokens"]  # ended, not run to its end
        with pytest.raises(GenerationServerError, match="'gone' is not loaded") as refused:
            await client.generate(url, PROMPTS[0], sample, lora_path="gone")
        return one, batch, stopped, aborted, other, refused.value

    one, batch, stopped, aborted, other, refused = run(with_vllm(go))
    assert refused.status == 400  # vLLM's 404 for the model, as the partial rollout's stale-adapter refusal
    assert len(one.output_ids) == 6 and one.finish_reason == "length" and one.output_versions == ["0"] * 6
    torch.testing.assert_close(
        torch.tensor(one.output_logprobs),
        forward_logprobs(reference_model, PROMPTS[0], one.output_ids, 1.0),
        atol=1e-3,
        rtol=0,
    )
    assert [len(r.output_ids) for r in batch] == [6, 6]
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stopped.output_ids[-1]
    assert aborted.finish_reason == other.finish_reason == "abort" and aborted.output_ids
    assert len(aborted.output_logprobs) == len(aborted.output_ids) == len(aborted.output_versions)
    status, body = post(url, "/inference/v1/generate", {"token_ids": [1, 2], "model": "nope"})
    assert status == 404 and body["error"] == {
        "message": f"The model `nope` does not exist. Valid aliases: {tiny_llama_dir}.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }
    status, body = post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": "/nowhere"}})
    assert status == 500 and body["error"]["type"] == "InternalServerError"


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_weight_update_pauses_reloads_and_resumes(start_server, tiny_llama_dir, tmp_path, release):
    """`load_version`: pause (abort) -> reload_weights -> reset_prefix_cache
    -> update_weight_version -> resume. The request in flight comes back
    aborted with its partial tokens under the old version; a generation sent
    while paused is refused 503 by 0.33 (the client sends it again, not
    counted) and held by 0.32; after it, tokens come from the new weights,
    labelled with the new version. A reload that fails leaves the server
    paused and the update failed."""
    server = start_server(tiny_llama_dir, "--emulate-vllm", release, "--weight-load-gate", str(tmp_path / "go"))
    url = server.url
    new_dir = str(tmp_path / "v1")
    save_perturbed(tiny_llama_dir, new_dir, seed=5, scale=0.2)
    probe = PROMPTS[2]
    sample = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}

    async def go(client: VLLMClient):
        held = asyncio.create_task(client.generate(url, PROMPTS[0], LONG))
        await asyncio.to_thread(wait_until, lambda: server_load(url) == 1, 60, "running")
        update = asyncio.create_task(client.load_version(url, new_dir, 1, lora=False))
        aborted = await held
        await asyncio.to_thread(wait_until, lambda: get(url, "/is_paused") == {"is_paused": True}, 30, "paused")
        body = {"token_ids": probe, "sampling_params": {"max_tokens": 2}}
        raw = asyncio.create_task(asyncio.to_thread(post, url, "/inference/v1/generate", body))
        during = asyncio.create_task(client.generate(url, probe, sample))
        await asyncio.sleep(0.3)  # both have reached the paused server (0.32 holds them)
        assert not during.done()
        (tmp_path / "go").touch()  # the reload may finish now
        await update
        return aborted, await raw, await during, await client.weight_version(url)

    aborted, paused_status, during, version = run(with_vllm(go))
    assert aborted.aborted and aborted.output_versions == ["0"] * len(aborted.output_ids)
    if release == "0.33":
        assert paused_status[0] == 503 and paused_status[1]["error"]["type"] == "ServiceUnavailableError"
        assert paused_status[1]["error"]["message"] == "Generation is paused. Please retry after it resumes."
    else:
        assert paused_status[0] == 200  # held until /resume, then served
    assert version == "1" and during.output_versions == ["1"] * 5
    new = load_reference(new_dir)
    torch.testing.assert_close(
        torch.tensor(during.output_logprobs), forward_logprobs(new, probe, during.output_ids, 1.0), atol=1e-3, rtol=0
    )

    async def broken(client: VLLMClient):
        with pytest.raises(
            ServerWeightsBroken, match="reload_weights from /nowhere failed, its weights are half written"
        ):
            await client.load_version(url, "/nowhere", 2, lora=False)
        return await client.weight_version(url)

    assert run(with_vllm(broken)) == "1"
    assert get(url, "/is_paused") == {"is_paused": True}  # nothing is served from half-written weights


def test_lora_versions_load_by_name_and_requests_name_them_in_model(
    start_server, tiny_llama_dir, tmp_path, reference_model
):
    """A LoRA version on vLLM: `/v1/load_lora_adapter` under `actor-v<v>` (a
    name loaded already is a 400 vLLM words so; the client takes it as loaded),
    `/update_weight_version`; a request names its adapter in `model`, and its
    tokens carry the version of their span. Loading version 3 unloads
    actor-v1 (`/v1/unload_lora_adapter`): a request scheduled on version 1
    just before (vLLM: 404, the model does not exist) is scheduled again, as
    on SGLang, and generated on version 3. The server is the trial's
    (`--secret-file`, `--weights-dir`): vLLM's routes, its dev routes too,
    refuse a caller without the key (401; real vLLM's `--api-key` would
    leave the dev routes open), and load weights only from the trial's
    directory (400, even with the key)."""
    from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest
    from realrl.system.partial_rollout import PartialRolloutManager
    from tests.impl.torch_server.test_weights import ab, write_adapter
    from tests.system.test_partial_rollout import StaleRouting

    secret = trial_secret.ensure_secret(str(tmp_path / "run"))
    weights_dir = tmp_path / "weights"
    trusted = ("--secret-file", secret, "--weights-dir", str(weights_dir))
    server = start_server(tiny_llama_dir, "--emulate-vllm", "0.33", *trusted)
    url = server.url
    outsider = [
        post(url, path, body)[0]
        for path, body in (
            ("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": tiny_llama_dir}}),
            ("/pause?mode=abort", {}),
            ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}),
            ("/inference/v1/generate", {"token_ids": [1, 2]}),
        )
    ]
    assert outsider == [401] * 4 and get(url, "/health") is None
    before = trial_secret.installed_path()
    trial_secret.install(secret)  # this test's clients are the trial's from here on
    out_features, in_features = reference_model.model.layers[0].self_attn.q_proj.weight.shape
    adapter = weights_dir / "v1"
    write_adapter(adapter, {"model.layers.0.self_attn.q_proj": ab(1, out_features, in_features)})
    evil = str(tmp_path / "elsewhere")  # with the key, still not the trial's weights
    sample = {"max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True}

    async def go(client: VLLMClient):
        await client.load_version(url, str(adapter), 1, lora=True)
        await client.load_version(url, str(adapter), 1, lora=True)  # again: already loaded, fine
        result = await client.generate(url, PROMPTS[0], sample, lora_path="actor-v1")
        version = await client.weight_version(url)
        for v in (2, 3):
            await client.load_version(url, str(adapter), v, lora=True)
        prm = PartialRolloutManager(StaleRouting(url, 1, 3), client, retry_backoff_s=0.01, lora=True)
        stale = await prm.generate(
            GenerationRequest("stale-0", PROMPTS[1], 1, GenerationHyperparameters(max_new_tokens=4))
        )
        return result, version, stale, prm.stats.pop()

    try:
        result, version, stale, stats = run(with_vllm(go))
        status, body = post(url, "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": evil}})
        assert status == 400 and "weights are loaded only from under" in body["error"]["message"]
        status, body = post(url, "/v1/unload_lora_adapter", {"lora_name": "actor-v1"})  # gone already
        assert status == 404 and body["error"]["message"] == "The lora adapter 'actor-v1' cannot be found."
        status, body = post(url, "/v1/load_lora_adapter", {"lora_name": "actor-v3", "lora_path": str(adapter)})
    finally:
        trial_secret.install(before)
    assert status == 400 and body["error"]["type"] == "InvalidUserInput"
    assert "has already been loaded" in body["error"]["message"]
    assert version == "1" and result.output_versions == ["1"] * 4
    assert stats["stale_adapters"] == 1 and stale.output_ids[0] and set(stale.output_versions[0]) == {3}
