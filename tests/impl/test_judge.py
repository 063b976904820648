"""The judge model (realrl/impl/judge.py): a tiny random judge on a real
frozen torch server, reached by a reward function through the chat
endpoint's `/judge/v1` with the openai client."""

from __future__ import annotations

import asyncio
import socket
import textwrap

import aiohttp
import pytest
import torch
from transformers import AutoModelForCausalLM

from realrl.impl.generation.client import GenerationClient
from realrl.impl.judge import Judge, load_judge_tokenizer
from realrl.impl.openai_compat.endpoint import ChatEndpoint
from realrl.impl.reward_fn import RewardFunctionRunner
from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_kit_tokenizer, build_tiny_model

REWARDS = textwrap.dedent(
    """
    ANSWERS = []

    async def echo(prompt, completion, answer, judge):
        reply = await judge.chat.completions.create(
            model="judge", messages=[{"role": "user", "content": completion}], max_tokens=6, temperature=0
        )
        ANSWERS.append(reply.choices[0].message.content)
        return 1.0

    async def as_number(prompt, completion, answer, judge):
        reply = await judge.chat.completions.create(
            model="judge", messages=[{"role": "user", "content": completion}], max_tokens=6, temperature=0
        )
        return float(reply.choices[0].message.content)  # a random judge answers garbage: ValueError

    def sync_judge(prompt, completion, answer, judge):
        return 1.0
    """
)


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> str:
    tokenizer = build_kit_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), seed=3)
    path = str(tmp_path_factory.mktemp("judge"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture
def rewards(tmp_path) -> str:
    path = tmp_path / "rewards.py"
    path.write_text(REWARDS)
    return str(path)


async def _runner_with_judge(spec: str, urls, timeout_s: float = 30.0, request_timeout_s: float = 20.0):
    endpoint = ChatEndpoint()
    await endpoint.start()
    endpoint.judge = Judge(load_judge_tokenizer(urls.model_dir), urls, request_timeout_s=request_timeout_s)
    runner = RewardFunctionRunner(spec, timeout_s=timeout_s, judge=endpoint.judge_client)
    return endpoint, runner


class _Urls:
    """The judge servers' URLs as a test changes them."""

    def __init__(self, model_dir: str, urls: list[str]):
        self.model_dir, self.urls = model_dir, urls

    def __call__(self) -> list[str]:
        return list(self.urls)


def test_frozen_server_refuses_weight_updates(judge_dir, start_server):
    server = start_server(judge_dir, "--frozen")

    async def go():
        async with aiohttp.ClientSession() as http:
            answers = {}
            for route, body in [
                ("/update_weights_from_disk", {"model_path": judge_dir, "weight_version": "1"}),
                ("/update_weight_version", {"new_version": "1"}),
                ("/load_lora_adapter", {"lora_name": "a", "lora_path": judge_dir}),
            ]:
                async with http.post(server.url + route, json=body) as resp:
                    answers[route] = (resp.status, await resp.text())
        async with GenerationClient() as client:
            info = await client.server_info(server.url)
            version = await client.weight_version(server.url)
            out = await client.generate(server.url, [5, 6, 7], {"max_new_tokens": 3, "temperature": 0})
        return answers, info, version, out

    answers, info, version, out = asyncio.run(go())
    assert all(status == 400 and "frozen" in text for status, text in answers.values()), answers
    assert info["rejections"] == {"frozen": 3}
    assert version == "0" and out.weight_version == "0"
    assert len(out.output_ids) >= 1  # still serves


def test_judge_answers_like_transformers_and_records_nothing(judge_dir, rewards, start_server):
    server = start_server(judge_dir, "--frozen")
    urls = _Urls(judge_dir, [server.url])
    completion = "Is 2+2=4? Answer yes or no."

    async def go():
        endpoint, runner = await _runner_with_judge(f"{rewards}:echo", urls)
        try:
            score = await runner.score("p", completion, "a")
            return score, runner.counts(), endpoint.stats(), len(endpoint.sessions)
        finally:
            await endpoint.judge.close()
            await endpoint.close()

    score, counts, stats, n_sessions = asyncio.run(go())
    assert score == 1.0
    assert counts == {"calls": 1, "timeouts": 0, "errors": 0, "judge_failures": 0}
    assert stats == {"judge_calls": 1} and n_sessions == 0  # nothing recorded as an episode

    # The judge rendered with its own chat template and answered greedily.
    tokenizer = load_judge_tokenizer(judge_dir)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": completion}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    model = AutoModelForCausalLM.from_pretrained(judge_dir, dtype=torch.float32).eval()
    ids = torch.tensor([list(prompt)])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1] :].tolist(), skip_special_tokens=True)
    import sys

    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == rewards)
    assert module.ANSWERS == [expected]


def test_judge_failures_score_zero_and_are_counted(judge_dir, rewards, start_server):
    server = start_server(judge_dir, "--frozen")
    stalled = socket.socket()  # accepts connections, never answers: a judge that stalls
    stalled.bind(("127.0.0.1", 0))
    stalled.listen(8)
    urls = _Urls(judge_dir, [server.url])

    async def go():
        endpoint, runner = await _runner_with_judge(f"{rewards}:as_number", urls, request_timeout_s=1.0)
        try:
            garbage = await runner.score_with_outcome("p", "hello", "a")  # a random judge's answer is no number
            after_garbage = runner.counts()
            urls.urls = [f"http://127.0.0.1:{stalled.getsockname()[1]}"]
            stall = await runner.score_with_outcome("p", "hello", "a")
            server.kill()
            urls.urls = [server.url]
            dead = await runner.score_with_outcome("p", "hello", "a")
            urls.urls = []
            none = await runner.score_with_outcome("p", "hello", "a")
            return garbage, after_garbage, stall, dead, none, runner.counts(), endpoint.stats()
        finally:
            await endpoint.judge.close()
            await endpoint.close()

    try:
        garbage, after_garbage, stall, dead, none, counts, stats = asyncio.run(go())
    finally:
        stalled.close()
    assert garbage == (0.0, "errors") and after_garbage["judge_failures"] == 1
    assert stall == dead == none == (0.0, "errors")
    assert counts == {"calls": 4, "timeouts": 0, "errors": 4, "judge_failures": 4}
    # The endpoint saw the four calls; the three that got no answer are its
    # failures (the stalled one too: the endpoint gives up before the client).
    assert stats == {"judge_calls": 4, "judge_failures": 3}


def test_bad_judge_config_is_one_line(judge_dir, rewards, tmp_path):
    with pytest.raises(ValueError, match=r"no judge is configured \(judge.model.path\)") as e:
        RewardFunctionRunner(f"{rewards}:echo")
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"takes `judge`, so it must be an `async def`"):
        RewardFunctionRunner(f"{rewards}:sync_judge", judge=lambda: None)
    plain = tmp_path / "plain"
    build_char_tokenizer().save_pretrained(str(plain))
    with pytest.raises(ValueError, match=r"^judge.model.path='.*': the judge's tokenizer has no chat template$"):
        load_judge_tokenizer(str(plain))
