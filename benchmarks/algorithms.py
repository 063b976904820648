"""Every algorithm preset on the same tasks, seeds and step budget (docs/algorithms.md).

    python benchmarks/algorithms.py [--quick] [--presets grpo,dapo,...] [--tasks arithmetic,countdown]
                                    [--seeds 1,2] [--steps 40] [--minibatches 4] [--json PATH] [--markdown]
                                    [override ...]
    python benchmarks/algorithms.py --from-json RUN1.json,RUN2.json

For each task x preset x seed, one full realrl trial (`realrl train
algorithm=<preset> seed=<seed> total_train_steps=<steps>`, greedy evaluation
at the start, half way and the end) in its own trial directory under
`--fileroot`:

- `arithmetic`: the default tiny task (the tiny kit, warm-started);
- `countdown`: `examples/countdown` (its reward function and data, written
  once under the fileroot; 16 new tokens, 250 warm-start steps, as its README
  suggests).

Every trial takes `--minibatches` optimizer steps per train step (default 4,
`ppo.ppo_n_minibatches`): with one, the policy equals the proximal policy
throughout the step's only update, every ratio is 1, no clip ever acts, and
`ppo` and `cispo` give the same update; from the second minibatch on the
policy losses differ. The tiny kit is built once per task (its seed is `tiny_kit.seed`, not the RL
seed) and shared, so every preset starts from the same weights. Reported per
trial: the greedy eval accuracy at the start, half way and the end, the
trained answers' accuracy over the last quarter of the steps, the step's
behaviour-weight ESS (min over steps), the clip fractions (mean over steps),
the summed step time and the wall time of the trial. `--json` writes every
trial, with a top-level "ratio": the best preset's final eval accuracy over
GRPO's, on the first task (means over seeds); `--markdown` prints the table
(means over seeds, and the seeds' range of the end accuracy) that
docs/algorithms.md shows; `--from-json` prints it for the trials of earlier
runs together (e.g. more seeds run later). `--quick`: a smoke run
(arithmetic, one seed, 4 steps). Accuracies do not depend on the machine's
load; times do. Extra arguments are Hydra overrides for every trial.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from realrl.experiment.config import algorithm_presets, load_config  # noqa: E402
from realrl.experiment.run import run_experiment  # noqa: E402

TASKS = ("arithmetic", "countdown")


def task_overrides(task: str, fileroot: str) -> list[str]:
    if task == "arithmetic":
        return []
    sys.path.insert(0, os.path.join(_REPO, "examples", "countdown"))
    from make_data import make_splits, write_jsonl

    data = os.path.join(fileroot, "countdown_data")
    train, test = os.path.join(data, "train.jsonl"), os.path.join(data, "test.jsonl")
    if not os.path.exists(test):
        os.makedirs(data, exist_ok=True)
        rows_train, rows_test = make_splits(3000, 200, seed=1)
        write_jsonl(train, rows_train)
        write_jsonl(test, rows_test)
    return [
        f"rollout.reward_fn={os.path.join(_REPO, 'examples', 'countdown', 'reward.py')}:reward",
        f"dataset.train_path={train}",
        f"dataset.test_path={test}",
        "rollout.gconfig.max_new_tokens=16",
        "tiny_kit.warm_start_steps=250",
    ]


def run_trial(task: str, preset: str, seed: int, steps: int, args, overrides: list[str]) -> dict:
    eval_every = max(steps // 2, 1)
    cfg = load_config(
        [
            f"algorithm={preset}",
            f"seed={seed}",
            f"total_train_steps={steps}",
            f"eval.every_n_steps={eval_every}",
            f"eval.max_prompts={args.eval_prompts}",
            f"ppo.ppo_n_minibatches={args.minibatches}",
            "experiment_name=algorithms",
            f"trial_name={task}-{preset}-s{seed}",
            f"fileroot={args.fileroot}",
            "console.every_n_steps=1000",
            *task_overrides(task, args.fileroot),
            *overrides,
        ]
    )
    t0 = time.monotonic()
    code, summary_path = run_experiment(cfg)
    wall = time.monotonic() - t0
    result = {"task": task, "preset": preset, "seed": seed, "steps": steps, "exit_code": code, "wall_s": wall}
    if code != 0:
        return result
    with open(summary_path) as f:
        summary = json.load(f)
    with open(summary["stats_path"]) as f:
        records = [r for r in map(json.loads, f) if "train/actor_loss" in r]

    def mean(key: str, recs=records) -> float | None:
        values = [r[key] for r in recs if isinstance(r.get(key), (int, float))]
        return statistics.fmean(values) if values else None

    last_quarter = records[-max(len(records) // 4, 1) :]
    evals = {e["step"]: e["accuracy"] for e in summary["eval_history"]}
    ess = [r["train/behav_ess"] for r in records if "train/behav_ess" in r]
    result.update(
        eval_accuracy={str(k): v for k, v in sorted(evals.items())},
        rollout_accuracy_last_quarter=mean("rollout/accuracy", last_quarter),
        behav_ess_min=min(ess) if ess else None,
        clip_high_frac=mean("train/clip_high_frac"),
        clip_low_frac=mean("train/clip_low_frac"),
        behav_capped_frac=mean("train/behav_capped_frac"),
        entropy_last=records[-1].get("train/entropy") if records else None,
        rejected_groups=sum(r.get("rollout/rejected_groups", 0) for r in records),
        step_s_total=sum(r.get("time/step_s", 0.0) for r in records),
    )
    return result


def final_accuracy(results: list[dict], task: str, preset: str) -> float | None:
    """The mean over seeds of a preset's last greedy eval accuracy."""
    finals = [
        r["eval_accuracy"][max(r["eval_accuracy"], key=int)]
        for r in results
        if (r["task"], r["preset"]) == (task, preset) and r.get("eval_accuracy")
    ]
    return statistics.fmean(finals) if finals else None


def best_over_grpo(results: list[dict], task: str) -> float | None:
    """The best preset's final accuracy over GRPO's (None without both)."""
    grpo = final_accuracy(results, task, "grpo")
    others = [final_accuracy(results, task, p) for p in {r["preset"] for r in results} - {"grpo"}]
    others = [a for a in others if a is not None]
    return max(others) / grpo if grpo and others else None


def _fmt(x, digits: int = 3) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown(results: list[dict]) -> str:
    """One row per task x preset, means over seeds."""
    lines = [
        "| task | preset | greedy eval acc: start → half → end (seeds' range at the end) | rollout acc, last ¼ | "
        "ESS min | clip high / low | train s | seeds |",
        "|---|---|---|---|---|---|---|---|",
    ]
    keys = sorted({(r["task"], r["preset"]) for r in results}, key=lambda k: (TASKS.index(k[0]), k[1]))
    for task, preset in keys:
        runs = [r for r in results if (r["task"], r["preset"]) == (task, preset) and r["exit_code"] == 0]
        if not runs:
            lines.append(f"| {task} | {preset} | failed | | | | | |")
            continue

        def avg(values):
            values = [v for v in values if v is not None]
            return statistics.fmean(values) if values else None

        steps = sorted({int(s) for r in runs for s in r["eval_accuracy"]})
        picks = [steps[0], steps[len(steps) // 2], steps[-1]] if steps else []
        curve = " → ".join(_fmt(avg([r["eval_accuracy"].get(str(s)) for r in runs])) for s in picks)
        end = str(picks[-1]) if picks else None
        ends = [r["eval_accuracy"][end] for r in runs if end in r["eval_accuracy"]]
        if len(ends) > 1:  # how far apart the seeds ended: a difference inside it is not a result
            curve += f" ({min(ends):.3f}–{max(ends):.3f})"
        lines.append(
            f"| {task} | {preset} | {curve} | {_fmt(avg([r['rollout_accuracy_last_quarter'] for r in runs]))} | "
            f"{_fmt(min((r['behav_ess_min'] for r in runs if r['behav_ess_min'] is not None), default=None))} | "
            f"{_fmt(avg([r['clip_high_frac'] for r in runs]))} / {_fmt(avg([r['clip_low_frac'] for r in runs]))} | "
            f"{_fmt(avg([r['step_s_total'] for r in runs]), 0)} | {len(runs)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: arithmetic, seed 1, 4 steps")
    parser.add_argument("--presets", default=",".join(algorithm_presets()), help="comma-separated (default: all)")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--seeds", default="1,2")
    parser.add_argument("--steps", type=int, default=40, help="train steps per trial")
    parser.add_argument("--minibatches", type=int, default=4, help="ppo.ppo_n_minibatches of every trial")
    parser.add_argument("--eval-prompts", type=int, default=200, help="greedy eval on the first N test prompts")
    parser.add_argument("--fileroot", default=os.path.join(_REPO, "runs", "algorithms"))
    parser.add_argument("--json", default=None, help="write every trial's figures here")
    parser.add_argument("--markdown", action="store_true", help="print the table docs/algorithms.md shows")
    parser.add_argument(
        "--from-json",
        default=None,
        help="comma-separated JSON files of earlier runs: print their trials' table together, train nothing",
    )
    args, overrides = parser.parse_known_args()
    if args.from_json:
        results = []
        for path in args.from_json.split(","):
            with open(path) as f:
                results += json.load(f)["trials"]
        print(markdown(results))
        return 0
    if args.quick:
        args.tasks, args.seeds, args.steps = "arithmetic", "1", 4
    presets, tasks = args.presets.split(","), args.tasks.split(",")
    unknown = [p for p in presets if p not in algorithm_presets()] + [t for t in tasks if t not in TASKS]
    if unknown:
        parser.error(f"unknown presets/tasks {unknown}; presets: {algorithm_presets()}, tasks: {list(TASKS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    for task in tasks:
        for preset in presets:
            for seed in seeds:
                result = run_trial(task, preset, seed, args.steps, args, overrides)
                print(json.dumps(result), flush=True)
                results.append(result)
                if args.json:  # after every trial: a long comparison keeps what it measured
                    os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
                    out = {"ratio": best_over_grpo(results, tasks[0]), "steps": args.steps, "seeds": seeds}
                    with open(args.json, "w") as f:
                        json.dump({**out, "overrides": overrides, "trials": results}, f)
    if args.markdown:
        print(markdown(results))
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
