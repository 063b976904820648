"""What security costs a training run: the default run with `security.enabled=true` vs `false`.

    python benchmarks/security_cost.py [--quick] [--steps N] [--rounds R] [--json PATH] [override ...]

Runs the default training (the tiny kit unless overridden) R times in each
mode, alternating off/on so that a machine whose load drifts affects both
alike, each run with the same seed and step budget. Steps per minute are
counted over the train loop (the sum of the steps' `time/step_s`, as
`benchmarks/async_vs_sync.py` counts them), so start-up and evaluation stay
out. Prints a table with the median of each mode and on/off ("ratio"; the
target is >= 0.95); `--json` writes them with a top-level "ratio". Extra
arguments are Hydra overrides applied to every run.
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

from realrl.experiment.build import resolve_model_and_data  # noqa: E402
from realrl.experiment.config import load_config  # noqa: E402
from realrl.experiment.run import run_experiment  # noqa: E402

MODES = {"off": "security.enabled=false", "on": "security.enabled=true"}


def overrides_for(mode: str, index: int, steps: int, fileroot: str, extra: list[str]) -> list[str]:
    return [
        "experiment_name=security-cost",
        f"trial_name={mode}{index}",
        f"fileroot={fileroot}",
        f"total_train_steps={steps}",
        "eval.every_n_steps=0",
        "eval.max_prompts=16",
        "saver.save_final_model=false",
        MODES[mode],
        *extra,
    ]


def run(mode: str, index: int, steps: int, fileroot: str, extra: list[str]) -> dict:
    cfg = load_config(overrides_for(mode, index, steps, fileroot, extra))
    t0 = time.monotonic()
    code, summary_path = run_experiment(cfg)
    wall = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"security {mode} run {index} failed with exit code {code}")
    with open(summary_path) as f:
        summary = json.load(f)
    with open(summary["stats_path"]) as f:
        steps_stats = [s for s in map(json.loads, f) if "train/actor_loss" in s]
    loop_s = sum(s["time/step_s"] for s in steps_stats)
    return {"wall_time_s": wall, "train_loop_s": loop_s, "steps_per_min": 60.0 * len(steps_stats) / loop_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (CI-sized)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--fileroot", default=os.path.join(_REPO, "runs", "bench"))
    args, overrides = parser.parse_known_args()
    steps = args.steps or (6 if args.quick else 20)
    rounds = args.rounds or (1 if args.quick else 2)
    # Build (or find) the tiny kit first, so that no run's time includes it.
    resolve_model_and_data(load_config(overrides_for("off", 0, steps, args.fileroot, overrides)), args.fileroot)
    runs: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for index in range(rounds):
        for mode in MODES:
            runs[mode].append(run(mode, index, steps, args.fileroot, overrides))
            print(f"... security {mode} run {index}: {runs[mode][-1]['steps_per_min']:.1f} steps/min", flush=True)
    median = {mode: statistics.median(r["steps_per_min"] for r in runs[mode]) for mode in MODES}
    ratio = median["on"] / median["off"]
    print(f"\nsecurity on vs off: {steps} steps per run, {rounds} runs per mode, same seed")
    print(f"{'mode':<5} {'steps/min (median)':>19} {'runs':>30}")
    for mode in MODES:
        each = ", ".join(f"{r['steps_per_min']:.1f}" for r in runs[mode])
        print(f"{mode:<5} {median[mode]:>19.1f} {each:>30}")
    print(f"ratio (on / off): {ratio:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ratio": ratio, "steps": steps, "rounds": rounds, "median": median, "runs": runs}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
