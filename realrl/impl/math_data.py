"""Synthetic arithmetic tasks and the math JSONL format.

The default realrl run trains on small arithmetic problems generated here, so it
needs no download. Every record follows the math task format that real data sets
(e.g. GSM8K converted to JSONL) use as well, one JSON object per line:

    {"query_id": "train-000017", "prompt": "Q: 23+58=?\\nA:", "answer": "81", "task": "math"}

`load_math_jsonl` reads that format back. It also accepts `"solutions": [str, ...]`
in place of `"answer"` (the first solution becomes `answer`, all of them are kept
under `solutions`), and reports a bad line with the file name and line number.

Problems are drawn from a `MathDataRecipe` (operand digits, operators, sizes,
seed), deterministically: the same recipe always writes byte-identical files.
Train and test prompts never overlap.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from typing import Any

from realrl.base.logging import getLogger

logger = getLogger(__name__)

PROMPT_TEMPLATE = "Q: {a}{op}{b}=?\nA:"
SUPPORTED_OPERATORS = "+-*"


@dataclass(frozen=True)
class MathDataRecipe:
    """How to draw the synthetic arithmetic problems.

    Each operand's digit count is drawn uniformly from `min_digits` to
    `max_digits`, then the operand uniformly among numbers of that many digits
    (1 digit means 0-9). For `*` the second operand is capped
    at `mul_max_digits` digits so products stay short. With
    `allow_negative=False` subtraction is written larger-minus-smaller.
    """

    seed: int = 1
    n_train: int = 4000
    n_test: int = 500
    min_digits: int = 1
    max_digits: int = 2
    operators: str = "+-"
    mul_max_digits: int = 1
    allow_negative: bool = False

    def __post_init__(self) -> None:
        if not self.operators or any(op not in SUPPORTED_OPERATORS for op in self.operators):
            raise ValueError(f"operators must be a non-empty subset of {SUPPORTED_OPERATORS!r}, got {self.operators!r}")
        if not 1 <= self.min_digits <= self.max_digits:
            raise ValueError(f"need 1 <= min_digits <= max_digits, got {self.min_digits}, {self.max_digits}")
        if self.mul_max_digits < 1:
            raise ValueError("mul_max_digits must be >= 1")
        if self.n_train < 1 or self.n_test < 1:
            raise ValueError("n_train and n_test must be >= 1")


def _random_operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    # Digit count first, uniformly, so short operands are as common as long
    # ones: a mix of easy and hard problems (1 digit means 0-9).
    digits = rng.randint(min_digits, max_digits)
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


def _draw_problem(rng: random.Random, recipe: MathDataRecipe) -> tuple[str, str]:
    op = rng.choice(recipe.operators)
    a = _random_operand(rng, recipe.min_digits, recipe.max_digits)
    if op == "*":
        b = _random_operand(rng, 1, min(recipe.mul_max_digits, recipe.max_digits))
        result = a * b
    else:
        b = _random_operand(rng, recipe.min_digits, recipe.max_digits)
        if op == "-" and not recipe.allow_negative and b > a:
            a, b = b, a
        result = a + b if op == "+" else a - b
    return PROMPT_TEMPLATE.format(a=a, op=op, b=b), str(result)


def generate_math_records(recipe: MathDataRecipe) -> tuple[list[dict], list[dict]]:
    """Draw distinct problems: the test split first, then a disjoint train split."""
    rng = random.Random(recipe.seed)
    needed = recipe.n_test + recipe.n_train
    seen: set[str] = set()
    problems: list[tuple[str, str]] = []
    # Bounded number of draws so a recipe with too few distinct problems fails
    # loudly instead of looping forever.
    for _ in range(needed * 50):
        prompt, answer = _draw_problem(rng, recipe)
        if prompt in seen:
            continue
        seen.add(prompt)
        problems.append((prompt, answer))
        if len(problems) == needed:
            break
    else:
        raise ValueError(
            f"recipe {recipe} has fewer than {needed} distinct problems "
            f"(found {len(problems)}); lower n_train/n_test or widen the digits/operators"
        )

    def to_records(split: str, items: list[tuple[str, str]]) -> list[dict]:
        return [
            {"query_id": f"{split}-{i:06d}", "prompt": prompt, "answer": answer, "task": "math"}
            for i, (prompt, answer) in enumerate(items)
        ]

    test = to_records("test", problems[: recipe.n_test])
    train = to_records("train", problems[recipe.n_test :])
    return train, test


def write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_math_dataset(out_dir: str, recipe: MathDataRecipe) -> tuple[str, str]:
    """Write `train.jsonl` and `test.jsonl` into `out_dir`; returns their paths."""
    os.makedirs(out_dir, exist_ok=True)
    train, test = generate_math_records(recipe)
    train_path = os.path.join(out_dir, "train.jsonl")
    test_path = os.path.join(out_dir, "test.jsonl")
    write_jsonl(train_path, train)
    write_jsonl(test_path, test)
    logger.info("wrote %d train / %d test arithmetic problems to %s", len(train), len(test), out_dir)
    return train_path, test_path


def _bad_line(path: str, line_no: int, why: str) -> ValueError:
    return ValueError(f"{path}:{line_no}: {why}")


def read_json_lines(path: str) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) of each non-blank line of a JSON-lines file;
    ValueError naming `path:line` for a line that is not a JSON object."""
    out = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise _bad_line(path, line_no, f"invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(obj, dict):
                raise _bad_line(path, line_no, f"expected a JSON object, got {type(obj).__name__}")
            out.append((line_no, obj))
    return out


def load_math_jsonl(path: str) -> list[dict[str, Any]]:
    """Load math records; each has query_id, prompt, answer, solutions, task.

    `answer` may be given directly or as the first entry of `solutions`.
    Blank lines are skipped. Raises ValueError naming `path:line` on a line that
    is not a JSON object or lacks a required field.
    """
    records: list[dict[str, Any]] = []
    for line_no, obj in read_json_lines(path):
        for key in ("query_id", "prompt"):
            if key not in obj:
                raise _bad_line(path, line_no, f"missing field {key!r}")
        if not isinstance(obj["prompt"], str):
            raise _bad_line(path, line_no, "field 'prompt' must be a string")

        if "answer" in obj:
            solutions = [str(obj["answer"])]
        elif "solutions" in obj:
            raw = obj["solutions"]
            if not isinstance(raw, list) or not raw:
                raise _bad_line(path, line_no, "field 'solutions' must be a non-empty list of strings")
            solutions = [str(s) for s in raw]
        else:
            raise _bad_line(path, line_no, "missing field 'answer' (or 'solutions')")

        record = dict(obj)
        record["query_id"] = str(obj["query_id"])
        record["answer"] = solutions[0]
        record["solutions"] = solutions
        record.setdefault("task", "math")
        records.append(record)
    return records


def dataset_row_fields(record: dict[str, Any]) -> dict[str, Any]:
    """A loaded record's own fields beyond query_id, prompt, answer,
    solutions and task: what a reward function gets as keyword arguments."""
    return {k: v for k, v in record.items() if k not in ("query_id", "prompt", "answer", "solutions", "task")}
