"""The torch generation server, as a real subprocess on 127.0.0.1, against the
same tiny Llama run in the test process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from realrl.impl.generation.client import GenerationClient, GenerationServerError
from tests.impl.conftest import EOS_ID, MAX_POSITIONS, ServerProcess, load_reference, save_perturbed

PROMPTS = [[0, 5], [0, 7, 9, 11], [0, 3, 3, 8, 20, 41, 12, 9, 50], [0] + [(7 * i + 3) % 60 + 2 for i in range(25)]]


def run(coro):
    return asyncio.run(coro)


# Every server test runs on both KV layouts (docs/design.md §6): dense, the
# default on CPU, and paged, the default on CUDA.
@pytest.fixture(scope="module", params=["dense", "paged"])
def engine_kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def shared_server(tiny_llama_dir, tmp_path_factory, engine_kind):
    """A server the read-only tests of one module share (never paused or updated)."""
    server = ServerProcess(
        tiny_llama_dir, str(tmp_path_factory.mktemp("server") / "server.log"), ("--engine", engine_kind)
    )
    try:
        server.wait_healthy()
        yield server
    finally:
        server.kill()


@pytest.fixture
def start_server(start_server, engine_kind):
    return lambda model_dir, *args: start_server(model_dir, "--engine", engine_kind, *args)


async def _with_client(fn, timeout_s: float = 300.0):
    async with GenerationClient(timeout_s=timeout_s) as client:
        return await fn(client)


def forward_logprobs(model, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of each output token from one fresh forward pass."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    logprobs = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def hf_greedy(model, prompt: list[int], max_new_tokens: int, ignore_eos: bool = False) -> list[int]:
    ids = torch.tensor([prompt])
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    if ignore_eos:
        kwargs["eos_token_id"] = None
        kwargs["min_new_tokens"] = max_new_tokens
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), **kwargs)
    return out[0, len(prompt) :].tolist()


def post_raw(url: str, path: str, data: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{url}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def get_json(url: str, path: str) -> dict:
    with urllib.request.urlopen(f"{url}{path}", timeout=30) as resp:
        return json.loads(resp.read())


def wait_until(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.05)


# --------------------------------------------------------------------------- correctness


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_fresh_forward(shared_server, reference_model, temperature):
    params = {"max_new_tokens": 24, "temperature": temperature, "ignore_eos": True}

    async def go(client):
        return await asyncio.gather(*[client.generate(shared_server.url, p, params) for p in PROMPTS])

    results = run(_with_client(go))
    for prompt, res in zip(PROMPTS, results):
        assert res.finish_reason == "length"
        assert len(res.output_ids) == len(res.output_logprobs) == res.completion_tokens == 24
        assert res.prompt_tokens == len(prompt)
        expected = forward_logprobs(reference_model, prompt, res.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-4, rtol=0)


def test_logprobs_are_taken_before_top_k_top_p(shared_server, reference_model):
    temperature = 0.8
    params = {"max_new_tokens": 30, "temperature": temperature, "top_k": 3, "top_p": 0.9, "ignore_eos": True}
    prompt = PROMPTS[2]
    res = run(_with_client(lambda c: c.generate(shared_server.url, prompt, params)))
    expected = forward_logprobs(reference_model, prompt, res.output_ids, temperature)
    torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-4, rtol=0)
    # ... and the tokens themselves respect top-k: each is among the 3 most likely.
    ids = torch.tensor([prompt + res.output_ids])
    with torch.no_grad():
        logits = reference_model(ids).logits[0, len(prompt) - 1 : -1]
    top3 = logits.topk(3, dim=-1).indices
    assert all(tok in top3[i].tolist() for i, tok in enumerate(res.output_ids))


def test_the_server_reports_the_logprob_of_the_distribution_it_sampled(shared_server, reference_model):
    """Beside the unfiltered logprob, each token's logprob under the
    distribution it was drawn from: softmax(logits / T) cut to the top-k /
    top-p tokens and renormalised; the unfiltered one, bit for bit, without
    filters; 0 for greedy tokens (docs/design.md §6)."""
    temperature, prompt = 0.8, PROMPTS[2]
    filtered = {"max_new_tokens": 30, "temperature": temperature, "top_k": 3, "top_p": 0.9, "ignore_eos": True}
    plain = {"max_new_tokens": 30, "temperature": temperature, "ignore_eos": True}
    greedy = {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True}

    async def go(client):
        return await asyncio.gather(*(client.generate(shared_server.url, prompt, p) for p in (filtered, plain, greedy)))

    res, unfiltered, argmax = run(_with_client(go))
    ids = torch.tensor([prompt + res.output_ids])
    with torch.no_grad():
        logits = reference_model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    probs, order = torch.softmax(logits, -1).sort(dim=-1, descending=True)
    keep = (torch.arange(probs.shape[1]) < 3) & (probs.cumsum(-1) - probs <= 0.9)
    kept_logits = torch.where(keep, logits.gather(1, order), torch.tensor(float("-inf")))
    token = torch.tensor(res.output_ids)
    rank = (order == token[:, None]).int().argmax(-1)
    expected = torch.log_softmax(kept_logits, -1).gather(1, rank[:, None]).squeeze(1)
    torch.testing.assert_close(torch.tensor(res.output_sampling_logprobs), expected, atol=1e-4, rtol=0)
    assert all(s > lp for s, lp in zip(res.output_sampling_logprobs, res.output_logprobs))  # mass was cut
    assert len(unfiltered.output_sampling_logprobs) == 30
    assert unfiltered.output_sampling_logprobs == unfiltered.output_logprobs
    assert argmax.output_sampling_logprobs == [0.0] * 8


def test_greedy_equals_hf_generate(shared_server, reference_model):
    max_new = 40

    async def go(client):
        return [
            await client.generate(shared_server.url, p, {"max_new_tokens": max_new, "temperature": 0}) for p in PROMPTS
        ]

    results = run(_with_client(go))
    for prompt, res in zip(PROMPTS, results):
        expected = hf_greedy(reference_model, prompt, max_new)
        assert res.output_ids == expected
        if res.output_ids[-1] == EOS_ID:
            assert res.finish_reason == "stop" and res.matched_stop == EOS_ID
        else:
            assert res.finish_reason == "length" and len(res.output_ids) == max_new
        assert res.weight_version == "0"


def test_concurrent_requests_equal_one_at_a_time(shared_server):
    """Batching, left padding, cache merging and row removal change nothing."""
    prompts = [[0] + [(5 * i + 3 * j) % 61 + 2 for j in range(1 + (7 * i) % 23)] for i in range(16)]
    lengths = [5 + (11 * i) % 37 for i in range(16)]

    def params(n):
        return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}

    async def one_at_a_time(client):
        return [await client.generate(shared_server.url, p, params(n)) for p, n in zip(prompts, lengths)]

    async def concurrent(client):
        return await asyncio.gather(
            *[client.generate(shared_server.url, p, params(n)) for p, n in zip(prompts, lengths)]
        )

    sequential = run(_with_client(one_at_a_time))
    before = get_json(shared_server.url, "/get_server_info")["stats"]
    together = run(_with_client(concurrent))
    after = get_json(shared_server.url, "/get_server_info")["stats"]
    for seq, con, n in zip(sequential, together, lengths):
        assert len(seq.output_ids) == n
        assert con.output_ids == seq.output_ids
        torch.testing.assert_close(
            torch.tensor(con.output_logprobs), torch.tensor(seq.output_logprobs), atol=1e-4, rtol=0
        )
    # The concurrent run really was batched: far fewer decode steps than tokens.
    steps = after["decode_steps"] - before["decode_steps"]
    assert steps < sum(lengths) / 2


def test_batched_input_and_zero_tokens(shared_server):
    body = {
        "input_ids": PROMPTS[:3],
        "sampling_params": {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
    }
    status, batched = post_raw(shared_server.url, "/generate", json.dumps(body).encode())
    assert status == 200 and isinstance(batched, list) and len(batched) == 3

    async def singles(client):
        return [
            await client.generate(shared_server.url, p, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
            for p in PROMPTS[:3]
        ]

    for out, single in zip(batched, run(_with_client(singles))):
        assert out["output_ids"] == single.output_ids
    zero = run(_with_client(lambda c: c.generate(shared_server.url, PROMPTS[0], {"max_new_tokens": 0})))
    assert zero.output_ids == [] and zero.finish_reason == "length"


def test_a_group_shares_one_prefill_and_samples_independently(shared_server, reference_model):
    """A batched request of one prompt n times (a GRPO group, as the rollout
    worker sends it) prefills the prompt once; every answer is still sampled
    on its own and its logprobs are those of a fresh forward pass."""
    n, prompt, temperature = 6, PROMPTS[3], 1.0
    params = {"max_new_tokens": 12, "temperature": temperature, "ignore_eos": True}
    before = get_json(shared_server.url, "/get_server_info")["stats"]
    results = run(
        _with_client(
            lambda c: c.generate_batch(shared_server.url, [prompt] * n, params, rids=[f"group/{i}" for i in range(n)])
        )
    )
    after = get_json(shared_server.url, "/get_server_info")["stats"]
    assert after["prompt_tokens_shared"] - before["prompt_tokens_shared"] == (n - 1) * len(prompt)
    assert len({tuple(r.output_ids) for r in results}) > 1  # not n copies of one sample
    for res in results:
        assert len(res.output_ids) == 12 and res.rid is not None
        expected = forward_logprobs(reference_model, prompt, res.output_ids, temperature)
        torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=1e-4, rtol=0)
    greedy = run(
        _with_client(
            lambda c: c.generate_batch(
                shared_server.url, [PROMPTS[1], PROMPTS[2], PROMPTS[1]], {"max_new_tokens": 10, "temperature": 0}
            )
        )
    )
    assert greedy[0].output_ids == greedy[2].output_ids == hf_greedy(reference_model, PROMPTS[1], 10)
    assert greedy[1].output_ids == hf_greedy(reference_model, PROMPTS[2], 10)


def test_stop_token_ids_and_min_new_tokens(shared_server, reference_model):
    prompt = PROMPTS[1]
    free = hf_greedy(reference_model, prompt, 30, ignore_eos=True)
    stop = free[5]
    first = free.index(stop)

    async def go(client):
        stopped = await client.generate(
            shared_server.url,
            prompt,
            {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True, "stop_token_ids": [stop]},
        )
        delayed = await client.generate(
            shared_server.url,
            prompt,
            {
                "max_new_tokens": 30,
                "temperature": 0,
                "ignore_eos": True,
                "stop_token_ids": [stop],
                "min_new_tokens": first + 2,
            },
        )
        return stopped, delayed

    stopped, delayed = run(_with_client(go))
    assert stopped.output_ids == free[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.matched_stop == stop
    # min_new_tokens bans the stop token until enough tokens are out.
    assert stop not in delayed.output_ids[: first + 1]
    assert len(delayed.output_ids) >= first + 2


def stop_at_token_k(model, prompt: list[int], k: int) -> dict:
    """Greedy sampling params whose k-th token is certainly a stop token: every id
    but one, f, is a stop token and stop tokens are banned for the first k - 1
    tokens (so those are f); f is one greedy does not pick next."""
    vocab = model.get_input_embeddings().num_embeddings
    for f in range(2, vocab):  # not bos / eos
        with torch.no_grad():
            logits = model(torch.tensor([prompt + [f] * (k - 1)])).logits[0, -1]
        if logits.max() - logits[f] > 0.1:  # far from a tie (float error is ~1e-5)
            stops = [t for t in range(vocab) if t != f]
            return {"max_new_tokens": k, "min_new_tokens": k - 1, "temperature": 0, "stop_token_ids": stops}
    raise AssertionError("no free token found")


def test_length_before_eos_reports_length_like_sglang(shared_server, start_server, tiny_llama_dir, reference_model):
    sglang_order = start_server(tiny_llama_dir, "--length-before-eos")
    k = 5
    last_is_stop = stop_at_token_k(reference_model, PROMPTS[1], k)
    stop_before_limit = dict(last_is_stop, max_new_tokens=k + 3)

    async def go(client):
        return [
            await client.generate(server.url, PROMPTS[1], params)
            for server in (shared_server, sglang_order)
            for params in (last_is_stop, stop_before_limit)
        ]

    default_last, default_early, switched_last, switched_early = run(_with_client(go))
    for res in (default_last, default_early, switched_last, switched_early):
        assert len(res.output_ids) == k and res.output_ids[-1] in last_is_stop["stop_token_ids"]
    assert default_last.finish_reason == "stop" and default_last.matched_stop == default_last.output_ids[-1]
    assert switched_last.finish_reason == "length"
    # Below the limit a stop token stops in either order.
    assert default_early.finish_reason == switched_early.finish_reason == "stop"
    assert get_json(sglang_order.url, "/get_server_info")["length_before_eos"] is True


def test_bad_requests_get_400_and_server_keeps_serving(shared_server):
    good = {"input_ids": [0, 5, 6], "sampling_params": {"max_new_tokens": 4}}
    bad_bodies = [
        b"{not json",
        b"",
        json.dumps([1, 2, 3]).encode(),
        json.dumps({"input_ids": []}).encode(),
        json.dumps({"input_ids": [0, 64]}).encode(),  # out of vocabulary
        json.dumps({"input_ids": [0, -1]}).encode(),
        json.dumps({"input_ids": [0, "a"]}).encode(),
        json.dumps({"input_ids": [0, 1.5]}).encode(),
        json.dumps({"input_ids": "0 1 2"}).encode(),
        json.dumps(dict(good, sampling_params={"max_new_tokens": -1})).encode(),
        json.dumps(dict(good, sampling_params={"max_new_tokens": "4"})).encode(),
        json.dumps(dict(good, sampling_params={"max_new_tokens": MAX_POSITIONS})).encode(),
        json.dumps(dict(good, sampling_params={"temperature": -0.5})).encode(),
        json.dumps(dict(good, sampling_params={"top_p": 0.0})).encode(),
        json.dumps(dict(good, sampling_params={"top_k": True})).encode(),
        json.dumps(dict(good, sampling_params={"no_such_param": 1})).encode(),
        json.dumps(dict(good, sampling_params={"frequency_penalty": 0.5})).encode(),
        json.dumps(dict(good, sampling_params={"stop_token_ids": [99]})).encode(),
        json.dumps(dict(good, sampling_params=[1, 2])).encode(),
        json.dumps(dict(good, return_logprob="yes")).encode(),
        json.dumps(dict(good, rid=7)).encode(),
        json.dumps(dict(good, unknown_field=1)).encode(),
        json.dumps({"text": "hello"}).encode(),
    ]
    before = get_json(shared_server.url, "/get_server_info")["stats"]["requests_rejected"]
    for body in bad_bodies:
        status, answer = post_raw(shared_server.url, "/generate", body)
        assert status == 400, body
        assert isinstance(answer.get("error"), str) and answer["error"], body
    after = get_json(shared_server.url, "/get_server_info")["stats"]["requests_rejected"]
    assert after - before == len(bad_bodies)
    status, answer = post_raw(shared_server.url, "/generate", json.dumps(good).encode())
    assert status == 200 and len(answer["output_ids"]) >= 1
    info = get_json(shared_server.url, "/model_info")
    assert info["is_generation"] is True and info["weight_version"] == "0"


def test_impossible_sampling_params_get_400_while_a_batch_runs(shared_server, reference_model):
    """Values that pass a naive check but that the engine cannot sample with
    (temperature 1e-40 used to fail the whole running batch) are refused with
    400 naming the field; the requests running beside them are untouched."""
    n = 200
    valid = {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}
    impossible = [
        ({"temperature": 1e-40}, "temperature"),
        ({"temperature": 1e-6}, "temperature"),
        ({"temperature": 1e7}, "temperature"),
        ({"max_new_tokens": 3, "min_new_tokens": 5}, "min_new_tokens"),
        ({"max_new_tokens": 2**40}, "max_new_tokens"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2**70}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"temperature": "hot"}, "temperature"),
        ({"min_new_tokens": 2, "stop_token_ids": list(range(64))}, "min_new_tokens"),
    ]
    non_finite = [b'"temperature": NaN', b'"top_p": Infinity', b'"temperature": -Infinity']

    def info():
        return get_json(shared_server.url, "/get_server_info")

    async def go(client):
        url = shared_server.url
        running = [asyncio.create_task(client.generate(url, p, valid)) for p in PROMPTS]
        await asyncio.to_thread(wait_until, lambda: info()["num_running_requests"] == len(PROMPTS), 60, "running")
        refused = await asyncio.gather(
            *[client.generate(url, PROMPTS[0], dict(valid, **params)) for params, _ in impossible],
            *[
                asyncio.to_thread(
                    post_raw, url, "/generate", b'{"input_ids": [0, 5], "sampling_params": {' + field + b"}}"
                )
                for field in non_finite
            ],
            return_exceptions=True,
        )
        return refused, await asyncio.gather(*running)

    before = info()["stats"]
    refused, results = run(_with_client(go))
    after = info()["stats"]
    for (params, field), error in zip(impossible, refused):
        assert isinstance(error, GenerationServerError) and error.status == 400, (params, error)
        assert field in error.message, (params, error.message)
    for field, (status, answer) in zip(non_finite, refused[len(impossible) :]):
        assert status == 400 and "not a JSON number" in answer["error"], field
    for prompt, res in zip(PROMPTS, results):
        assert res.finish_reason == "length"
        assert res.output_ids == hf_greedy(reference_model, prompt, n, ignore_eos=True)
    assert after["requests_rejected"] - before["requests_rejected"] == len(impossible) + len(non_finite)
    assert after["requests_failed"] == before["requests_failed"]


def test_deeply_nested_json_gets_400_and_server_keeps_serving(shared_server):
    deep = 100_000
    bodies = [
        b"[" * deep + b"]" * deep,
        b'{"a":' * deep + b"1" + b"}" * deep,
        b"[" * deep,  # never closed
        b'{"input_ids": ' + b"[" * deep + b"0" + b"]" * deep + b"}",
        b'{"input_ids": [0, 5], "sampling_params": {"stop_token_ids": ' + b"[" * 40 + b"]" * 40 + b"}}",
    ]
    before = get_json(shared_server.url, "/get_server_info")["stats"]["requests_rejected"]
    for path in ("/generate", "/abort_request", "/update_weights_from_disk"):
        for body in bodies:
            status, answer = post_raw(shared_server.url, path, body)
            assert status == 400, (path, body[:60])
            assert "nested deeper than" in answer["error"], (path, answer)
    after = get_json(shared_server.url, "/get_server_info")["stats"]["requests_rejected"]
    assert after - before == 3 * len(bodies)
    # Brackets inside strings are not nesting; the server still answers.
    status, answer = post_raw(
        shared_server.url, "/generate", json.dumps({"input_ids": [0, 5], "rid": "[" * 1000}).encode()
    )
    assert status == 200 and answer["meta_info"]["id"] == "[" * 1000
    assert urllib.request.urlopen(f"{shared_server.url}/health", timeout=30).status == 200


# --------------------------------------------------------------------------- weights


def test_update_weights_from_disk(start_server, tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir)
    new_dir, sharded_dir = str(tmp_path / "v1"), str(tmp_path / "v2")
    save_perturbed(tiny_llama_dir, new_dir, seed=1)
    save_perturbed(tiny_llama_dir, sharded_dir, seed=2, max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded_dir, "model.safetensors.index.json"))
    assert sum(f.endswith(".safetensors") for f in os.listdir(sharded_dir)) > 1
    long_params = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}
    probe = PROMPTS[2]
    greedy = {"max_new_tokens": 30, "temperature": 0}

    async def go(client):
        url = server.url
        inflight = [asyncio.create_task(client.generate(url, p, long_params)) for p in PROMPTS]
        await asyncio.to_thread(
            wait_until, lambda: get_json(url, "/get_server_info")["num_running_requests"] == len(PROMPTS), 60, "running"
        )
        update = await client.update_weights_from_disk(url, new_dir, weight_version=1)
        # They go on under the new weights: once each has new tokens, they are aborted.
        made = get_json(url, "/get_server_info")["stats"]["generated_tokens"]
        await asyncio.to_thread(
            wait_until,
            lambda: get_json(url, "/get_server_info")["stats"]["generated_tokens"] >= made + 2 * len(PROMPTS),
            60,
            "tokens under the new weights",
        )
        await client.abort_request(url, abort_all=True)
        aborted = await asyncio.gather(*inflight)
        after_v1 = await client.generate(url, probe, greedy)
        # Sharded checkpoint, and a bad path that must leave v2 serving.
        await client.update_weights_from_disk(url, sharded_dir, weight_version="2")
        with pytest.raises(GenerationServerError) as bad:
            await client.update_weights_from_disk(url, str(tmp_path / "missing"), weight_version="3")
        after_v2 = await client.generate(url, probe, greedy)
        return update, aborted, after_v1, bad.value, after_v2, await client.model_info(url)

    update, aborted, after_v1, bad, after_v2, info = run(_with_client(go))
    assert update.success is True and update.num_paused_requests == len(PROMPTS)
    for res in aborted:  # each token labelled with the weights that sampled it (its span's version)
        assert res.finish_reason == "abort" and res.weight_version == "1"
        assert 0 < len(res.output_ids) < 4000
        assert len(res.output_logprobs) == len(res.output_ids) == len(res.output_versions)
        switch = res.output_versions.index("1")
        assert 0 < switch and res.output_versions == ["0"] * switch + ["1"] * (len(res.output_ids) - switch)
    assert after_v1.weight_version == "1"
    assert after_v1.output_ids == hf_greedy(load_reference(new_dir), probe, 30)
    assert after_v1.output_ids != hf_greedy(load_reference(tiny_llama_dir), probe, 30)
    assert bad.status == 400 and "missing" in bad.message
    assert after_v2.weight_version == "2" and info.weight_version == "2"
    assert after_v2.output_ids == hf_greedy(load_reference(sharded_dir), probe, 30)


def test_update_weights_without_abort_lets_requests_finish(start_server, tiny_llama_dir, tmp_path):
    server = start_server(tiny_llama_dir)
    new_dir = str(tmp_path / "v1")
    save_perturbed(tiny_llama_dir, new_dir, seed=3)
    n_tokens = 300
    # One batched request: its prompts start together and end at the same step,
    # so "all running" is a state that lasts, not a race.
    body = {
        "input_ids": PROMPTS,
        "sampling_params": {"max_new_tokens": n_tokens, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }

    async def go(client):
        url = server.url
        inflight = asyncio.create_task(asyncio.to_thread(post_raw, url, "/generate", json.dumps(body).encode()))
        await asyncio.to_thread(
            wait_until, lambda: get_json(url, "/get_server_info")["num_running_requests"] == len(PROMPTS), 60, "running"
        )
        update = await client.update_weights_from_disk(url, new_dir, weight_version=7, abort_all_requests=False)
        status, results = await inflight
        after = await client.generate(url, PROMPTS[0], {"max_new_tokens": 3})
        return update, status, results, after

    update, status, results, after = run(_with_client(go))
    assert update.success and update.num_paused_requests == 0
    # Each request ran to its end under the old weights (a version is stamped
    # when a request finishes, so a mid-flight swap would show "7").
    assert status == 200 and len(results) == len(PROMPTS)
    for res in results:
        meta = res["meta_info"]
        assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "0"
        assert len(res["output_ids"]) == n_tokens
    assert after.weight_version == "7"


def lora_versions(model_dir: str, out_dir, n: int) -> list:
    """`n` versions of a LoRA actor over the model in model_dir, each saved in
    peft's format to out_dir/<v> (v = 1..n): the peft models, for reference."""
    from realrl.api.cli_args import LoraConfig
    from realrl.impl import lora
    from realrl.system.model_worker import save_model

    models = []
    for version in range(1, n + 1):
        torch.manual_seed(version)
        model = lora.wrap(load_reference(model_dir), LoraConfig(rank=4, alpha=8))
        with torch.no_grad():  # B starts at zero: "train" it to something
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(torch.randn_like(p) * 0.3)
        save_model(model, str(out_dir / str(version)))
        models.append(model.eval())
    return models


def test_lora_versions_match_the_trainer_and_old_ones_are_unloaded(start_server, tiny_llama_dir, tmp_path):
    """A LoRA run's version switch (`GenerationClient.load_version`, as the
    manager sends it): in-flight requests end under the old version, the
    new adapter's logprobs equal the trainer's peft forward, the previous
    adapter stays loaded (requests naming it run on the new one and say so),
    older ones are unloaded, and a broken adapter leaves the current one serving."""
    server = start_server(tiny_llama_dir)
    models = lora_versions(tiny_llama_dir, tmp_path, 3)
    long_params = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    prompt = PROMPTS[2]

    async def go(client):
        url = server.url
        inflight = [asyncio.create_task(client.generate(url, p, long_params)) for p in PROMPTS]
        await asyncio.to_thread(
            wait_until, lambda: get_json(url, "/get_server_info")["num_running_requests"] == len(PROMPTS), 60, "running"
        )
        aborted_n = await client.load_version(url, str(tmp_path / "1"), 1, lora=True)
        aborted = await asyncio.gather(*inflight)
        v1 = await client.generate(url, prompt, params, lora_path="actor-v1")
        await client.load_version(url, str(tmp_path / "2"), 2, lora=True)
        after_v2 = get_json(url, "/get_server_info")
        await client.load_version(url, str(tmp_path / "3"), 3, lora=True)
        after_v3 = get_json(url, "/get_server_info")
        with pytest.raises(GenerationServerError) as unloaded:
            await client.generate(url, prompt, params, lora_path="actor-v1")
        late = await client.generate(url, prompt, params, lora_path="actor-v2")  # scheduled on v2 before the switch
        with pytest.raises(GenerationServerError) as broken:
            await client.load_version(url, str(tmp_path / "missing"), 4, lora=True)
        again = await client.load_lora_adapter(url, "actor-v3", str(tmp_path / "3"))  # a retry: no error
        return aborted_n, aborted, v1, after_v2, after_v3, unloaded.value, late, broken.value, again

    aborted_n, aborted, v1, after_v2, after_v3, unloaded, late, broken, again = run(_with_client(go))
    assert aborted_n == len(PROMPTS)
    assert all(r.finish_reason == "abort" and r.weight_version == "0" for r in aborted)
    assert v1.weight_version == "1"
    expected = forward_logprobs(models[0], prompt, v1.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(v1.output_logprobs), expected, atol=1e-4, rtol=0)
    assert after_v2["lora_adapters"] == ["actor-v1", "actor-v2"] and after_v2["lora_adapter"] == "actor-v2"
    assert after_v3["lora_adapters"] == ["actor-v2", "actor-v3"] and after_v3["weight_version"] == "3"
    assert unloaded.status == 400 and "actor-v1" in unloaded.message and "not loaded" in unloaded.message
    assert late.weight_version == "3"
    expected = forward_logprobs(models[2], prompt, late.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(late.output_logprobs), expected, atol=1e-4, rtol=0)
    assert broken.status == 400 and "missing" in broken.message
    assert again == ["actor-v2", "actor-v3"]
    info = get_json(server.url, "/get_server_info")
    assert info["weight_version"] == "3" and info["lora_adapter"] == "actor-v3"
    assert info["rejections"] == {"lora_not_loaded": 1}


def test_a_lora_merge_that_fails_part_way_keeps_the_previous_weights_and_a_retry_applies(
    start_server, tiny_llama_dir, tmp_path, monkeypatch
):
    """Version 2's merge fails after its first module (fault point
    `torch_server.adapter_merge`, armed once version 1 was applied): the
    server says so, keeps serving version 1 exactly (every module back, none
    half-merged), and the manager's retry of the same version merges it."""
    from realrl.base import faults

    monkeypatch.setenv(faults.FAULTS_DIR_ENV, str(tmp_path / "faults"))
    monkeypatch.setenv(
        faults.FAULTS_ENV,
        "torch_server.adapter_applied=hold:0,torch_server.adapter_merge=fail_once;after=torch_server.adapter_applied",
    )
    (tmp_path / "faults").mkdir()
    server = start_server(tiny_llama_dir)
    models = lora_versions(tiny_llama_dir, tmp_path, 2)
    params = {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True}
    prompt = PROMPTS[2]

    async def go(client):
        url = server.url
        await client.load_version(url, str(tmp_path / "1"), 1, lora=True)
        with pytest.raises(GenerationServerError) as failed:
            await client.load_version(url, str(tmp_path / "2"), 2, lora=True)
        after_failure = get_json(url, "/get_server_info")
        still_v1 = await client.generate(url, prompt, params, lora_path="actor-v1")
        await client.load_version(url, str(tmp_path / "2"), 2, lora=True)  # the manager's retry
        v2 = await client.generate(url, prompt, params, lora_path="actor-v2")
        return failed.value, after_failure, still_v1, v2

    failed, after_failure, still_v1, v2 = run(_with_client(go))
    assert faults.fired("torch_server.adapter_merge")
    assert "merging failed part-way" in failed.message and "still serving LoRA adapter actor-v1" in failed.message
    assert after_failure["weight_version"] == "1" and after_failure["lora_adapter"] == "actor-v1"
    assert still_v1.weight_version == "1"
    expected = forward_logprobs(models[0], prompt, still_v1.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(still_v1.output_logprobs), expected, atol=1e-4, rtol=0)
    assert v2.weight_version == "2"
    expected = forward_logprobs(models[1], prompt, v2.output_ids, 1.0)
    torch.testing.assert_close(torch.tensor(v2.output_logprobs), expected, atol=1e-4, rtol=0)


# --------------------------------------------------------------------------- control


def test_pause_continue_and_abort(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir)
    # Long requests never finish during the test, so "running" states last.
    long_params = {"max_new_tokens": 4000, "temperature": 1.0, "ignore_eos": True}
    short = {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}

    def info():
        return get_json(server.url, "/get_server_info")

    async def go(client):
        url = server.url
        first = asyncio.create_task(client.generate(url, PROMPTS[0], long_params))
        await asyncio.to_thread(wait_until, lambda: info()["num_running_requests"] == 1, 60, "running")
        await client.pause_generation(url)
        paused_result = await first
        # While paused a new request waits...
        waiting = asyncio.create_task(client.generate(url, PROMPTS[1], short))
        await asyncio.to_thread(wait_until, lambda: info()["num_waiting_requests"] == 1, 60, "queued")
        state_while_paused = info()
        assert not waiting.done()
        # ... and runs after continue.
        await client.continue_generation(url)
        resumed = await waiting

        # abort_request by rid: only that request ends.
        a = asyncio.create_task(client.generate(url, PROMPTS[2], long_params, rid="victim"))
        b = asyncio.create_task(client.generate(url, PROMPTS[3], long_params, rid="bystander"))
        await asyncio.to_thread(wait_until, lambda: info()["num_running_requests"] == 2, 60, "running")
        await client.abort_request(url, rid="victim")
        victim = await a
        running_after_victim = info()["num_running_requests"]
        await client.abort_request(url, rid="bystander")
        bystander = await b

        # abort_all ends everything.
        c = [asyncio.create_task(client.generate(url, p, long_params)) for p in PROMPTS]
        await asyncio.to_thread(wait_until, lambda: info()["num_running_requests"] == len(PROMPTS), 60, "running")
        await client.abort_request(url, abort_all=True)
        all_aborted = await asyncio.gather(*c)
        return paused_result, state_while_paused, resumed, victim, running_after_victim, bystander, all_aborted

    paused_result, state_while_paused, resumed, victim, running_after_victim, bystander, all_aborted = run(
        _with_client(go)
    )
    assert paused_result.finish_reason == "abort" and 0 < len(paused_result.output_ids) < 4000
    assert len(paused_result.output_logprobs) == len(paused_result.output_ids)
    assert state_while_paused["paused"] is True and state_while_paused["num_running_requests"] == 0
    assert resumed.finish_reason == "length" and len(resumed.output_ids) == 5
    assert victim.finish_reason == "abort" and victim.rid == "victim" and len(victim.output_ids) > 0
    assert running_after_victim == 1  # the bystander went on
    assert bystander.finish_reason == "abort" and bystander.rid == "bystander"
    assert all(r.finish_reason == "abort" for r in all_aborted)


def test_sigterm_shuts_down_cleanly(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir)

    async def go(client):
        task = asyncio.create_task(
            client.generate(server.url, PROMPTS[0], {"max_new_tokens": 3000, "ignore_eos": True})
        )
        await asyncio.to_thread(
            wait_until, lambda: get_json(server.url, "/get_server_info")["num_running_requests"] == 1, 60, "running"
        )
        os.killpg(server.proc.pid, signal.SIGTERM)
        return await task

    res = run(_with_client(go))
    assert res.finish_reason == "abort"
    assert server.proc.wait(timeout=60) == 0


# --------------------------------------------------------------------------- engine faults


def poisoned_token(model, pool: list[list[int]], n: int) -> tuple[int, list[int], list[list[int]]]:
    """A token x (not bos / eos), a prompt whose greedy answer (n tokens, no
    eos) reaches x early, and prompts without x."""
    answers = [hf_greedy(model, p, n, ignore_eos=True) for p in pool]
    for x in range(2, model.get_input_embeddings().num_embeddings):
        victims = [p for p, a in zip(pool, answers) if x not in p and x in a[: n - 2]]
        clean = [p for p in pool if x not in p and p not in victims]
        if victims and len(clean) >= 4:
            return x, victims[0], clean[:4]
    raise AssertionError("no token to poison found")


def hf_greedy_without(model, prompt: list[int], max_new_tokens: int, banned: int) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
            bad_words_ids=[[banned]],
        )
    return out[0, len(prompt) :].tolist()


def test_engine_fault_fails_only_its_request(start_server, tiny_llama_dir, reference_model, tmp_path):
    """A real fault: weights whose embedding of token x is NaN give NaN logits
    to any request that feeds x to the model. In one batch, one request has x
    in its prompt (its prefill fails) and one generates x (a decode step
    fails); only those two fail. The others (x banned through stop_token_ids
    + min_new_tokens) go on, a newcomer joins their batch in the failed row's
    slot, and the server keeps serving."""
    victim_tokens = 40
    pool = [[0] + [(7 * i + 3 * j) % 61 + 2 for j in range(1 + (5 * i) % 9)] for i in range(12)]
    x, decode_victim, (newcomer, *bystanders) = poisoned_token(reference_model, pool, victim_tokens)
    prefill_victim = [0, x, 5]
    model = load_reference(tiny_llama_dir)
    with torch.no_grad():
        model.get_input_embeddings().weight[x] = float("nan")
    model.save_pretrained(str(tmp_path / "poisoned"))
    server = start_server(str(tmp_path / "poisoned"))

    def without_x(n: int) -> dict:  # x is banned for every token: the request never meets it
        return {"max_new_tokens": n, "min_new_tokens": n, "stop_token_ids": [x], "temperature": 0, "ignore_eos": True}

    def info():
        return get_json(server.url, "/get_server_info")

    async def go(client):
        url = server.url
        # Paused, everything queues up and starts as one prefill group, one batch.
        await client.pause_generation(url)
        victim_params = {"max_new_tokens": victim_tokens, "temperature": 0, "ignore_eos": True}
        running = [asyncio.create_task(client.generate(url, p, without_x(4000))) for p in bystanders]
        victims = [asyncio.create_task(client.generate(url, p, victim_params)) for p in (decode_victim, prefill_victim)]
        await asyncio.to_thread(wait_until, lambda: info()["num_waiting_requests"] == 5, 60, "queued")
        await client.continue_generation(url)
        failed = await asyncio.gather(*victims, return_exceptions=True)
        # The bystanders run on (4000 tokens). Some steps later (so the failed
        # row's last keys/values lie inside the window, left of the newcomer's
        # prompt) a newcomer joins them in the freed slot.
        steps = info()["stats"]["decode_steps"]
        await asyncio.to_thread(wait_until, lambda: info()["stats"]["decode_steps"] >= steps + 40, 60, "decoding")
        assert info()["num_running_requests"] == len(bystanders)
        joined = await client.generate(url, newcomer, without_x(20))
        await client.abort_request(url, abort_all=True)
        aborted = await asyncio.gather(*running)
        again = await asyncio.gather(client.generate(url, prefill_victim, victim_params), return_exceptions=True)
        return failed + again, joined, aborted, await client.generate(url, newcomer, without_x(20))

    failed, joined, aborted, after = run(_with_client(go))
    for error in failed:
        assert isinstance(error, GenerationServerError) and error.status == 500, error
        assert "non-finite logits" in error.message
    assert joined.finish_reason == "length" and joined.output_ids == hf_greedy_without(reference_model, newcomer, 20, x)
    assert after.output_ids == joined.output_ids
    for prompt, res in zip(bystanders, aborted):
        assert res.finish_reason == "abort" and len(res.output_ids) > 40
        assert res.output_ids[:40] == hf_greedy_without(reference_model, prompt, 40, x)
    stats = info()["stats"]
    assert stats["requests_failed"] == 3 and stats["engine_errors"] >= 3
    with urllib.request.urlopen(f"{server.url}/metrics", timeout=30) as resp:
        assert "realrl_torch_server_requests_failed 3.0" in resp.read().decode()


# --------------------------------------------------------------------------- engine, in process


class DirectSubmitter:
    """Submits requests straight to a GenerationEngine (no HTTP) and keeps
    each reply under the name it was submitted with."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.results: dict = {}
        self.events: dict = {}

    def submit(self, name, prompt: list[int], sampling_params: dict, **bypass) -> threading.Event:
        """`bypass` sets request fields after validation (values a client could not send)."""
        from realrl.impl.generation import torch_server

        (req,), _ = torch_server.parse_generate_body(
            {"input_ids": prompt, "sampling_params": sampling_params}, self.engine.limits
        )
        for key, value in bypass.items():
            setattr(req, key, value)
        done = self.events[name] = threading.Event()

        def reply(result):
            self.results[name] = result
            done.set()

        req.reply = reply
        self.engine.submit(req)
        return done


def make_engine(kind: str, model, **kwargs):
    """A dense or paged engine on CPU; the paged one on its own copy of the
    model (it switches the model's attention to the paged one)."""
    import copy

    from realrl.impl.generation import torch_server
    from realrl.impl.generation.torch_server.paged_engine import PagedGenerationEngine

    if kind == "dense":
        return torch_server.GenerationEngine(model, device=torch.device("cpu"), **kwargs)
    kwargs.setdefault("kv_cache_tokens", 4096)
    return PagedGenerationEngine(copy.deepcopy(model), device=torch.device("cpu"), cuda_graphs=False, **kwargs)


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_engine_cache_bookkeeping_under_random_arrivals(reference_model, monkeypatch, kind):
    """Rows joining (left-widening and re-allocating the window), leaving, trimming
    and column re-allocation, driven hard: a tiny batch limit, a small prefill
    budget and a 7-column headroom; every output must equal the request run alone.
    Paged: a pool of 24 blocks of 4 tokens, so running requests are preempted."""
    import random

    from realrl.impl.generation import torch_server

    monkeypatch.setattr(torch_server.batch, "MAX_HEADROOM", 7)
    engine = make_engine(
        kind,
        reference_model,
        max_running_requests=6,
        max_prefill_tokens=64,
        eos_token_ids=torch_server.eos_token_ids_of(reference_model),
        **({"kv_cache_tokens": 96, "block_size": 4} if kind == "paged" else {}),
    )
    engine.start()
    rng = random.Random(0)
    n = 30
    prompts = [[0] + [rng.randrange(2, 64) for _ in range(rng.randint(0, 40))] for _ in range(n)]
    lengths = [rng.randint(1, 30) for _ in range(n)]
    direct = DirectSubmitter(engine)
    results = direct.results

    def submit(i: int) -> threading.Event:
        return direct.submit(i, prompts[i], {"temperature": 0, "max_new_tokens": lengths[i]})

    try:
        alone = []
        for i in range(n):
            assert submit(i).wait(60)
            alone.append(results[i].output_ids)
        events = []
        for i in range(n):
            events.append(submit(i))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.02)
        assert all(e.wait(120) for e in events)
    finally:
        engine.stop()
    assert [results[i].output_ids for i in range(n)] == alone
    assert engine.stats["finish_stop"] > 0  # some rows left early at eos
    if kind == "paged":
        assert engine.stats["preemptions"] > 0 and engine.allocator.num_free == engine.allocator.num_blocks


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_engine_isolates_requests_that_bypassed_validation(reference_model, kind):
    """Requests built past the HTTP checks with values the engine cannot use
    (temperature 1e-40: NaN logprobs; top_k 2**70: no int64) fail alone in a
    prefill group with valid requests; after `stop` every submission is
    answered at once."""

    from realrl.impl.generation import torch_server

    engine = make_engine(kind, reference_model, eos_token_ids=torch_server.eos_token_ids_of(reference_model))
    engine.start()
    direct = DirectSubmitter(engine)
    results, events = direct.results, direct.events

    def submit(name: str, prompt: list[int], **bypass) -> None:
        direct.submit(name, prompt, {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}, **bypass)

    try:
        engine.command("pause", {}, lambda result: None)
        for i, prompt in enumerate(PROMPTS):
            submit(f"good{i}", prompt)
        submit("tiny_temperature", PROMPTS[1], temperature=1e-40)
        submit("huge_top_k", PROMPTS[2], temperature=1.0, top_k=2**70)
        engine.command("continue", {}, lambda result: None)
        assert all(e.wait(120) for e in events.values())
    finally:
        engine.stop()
    assert isinstance(results["tiny_temperature"], torch_server.EngineError)
    assert "non-finite logits" in str(results["tiny_temperature"])
    assert isinstance(results["huge_top_k"], torch_server.EngineError)
    for i, prompt in enumerate(PROMPTS):
        assert results[f"good{i}"].output_ids == hf_greedy(reference_model, prompt, 12, ignore_eos=True)
    assert engine.stats["requests_failed"] == 2 and not engine._live
    submit("late", PROMPTS[0])
    assert events["late"].is_set() and isinstance(results["late"], torch_server.EngineError)


def test_weight_checks_refuse_mismatched_checkpoints(reference_model, tiny_llama_dir, tmp_path):
    from transformers import LlamaForCausalLM

    from realrl.impl.generation import torch_server
    from tests.impl.conftest import tiny_llama_config

    engine = torch_server.GenerationEngine(reference_model, device=torch.device("cpu"))  # thread not started
    assert set(engine.read_weights(tiny_llama_dir)) == set(reference_model.state_dict())

    other = tiny_llama_config()
    other.intermediate_size = 128
    LlamaForCausalLM(other).save_pretrained(str(tmp_path / "wrong_shape"))
    with pytest.raises(torch_server.WeightLoadError, match="shape"):
        engine.read_weights(str(tmp_path / "wrong_shape"))

    deeper = tiny_llama_config()
    deeper.num_hidden_layers = 3
    LlamaForCausalLM(deeper).save_pretrained(str(tmp_path / "extra_layer"))
    with pytest.raises(torch_server.WeightLoadError, match="unexpected"):
        engine.read_weights(str(tmp_path / "extra_layer"))

    (tmp_path / "empty").mkdir()
    with pytest.raises(torch_server.WeightLoadError, match="no safetensors"):
        engine.read_weights(str(tmp_path / "empty"))

    # Tied embeddings: the checkpoint has no lm_head.weight, and that is fine.
    tied_config = tiny_llama_config()
    tied_config.tie_word_embeddings = True
    tied = LlamaForCausalLM(tied_config)
    tied.save_pretrained(str(tmp_path / "tied"))
    tied_engine = torch_server.GenerationEngine(tied.eval(), device=torch.device("cpu"))
    loaded = tied_engine.read_weights(str(tmp_path / "tied"))
    assert "lm_head.weight" not in loaded
    # ... but an untied model needs its own lm_head.
    with pytest.raises(torch_server.WeightLoadError, match="missing"):
        engine.read_weights(str(tmp_path / "tied"))


def test_engine_join_widens_trimmed_window(reference_model):
    """A long prompt leaves (the window is trimmed to the short rows), then a
    newcomer longer than the trimmed window joins: the window widens to the left
    again over stale columns, which must stay masked."""

    from realrl.impl.generation import torch_server

    engine = torch_server.GenerationEngine(reference_model, device=torch.device("cpu"))
    engine.start()
    direct = DirectSubmitter(engine)
    results, events = direct.results, direct.events

    def submit(name: str, prompt: list[int], max_new: int) -> None:
        direct.submit(name, prompt, {"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True})

    long_prompt = [0] + [(3 * i) % 60 + 2 for i in range(30)]
    short_prompt = [0, 9, 4]
    middle_prompt = [0] + [(5 * i) % 60 + 2 for i in range(12)]
    try:
        alone = {}
        for name, prompt, n in [("long", long_prompt, 2), ("short", short_prompt, 1500), ("middle", middle_prompt, 20)]:
            submit(name, prompt, n)
            assert events[name].wait(120)
            alone[name] = results[name].output_ids
        # Paused, both queue up and are then prefilled as one group.
        engine.command("pause", {}, lambda result: None)
        submit("long", long_prompt, 2)
        submit("short", short_prompt, 1500)
        engine.command("continue", {}, lambda result: None)
        assert events["long"].wait(120)
        # The long row left: the window now starts at the short row's first token.
        wait_until(lambda: engine._batch is not None and engine._batch.window.start > 0, 60, "trim")
        assert not events["short"].is_set()  # still running: 1500 tokens
        submit("middle", middle_prompt, 20)
        assert events["middle"].wait(120) and events["short"].wait(120)
    finally:
        engine.stop()
    assert {k: results[k].output_ids for k in alone} == alone


# --------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
def test_cuda_server_matches_the_cpu_reference(start_server, tiny_llama_dir, reference_model):
    """The same server on a GPU: logprobs of a fresh CPU forward pass (looser
    tolerance: different kernels) and HF greedy output, batched requests included."""
    server = start_server(tiny_llama_dir, "--device", "cuda")

    async def go(client):
        sampled = await asyncio.gather(
            *[
                client.generate(server.url, p, {"max_new_tokens": 16, "temperature": 1.0, "ignore_eos": True})
                for p in PROMPTS
            ]
        )
        greedy = await asyncio.gather(
            *[client.generate(server.url, p, {"max_new_tokens": 24, "temperature": 0}) for p in PROMPTS]
        )
        return sampled, greedy

    sampled, greedy = run(_with_client(go))
    for prompt, res in zip(PROMPTS, sampled):
        expected = forward_logprobs(reference_model, prompt, res.output_ids, 1.0)
        torch.testing.assert_close(torch.tensor(res.output_logprobs), expected, atol=2e-3, rtol=0)
    for prompt, res in zip(PROMPTS, greedy):
        assert res.output_ids == hf_greedy(reference_model, prompt, 24)
