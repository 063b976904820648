"""Warm-start rows that show the tiny kit the calculator (docs/custom_tasks.md,
"Warm-starting a multi-turn task"), and the RL data.

The tiny kit's warm start teaches a prompt -> answer turn. For the tool agent
a later turn starts from a context holding the earlier tool call and its
result, so that context is written out as a prompt of its own, exactly as the
kit's chat template renders the agent's messages (one character per token;
`<eos>` is the EOS that ends an assistant turn):

    {"prompt": "Q: 12+30=?\\nA:", "answer": "42"}                       # answer directly
    {"prompt": "Q: 12+30=?\\nA:", "answer": "<tool_call>{...}</tool_call>"}  # or call calc
    {"prompt": "Q: 12+30=?\\nA:<tool_call>{...}</tool_call><eos><tool_response>42</tool_response>",
     "answer": "42"}                                                      # then read its result

A `--tool-fraction` of the problems get the tool rows, the rest the direct
one: the warm-started model calls the tool on some prompts and answers from
its own (weak) arithmetic on the others, and RL has something to prefer.

    python examples/tool_agent/make_warm_start.py --out-dir runs/tool_agent

writes `warm.jsonl` / `warm_test.jsonl` (the warm start's rows) and
`train.jsonl` / `test.jsonl` (the RL prompts: the built-in arithmetic), then
builds the tiny kit warm-started on the rows (`--warm-start-steps`, cached
under `<out-dir>/cache`) and prints its model directory, for `model.path`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, _REPO)

from realrl.impl.math_data import MathDataRecipe, generate_math_records, write_jsonl  # noqa: E402

EOS = "<eos>"  # the kit tokenizer reads it in a prompt as its EOS token


def tool_call(expression: str) -> str:
    """An assistant turn calling calc, as the kit's chat template renders it."""
    arguments = json.dumps({"expression": expression})
    return f'<tool_call>{{"name": "calc", "arguments": {arguments}}}</tool_call>'


def expression(prompt: str) -> str:
    """`12+30` of `Q: 12+30=?\\nA:`."""
    return prompt.removeprefix("Q: ").split("=?", 1)[0]


def warm_rows(records: list[dict], tool_fraction: float, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for r in records:
        prompt, answer = r["prompt"], str(r["answer"])
        if rng.random() < tool_fraction:
            call = tool_call(expression(prompt))
            after = f"{prompt}{call}{EOS}<tool_response>{answer}</tool_response>"
            rows.append({"query_id": f"{r['query_id']}-call", "prompt": prompt, "answer": call})
            rows.append({"query_id": f"{r['query_id']}-read", "prompt": after, "answer": answer})
        else:
            rows.append({"query_id": r["query_id"], "prompt": prompt, "answer": answer})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--tool-fraction", type=float, default=0.25)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--warm-start-steps", type=int, default=1000)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    train, test = generate_math_records(MathDataRecipe(seed=args.seed))
    write_jsonl(os.path.join(args.out_dir, "train.jsonl"), train)
    write_jsonl(os.path.join(args.out_dir, "test.jsonl"), test)
    write_jsonl(os.path.join(args.out_dir, "warm.jsonl"), warm_rows(train, args.tool_fraction, args.seed))
    write_jsonl(os.path.join(args.out_dir, "warm_test.jsonl"), test)

    from realrl.impl.tiny_model import build_tiny_kit, dataset_recipe

    warm = (os.path.join(args.out_dir, "warm.jsonl"), os.path.join(args.out_dir, "warm_test.jsonl"))
    recipe = dataset_recipe(*warm, seed=args.seed)
    recipe = dataclasses.replace(recipe, warm_start=dataclasses.replace(recipe.warm_start, steps=args.warm_start_steps))
    kit = build_tiny_kit(os.path.join(args.out_dir, "cache"), recipe, warm)
    print(kit.model_path)


if __name__ == "__main__":
    main()
