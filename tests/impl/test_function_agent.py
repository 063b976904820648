"""Agents as async functions over an OpenAI client, and external agents
(realrl/impl/agents/function_agent.py), run the way the rollout worker runs
agents (`agent.run_episode`): against a real torch server with a tiny random
model (`ServerGenerator`), and in evaluation against the model in-process."""

from __future__ import annotations

import asyncio
import textwrap

import aiohttp
import openai
import pytest

import realrl.impl.agents  # noqa: F401  (registers the built-ins)
import realrl.impl.environments  # noqa: F401
from realrl.api.agent_api import AgentSettings, PromptRecord, make_agent
from realrl.api.env_api import make_env
from realrl.api.generation_api import GenerationRequest, GenerationResult
from realrl.impl.agents.function_agent import load_agent_fn
from realrl.impl.evaluation import ModelGenerator, evaluate_prompts
from realrl.impl.generation.server_generator import ServerGenerator
from realrl.impl.openai_compat.endpoint import shared_endpoint
from realrl.impl.tiny_model import TinyModelConfig, build_tiny_model
from tests.impl.conftest import ServerProcess
from tests.impl.openai_compat.chat_kit import ScriptedGenerator, char_chat_tokenizer

AGENT = '''
import asyncio
import json

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}


async def run(client, row, max_tokens=6):
    """Two turns: ask (a tool may be called), then a tool or user message, then score."""
    messages = list(row["messages"])
    ask = dict(model="policy", tools=[CALC], max_tokens=max_tokens)
    first = await client.chat.completions.create(messages=messages, **ask)
    reply = first.choices[0].message
    messages.append(reply)
    if reply.tool_calls:
        messages.append({"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "2"})
    else:
        messages.append({"role": "user", "content": "Use the tool."})
    second = await client.chat.completions.create(messages=messages, **ask)
    text = second.choices[0].message.content or ""
    return {"reward": float(row["answer"] in text), "chars": len(text)}


async def run_long(client, row):
    return await run(client, row, max_tokens=64)


async def fails_on_odd(client, row):
    await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=2)
    fails_on_odd.calls = getattr(fails_on_odd, "calls", 0) + 1
    if fails_on_odd.calls % 2:
        raise KeyError("my bug")
    return 1.0


async def calls_then_scores(client, row):
    """`row["calls"]` chat calls, then full credit if `row["solve"]`; raises instead if `row["fail"]`."""
    messages = list(row["messages"])
    for _ in range(row["calls"]):
        reply = await client.chat.completions.create(model="policy", messages=messages, max_tokens=3)
        messages += [reply.choices[0].message, {"role": "user", "content": "Again."}]
    if row.get("fail"):
        raise RuntimeError("my bug")
    return float(row["solve"])


async def nucleus_then_top_k(client, row):
    """A call with top_p < 1 and no top_k, then one with a top_k too; returns what the first got."""
    import openai

    ask = dict(model="policy", messages=row["messages"], max_tokens=2, top_p=0.5)
    try:
        await client.chat.completions.create(**ask)
        refused = ""
    except openai.BadRequestError as e:
        refused = f"{e.status_code} {e.message}"
    await client.chat.completions.create(**ask, extra_body={"top_k": 20})
    nucleus_then_top_k.refused = refused
    return 1.0


def not_async(client, row):
    return 1.0


async def hangs_on_odd(client, row):
    if row["answer"] == "3":
        await asyncio.Event().wait()  # a hung agent: never returns
    return 1.0


async def one_argument(client):
    return 1.0
'''

CUSTOM_AGENT = """
from realrl.api.agent_api import Agent


class EchoAgent(Agent):
    def __init__(self, settings=None, word="hi"):
        super().__init__(settings)
        self.word = word

    async def collect_trajectory(self, prompt, env):
        return []
"""


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory) -> str:
    """A tiny random Llama whose tokenizer has the tool-call chat template."""
    tokenizer = char_chat_tokenizer()
    model = build_tiny_model(
        tokenizer,
        TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=512),
        seed=7,
    )
    path = str(tmp_path_factory.mktemp("chat_model"))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def chat_server(chat_model_dir, tmp_path_factory):
    """One torch server for the module's tests (they only generate)."""
    server = ServerProcess(chat_model_dir, str(tmp_path_factory.mktemp("server") / "server.log"))
    try:
        server.wait_healthy()
        yield server
    finally:
        server.kill()


@pytest.fixture
def agent_file(tmp_path) -> str:
    path = tmp_path / "my_agent.py"
    path.write_text(textwrap.dedent(AGENT))
    return str(path)


def prompt(qid: str = "q1@0", text: str = "1+1?", answer: str = "2") -> PromptRecord:
    return PromptRecord(qid=qid, prompt=text, prompt_ids=[5], solutions=[answer], row={"task_id": 9})


class RecordingGenerator(ServerGenerator):
    """`ServerGenerator` that keeps what the server answered."""

    def __init__(self, url: str):
        super().__init__(url)
        self.results: list[GenerationResult] = []

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        result = await super().generate(request)
        self.results.append(result)
        return result


def test_an_agent_function_trains_on_exactly_what_the_server_sampled(chat_model_dir, agent_file, chat_server):
    server = chat_server
    settings = AgentSettings(tokenizer_path=chat_model_dir, group_size=3, gconfig={"max_new_tokens": 8})
    agent = make_agent("function", settings, fn=f"{agent_file}:run")

    async def main():
        generator = RecordingGenerator(server.url)
        try:
            return await agent.run_episode(prompt(), make_env("math"), generator), generator.results
        finally:
            await generator.close()

    (traj,), results = asyncio.run(main())
    # 3 independent episodes of 2 calls each: 6 turns. One sequence per chain
    # of turns: a second call stitched onto the first shares its sequence.
    assert len(results) == 6 and 3 <= traj.group_size <= 6
    episodes = traj.metadata["episode"]
    assert sorted(set(episodes)) == [0, 1, 2]
    assert all(sum(n for e, n in zip(episodes, traj.metadata["turns"]) if e == k) == 2 for k in range(3))
    # Each call's prompt ids and what the server sampled, with its logprobs, is
    # in one sequence, where exactly the sampled ids carry the loss.
    for r in results:
        prompt_ids, output = r.prompt_ids, r.output_ids[0]
        (i,) = [i for i in range(traj.group_size) if traj.input_ids[i][: len(prompt_ids) + len(output)].tolist()
                == prompt_ids + output]  # fmt: skip
        span = slice(len(prompt_ids) - traj.prompt_len[i], len(prompt_ids) - traj.prompt_len[i] + len(output))
        assert traj.loss_mask[i][span].all()
        assert traj.logprobs[i][span].tolist() == pytest.approx(r.output_logprobs[0])
    assert sum(int(m.sum()) for m in traj.loss_mask) == sum(len(r.output_ids[0]) for r in results)
    for i in range(traj.group_size):  # context: logprob 0, version -1
        assert (traj.logprobs[i][~traj.loss_mask[i]] == 0).all() and (traj.versions[i][~traj.loss_mask[i]] == -1).all()
    assert all(0 < len(r.output_ids[0]) <= 6 for r in results)  # the agent's max_tokens
    tok = agent.tokenizer
    first_prompt = tok.decode(traj.input_ids[0][: traj.prompt_len[0]].tolist())
    assert (
        first_prompt.startswith("<|im_start|>system\n# Tools\n") and "<|im_start|>user\n1+1?<|im_end|>" in first_prompt
    )
    traj_scores = [traj.metadata["episode_scores"][e] for e in episodes]
    assert traj.scores == traj_scores
    assert traj.reward == [settings.reward(s) for s in traj.scores]
    stats = agent.pop_stats()
    assert stats["n_episodes"] == 1 and stats["turns"] == 6 and "fn/chars" in stats


def test_a_tool_call_episode_trains_as_one_sequence_with_its_context_masked(agent_file, chat_model_dir):
    settings = AgentSettings(tokenizer_path=chat_model_dir, group_size=1, gconfig={"max_new_tokens": 64})
    agent = make_agent("function", settings, fn=f"{agent_file}:run_long")
    tok = agent.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    call_ids = tok.encode('<tool_call>\n{"name": "calc", "arguments": {}}\n</tool_call>', add_special_tokens=False)
    answer_ids = tok.encode("2", add_special_tokens=False)
    generator = ScriptedGenerator([call_ids + [end], answer_ids + [end]], frozenset({end}))
    (traj,) = asyncio.run(agent.run_episode(prompt(), make_env("math"), generator))
    assert traj.group_size == 1 and traj.metadata["turns"] == [2] and traj.scores == [1.0]
    first, second = generator.requests
    completion = traj.completion_ids(0)
    # the tool call and the answer carry the loss; the tool result and the
    # template's tokens between the turns are context
    bridge = len(second.prompt_ids) - len(first.prompt_ids) - len(call_ids) - 1
    assert traj.loss_mask[0].tolist() == [True] * (len(call_ids) + 1) + [False] * bridge + [True] * (
        len(answer_ids) + 1
    )
    assert (
        tok.decode(completion[~traj.loss_mask[0]].tolist())
        == "\n<|im_start|>tool\n2<|im_end|>\n<|im_start|>assistant\n"
    )
    assert completion[traj.loss_mask[0]].tolist() == call_ids + [end] + answer_ids + [end]
    assert traj.logprobs[0][~traj.loss_mask[0]].tolist() == [0.0] * bridge
    assert (traj.versions[0][~traj.loss_mask[0]] == -1).all() and (traj.versions[0][traj.loss_mask[0]] == 3).all()


def test_a_failing_episode_leaves_its_group_and_a_generation_failure_fails_the_episode(agent_file, chat_model_dir):
    from realrl.system.partial_rollout import PartialRolloutError

    class Generator:
        def __init__(self, fail: bool):
            self.fail = fail

        async def generate(self, request):
            if self.fail:
                raise PartialRolloutError("servers gone")
            eos = agent.tokenizer.eos_token_id
            n = request.group_size
            return GenerationResult(request.qid, request.prompt_ids, [[eos]] * n, [[-1.0]] * n, [[0]] * n,
                                    [False] * n, [0] * n, [0] * n)  # fmt: skip

    settings = AgentSettings(tokenizer_path=chat_model_dir, group_size=4, gconfig={"max_new_tokens": 4})
    agent = make_agent("function", settings, fn=f"{agent_file}:fails_on_odd")
    (traj,) = asyncio.run(agent.run_episode(prompt(), make_env("math"), Generator(fail=False)))
    assert traj.group_size == 2 and traj.scores == [1.0, 1.0]  # 2 of 4 episodes raised: left out
    assert agent.pop_stats()["fn_errors"] == 2
    with pytest.raises(PartialRolloutError, match="servers gone"):
        asyncio.run(agent.run_episode(prompt(), make_env("math"), Generator(fail=True)))


def test_a_call_with_sampling_the_backend_cannot_serve_is_a_400_to_the_agent(agent_file, chat_model_dir):
    """SGLang 0.5.23 refuses the sampling logprobs of top_p < 1 without a
    top_k: the agent's call gets HTTP 400 and SGLang's reason, nothing is
    sent, and the episode goes on (its next call, with a top_k, is served)."""
    from realrl.api.served_sampling import ServedSampling

    settings = AgentSettings(
        tokenizer_path=chat_model_dir,
        group_size=1,
        gconfig={"max_new_tokens": 4},
        served=ServedSampling("sglang", "0.5.23"),
    )
    agent = make_agent("function", settings, fn=f"{agent_file}:nucleus_then_top_k")
    end = agent.tokenizer.eos_token_id
    generator = ScriptedGenerator([[end]], frozenset({end}))
    (traj,) = asyncio.run(agent.run_episode(prompt(), make_env("math"), generator))
    refused = agent.fn.refused
    assert refused.startswith("400 ") and "SGLang 0.5.23 refuses" in refused and "1 < top_k <= 4096" in refused
    (served,) = generator.requests  # only the call with a top_k reached the generator
    assert (served.gconfig.top_p, served.gconfig.top_k) == (0.5, 20) and traj.scores == [1.0]


def test_evaluation_runs_the_agent_function_greedily_in_process(agent_file, chat_model_dir):
    from transformers import AutoModelForCausalLM

    settings = AgentSettings(tokenizer_path=chat_model_dir, gconfig={"max_new_tokens": 6}).for_evaluation()
    agent = make_agent("function", settings, fn=f"{agent_file}:run")
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir).eval()
    generator = ModelGenerator(model, agent.tokenizer, "cpu", version=0)
    prompts = [prompt(f"e{i}", f"{i}+1?", str(i + 1)) for i in range(3)]
    results = asyncio.run(evaluate_prompts(agent, lambda: make_env("math"), prompts, generator))
    assert len(results) == 3 and all(o.score in (0.0, 1.0) for o in results)
    assert all(o.turns == 2 for o in results)  # the function's two chat calls
    assert generator.n_batches >= 2  # two calls per episode, the episodes' calls batched together


def test_evaluation_counts_an_agent_functions_chat_calls_as_its_turns(agent_file, chat_model_dir):
    """An agent function's episode is scored once, when it returns: solved within
    as many turns as it made chat calls. A failed episode still made its calls."""
    from transformers import AutoModelForCausalLM

    from realrl.impl.eval_metrics import metrics, summarize

    settings = AgentSettings(tokenizer_path=chat_model_dir, gconfig={"max_new_tokens": 3}).for_evaluation()
    agent = make_agent("function", settings, fn=f"{agent_file}:calls_then_scores")
    model = AutoModelForCausalLM.from_pretrained(chat_model_dir).eval()
    generator = ModelGenerator(model, agent.tokenizer, "cpu", version=0)
    rows = [dict(calls=1, solve=1), dict(calls=3, solve=1), dict(calls=2, solve=0), dict(calls=2, solve=1, fail=True)]
    prompts = [PromptRecord(f"f{i}", f"{i}+1?", [5], [str(i + 1)], row=r) for i, r in enumerate(rows)]
    outcomes = asyncio.run(asyncio.wait_for(evaluate_prompts(agent, lambda: make_env("math"), prompts, generator), 120))
    assert [(o.turns, o.solved_at_turn, o.score) for o in outcomes] == [
        (1, 1, 1.0),
        (3, 3, 1.0),
        (2, None, 0.0),
        (2, None, 0.0),  # raised: no trajectory, but its two calls were made
    ]
    stats = metrics(summarize(outcomes))
    assert stats["turns_mean"] == 2.0 and stats["accuracy"] == 0.5
    assert [stats[f"solved_within_{k}"] for k in (1, 2, 3)] == [0.25, 0.25, 0.5]


def test_an_external_agent_drives_episodes_over_http(chat_model_dir, chat_server):
    server = chat_server
    settings = AgentSettings(tokenizer_path=chat_model_dir, group_size=2, gconfig={"max_new_tokens": 4})
    agent = make_agent("external", settings)

    async def outside(base: str, n: int) -> list[str]:
        """An agent process of its own: open, chat, close, n times."""
        qids = []
        async with aiohttp.ClientSession() as http:
            for k in range(n):
                async with http.post(f"{base}/rl/episodes", json={"wait_s": 10}) as resp:
                    opened = await resp.json()
                client = openai.AsyncOpenAI(base_url=opened["base_url"], api_key="k")
                await client.chat.completions.create(model="m", messages=opened["row"]["messages"], max_tokens=3)
                await client.close()
                async with http.post(f"{base}/rl/episodes/{opened['episode_id']}/close", json={"reward": k}) as resp:
                    assert resp.status == 200
                qids.append(opened["qid"])
        return qids

    async def main():
        generator = ServerGenerator(server.url)
        try:
            async with shared_endpoint() as endpoint:  # the rollout worker's role: it holds the endpoint
                episode = asyncio.create_task(agent.run_episode(prompt("q5@1"), make_env("math"), generator))
                qids = await outside(endpoint.url, 2)
                return await episode, qids
        finally:
            await generator.close()

    (traj,), qids = asyncio.run(main())
    assert qids == ["q5@1", "q5@1"] and traj.group_size == 2 and sorted(traj.scores) == [0.0, 1.0]

    timeout_agent = make_agent("external", settings, episode_timeout_s=0.2)

    async def nobody_comes():
        async with shared_endpoint():
            return await timeout_agent.run_episode(prompt(), make_env("math"), None)

    assert asyncio.run(nobody_comes()) == []  # nobody took them: no trajectory, counted
    stats = timeout_agent.pop_stats()
    assert stats["external_timeouts"] == 2 and "fn_errors" not in stats


@pytest.mark.parametrize(
    "name, message",
    [
        ("run", None),
        ("not_async", "is not an async function"),
        ("one_argument", "cannot be called as fn(client, row[, judge])"),
        ("missing", "has no attribute 'missing'"),
    ],
)
def test_agent_functions_are_checked_when_loaded(agent_file, name, message):
    if message is None:
        assert load_agent_fn(f"{agent_file}:{name}").__name__ == "run"
        return
    with pytest.raises(ValueError, match="agent function") as info:
        load_agent_fn(f"{agent_file}:{name}")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_agent_class_of_a_users_file_needs_no_registering(tmp_path):
    path = tmp_path / "echo_agent.py"
    path.write_text(CUSTOM_AGENT)
    agent = make_agent(f"{path}:EchoAgent", AgentSettings(), word="ho")
    assert type(agent).__name__ == "EchoAgent" and agent.word == "ho"
    with pytest.raises(ValueError, match="has no attribute 'Nope'"):
        make_agent(f"{path}:Nope", AgentSettings())


def test_a_hung_agent_episode_is_dropped_at_the_episode_timeout_and_frees_its_slot(agent_file, chat_model_dir):
    """rollout.episode_timeout: an agent function that never returns is
    cancelled and its episode dropped (counted `episode_timeouts`); the
    prompt's collect_trajectory returns instead of holding its slot forever."""
    settings = AgentSettings(tokenizer_path=chat_model_dir, group_size=2, episode_timeout=0.5)
    agent = make_agent("function", settings, fn=f"{agent_file}:hangs_on_odd")

    async def main():
        async with shared_endpoint():
            hung = await asyncio.wait_for(agent.run_episode(prompt(answer="3"), make_env("math"), None), 60)
            fine = await asyncio.wait_for(agent.run_episode(prompt(answer="2"), make_env("math"), None), 60)
            return hung, fine

    hung, fine = asyncio.run(main())
    assert hung == [] and fine == []  # (no chat call made: nothing to train, the group rejected)
    stats = agent.pop_stats()
    assert stats["episode_timeouts"] == 2 and "fn_errors" not in stats
