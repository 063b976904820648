"""Write train/test JSONL for the reverse-string plugin.

Each line is a record in realrl's prompt format:

    {"query_id": "train-000003", "prompt": "Reverse: cab\\nA:", "answer": "bac", "task": "reverse_string"}

Strings are drawn from a small alphabet with few characters so a tiny
character-level model can learn the task; test strings never appear in train.
The same arguments always write the same files.

    python examples/plugins/reverse_string/make_data.py --out-dir /tmp/reverse_data
"""

from __future__ import annotations

import argparse
import json
import os
import random

PROMPT_TEMPLATE = "Reverse: {s}\nA:"


def make_records(n_train: int, n_test: int, min_len: int, max_len: int, alphabet: str, seed: int) -> tuple[list, list]:
    n_possible = sum(len(alphabet) ** k for k in range(min_len, max_len + 1))
    if n_train + n_test > n_possible:
        raise ValueError(f"only {n_possible} distinct strings for {n_train + n_test} records; widen the lengths")
    rng = random.Random(seed)
    strings: list[str] = []
    seen: set[str] = set()
    while len(strings) < n_train + n_test:
        s = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
        if s not in seen:
            seen.add(s)
            strings.append(s)

    def records(split: str, items: list[str]) -> list[dict]:
        return [
            {
                "query_id": f"{split}-{i:06d}",
                "prompt": PROMPT_TEMPLATE.format(s=s),
                "answer": s[::-1],
                "task": "reverse_string",
            }
            for i, s in enumerate(items)
        ]

    return records("train", strings[n_test:]), records("test", strings[:n_test])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=100)
    parser.add_argument("--min-len", type=int, default=3)
    parser.add_argument("--max-len", type=int, default=5)
    parser.add_argument("--alphabet", default="abcdefgh")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    if not 1 <= args.min_len <= args.max_len:
        parser.error("need 1 <= --min-len <= --max-len")

    train, test = make_records(args.n_train, args.n_test, args.min_len, args.max_len, args.alphabet, args.seed)
    os.makedirs(args.out_dir, exist_ok=True)
    for name, records in (("train.jsonl", train), ("test.jsonl", test)):
        with open(os.path.join(args.out_dir, name), "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record) + "\n")
    print(f"wrote {len(train)} train / {len(test)} test records to {args.out_dir}")


if __name__ == "__main__":
    main()
