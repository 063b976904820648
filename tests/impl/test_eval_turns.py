"""Evaluation of multi-turn agents: turns per episode and solved within k turns
(realrl/impl/eval_metrics.py). Real parts: a tiny random Llama generating
greedily in process (`ModelGenerator`), the real built-in agents and
evaluation loop, `realrl eval`. The environment is the one stub: `TurnGate`
gives full credit from a chosen step of the episode on, whatever the answer,
so that a prompt is solved exactly on turn 2 (a random model's answers are
right only by chance)."""

from __future__ import annotations

import asyncio
import json

import pytest

import realrl.impl.agents  # noqa: F401  (registers the built-ins)
import realrl.impl.environments  # noqa: F401
from realrl.api.agent_api import Agent, AgentSettings, PromptRecord, make_agent
from realrl.api.env_api import EnvironmentService
from realrl.api.trajectory import Trajectory
from realrl.impl.eval_metrics import EpisodeOutcome, merge, metrics, summarize
from realrl.impl.evaluation import ModelGenerator, evaluate_prompts
from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model


class TurnGate(EnvironmentService):
    """Full credit from the row's `solve_at`-th `step` of the episode on (0:
    never), whatever the answers; 0.25 before (partial credit)."""

    async def reset(self, seed=None, options=None):
        self.solve_at, self.steps = int(options["prompt"].row.get("solve_at", 0)), 0
        return None, {}

    async def step(self, answers):
        self.steps += 1
        score = 1.0 if self.solve_at and self.steps >= self.solve_at else 0.25
        return None, [score] * len(answers), True, False, {}


class AlwaysThree(Agent):
    """Three calls whatever the scores (a solved episode answers again), every
    answer scored: its solution comes before its last turn. With
    `say_turns=False` its trajectory does not say which call answered which
    sequence (as a hand-built one would not)."""

    def __init__(self, settings=None, say_turns: bool = True):
        super().__init__(settings)
        self.say_turns = say_turns

    async def collect_trajectory(self, prompt, env):
        await env.reset(options={"prompt": prompt})
        results, scores, ids = [], [], prompt.prompt_ids
        for _ in range(3):
            result = await self.generate(ids, n=1)
            _, s, *_ = await env.step([self.decode(result.output_ids[0])])
            results.append(result)
            scores += s
            ids = self.next_turn_prompt(result.prompt_ids, result.output_ids[0], "Again.\nA:")
        trajectory = Trajectory.from_results(prompt, results, scores, self.settings.rewards(scores))
        if not self.say_turns:
            del trajectory.metadata["answer_turn"]
        return [trajectory]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    """A tiny random Llama with the character tokenizer (no chat template)."""
    tokenizer = build_char_tokenizer()
    config = TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=512
    )
    path = str(tmp_path_factory.mktemp("model"))
    build_tiny_model(tokenizer, config, seed=3).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir).eval()


def prompts(tokenizer, solve_at: list[int]) -> list[PromptRecord]:
    out = []
    for i, k in enumerate(solve_at):
        text = f"Q: {i}+1=?\nA:"
        ids = tokenizer.encode(text, add_special_tokens=False)
        out.append(PromptRecord(f"e{i}", text, ids, [str(i + 1)], row={"solve_at": k}))
    return out


def evaluate(agent: Agent, model, solve_at: list[int]) -> list[EpisodeOutcome]:
    generator = ModelGenerator(model, agent.tokenizer, "cpu", version=0)
    records = prompts(agent.tokenizer, solve_at)
    return asyncio.run(asyncio.wait_for(evaluate_prompts(agent, TurnGate, records, generator), 120))


def settings(model_dir) -> AgentSettings:
    return AgentSettings(tokenizer_path=model_dir, group_size=4, gconfig={"max_new_tokens": 4}).for_evaluation()


def test_the_multi_turn_agent_reports_turns_and_the_turn_it_solved_at(model_dir, model):
    agent = make_agent("math-multi-turn", settings(model_dir), num_turns=3)
    outcomes = evaluate(agent, model, [1, 2, 2, 0])
    assert [o.turns for o in outcomes] == [1, 2, 2, 3]  # a solved dialogue stops; an unsolved one uses all 3
    assert [o.solved_at_turn for o in outcomes] == [1, 2, 2, None]
    assert [o.score for o in outcomes] == [1.0, 1.0, 1.0, 0.25]
    stats = metrics(summarize(outcomes))
    assert stats == {
        "accuracy": 0.75,
        "score_mean": pytest.approx((3 + 0.25) / 4),
        "turns_mean": 2.0,
        "solved_within_1": 0.25,
        "solved_within_2": 0.75,
        "solved_within_3": 0.75,  # the most turns any episode made: the accuracy
    }


def test_an_answer_before_the_last_turn_counts_at_its_own_turn(model_dir, model):
    """An episode that goes on after its solution: solved at turn 2 of 3. A
    trajectory that does not say which call answered it counts as solved when
    the episode ended (as a chat agent's episode, scored once)."""
    outcomes = evaluate(AlwaysThree(settings(model_dir)), model, [2, 0, 1])
    assert [(o.turns, o.solved_at_turn) for o in outcomes] == [(3, 2), (3, None), (3, 1)]
    stats = metrics(summarize(outcomes))
    assert (stats["turns_mean"], stats["solved_within_1"], stats["solved_within_2"]) == (
        3.0,
        pytest.approx(1 / 3),
        pytest.approx(2 / 3),
    )
    assert stats["solved_within_3"] == stats["accuracy"] == pytest.approx(2 / 3)
    unsaid = evaluate(AlwaysThree(settings(model_dir), say_turns=False), model, [2, 0, 1])
    assert [(o.turns, o.solved_at_turn) for o in unsaid] == [(3, 3), (3, None), (3, 3)]


def test_a_single_turn_agent_has_one_turn_and_solved_within_1_is_its_accuracy(model_dir, model):
    outcomes = evaluate(make_agent("single-step", settings(model_dir)), model, [1, 0, 1, 0])
    stats = metrics(summarize(outcomes))
    assert stats == {"accuracy": 0.5, "score_mean": 0.625, "turns_mean": 1.0, "solved_within_1": 0.5}


def test_the_ranks_summaries_add_up():
    """Data-parallel ranks evaluate shares of the test set; their most turns differ."""
    rank0 = summarize([EpisodeOutcome(1.0, "", 1, 1), EpisodeOutcome(0.0, "", 1, None)])
    rank1 = summarize([EpisodeOutcome(1.0, "", 3, 3), EpisodeOutcome(1.0, "", 2, 2), EpisodeOutcome(0.5, "", 3)])
    assert rank0["solved_at"] == [1] and rank1["solved_at"] == [0, 1, 1]
    merged = merge([rank0, rank1])
    assert merged == {"n": 5, "n_correct": 3, "score_sum": 3.5, "turns_sum": 10, "max_turns": 3, "solved_at": [1, 1, 1]}
    stats = metrics(merged)
    assert stats["turns_mean"] == 2.0 and stats["accuracy"] == 0.6
    assert [stats[f"solved_within_{k}"] for k in (1, 2, 3)] == [0.2, 0.4, 0.6]
    assert metrics(merge([summarize([])])) == {"accuracy": 0.0, "score_mean": 0.0, "turns_mean": 0.0}


PLUGIN = """
from realrl.api.env_api import register_environment
from tests.impl.test_eval_turns import TurnGate

register_environment("turn-gate", TurnGate)
"""


def test_realrl_eval_reports_turns_and_solved_within(model_dir, tmp_path, capsys):
    from realrl.cli.eval import main

    (tmp_path / "gate.py").write_text(PLUGIN)
    with open(tmp_path / "test.jsonl", "w") as f:
        for i, k in enumerate([2, 0, 1, 2]):
            f.write(json.dumps({"query_id": f"q{i}", "prompt": f"Q: {i}+1=?\nA:", "answer": str(i + 1), "solve_at": k}))
            f.write("\n")
    out = tmp_path / "eval.json"
    code = main(
        [
            f"model.path={model_dir}",
            f"dataset.test_path={tmp_path / 'test.jsonl'}",
            f"plugins=[{tmp_path / 'gate.py'}]",
            "rollout.agent.type=math-multi-turn",
            "rollout.agent.args.num_turns=3",
            "rollout.env.type=turn-gate",
            "rollout.gconfig.max_new_tokens=4",
            "train.device=cpu",
            "--output",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    assert (result["n"], result["n_correct"], result["accuracy"]) == (4, 3, 0.75)
    assert result["turns_mean"] == (2 + 3 + 1 + 2) / 4
    assert [result[f"solved_within_{k}"] for k in (1, 2, 3)] == [0.25, 0.75, 0.75]
    assert "solved_within_4" not in result
    assert [s["turns"] for s in result["samples"]] == [2, 3, 1]


@pytest.mark.parametrize(
    "setting, message",
    [
        ("judge.model.path={tmp}", "judge.model.path: realrl eval starts no judge servers"),
        (
            "rollout.agent_fn={tmp}/judged.py:run",
            "rollout.agent_fn: takes `judge`, and realrl eval starts no judge servers",
        ),
    ],
)
def test_realrl_eval_refuses_a_judge_in_one_line(model_dir, tmp_path, capsys, setting, message):
    """`realrl eval` starts no judge servers: a judge, or an agent function
    that takes one, is refused before anything runs."""
    from realrl.cli.eval import main

    (tmp_path / "judged.py").write_text("async def run(client, row, judge):\n    return 0.0\n")
    (tmp_path / "test.jsonl").write_text(json.dumps({"query_id": "q", "prompt": "Q: 1+1=?\nA:", "answer": "2"}) + "\n")
    code = main(
        [f"model.path={model_dir}", f"dataset.test_path={tmp_path / 'test.jsonl'}", setting.format(tmp=tmp_path)]
    )
    assert code == 2
    assert capsys.readouterr().err.strip() == f"realrl: config error: {message}"
