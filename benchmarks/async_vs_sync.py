"""Asynchronous vs synchronous PPO on the same run, in one process.

    python benchmarks/async_vs_sync.py [--quick] [--json PATH] [override ...]

Runs the default training twice with the same seed and step budget:
  async: η = rollout.max_head_offpolicyness = 4, decoupled PPO loss (the default);
  sync:  η = 0 and the decoupled loss off — synchronous PPO: generation of
         batch k+1 waits for the weights of step k.
Prints wall time, train steps per minute, reward and accuracy per step, and
where the time goes; `--json` writes them with a top-level "ratio" = async
steps/min over sync steps/min. Extra arguments are Hydra overrides applied to
both runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from realrl.experiment.build import resolve_model_and_data  # noqa: E402
from realrl.experiment.config import load_config  # noqa: E402
from realrl.experiment.run import run_experiment  # noqa: E402

MODES = {
    "async": ["rollout.max_head_offpolicyness=4", "ppo.use_decoupled_loss=true"],
    "sync": ["rollout.max_head_offpolicyness=0", "ppo.use_decoupled_loss=false"],
}


def overrides_for(mode: str, steps: int, fileroot: str, extra: list[str]) -> list[str]:
    return [
        "experiment_name=async-vs-sync",
        f"trial_name={mode}",
        f"fileroot={fileroot}",
        f"total_train_steps={steps}",
        "eval.every_n_steps=0",
        *MODES[mode],
        *extra,
    ]


def run(mode: str, steps: int, fileroot: str, extra: list[str]) -> dict:
    cfg = load_config(overrides_for(mode, steps, fileroot, extra))
    t0 = time.monotonic()
    code, summary_path = run_experiment(cfg)
    wall = time.monotonic() - t0
    if code != 0:
        raise SystemExit(f"{mode} run failed with exit code {code}")
    with open(summary_path) as f:
        summary = json.load(f)
    with open(summary["stats_path"]) as f:
        steps_stats = [s for s in map(json.loads, f) if "train/actor_loss" in s]
    step_seconds = sum(s["time/step_s"] for s in steps_stats)
    mean = lambda key: sum(s.get(key, 0.0) for s in steps_stats) / max(len(steps_stats), 1)  # noqa: E731
    return {
        "wall_time_s": wall,
        "train_loop_s": step_seconds,
        "steps": len(steps_stats),
        "steps_per_min": 60.0 * len(steps_stats) / step_seconds,
        "seconds_per_step": {
            "fetch (waiting for rollouts)": mean("time/fetch_s"),
            "inference": mean("time/inference_s"),
            "train + publish": mean("time/train_s"),
        },
        "reward_per_step": [s.get("rollout/reward/mean") for s in steps_stats],
        "accuracy_per_step": [s.get("rollout/accuracy") for s in steps_stats],
        "max_staleness_trained": summary["max_staleness_trained"],
        "initial_eval_accuracy": summary["initial_eval_accuracy"],
        "final_eval_accuracy": summary["final_eval_accuracy"],
        "trajectories": summary["trajectories"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (CI-sized)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--fileroot", default=os.path.join(_REPO, "runs", "bench"))
    args, overrides = parser.parse_known_args()
    steps = args.steps or (8 if args.quick else 30)
    # Build (or find) the tiny kit first, so that neither mode's wall time includes it.
    resolve_model_and_data(load_config(overrides_for("sync", steps, args.fileroot, overrides)), args.fileroot)
    results = {mode: run(mode, steps, args.fileroot, overrides) for mode in ("sync", "async")}
    ratio = results["async"]["steps_per_min"] / results["sync"]["steps_per_min"]

    print(f"\nasync (η=4, decoupled) vs sync (η=0) — {steps} steps each, same seed")
    print(
        f"{'mode':<6} {'wall s':>8} {'steps/min':>10} {'fetch s':>8} {'inf s':>7} {'train s':>8} "
        f"{'eval acc':>15} {'max stale':>9}"
    )
    for mode, r in results.items():
        sp = r["seconds_per_step"]
        print(
            f"{mode:<6} {r['wall_time_s']:>8.1f} {r['steps_per_min']:>10.1f} "
            f"{sp['fetch (waiting for rollouts)']:>8.2f} "
            f"{sp['inference']:>7.2f} {sp['train + publish']:>8.2f} "
            f"{r['initial_eval_accuracy']:>6.3f}->{r['final_eval_accuracy']:<6.3f} {r['max_staleness_trained']:>9}"
        )
    print(f"speedup (async steps/min / sync steps/min): {ratio:.2f}x")
    for mode, r in results.items():
        acc = ", ".join(f"{a:.2f}" for a in r["accuracy_per_step"] if a is not None)
        print(f"{mode} rollout accuracy per step: {acc}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"ratio": ratio, "steps": steps, **results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
