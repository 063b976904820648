"""Synthetic arithmetic data: determinism, disjoint splits, and the JSONL loader."""

from __future__ import annotations

import json

import pytest

from realrl.impl.math_data import (
    MathDataRecipe,
    generate_math_records,
    load_math_jsonl,
    write_math_dataset,
)


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_same_seed_writes_identical_files(tmp_path):
    recipe = MathDataRecipe(seed=7, n_train=300, n_test=50)
    a = write_math_dataset(str(tmp_path / "a"), recipe)
    b = write_math_dataset(str(tmp_path / "b"), recipe)
    for path_a, path_b in zip(a, b):
        assert _read_bytes(path_a) == _read_bytes(path_b)


def test_different_seed_writes_different_files(tmp_path):
    a_train, a_test = write_math_dataset(str(tmp_path / "a"), MathDataRecipe(seed=7, n_train=300, n_test=50))
    b_train, b_test = write_math_dataset(str(tmp_path / "b"), MathDataRecipe(seed=8, n_train=300, n_test=50))
    assert _read_bytes(a_train) != _read_bytes(b_train)
    assert _read_bytes(a_test) != _read_bytes(b_test)


def test_records_are_correct_arithmetic_and_splits_disjoint():
    recipe = MathDataRecipe(seed=3, n_train=500, n_test=100, operators="+-*")
    train, test = generate_math_records(recipe)
    assert len(train) == 500 and len(test) == 100
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}
    assert len({r["query_id"] for r in train + test}) == 600
    ops_seen = set()
    for r in train + test:
        assert r["task"] == "math"
        assert r["prompt"].startswith("Q: ") and r["prompt"].endswith("=?\nA:")
        expression = r["prompt"][len("Q: ") : -len("=?\nA:")]
        ops_seen.update(op for op in "+-*" if op in expression)
        assert eval(expression) == int(r["answer"])  # noqa: S307 - our own digits and + - *
        assert int(r["answer"]) >= 0  # allow_negative=False
    assert ops_seen == {"+", "-", "*"}


def test_recipe_rejects_bad_settings_and_too_few_problems():
    with pytest.raises(ValueError, match="operators"):
        MathDataRecipe(operators="+^")
    with pytest.raises(ValueError, match="digits"):
        MathDataRecipe(min_digits=3, max_digits=2)
    # 1-digit addition has only 100 distinct prompts.
    with pytest.raises(ValueError, match="distinct problems"):
        generate_math_records(MathDataRecipe(n_train=200, n_test=10, max_digits=1, operators="+"))


def test_loader_roundtrip_and_solutions(tmp_path):
    train_path, _ = write_math_dataset(str(tmp_path), MathDataRecipe(seed=1, n_train=20, n_test=5))
    records = load_math_jsonl(train_path)
    assert len(records) == 20
    assert all(r["solutions"] == [r["answer"]] for r in records)

    path = tmp_path / "gsm.jsonl"
    lines = [
        {"query_id": 17, "prompt": "How many?", "solutions": ["She has 3+4 = 7 apples. #### 7", "7"]},
        {"query_id": "b", "prompt": "Q: 1+1=?\nA:", "answer": 2, "task": "math"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")  # trailing blank line is fine
    loaded = load_math_jsonl(str(path))
    assert [r["query_id"] for r in loaded] == ["17", "b"]
    assert loaded[0]["answer"] == "She has 3+4 = 7 apples. #### 7"
    assert loaded[0]["solutions"] == ["She has 3+4 = 7 apples. #### 7", "7"]
    assert loaded[0]["task"] == "math"
    assert loaded[1]["answer"] == "2" and loaded[1]["solutions"] == ["2"]


@pytest.mark.parametrize(
    "bad_line, message",
    [
        ('{"query_id": "x", "prompt": "p", "answer": "1"', "invalid JSON"),
        ('["not", "an", "object"]', "expected a JSON object"),
        ('{"prompt": "p", "answer": "1"}', "missing field 'query_id'"),
        ('{"query_id": "x", "answer": "1"}', "missing field 'prompt'"),
        ('{"query_id": "x", "prompt": "p"}', "missing field 'answer'"),
        ('{"query_id": "x", "prompt": "p", "solutions": []}', "solutions"),
    ],
)
def test_loader_error_names_file_and_line(tmp_path, bad_line, message):
    path = tmp_path / "data.jsonl"
    good = json.dumps({"query_id": "ok", "prompt": "Q: 1+2=?\nA:", "answer": "3"})
    path.write_text(f"{good}\n\n{good}\n{bad_line}\n{good}\n")  # bad line is line 4
    with pytest.raises(ValueError, match=message) as excinfo:
        load_math_jsonl(str(path))
    assert f"{path}:4:" in str(excinfo.value)
