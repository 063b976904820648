"""The OpenAI-compatible endpoint against the real `openai` client
(realrl/impl/openai_compat/endpoint.py): a real aiohttp server on 127.0.0.1,
the client's own request building, response parsing, errors and retries."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest

from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest
from realrl.api.served_sampling import ServedSampling
from realrl.impl.openai_compat.chat import ChatConfig, ChatSession
from realrl.impl.openai_compat.endpoint import ChatEndpoint, shared_endpoint
from realrl.impl.openai_compat.rendering import ChatRenderer
from realrl.impl.openai_compat.tool_calls import TOOL_PARSERS
from tests.impl.openai_compat.chat_kit import ScriptedGenerator, char_chat_tokenizer

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "a + b",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}},
    },
}
TOK = char_chat_tokenizer()
EOS = TOK.eos_token_id


def ids(text: str, end: bool = True) -> list[int]:
    return TOK.encode(text, add_special_tokens=False) + ([EOS] if end else [])


class Episode:
    """An endpoint with one open episode whose policy samples `outputs`."""

    def __init__(
        self,
        outputs: list[list[int]],
        fail: bool = False,
        row: dict | None = None,
        served: ServedSampling | None = None,
    ):
        self.policy = ScriptedGenerator(outputs, frozenset({EOS}))
        self.fail = fail
        config = ChatConfig(
            tokenizer=TOK,
            renderer=ChatRenderer(TOK, {EOS}),
            gconfig=GenerationHyperparameters(max_new_tokens=128),
            tool_parser=TOOL_PARSERS.get("hermes"),
            served=served or ServedSampling(),
        )
        self.session = ChatSession(config, self._generate, "q7@0", row or {"messages": []})
        self.endpoint = ChatEndpoint()

    async def _generate(self, prompt_ids, n, gconfig):
        if self.fail:
            raise RuntimeError("every server failed")
        return await self.policy.generate(GenerationRequest("q7@0", prompt_ids, n, gconfig))

    async def __aenter__(self):
        await self.endpoint.start()
        self.base_url = self.endpoint.open(self.session)
        return self

    async def __aexit__(self, *exc):
        await self.endpoint.close()

    def client(self, **kwargs) -> openai.AsyncOpenAI:
        """A client as agents make them (the default retries, unless given)."""
        return openai.AsyncOpenAI(base_url=self.base_url, api_key="k", **kwargs)


def run(coro):
    return asyncio.run(coro)


def test_answers_have_openais_exact_shape():
    sampled = ids('Adding.<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')

    async def main():
        async with Episode([sampled]) as ep:
            client = ep.client(_strict_response_validation=True)  # every required field, every type
            r = await client.chat.completions.create(
                model="my-policy",
                messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2?"}],
                tools=[ADD_TOOL],
                max_completion_tokens=100,
                logprobs=True,
                extra_body={"return_token_ids": True},
            )
            await client.close()
            return r, ep

    r, ep = run(main())
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == "my-policy" and r.created > 0
    (choice,) = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Adding."
    (tool_call,) = choice.message.tool_calls
    assert tool_call.type == "function" and tool_call.id.startswith("call_")
    assert tool_call.function.name == "add" and json.loads(tool_call.function.arguments) == {"a": 1, "b": 2}
    (request,) = ep.policy.requests
    assert request.gconfig.max_new_tokens == 100
    prompt = TOK.decode(request.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n# Tools\n") and prompt.endswith("<|im_start|>assistant\n")
    assert r.model_extra["prompt_token_ids"] == request.prompt_ids and choice.model_extra["token_ids"] == sampled
    assert [t.logprob for t in choice.logprobs.content] == pytest.approx(
        [-0.25 - 0.01 * j for j in range(len(sampled))]
    )
    assert "".join(t.token for t in choice.logprobs.content[:7]) == "Adding."
    assert r.usage.prompt_tokens == len(request.prompt_ids) and r.usage.completion_tokens == len(sampled)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.parametrize("shape", ["object", "model_dump", "exclude_none"])
def test_a_reply_echoed_in_any_shape_continues_its_turn(shape):
    """Agents append the reply as the message object, its model_dump() (with
    null extras) or model_dump(exclude_none=True); each continues the turn's
    tokens."""

    async def main():
        async with Episode([ids('<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'), ids("3")]) as ep:
            client = ep.client()
            messages = [{"role": "user", "content": "1+2?"}]
            r = await client.chat.completions.create(model="m", messages=messages, tools=[ADD_TOOL])
            message = r.choices[0].message
            echo = {
                "object": message,
                "model_dump": message.model_dump(),
                "exclude_none": message.model_dump(exclude_none=True),
            }[shape]
            tool = {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "3"}
            await client.chat.completions.create(model="m", messages=[*messages, echo, tool], tools=[ADD_TOOL])
            await client.close()
            return ep

    ep = run(main())
    first, second = ep.session.recorder.turns
    assert second.stitched_onto == 0
    assert second.prompt_ids[: len(first.prompt_ids) + len(first.output_ids)] == first.prompt_ids + first.output_ids


def test_a_request_the_endpoint_cannot_honour_is_a_400_the_client_does_not_retry():
    async def main():
        async with Episode([]) as ep:
            client = ep.client()  # max_retries=2: a 5xx or 429 would be sent three times
            user = [{"role": "user", "content": "hi"}]
            errors = []
            for kwargs in (
                {"messages": user, "extra_body": {"top_kk": 5}},
                {"messages": user, "logprobs": True, "top_logprobs": 2},
                {"messages": user, "tool_choice": "required", "tools": [ADD_TOOL]},
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                {"messages": []},
            ):
                with pytest.raises(openai.BadRequestError) as info:
                    await client.chat.completions.create(model="m", **kwargs)
                errors.append(info.value)
            await client.close()
            return ep, errors

    ep, errors = run(main())
    assert ep.endpoint.counters["calls"] == len(errors)  # one request each: nothing retried
    assert not ep.policy.requests
    expected = ["'top_kk'", "'top_logprobs'", "'tool_choice'", "only text", "'messages'"]
    for error, words in zip(errors, expected):
        assert error.status_code == 400 and words in error.message, error.message
        assert error.type == "invalid_request_error"


@pytest.mark.parametrize("release", [None, "0.5.16", "0.5.23"])
def test_sampling_values_the_servers_would_refuse_are_the_agents_400_and_a_tiny_temperature_is_greedy(release):
    """What a server would refuse never reaches it (its refusal would fail the
    rollout worker): a temperature over the servers' bound is a 400, and on
    SGLang (either release: `ServedSampling`'s rule) so is top_p < 1 without a
    finite top_k; a temperature in (0, 1e-5), which the torch server refuses,
    is sampled greedily. `release` None: the torch server."""
    served = ServedSampling("sglang", release) if release else ServedSampling()

    async def main():
        async with Episode([ids("a"), ids("b"), ids("c")], served=served) as ep:
            client = ep.client()
            user = [{"role": "user", "content": "hi"}]
            tiny = await client.chat.completions.create(model="m", messages=user, temperature=1e-7)
            with pytest.raises(openai.BadRequestError) as hot:
                await client.chat.completions.create(model="m", messages=user, temperature=2e6)
            filtered = None
            try:
                await client.chat.completions.create(model="m", messages=user, top_p=0.9)
            except openai.BadRequestError as e:
                filtered = e
            with_k = await client.chat.completions.create(model="m", messages=user, top_p=0.9, extra_body={"top_k": 20})
            await client.close()
            return ep, tiny, hot.value, filtered, with_k

    ep, tiny, hot, filtered, with_k = run(main())
    assert tiny.choices[0].message.content == "a"
    assert ep.policy.requests[0].gconfig.greedy and ep.policy.requests[0].gconfig.sampling().temperature == 0
    assert hot.status_code == 400 and "temperature" in hot.message
    if release:
        assert filtered is not None and filtered.status_code == 400, filtered
        assert f"SGLang {release} refuses" in filtered.message and "top_k" in filtered.message
        assert len(ep.policy.requests) == 2
    else:
        assert filtered is None and len(ep.policy.requests) == 3
    assert with_k.choices[0].message.content in ("b", "c") and ep.policy.requests[-1].gconfig.top_k == 20


def test_a_call_its_client_gave_up_on_is_cancelled_and_never_recorded():
    """The agent's client times out while its call generates: the handler is
    cancelled (its generation with it) and no turn is recorded, so a reply
    the agent never saw is never trained on (a hook holds the generation
    until the client has given up)."""
    started, cancelled, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def main():
        async with Episode([ids("late")]) as ep:
            scripted = ep._generate

            async def held(prompt_ids, n, gconfig):
                started.set()
                try:
                    await release.wait()
                except asyncio.CancelledError:
                    cancelled.set()
                    raise
                return await scripted(prompt_ids, n, gconfig)

            ep.session.generate = held
            client = ep.client(max_retries=0, timeout=0.5)
            with pytest.raises(openai.APITimeoutError):
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            await client.close()
            await asyncio.wait_for(started.wait(), 10)
            try:
                await asyncio.wait_for(cancelled.wait(), 10)
            finally:
                release.set()
            for _ in range(100):  # (an uncancelled handler would record its turn now)
                await asyncio.sleep(0)
            return ep

    ep = run(main())
    assert cancelled.is_set()
    assert ep.session.recorder.turns == [] and not ep.policy.requests
    assert ep.endpoint.counters["calls_abandoned"] == 1


def test_an_unknown_episode_is_a_404_and_a_failed_generation_a_500_sent_once():
    async def main():
        async with Episode([], fail=True) as ep:
            client = ep.client()
            with pytest.raises(openai.InternalServerError) as failed:
                await client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            stranger = openai.AsyncOpenAI(base_url=f"{ep.endpoint.url}/episodes/nope/v1", api_key="k")
            with pytest.raises(openai.NotFoundError) as unknown:
                await stranger.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            for c in (client, stranger):
                await c.close()
            return ep, failed.value, unknown.value

    ep, failed, unknown = run(main())
    assert "every server failed" in failed.message
    assert ep.endpoint.counters["calls"] == 2  # x-should-retry: false, so the 500 was not sent again
    assert isinstance(ep.session.failure, RuntimeError)  # the episode fails with the original error
    assert "no open episode 'nope'" in unknown.message


def test_streamed_answers_assemble_to_the_same_message():
    sampled = ids('Sure.<tool_call>{"name": "add", "arguments": {"a": 2, "b": 2}}</tool_call>')

    async def main():
        async with Episode([sampled]) as ep:
            client = ep.client()
            stream = await client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "2+2?"}],
                tools=[ADD_TOOL],
                stream=True,
                stream_options={"include_usage": True},
            )
            chunks = [chunk async for chunk in stream]
            models = await client.models.list()
            await client.close()
            return chunks, models

    chunks, models = run(main())
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or ()]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert content == "Sure." and finish == ["tool_calls"]
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in calls] == [
        (0, "add", {"a": 2, "b": 2})
    ]
    assert chunks[-1].usage.completion_tokens == len(sampled)
    assert [m.id for m in models.data] == ["realrl"]


def test_an_external_agent_opens_chats_and_closes_an_episode():
    row = {"messages": [{"role": "user", "content": "1+1?"}], "answer": "2"}

    async def main():
        async with Episode([ids("2")], row=row) as ep, aiohttp.ClientSession() as http:
            url = ep.endpoint.url
            async with http.post(f"{url}/rl/episodes", json={}) as resp:
                assert (await resp.json()) == {"episode_id": None}  # nobody is waiting yet
            waiting = asyncio.create_task(ep.endpoint.offer(ep.session))
            async with http.post(f"{url}/rl/episodes", json={"wait_s": 5}) as resp:
                opened = await resp.json()
            client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="k")
            r = await client.chat.completions.create(model="m", messages=opened["row"]["messages"])
            await client.close()
            close = f"{url}/rl/episodes/{opened['episode_id']}/close"
            async with http.post(close, json={"reward": {"reward": 1.0, "tool_calls": 0}}) as resp:
                closed = (resp.status, await resp.json())
            async with http.post(close, json={"reward": 0.5}) as resp:
                again = resp.status
            return opened, r, closed, again, await waiting

    opened, r, closed, again, reward = run(main())
    assert opened["qid"] == "q7@0" and opened["row"] == row and opened["base_url"].endswith("/v1")
    assert r.choices[0].message.content == "2"
    assert closed == (200, {"success": True, "turns": 1}) and again == 409
    assert reward == {"reward": 1.0, "tool_calls": 0}


def test_the_loops_endpoint_is_shared_while_used_and_stopped_after():
    async def main():
        async with shared_endpoint() as a:
            async with shared_endpoint(host="127.0.0.2") as b:  # the running one, as it is
                assert a is b
            async with aiohttp.ClientSession() as http, http.get(f"{a.url}/health") as resp:
                assert resp.status == 200
        with pytest.raises(aiohttp.ClientConnectionError):
            async with aiohttp.ClientSession() as http, http.get(f"{a.url}/health"):
                pass
        async with shared_endpoint() as c:
            return a, c

    a, c = run(main())
    assert a is not c
