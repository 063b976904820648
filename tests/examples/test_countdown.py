"""The Countdown reward-function example (examples/countdown): the safe
expression parser, the reward, and the data generator."""

from __future__ import annotations

import importlib
import importlib.util
import json
import subprocess
import sys
import time
from fractions import Fraction
from pathlib import Path

import pytest

from realrl.impl.math_data import load_math_jsonl
from realrl.impl.tiny_model import ALPHABET

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "countdown"


def load_by_path(path: Path, name: str):
    """Load a file the way a reward-function loader does: by file path, with
    its directory on sys.path during the import."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module


reward_module = load_by_path(EXAMPLE / "reward.py", "countdown_reward_under_test")
reward = reward_module.reward
expr = reward_module.evaluate.__globals__  # the parser module reward.py imported
evaluate, ExpressionError, MAX_LEN = expr["evaluate"], expr["ExpressionError"], expr["MAX_LEN"]
make_data = load_by_path(EXAMPLE / "make_data.py", "countdown_make_data_under_test")


def score(completion: str, numbers=(3, 5, 7), target=22) -> float:
    return reward(
        prompt="Use ...",
        completion=completion,
        answer="3*5+7",
        numbers=list(numbers),
        target=target,
        query_id="q",
        task="countdown",
    )


# ---------------------------------------------------------------- parser


@pytest.mark.parametrize(
    "text, value, numbers",
    [
        ("3*5+7", 22, [3, 5, 7]),
        ("3+5*7", 38, [3, 5, 7]),  # * before +
        ("(3+5)*7", 56, [3, 5, 7]),
        ("10-4-3", 3, [10, 4, 3]),  # left-associative
        ("10-(4-3)", 9, [10, 4, 3]),
        ("12/4/3", 1, [12, 4, 3]),
        ("7/2", Fraction(7, 2), [7, 2]),  # exact, not 3.5 in floating point
        ("(7/3)*3", 7, [7, 3, 3]),
        (" ( 2 + 3 ) * 4 ", 20, [2, 3, 4]),
        ("((((5))))", 5, [5]),
        ("12", 12, [12]),
    ],
)
def test_parser_values(text, value, numbers):
    assert evaluate(text) == (value, numbers)


@pytest.mark.parametrize(
    "text",
    [
        "",
        " ",
        "-3+5",
        "3+-5",
        "+3",
        "3+",
        "3**2",
        "(3+5",
        "3+5)",
        "()",
        "3 5",
        "3.5",
        "3x5",
        "2^3",
        "1e3",
        "__import__('os')",
        "3/0",
        "3/(5-5)",
        "²",
        "٣+1",
        "3+4=7",
    ],
)
def test_parser_rejects(text):
    with pytest.raises(ExpressionError):
        evaluate(text)


def test_parser_bounds_hostile_input_quickly():
    start = time.perf_counter()
    for text in ["(" * 10_000 + "1" + ")" * 10_000, "1+" * 100_000 + "1", "9" * 1_000_000, "(" * 32 + "1" + ")" * 32]:
        with pytest.raises(ExpressionError):
            evaluate(text)
    # within the length cap but nested too deep: rejected by the depth cap, no RecursionError
    deep = "(" * 20 + "1" + ")" * 20
    assert len(deep) <= MAX_LEN
    with pytest.raises(ExpressionError, match="nested"):
        evaluate(deep)
    assert time.perf_counter() - start < 1.0


# ---------------------------------------------------------------- reward


def test_reward_exact_hit():
    assert score("3*5+7") == 1.0
    assert score("7+5*3") == 1.0  # any order
    assert score(" 7 + 3 * 5 ") == 1.0
    assert score("4*5+2", numbers=(2, 4, 5), target=22) == 1.0


def test_reward_completion_first_line_only():
    assert score("3*5+7\nsome trailing text") == 1.0
    assert score("3*5+7\n") == 1.0
    assert score("3*5+7 because") == 0.0  # trailing text on the answer line is not an expression
    assert score("\n3*5+7") == 0.0  # the first line is empty


def test_reward_numbers_must_be_given_and_not_reused():
    assert score("2*11") == 0.0  # 22, but 2 and 11 are not given
    assert score("3*7+1") == 0.0  # 1 is not given
    assert score("5*5-3") == 0.0  # 22, but 5 used twice
    assert score("7+7+7+1") == 0.0
    assert score("3*3+13", numbers=(3, 3, 13)) == 1.0  # a number given twice may be used twice


def test_reward_at_most_once():
    assert score("3*7", numbers=(3, 5, 7), target=21) == 1.0  # 5 unused: allowed


def test_reward_partial_credit():
    near, far = score("3*7+5"), score("3-5+7")  # 26 and 5, legal numbers, target 22
    assert 0.1 <= far < near < 0.3
    assert near == pytest.approx(0.1 + 0.2 * (1 - 4 / 22))
    assert score("7*5*3") == pytest.approx(0.1)  # 105: far off, still the floor
    assert score("7/5") > 0.1  # a fraction is a legal miss too


def test_reward_invalid_is_zero():
    too_long = ["(" * 40 + "3" + ")" * 40, "3" + " " * 70 + "*5+7"]
    for completion in ["", "22", "hello", "3*5+", "3/(5-5)+7", "-3+5*7", *too_long]:
        assert score(completion) == 0.0, completion


def test_reward_importable_as_module_too():
    module = importlib.import_module("examples.countdown.reward")
    assert module.reward(prompt="", completion="3*5+7", answer="", numbers=[3, 5, 7], target=22) == 1.0


# ---------------------------------------------------------------- data


def test_make_rows_deterministic_per_seed():
    assert make_data.make_rows(300, seed=7) == make_data.make_rows(300, seed=7)
    assert make_data.make_rows(300, seed=7) != make_data.make_rows(300, seed=8)


@pytest.fixture(scope="module")
def splits():
    return make_data.make_splits(3000, 200, seed=1)  # the README's defaults


def test_rows_are_reachable_and_tokenizable(splits):
    train, test = splits
    alphabet = set(ALPHABET)
    for row in train + test:
        assert set(row) == {"query_id", "prompt", "answer", "numbers", "target", "task"}
        assert reward(completion=row["answer"], **row) == 1.0, row
        assert 1 <= row["target"] <= 99 and all(1 <= n <= 12 for n in row["numbers"])
        assert row["prompt"] == f"Use {' '.join(map(str, row['numbers']))} to make {row['target']}.\nA:"
        assert set(row["prompt"]) <= alphabet and set(row["answer"]) <= alphabet
    max_prompt = max(len(r["prompt"]) for r in train + test)
    max_answer = max(len(r["answer"]) for r in train + test)
    print(f"max prompt {max_prompt} chars, max answer {max_answer} chars")
    assert max_prompt <= 32 and max_answer <= 15  # fits rollout.gconfig.max_new_tokens=16 with eos
    share_of_3 = sum(len(r["numbers"]) == 3 for r in train) / len(train)
    assert 0.75 <= share_of_3 <= 0.85


def test_splits_disjoint(splits):
    train, test = splits
    key = lambda r: (tuple(sorted(r["numbers"])), r["target"])  # noqa: E731
    assert len({key(r) for r in train}) == len(train)
    assert not {key(r) for r in train} & {key(r) for r in test}
    assert [r["query_id"] for r in test[:2]] == ["test-000000", "test-000001"]


def test_too_many_rows_fails_loudly():
    with pytest.raises(ValueError, match="distinct problems"):
        make_data.make_rows(500, seed=1, max_number=3, max_target=9)


def test_cli_writes_loadable_jsonl(tmp_path):
    out = tmp_path / "data"
    args = [sys.executable, str(EXAMPLE / "make_data.py"), "--out-dir", str(out), "--n-train", "50", "--n-test", "10"]
    subprocess.run(args, check=True, capture_output=True, timeout=60)
    first = (out / "train.jsonl").read_bytes()
    subprocess.run(args, check=True, capture_output=True, timeout=60)
    assert (out / "train.jsonl").read_bytes() == first  # byte-identical reruns
    train, test = load_math_jsonl(str(out / "train.jsonl")), load_math_jsonl(str(out / "test.jsonl"))
    assert len(train) == 50 and len(test) == 10
    row = json.loads(first.splitlines()[0])
    assert isinstance(row["numbers"], list) and isinstance(row["target"], int)
    extra = {k: v for k, v in train[0].items() if k not in ("prompt", "answer")}
    assert reward(prompt=train[0]["prompt"], completion=train[0]["answer"], answer=train[0]["answer"], **extra) == 1.0
