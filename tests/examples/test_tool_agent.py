"""The tool-calling agent example (examples/tool_agent): its calculator, and
the agent function trained end to end on the tiny kit (two turns per
episode; the tool results and re-asked questions between turns are context)."""

from __future__ import annotations

import glob
import json
import os

import pytest

from benchmarks.learning_floors import RUNS, assert_reaches_floor, train, trial_name
from tests.examples.test_countdown import load_by_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
AGENT = os.path.join(REPO, "examples", "tool_agent", "agent.py")
calc = load_by_path(__import__("pathlib").Path(AGENT), "tool_agent_under_test").calc


@pytest.mark.parametrize(
    "expression, value",
    [
        ("12+30", "42"),
        ("2*3-4", "2"),
        (" 7 ", "7"),
        ("1/2", "error"),
        ("__import__('os')", "error"),
        ("1.5+1", "error"),
    ],
)
def test_calc_evaluates_integer_arithmetic_only(expression, value):
    assert calc(expression) == value


def test_the_tool_agent_learns_end_to_end_on_the_tiny_kit(tmp_path, kit_cache):
    """benchmarks/learning_floors.py's run "tool-agent", seed 1: the agent function on the
    default kit; its final greedy accuracy (the agent's two turns) must reach the floor
    measured over seeds 1-5 (benchmarks/learning_floors.json, docs/benchmarks.md
    "Learning floors")."""
    steps = RUNS["tool-agent"].steps
    summary, _ = train("tool-agent", 1, str(tmp_path), kit_cache)
    assert summary["steps"] == steps and summary["trajectories"]["consumed"] == steps * 16
    assert_reaches_floor(summary, "tool-agent", seed=1)
    logs = os.path.join(tmp_path, "logs", "async-ppo-tiny", trial_name("tool-agent", 1))
    samples = [json.loads(line) for path in glob.glob(f"{logs}/samples/*.jsonl") for line in open(path)]
    assert samples
    sequences = [
        (turns, sampled, total)
        for s in samples
        for turns, sampled, total in zip(s["turns"], s["sampled_lens"], s["completion_lens"])
    ]
    # every sequence trains on its sampled tokens only; a two-turn chain holds context (the re-asked question)
    assert all(0 < sampled <= total for _, sampled, total in sequences)
    assert all((sampled < total) == (turns == 2) for turns, sampled, total in sequences)
    assert any(turns == 2 for turns, _, _ in sequences), sequences
    log = open(os.path.join(logs, "rollout_worker-0.log")).read()
    assert "prompts_stitched" in log


def test_the_warm_start_rows_are_the_contexts_the_agent_sees():
    """examples/tool_agent/make_warm_start.py writes each later turn's context
    as a prompt: it must be token for token what the kit's chat template makes
    of the agent's messages (the user's question, the assistant's calc call as
    the endpoint records it, the tool's result), or the warm start teaches a
    context the agent never shows the model."""
    from realrl.impl.tiny_model import build_kit_tokenizer

    warm = load_by_path(__import__("pathlib").Path(AGENT).parent / "make_warm_start.py", "tool_warm_under_test")
    record = {"query_id": "q1", "prompt": "Q: 12+30=?\nA:", "answer": "42"}
    call, read = warm.warm_rows([record], tool_fraction=1.0, seed=0)
    direct = warm.warm_rows([record], tool_fraction=0.0, seed=0)
    assert direct == [record] and call["prompt"] == record["prompt"] and read["answer"] == "42"

    tokenizer = build_kit_tokenizer()
    arguments = json.dumps({"expression": "12+30"})  # as the endpoint puts a parsed call's arguments
    messages = [
        {"role": "user", "content": record["prompt"]},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "calc", "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": "c0", "content": calc("12+30")},
    ]

    def rendered(msgs):
        return tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False)

    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert encode(read["prompt"]) == rendered(messages)  # the second turn's context
    # the first turn's answer: the assistant message's tokens, before its EOS
    assert encode(call["prompt"]) + encode(call["answer"]) + [tokenizer.eos_token_id] == rendered(messages[:2])
