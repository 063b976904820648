"""Simulated generation servers (realrl/impl/generation/sim_server.py), over
real HTTP on 127.0.0.1: they answer the routes the runtime uses as the torch
server does (compared with a real torch server on a tiny Llama in this
process), take the time per token they are configured with, and load weights
by reading the checkpoint they are told to."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time

import aiohttp
import pytest
import torch
from aiohttp import web
from safetensors.torch import save_file

from realrl.impl.generation.client import GenerationClient, GenerationServerError
from realrl.impl.generation.sim_server import SimServerConfig, SimServerHost
from realrl.impl.generation.torch_server import GenerationEngine, TorchGenerationServer, eos_token_ids_of, load_model
from tests.impl.conftest import EOS_ID, MAX_POSITIONS

VOCAB = 64  # the tiny Llama's


def sim_config(**kw) -> SimServerConfig:
    kw = {"token_latency_s": 0.001, "output_tokens": 6, "vocab_size": VOCAB, "eos_token_ids": [EOS_ID], **kw}
    return SimServerConfig(max_positions=MAX_POSITIONS, **kw)


@contextlib.asynccontextmanager
async def sim_host(n: int = 1, **kw):
    host = SimServerHost(sim_config(**kw))
    try:
        await host.start(n)
        yield host
    finally:
        await host.close()


@contextlib.asynccontextmanager
async def torch_server(model_dir: str):
    """The real torch server's application around a real engine, in this process."""
    torch.set_num_threads(1)
    model = load_model(model_dir, "cpu", "float32")
    engine = GenerationEngine(model, device=torch.device("cpu"), eos_token_ids=eos_token_ids_of(model))
    engine.start()
    runner = web.AppRunner(TorchGenerationServer(engine, model_dir, "cpu", "float32").make_app())
    await runner.setup()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await web.SockSite(runner, sock).start()
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        await asyncio.to_thread(engine.stop)
        await runner.cleanup()


async def call(session: aiohttp.ClientSession, method: str, url: str, body=None) -> tuple[int, object]:
    """(status, the JSON body, or its text when it is not JSON)."""
    async with session.request(method, url, json=body) as resp:
        text = await resp.text()
        try:
            return resp.status, json.loads(text) if text.strip() else None
        except ValueError:
            return resp.status, text


def shape(value):
    """The JSON's structure: keys and value types, not the values."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return [shape(value[0])] if value else []
    return "number" if isinstance(value, (int, float)) and not isinstance(value, bool) else type(value).__name__


# (method, route, body): what the runtime sends (the client, the manager, the rollout side), and refused
# bodies. Answers end by length (ignore_eos): where the random tiny model stops is not the simulation's.
LENGTH = {"ignore_eos": True}
REQUESTS = [
    ("POST", "/generate", {"input_ids": [0, 5, 7], "sampling_params": {"max_new_tokens": 4, **LENGTH}}),
    (
        "POST",
        "/generate",
        {"input_ids": [0, 5], "sampling_params": {"max_new_tokens": 12, **LENGTH}, "return_logprob": True},
    ),
    (
        "POST",
        "/generate",
        {
            "input_ids": [[0, 5], [0, 9, 9]],
            "sampling_params": [{"max_new_tokens": 3, **LENGTH}, {"max_new_tokens": 2, **LENGTH}],
            "return_logprob": True,
            "rid": ["a", "b"],
        },
    ),
    ("POST", "/generate", {"input_ids": []}),
    ("POST", "/generate", {"input_ids": [0, VOCAB]}),
    ("POST", "/generate", {"text": "hello"}),
    ("POST", "/generate", {"input_ids": [0, 5], "sampling_params": {"max_new_tokens": MAX_POSITIONS}}),
    ("POST", "/update_weights_from_disk", {"model_path": "/nonexistent/weights", "weight_version": "3"}),
    ("POST", "/update_weights_from_disk", {"weight_version": "3"}),
    ("POST", "/abort_request", {}),
    ("POST", "/abort_request", {"rid": "nothing-runs"}),
    ("POST", "/pause_generation", {}),
    ("POST", "/continue_generation", {}),
    ("POST", "/pause_generation", {"mode": "in_place"}),
    ("POST", "/continue_generation", {}),
    ("POST", "/pause_generation", {"mode": "retract"}),
    ("POST", "/load_lora_adapter", {"lora_name": "a", "lora_path": "/nonexistent/adapter"}),
    ("POST", "/load_lora_adapter", {"lora_name": ""}),
    ("POST", "/unload_lora_adapter", {"lora_name": "a"}),
    ("POST", "/generate", {"input_ids": [0, 5], "lora_path": "a"}),
    ("POST", "/update_weight_version", {"new_version": "0"}),
    ("POST", "/flush_cache", None),
    ("GET", "/health", None),
    ("GET", "/model_info", None),
    ("GET", "/get_model_info", None),
    ("GET", "/get_weight_version", None),
    ("GET", "/get_server_info", None),
    ("GET", "/v1/loads", None),
    ("GET", "/no_such_route", None),
]


def test_answers_like_the_torch_server(tiny_llama_dir):
    """Every route the runtime uses: the same status and the same JSON
    structure from a simulated server as from the torch server; refusals with
    the same message; the typed client reads both."""

    async def go():
        async with torch_server(tiny_llama_dir) as real, sim_host() as host, aiohttp.ClientSession() as session:
            sim = host.urls[0]
            for method, route, body in REQUESTS:
                (s1, b1), (s2, b2) = [await call(session, method, url + route, body) for url in (real, sim)]
                assert s1 == s2, (route, body, b1, b2)
                if route == "/get_server_info":  # the engines' counters differ; the contract's fields do not
                    b1, b2 = (
                        {k: v for k, v in b1.items() if k != "stats"},
                        {k: v for k, v in b2.items() if k != "stats"},
                    )
                if route == "/v1/loads":  # the time of the answer differs
                    b1, b2 = ({k: v for k, v in b.items() if k != "timestamp"} for b in (b1, b2))
                if s1 >= 400 or route in ("/abort_request", "/update_weights_from_disk", "/v1/loads"):
                    assert b1 == b2, (route, body)  # the same refusal, word for word
                else:
                    assert shape(b1) == shape(b2), (route, body, b1, b2)
            async with GenerationClient(timeout_s=60) as client:
                for url in (real, sim):
                    result = await client.generate(url, [0, 5, 7], {"max_new_tokens": 4, **LENGTH}, rid="typed")
                    assert len(result.output_ids) == len(result.output_logprobs) == 4
                    assert (result.finish_reason, result.weight_version, result.rid) == ("length", "0", "typed")
                    batch = await client.generate_batch(url, [[0, 5], [0, 6]], {"max_new_tokens": 2, **LENGTH})
                    assert [len(r.output_ids) for r in batch] == [2, 2]
                    assert (await client.model_info(url)).weight_version == "0"

    asyncio.run(go())


def test_answers_take_the_configured_time_per_token_and_end_like_a_model():
    latency = 0.05

    async def go():
        async with sim_host(token_latency_s=latency, output_tokens=5) as host, GenerationClient(timeout_s=60) as c:
            url = host.urls[0]
            t0 = time.monotonic()
            natural = await c.generate(url, [0, 5], {"max_new_tokens": 16})
            elapsed = time.monotonic() - t0
            # The natural answer: 5 tokens, the last one EOS, none before.
            assert natural.output_ids[-1] == EOS_ID and EOS_ID not in natural.output_ids[:-1]
            assert (natural.finish_reason, natural.matched_stop, len(natural.output_ids)) == ("stop", EOS_ID, 5)
            assert elapsed >= 5 * latency - 1e-3 and natural.meta_info.e2e_latency >= 5 * latency - 1e-3
            cut = await c.generate(url, [0, 5], {"max_new_tokens": 3})
            assert cut.finish_reason == "length" and len(cut.output_ids) == 3 and EOS_ID not in cut.output_ids
            forced = await c.generate(url, [0, 5], {"max_new_tokens": 9, "ignore_eos": True})
            assert len(forced.output_ids) == 9 and forced.finish_reason == "length"  # (EOS may come up: not a stop)
            longer = await c.generate(url, [0, 5], {"max_new_tokens": 16, "min_new_tokens": 8})
            assert len(longer.output_ids) == 8 and longer.finish_reason == "stop"
            assert all(-2.0 <= lp <= 0.0 for lp in natural.output_logprobs)

    asyncio.run(go())


def save_weights(path: str, n: int) -> int:
    os.makedirs(path)
    tensors = {"w": torch.ones(n, dtype=torch.float32), "b": torch.zeros(3, dtype=torch.float32)}
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_a_weight_update_reads_the_checkpoint_and_interrupts_what_runs(tmp_path):
    """An update loads the directory it names (its tensors' bytes are counted
    per version), aborts the request in flight with what it had under the old
    version, and later answers carry the new version; a directory that is not
    a checkpoint is refused (400) and the old version keeps serving."""
    good = str(tmp_path / "v1")
    nbytes = save_weights(good, 1000)
    broken = tmp_path / "v2"
    broken.mkdir()
    (broken / "model.safetensors").write_bytes(b"not safetensors")

    async def go():
        async with sim_host(n=2, token_latency_s=1.0, output_tokens=1000) as host, GenerationClient(timeout_s=60) as c:
            url, other = host.urls
            long = asyncio.create_task(c.generate(url, [0, 5], {"max_new_tokens": 2000}))
            while not host.engines[0].info().num_running_requests:
                await asyncio.sleep(0.01)
            await c.update_weights_from_disk(url, good, 1)
            interrupted = await long
            assert interrupted.finish_reason == "abort" and interrupted.weight_version == "0"
            assert len(interrupted.output_ids) < 1000
            assert (await c.model_info(url)).weight_version == "1"
            assert (await c.model_info(other)).weight_version == "0"  # each server loads on its own
            loads = host.stats()["loads"]
            assert list(loads) == ["1"] and loads["1"]["servers"] == 1 and loads["1"]["bytes"] == nbytes
            for path in (str(broken), str(tmp_path / "missing")):
                with pytest.raises(GenerationServerError) as e:
                    await c.update_weights_from_disk(url, path, 2)
                assert e.value.status == 400
            assert (await c.model_info(url)).weight_version == "1"
            assert host.stats()["engine"]["weight_updates"] == 1

    asyncio.run(go())


def test_a_host_serves_many_servers_and_counts_their_requests():
    async def go():
        async with sim_host(n=3) as host, GenerationClient(timeout_s=60) as c:
            assert len(set(host.urls)) == 3
            for i, url in enumerate(host.urls):
                for _ in range(i + 1):
                    assert await c.health(url)
                await c.generate(url, [0, 5], {"max_new_tokens": 2})
            stats = host.stats()
            assert stats["servers"] == 3
            assert stats["requests"] == {"/health": 6, "/generate": 3}
            assert stats["engine"]["requests_finished"] == 3 and stats["engine"]["generated_tokens"] == 6

    asyncio.run(go())


def test_a_pause_in_place_stops_answers_where_they_are_until_continue():
    """Mode in_place keeps what runs (nothing aborted, no tokens while
    paused); continue resumes it to its full length. Mode abort ends it."""
    latency = 0.02

    async def go():
        async with sim_host(token_latency_s=latency, output_tokens=10) as host, GenerationClient(timeout_s=60) as c:
            url, engine = host.urls[0], host.engines[0]
            running = asyncio.create_task(c.generate(url, [0, 5], {"max_new_tokens": 16}))
            while not engine.info().num_running_requests:
                await asyncio.sleep(0.005)
            await c.pause_generation(url, mode="in_place")
            await asyncio.sleep(20 * latency)  # longer than the whole answer takes
            assert not running.done() and engine.info().num_running_requests == 1
            await c.continue_generation(url)
            resumed = await running
            assert (resumed.finish_reason, len(resumed.output_ids)) == ("stop", 10)
            cut = asyncio.create_task(c.generate(url, [0, 5], {"max_new_tokens": 16}))
            while not engine.info().num_running_requests:
                await asyncio.sleep(0.005)
            await c.pause_generation(url)
            aborted = await cut
            assert aborted.finish_reason == "abort" and len(aborted.output_ids) < 10
            await c.continue_generation(url)

    asyncio.run(go())


def save_adapter(path, rank: int = 2) -> int:
    os.makedirs(path)
    a, b = torch.ones(rank, 8), torch.zeros(8, rank)
    tensors = {
        "base_model.model.layer.q_proj.lora_A.weight": a,
        "base_model.model.layer.q_proj.lora_B.weight": b,
    }
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank}, f)
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_lora_adapters_are_read_and_switched_to_by_name(tmp_path):
    """A LoRA run's version switch (the manager's load_version): the adapter
    is read for real, served from the next update_weight_version (its bytes
    counted per version), and requests may name it; a name not loaded is
    refused (400) and counted."""
    nbytes = save_adapter(str(tmp_path / "v1"))

    async def go():
        async with sim_host() as host, aiohttp.ClientSession() as session:
            url = host.urls[0]
            status, body = await call(
                session, "POST", url + "/load_lora_adapter", {"lora_name": "v1", "lora_path": str(tmp_path / "v1")}
            )
            assert status == 200 and body["loaded_adapters"] == {"v1": str(tmp_path / "v1")}
            status, body = await call(session, "POST", url + "/update_weight_version", {"new_version": "1"})
            assert status == 200 and body["new_version"] == "1"
            status, info = await call(session, "GET", url + "/get_server_info")
            assert (info["weight_version"], info["lora_adapter"], info["lora_adapters"]) == ("1", "v1", ["v1"])
            assert host.stats()["loads"]["1"]["bytes"] == nbytes
            body = {"input_ids": [0, 5], "sampling_params": {"max_new_tokens": 2}, "lora_path": "v1"}
            status, answer = await call(session, "POST", url + "/generate", body)
            assert status == 200 and answer["meta_info"]["weight_version"] == "1"
            status, _ = await call(session, "POST", url + "/generate", dict(body, lora_path="v0"))
            assert status == 400 and host.engines[0].rejections == {"lora_not_loaded": 1}

    asyncio.run(go())


def test_a_lora_server_that_skips_versions_keeps_the_adapter_it_served(tmp_path):
    """A server going 5 -> 7 (two publications during one fan-out) keeps
    actor-v5, which the requests scheduled on it still name, and unloads
    what is older; 7 -> 8 then unloads actor-v5."""
    for v in (4, 5, 7, 8):
        save_adapter(str(tmp_path / str(v)))

    async def go():
        async with sim_host() as host, GenerationClient(timeout_s=30) as client:
            url = host.urls[0]
            held = []
            for v in (4, 5, 7, 8):
                await client.load_version(url, str(tmp_path / str(v)), v, lora=True)
                held.append(sorted(host.engines[0].adapters.adapters))
            return held

    assert asyncio.run(go()) == [
        ["actor-v4"],
        ["actor-v4", "actor-v5"],
        ["actor-v5", "actor-v7"],
        ["actor-v7", "actor-v8"],
    ]
