"""The shared generation client against a real torch server subprocess."""

from __future__ import annotations

import asyncio

import pytest

from realrl.api.sglang_api import UpdateWeightsFromDiskResponse
from realrl.base.http_body import from_json
from realrl.impl.generation.client import (
    GenerateResult,
    GenerationClient,
    GenerationServerError,
    GenerationServerUnavailable,
    new_rid,
)
from tests.impl.conftest import _free_port
from tests.impl.test_torch_server import get_json, wait_until


def test_request_ids_are_never_prefixes_of_one_another():
    """SGLang aborts every request whose rid starts with the one given."""
    rids = [new_rid(qid, i) for _ in range(2) for qid in ("q", "q/1", "q/10", "q/1/0", "") for i in (0, 1, 10)]
    assert len(set(rids)) == len(rids)
    assert not [(a, b) for a in rids for b in rids if a != b and b.startswith(a)]
    assert rids[1].endswith("/q/1")  # readable: the episode and the answer


def test_update_answers_with_a_count_per_rank():
    """SGLang with data parallelism answers one num_paused_requests per rank."""
    single = from_json(UpdateWeightsFromDiskResponse, {"success": True, "message": "", "num_paused_requests": 3})
    per_rank = from_json(UpdateWeightsFromDiskResponse, {"success": True, "num_paused_requests": [2, 0, 1]})
    assert (single.paused_total, per_rank.paused_total) == (3, 3)


def test_generate_result_parses_sglang_shapes():
    # The torch server's shape (output_ids + dict finish_reason)...
    ours = GenerateResult.from_response(
        {
            "output_ids": [5, 1],
            "meta_info": {
                "id": "r1",
                "finish_reason": {"type": "stop", "matched": 1},
                "output_token_logprobs": [[-0.5, 5, None], [-0.25, 1, None]],
                "weight_version": "3",
                "prompt_tokens": 4,
                "completion_tokens": 2,
            },
        }
    )
    assert (ours.output_ids, ours.output_logprobs, ours.finish_reason) == ([5, 1], [-0.5, -0.25], "stop")
    assert (ours.weight_version, ours.prompt_tokens, ours.completion_tokens) == ("3", 4, 2)
    assert ours.matched_stop == 1 and ours.rid == "r1" and not ours.aborted
    # ... and an SGLang answer without output_ids, with a null finish reason
    # (aborted) and no weight_version (older SGLang).
    sglang = GenerateResult.from_response(
        {
            "text": "xy",
            "meta_info": {
                "finish_reason": None,
                "output_token_logprobs": [[-1.0, 7, None]],
                "prompt_tokens": 2,
                "completion_tokens": 1,
            },
        }
    )
    assert sglang.output_ids == [7] and sglang.output_logprobs == [-1.0]
    assert sglang.aborted and sglang.weight_version == ""


def test_client_round_trip_and_errors(shared_server, tmp_path):
    url = shared_server.url

    async def go():
        async with GenerationClient(timeout_s=120) as client:
            assert await client.health(url)
            await client.wait_healthy(url, timeout_s=10)
            info = await client.model_info(url)
            version = await client.weight_version(url)
            # Many concurrent calls share one session / connection pool.
            results = await asyncio.gather(
                *[
                    client.generate(url, [0, 3 + i], {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True})
                    for i in range(24)
                ]
            )
            session = client._session
            no_logprob = await client.generate(url, [0, 4], {"max_new_tokens": 3}, return_logprob=False)
            with pytest.raises(GenerationServerError) as bad:
                await client.generate(url, [0, 10_000], {"max_new_tokens": 3})
            with pytest.raises(GenerationServerError) as bad_update:
                await client.update_weights_from_disk(url, str(tmp_path / "nowhere"), weight_version=1)
            with pytest.raises(ValueError):
                await client.abort_request(url)
            flushed = await client.flush_cache(url)
            return info, version, results, session, no_logprob, bad.value, bad_update.value, flushed, client

    info, version, results, session, no_logprob, bad, bad_update, flushed, client = asyncio.run(go())
    assert info.is_generation and version == "0"
    assert all(len(r.output_ids) == 6 and len(r.output_logprobs) == 6 for r in results)
    assert session.closed and client._session is None  # closed by the context manager
    assert len(no_logprob.output_ids) >= 1 and no_logprob.output_logprobs == []
    assert bad.status == 400 and "vocabulary" in bad.message and bad.url == url
    assert bad_update.status == 400 and "weight update failed" in bad_update.message
    assert flushed["success"] is True
    # The server still serves the old weights after the refused update.
    assert get_json(url, "/model_info")["weight_version"] == "0"


def test_unreachable_server():
    url = f"http://127.0.0.1:{_free_port()}"  # nothing listens there

    async def go():
        async with GenerationClient(timeout_s=5) as client:
            assert not await client.health(url)
            with pytest.raises(GenerationServerUnavailable) as err:
                await client.generate(url, [0, 1], {"max_new_tokens": 2})
            with pytest.raises(TimeoutError):
                await client.wait_healthy(url, timeout_s=0.5, poll_s=0.1)
            return err.value

    err = asyncio.run(go())
    assert err.url == url and "unavailable" in str(err)


def test_client_timeout_aborts_server_side(shared_server):
    """A client that gives up closes its connection; the server stops generating for it."""
    url = shared_server.url
    before = get_json(url, "/get_server_info")["stats"]["finish_abort"]

    async def go():
        async with GenerationClient(timeout_s=120) as client:
            task = asyncio.create_task(
                client.generate(url, [0, 9], {"max_new_tokens": 3000, "ignore_eos": True}, timeout_s=600)
            )
            await asyncio.to_thread(
                wait_until, lambda: get_json(url, "/get_server_info")["num_running_requests"] == 1, 60, "running"
            )
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

    asyncio.run(go())
    wait_until(
        lambda: get_json(url, "/get_server_info")["stats"]["finish_abort"] == before + 1, 60, "server-side abort"
    )
    assert get_json(url, "/get_server_info")["num_running_requests"] == 0


def test_client_is_bound_to_one_event_loop(shared_server):
    url = shared_server.url
    client = GenerationClient(timeout_s=30)
    first_loop = asyncio.new_event_loop()
    try:
        assert first_loop.run_until_complete(client.model_info(url)).is_generation
        with pytest.raises(RuntimeError, match="another event loop"):
            asyncio.run(client.model_info(url))
    finally:
        first_loop.run_until_complete(client.close())
        first_loop.close()

    async def reuse_after_close():
        try:
            return await client.health(url)
        finally:
            await client.close()

    assert asyncio.run(reuse_after_close())


def _post_generate(url: str, body: dict, accept: str | None) -> tuple[str, bytes]:
    import json
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Accept": accept} if accept else {})}
    request = urllib.request.Request(f"{url}/generate", data=json.dumps(body).encode(), headers=headers)
    with urllib.request.urlopen(request, timeout=60) as resp:
        return resp.headers.get_content_type(), resp.read()


def test_the_torch_server_answers_columnar_to_a_client_that_asks(shared_server):
    """docs/design.md §6, columnar answers: asked with the Accept header, the
    torch server's /generate answer is columnar (one prompt or a batch);
    without it, JSON; the client asks and reads either into the same results."""
    import json

    from realrl.api.generate_answers import ANSWERS_MEDIA_TYPE, decode_answers

    url = shared_server.url
    greedy = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}
    batch = {"input_ids": [[0, 5, 6], [0, 7]], "sampling_params": greedy, "return_logprob": True}
    kind, raw = _post_generate(url, batch, f"{ANSWERS_MEDIA_TYPE}, application/json;q=0.9")
    assert kind == ANSWERS_MEDIA_TYPE
    columnar, batched = decode_answers(raw)
    kind, raw_json = _post_generate(url, batch, None)
    assert kind == "application/json" and batched
    plain = [GenerateResult.from_response(b) for b in json.loads(raw_json)]
    one_kind, one = _post_generate(url, {**batch, "input_ids": [0, 7]}, ANSWERS_MEDIA_TYPE)
    assert one_kind == ANSWERS_MEDIA_TYPE and decode_answers(one)[1] is False

    async def go():
        async with GenerationClient(timeout_s=60) as client:
            return (
                await client.generate_batch(url, batch["input_ids"], greedy),
                await client.generate(url, [0, 7], greedy),
            )

    through_client, single = asyncio.run(go())
    for results in ([GenerateResult.from_response(r) for r in columnar], through_client):
        # The same greedy tokens and versions as the JSON answer; logprobs of a batch computed again.
        assert [r.output_ids for r in results] == [r.output_ids for r in plain]
        assert [(r.finish_reason, r.weight_version, r.prompt_tokens) for r in results] == [
            (r.finish_reason, r.weight_version, r.prompt_tokens) for r in plain
        ]
        for r, p in zip(results, plain):
            assert r.output_logprobs == pytest.approx(p.output_logprobs, abs=1e-5)
            assert r.output_sampling_logprobs == pytest.approx(p.output_sampling_logprobs, abs=1e-5)
    assert single.output_ids == plain[1].output_ids
