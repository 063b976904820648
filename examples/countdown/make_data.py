"""Write train/test JSONL for the Countdown reward-function example.

Each line is one problem in realrl's prompt format, plus the fields the reward
function reads (every extra field reaches it as a keyword argument):

    {"query_id": "train-000000", "prompt": "Use 3 5 7 to make 22.\\nA:", "answer": "3*5+7",
     "numbers": [3, 5, 7], "target": 22, "task": "countdown"}

A problem is made by drawing 3 numbers (4 with probability `four_fraction`)
from 1..max_number and folding them, in the order listed, with random operators
left to right: ((a op b) op c) op d, every intermediate value a positive
integer (computed exactly with fractions). The fold's value is the target
(kept if it is in 1..max_target and not one of the numbers) and the fold,
written with the fewest parentheses, is `answer`: the demonstration the tiny
model's warm start learns from. So every target is reachable, and the
demonstrations share one simple shape that a tiny character-level model can
pick up; the reward accepts any valid expression. A problem is identified by
(sorted numbers, target): no two rows share one, so train and test are disjoint.
The same arguments always write the same files.

    python examples/countdown/make_data.py --out-dir /tmp/countdown_data
"""

from __future__ import annotations

import argparse
import json
import os
import random
from fractions import Fraction

PROMPT_TEMPLATE = "Use {numbers} to make {target}.\nA:"
OPERATORS = "+-*/"
OPERATOR_WEIGHTS = (4, 3, 3, 1)  # division is rare: it seldom comes out exact


def _fold(rng: random.Random, numbers: list[int]) -> tuple[str, int] | None:
    """(expression, value) of a random left-to-right fold of `numbers`, or None
    if an intermediate value is not a positive integer."""
    text, value, additive = str(numbers[0]), Fraction(numbers[0]), False
    for n in numbers[1:]:
        op = rng.choices(OPERATORS, OPERATOR_WEIGHTS)[0]
        value = {"+": value + n, "-": value - n, "*": value * n, "/": value / n}[op]
        if value <= 0 or value.denominator != 1:
            return None
        if op in "*/" and additive:  # (a+b)*c needs its parentheses; a*b+c does not
            text = f"({text})"
        text += f"{op}{n}"
        additive = op in "+-"
    return text, int(value)


def make_rows(
    n: int,
    seed: int,
    *,
    four_fraction: float = 0.2,
    max_number: int = 12,
    max_target: int = 99,
    prefix: str = "row",
) -> list[dict]:
    """`n` distinct problems (see the module docstring), deterministic per arguments."""
    rng = random.Random(seed)
    rows: list[dict] = []
    seen: set[tuple] = set()
    for _ in range(n):
        size = 4 if rng.random() < four_fraction else 3  # fixed per row, so every split gets the same mix
        for _ in range(10_000):  # bounded: too narrow a range fails instead of looping
            numbers = [rng.randint(1, max_number) for _ in range(size)]
            folded = _fold(rng, numbers)
            if folded is None:
                continue
            answer, target = folded
            key = (tuple(sorted(numbers)), target)
            if 1 <= target <= max_target and target not in numbers and key not in seen:
                break
        else:
            break
        seen.add(key)
        prompt = PROMPT_TEMPLATE.format(numbers=" ".join(map(str, numbers)), target=target)
        rows.append(
            {
                "query_id": f"{prefix}-{len(rows):06d}",
                "prompt": prompt,
                "answer": answer,
                "numbers": numbers,
                "target": target,
                "task": "countdown",
            }
        )
    if len(rows) < n:
        raise ValueError(
            f"found only {len(rows)} distinct problems of {n}; lower n or four_fraction, or widen max_number"
        )
    return rows


def make_splits(n_train: int, n_test: int, seed: int, **kwargs) -> tuple[list[dict], list[dict]]:
    """(train, test): one stream of distinct problems, test first, so they never overlap."""
    rows = make_rows(n_test + n_train, seed, **kwargs)

    def relabel(split: str, items: list[dict]) -> list[dict]:
        return [{**r, "query_id": f"{split}-{i:06d}"} for i, r in enumerate(items)]

    return relabel("train", rows[n_test:]), relabel("test", rows[:n_test])


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--n-train", type=int, default=3000)
    parser.add_argument("--n-test", type=int, default=200)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--four-fraction", type=float, default=0.2, help="share of 4-number problems")
    parser.add_argument("--max-number", type=int, default=12)
    parser.add_argument("--max-target", type=int, default=99)
    args = parser.parse_args(argv)
    if args.n_train < 1 or args.n_test < 1:
        parser.error("--n-train and --n-test must be >= 1")
    train, test = make_splits(
        args.n_train,
        args.n_test,
        args.seed,
        four_fraction=args.four_fraction,
        max_number=args.max_number,
        max_target=args.max_target,
    )
    os.makedirs(args.out_dir, exist_ok=True)
    for name, rows in (("train", train), ("test", test)):
        write_jsonl(os.path.join(args.out_dir, f"{name}.jsonl"), rows)
    print(f"wrote {len(train)} train / {len(test)} test problems to {args.out_dir}")


if __name__ == "__main__":
    main()
