"""The torch server emulating SGLang (`--emulate-sglang VERSION`), as a real
subprocess: the behaviours realrl must meet on SGLang, which cannot run here
(`realrl.impl.generation.backends` cites the SGLang source of each)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import torch

from realrl.api.generate_answers import ANSWERS_MEDIA_TYPE
from realrl.impl.generation.client import GenerationClient, GenerationServerError, GenerationServerUnavailable
from realrl.impl.generation.torch_server.sglang_compat import SGLangCompat
from tests.impl.conftest import load_reference, save_perturbed
from tests.impl.test_torch_server import (
    PROMPTS,
    _with_client,
    forward_logprobs,
    get_json,
    post_raw,
    run,
    stop_at_token_k,
    wait_until,
)

LONG = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}  # never finishes during a test


def status_of(url: str, path: str) -> int:
    try:
        with urllib.request.urlopen(f"{url}{path}", timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


def test_behaviours_by_release():
    env = {"SGLANG_HEALTH_CHECK_TIMEOUT": "3", "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false"}
    new, old = SGLangCompat.from_env("0.5.16", environ=env), SGLangCompat.from_env("0.5.5", environ=env)
    assert new.health_timeout_s == 3 and not new.health_generation
    # The switch works from 0.5.6; /health_generate always generates; before 0.4.10.post2 /health did not.
    assert not new.health_generates("/health") and new.health_generates("/health_generate")
    assert old.health_generates("/health")
    assert not SGLangCompat.from_env("0.4.10", environ={}).health_generates("/health")
    assert SGLangCompat.from_env("0.4.10.post2", environ={}).health_generates("/health")
    assert (new.has_model_info, old.has_model_info) == (True, False)
    assert (new.control_bodies_required, old.control_bodies_required) == (True, False)
    assert not new.has_weight_version_route and SGLangCompat.from_env("0.5.7", environ={}).has_weight_version_route
    assert (
        not new.refused_flush_swaps_weights and SGLangCompat.from_env("0.5.23", environ={}).refused_flush_swaps_weights
    )
    assert SGLangCompat.from_env("0.5.16", dp=3, environ={}).per_rank(5, 0) == [5, 0, 0] and new.per_rank(5, 0) == 5
    for bad in ("0.4.8", "latest"):
        with pytest.raises(ValueError):
            SGLangCompat.from_env(bad)


def test_shapes_prefix_aborts_pauses_and_health(start_server, tiny_llama_dir, tmp_path, monkeypatch):
    """SGLang 0.5.16 with two data-parallel ranks, a health check that gives up
    after 1 s, and room for two running requests."""
    monkeypatch.setenv("SGLANG_HEALTH_CHECK_TIMEOUT", "1")
    monkeypatch.delenv("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", raising=False)
    server = start_server(
        tiny_llama_dir, "--emulate-sglang", "0.5.16", "--emulate-sglang-dp", "2", "--max-running-requests", "2"
    )
    url = server.url
    new_dir = str(tmp_path / "v1")
    save_perturbed(tiny_llama_dir, new_dir, seed=3)

    # Response shapes: no request counts in /get_server_info, per-rank lists elsewhere.
    info = get_json(url, "/get_server_info")
    assert "num_running_requests" not in info and "num_waiting_requests" not in info
    assert len(info["internal_states"]) == 2 and info["version"] == "0.5.16"
    assert status_of(url, "/get_weight_version") == 404  # "deprecated, use /model_info" from 0.5.8
    # SGLang has no columnar answer: asked for one, the emulation answers JSON, as SGLang would.
    asked = urllib.request.Request(
        f"{url}/generate",
        data=b'{"input_ids": [0, 5], "sampling_params": {"max_new_tokens": 2}}',
        headers={"Content-Type": "application/json", "Accept": ANSWERS_MEDIA_TYPE},
    )
    with urllib.request.urlopen(asked, timeout=60) as resp:
        assert resp.headers.get_content_type() == "application/json" and "output_ids" in json.loads(resp.read())

    async def go(client):

        # Aborts by prefix, once the rid itself is live: "q/1" also ends "q/10".
        tasks = {
            rid: asyncio.create_task(client.generate(url, PROMPTS[i], LONG, rid=rid))
            for i, rid in enumerate(["q/1", "q/10", "r"])
        }
        await asyncio.to_thread(wait_until, lambda: loads(url) == [(2, 1), (0, 0)], 60, "2 running, 1 waiting")
        await client.abort_request(url, rid="q")  # no such request: nothing ends
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in tasks.values())
        assert await client.abort_request(url, rid="q/1") is None  # an empty 200, as SGLang answers
        prefixed = [await tasks["q/1"], await tasks["q/10"]]
        assert not tasks["r"].done()

        # A pause needs a body, and in abort mode ends the waiting requests too.
        waiting = [asyncio.create_task(client.generate(url, PROMPTS[3], LONG)) for _ in range(2)]
        await asyncio.to_thread(wait_until, lambda: loads(url) == [(2, 1), (0, 0)], 60, "2 running, 1 waiting")
        no_body = post_raw(url, "/pause_generation", b"")
        paused = await client.pause_generation(url)
        ended = [await tasks["r"], *[await w for w in waiting]]
        # Paused: /health (a generation) waits, then answers 503 after the timeout.
        probe_paused = await client.probe(url, timeout_s=10)
        assert post_raw(url, "/continue_generation", b"")[0] == 400
        await client.continue_generation(url)
        probe_continued = await client.probe(url, timeout_s=10)

        update = await client.update_weights_from_disk(url, new_dir, 1)
        return prefixed, no_body, paused, ended, probe_paused, probe_continued, update, await client.model_info(url)

    prefixed, no_body, paused, ended, probe_paused, probe_continued, update, model_info = run(_with_client(go))
    assert [r.finish_reason for r in prefixed] == ["abort", "abort"]
    assert no_body[0] == 400
    assert paused == {"message": "Generation paused successfully.", "status": "ok"}
    assert [r.finish_reason for r in ended] == ["abort"] * 3
    assert any(r.output_ids == [] for r in ended)  # the one that never left the queue
    assert not probe_paused.ok and "503" in probe_paused.reason and probe_continued.ok
    assert update.num_paused_requests == [0, 0] and " | " in update.message  # one per rank
    assert model_info.weight_version == "1"

    # Before 0.5.23 a weight update that cannot flush the cache (requests paused
    # in place) kills the server.
    async def paused_in_place_update(client):
        task = asyncio.create_task(client.generate(url, PROMPTS[0], LONG))
        await asyncio.to_thread(wait_until, lambda: loads(url)[0][0] == 1, 60, "running")
        await client.pause_generation(url, mode="in_place")
        with pytest.raises(GenerationServerUnavailable):
            await client.update_weights_from_disk(url, tiny_llama_dir, 2)
        await asyncio.gather(task, return_exceptions=True)

    run(_with_client(paused_in_place_update))
    assert server.proc.wait(timeout=30) != 0


def test_0_5_23_swaps_weights_it_reports_as_not_updated(start_server, tiny_llama_dir, tmp_path):
    """A weight update into a batch paused in place: `success: false`, the old
    version reported, the new weights serving; loading again once the batch is
    gone succeeds (what the manager's retry does)."""
    server = start_server(tiny_llama_dir, "--emulate-sglang", "0.5.23")
    url = server.url
    new_dir = str(tmp_path / "v1")
    save_perturbed(tiny_llama_dir, new_dir, seed=4, scale=0.2)
    probe = PROMPTS[2]
    sample = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}

    async def go(client):
        held = asyncio.create_task(client.generate(url, PROMPTS[0], LONG))
        await asyncio.to_thread(wait_until, lambda: loads(url)[0][0] == 1, 60, "running")
        await client.pause_generation(url, mode="in_place")
        with pytest.raises(GenerationServerError) as refused:
            await client.update_weights_from_disk(url, new_dir, 1)
        version_after_refusal = await client.weight_version(url)
        await client.continue_generation(url)
        after = await client.generate(url, probe, sample)
        retry = await client.update_weights_from_disk(url, new_dir, 1)  # aborts the held request
        return refused.value, version_after_refusal, after, retry, await held, await client.weight_version(url)

    refused, version_after_refusal, after, retry, held, version = run(_with_client(go))
    assert refused.status == 400 and "Weights were updated, but the cache was not flushed" in str(refused)
    assert version_after_refusal == "0" and after.weight_version == "0"
    new, old = load_reference(new_dir), load_reference(tiny_llama_dir)
    got = torch.tensor(after.output_logprobs)
    torch.testing.assert_close(got, forward_logprobs(new, probe, after.output_ids, 1.0), atol=1e-3, rtol=0)
    assert not torch.allclose(got, forward_logprobs(old, probe, after.output_ids, 1.0), atol=1e-3)
    assert retry.success and version == "1" and held.finish_reason == "abort"


async def client_loads(url: str) -> list[tuple[int, int]]:
    """(running, waiting) per rank, from /v1/loads."""
    async with GenerationClient(timeout_s=10) as client:
        return [(r.num_running_reqs, r.num_waiting_reqs) for r in (await client.loads(url)).loads]


def loads(url: str) -> list[tuple[int, int]]:
    return asyncio.run(client_loads(url))


def generated(url: str) -> int:
    """Tokens the server has generated since it started (its /metrics)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("realrl_torch_server_generated_tokens "):
                return int(float(line.split()[1]))
    return 0


def test_sampling_logprobs_and_finish_order_as_each_release_reports_them(start_server, tiny_llama_dir, reference_model):
    """A request whose last allowed token is EOS reports `length` up to
    0.5.16 (the length limit checked first) and `stop` from 0.5.23; the
    partial rollout ends an answer on its last token either way. From
    0.5.16 SGLang reports sampling logprobs for a request with
    `return_sampling_mask` (the client asks exactly when the sampling
    filters) and refuses, with HTTP 400 and its message, one whose top_k it
    cannot bound: 0.5.16 top_k off, 0.5.23 also top_k > 4096; before 0.5.16,
    never reports them. A filtered answer without them fails the partial
    rollout instead of training on the unfiltered logprobs."""
    from realrl.api.generation_api import GenerationHyperparameters
    from realrl.system.partial_rollout import PartialRolloutError, PartialRolloutManager, _Answer

    nucleus = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.8, "top_k": 20, "ignore_eos": True}
    plain = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    no_top_k = {"max_new_tokens": 8, "temperature": 1.0, "top_p": 0.8, "ignore_eos": True}
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "top_p": 0.8, "ignore_eos": True}
    big_top_k = dict(nucleus, top_k=5000)
    servers = {
        v: start_server(tiny_llama_dir, "--emulate-sglang", v, wait=False) for v in ("0.5.16", "0.5.23", "0.5.15")
    }
    for server in servers.values():  # (started side by side: each start is mostly one core's imports)
        server.wait_healthy()

    async def go(url, client):
        calls = (nucleus, plain, no_top_k, greedy, big_top_k)
        return await asyncio.gather(*(client.generate(url, PROMPTS[1], p) for p in calls), return_exceptions=True)

    answers = {v: run(_with_client(lambda c, s=s: go(s.url, c))) for v, s in servers.items()}
    last_is_eos = stop_at_token_k(reference_model, PROMPTS[1], 5)
    order = {
        v: run(_with_client(lambda c, s=s: c.generate(s.url, PROMPTS[1], last_is_eos))) for v, s in servers.items()
    }
    assert [len(r.output_ids) for r in order.values()] == [5] * 3
    assert {v: r.finish_reason for v, r in order.items()} == {"0.5.16": "length", "0.5.23": "stop", "0.5.15": "length"}
    for release in ("0.5.16", "0.5.23"):
        filtered, unfiltered, refused, argmax, big = answers[release]
        assert len(filtered.output_sampling_logprobs) == 8
        assert all(s > lp for s, lp in zip(filtered.output_sampling_logprobs, filtered.output_logprobs))
        assert unfiltered.output_sampling_logprobs is None and len(unfiltered.output_logprobs) == 8  # not asked for
        assert isinstance(refused, GenerationServerError) and refused.status == 400
        assert argmax.output_sampling_logprobs is None  # greedy filters nothing: not asked for
    assert answers["0.5.16"][2].message.startswith("return_sampling_mask requires finite top_k; top_p-only")
    assert len(answers["0.5.16"][4].output_sampling_logprobs) == 8  # 0.5.16 takes any finite top_k
    for refused, k in ((answers["0.5.23"][2], 1 << 30), (answers["0.5.23"][4], 5000)):
        assert refused.message == (
            "return_sampling_mask requires top_k=1 for greedy sampling or finite 1 < top_k <= 4096; "
            f"got top_k={k}. Lower top_k or increase --sampling-mask-max-tokens."
        )
    before = answers["0.5.15"]
    assert [r.output_sampling_logprobs for r in before] == [None] * 5 and not before[2].aborted

    manager = PartialRolloutManager(routing=None, client=None)
    answer = _Answer()
    with pytest.raises(PartialRolloutError, match="no sampling logprobs"):
        manager._append(
            answer, before[0], 0, "q", servers["0.5.15"].url, GenerationHyperparameters(top_p=0.8, top_k=20)
        )
    assert answer.output_ids == []  # nothing appended
    manager._append(answer, before[1], 0, "q", servers["0.5.15"].url, GenerationHyperparameters())  # the logprobs
    assert answer.sampling_logprobs == answer.logprobs == before[1].output_logprobs


def test_a_request_aborted_while_retracted_comes_back_without_sampling_logprobs(start_server, tiny_llama_dir):
    """SGLang 0.5.23: a `retract` pause puts running requests back in the
    queue; one aborted there answers with the tokens it had streamed (every
    50 for a non-streamed request) and their logprobs, but no sampling
    logprobs. The partial rollout drops those tokens and generates them
    again, so every trained token has its behaviour logprob; a weight update
    meanwhile aborts them and succeeds (the queue holds them, not a batch)."""
    from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest
    from realrl.system.partial_rollout import PartialRolloutManager, _Answer

    server = start_server(tiny_llama_dir, "--emulate-sglang", "0.5.23")
    url = server.url
    filtered = {"max_new_tokens": 4000, "temperature": 1.0, "top_p": 0.9, "top_k": 20, "ignore_eos": True}

    async def go_with_rids(client):
        rids = ["a" * 32, "b" * 32]
        held = [asyncio.create_task(client.generate(url, PROMPTS[i], filtered, rid=r)) for i, r in enumerate(rids)]
        await asyncio.to_thread(wait_until, lambda: generated(url) >= 2 * 60, 120, "60 tokens each")
        await client.pause_generation(url, mode="retract")
        await client.abort_request(url, rid=rids[0])
        aborted = await held[0]
        update = await client.update_weights_from_disk(url, tiny_llama_dir, 1)  # aborts the other one first
        other = await held[1]
        await client.continue_generation(url)
        after = await client.generate(url, PROMPTS[2], dict(filtered, max_new_tokens=4))
        return aborted, update, other, after

    aborted, update, other, after = run(_with_client(go_with_rids))
    for r in (aborted, other):
        n = len(r.output_ids)
        assert r.aborted and n >= 50 and n % 50 == 0 and len(r.output_logprobs) == n
        assert r.output_sampling_logprobs is None and r.prompt_tokens == 0
    assert update.success
    assert len(after.output_sampling_logprobs) == 4  # resumed requests report them again

    manager = PartialRolloutManager(routing=None, client=None)
    answer = _Answer()
    gconfig = GenerationHyperparameters(top_p=0.9, top_k=20, max_new_tokens=4000)
    assert manager._append(answer, aborted, 0, "q", url, gconfig) == 0
    assert answer.output_ids == [] and manager.stats.dropped_tokens == len(aborted.output_ids)
    assert not manager._take(answer, aborted, GenerationRequest("q", [1], 1, gconfig), url)  # resubmitted
