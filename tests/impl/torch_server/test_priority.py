"""`/generate`'s `priority` on the real torch server (a subprocess): waiting
requests are admitted lowest value first, bodies without one last, equal ones
in arrival order; a bad value is a counted 400 (docs/design.md §6)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest

from realrl.impl.generation.client import GenerationClient

PARAMS = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def _info(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/get_server_info", timeout=30) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict) -> tuple[int, dict]:
    data = json.dumps(body).encode()
    req = urllib.request.Request(f"{url}/generate", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


async def _wait_waiting(url: str, n: int) -> None:
    deadline = time.monotonic() + 60
    while (await asyncio.to_thread(_info, url))["num_waiting_requests"] < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests ever waited"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("engine", ["dense", "paged"])
def test_waiting_requests_are_admitted_by_priority(start_server, tiny_llama_dir, engine):
    """One running request at a time (`--max-running-requests 1`), the server
    paused in place while the bodies arrive: each body is admitted after the
    one before it finished, so the order they finish in is the order they were
    admitted in. Sent: none, 5, 1, 5 (batched, two prompts), 1, -3; admitted:
    -3, then the two 1s in arrival order, the 5s in arrival order, none last."""
    server = start_server(tiny_llama_dir, "--engine", engine, "--max-running-requests", "1")
    sent = [("none", None, 1), ("5a", 5, 1), ("1a", 1, 1), ("5b", 5, 2), ("1b", 1, 1), ("-3", -3, 1)]
    finished: list[str] = []

    async def go(client: GenerationClient) -> None:
        await client.pause_generation(server.url, mode="in_place")
        tasks = []
        for k, (name, priority, n) in enumerate(sent):

            async def one(name=name, priority=priority, n=n) -> None:
                prompts = [[0, 5 + i, 9] for i in range(n)]
                await client.generate_batch(server.url, prompts, PARAMS, priority=priority)
                finished.append(name)

            tasks.append(asyncio.create_task(one()))
            await _wait_waiting(server.url, sum(n for _, _, n in sent[: k + 1]))  # arrival order is sending order
        await client.continue_generation(server.url)
        await asyncio.gather(*tasks)

    async def main() -> None:
        async with GenerationClient(timeout_s=120) as client:
            await go(client)

    asyncio.run(main())
    assert finished == ["-3", "1a", "1b", "5a", "5b", "none"]


def test_a_bad_priority_is_a_counted_400(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir)
    base = {"input_ids": [0, 5, 9], "sampling_params": PARAMS}
    bad = [("high", "type"), (True, "type"), ([1, 2], "type"), (1.5, "type"), (2**70, "range")]
    for value, _ in bad:
        status, body = _post(server.url, {**base, "priority": value})
        assert status == 400, (value, status, body)
        assert "priority" in json.dumps(body), body
    batched = {"input_ids": [[0, 5], [0, 6]], "sampling_params": PARAMS, "priority": [1, 2]}
    status, body = _post(server.url, batched)  # one per body, as SGLang takes it
    assert status == 400 and "priority" in json.dumps(body), body
    rejections = _info(server.url)["rejections"]
    assert rejections.get("type", 0) == 5 and rejections.get("range", 0) == 1, rejections
    status, body = _post(server.url, {**base, "priority": -(2**62)})
    assert status == 200 and len(body["output_ids"]) == PARAMS["max_new_tokens"], body
