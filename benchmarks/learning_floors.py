"""Learning floors: the short seeded runs the suite trains, run over several seeds.

    python benchmarks/learning_floors.py [--runs default,lora,...] [--seeds 1,2,3,4,5]
                                         [--kit-cache DIR] [--fileroot DIR] [--json PATH] [--record]
    python benchmarks/learning_floors.py --markdown [--docs]

Each entry of `RUNS` is one configuration that a test of the suite trains
(tests/e2e/test_async_ppo.py, test_algorithms.py, test_lora.py and
tests/examples/test_tool_agent.py call `train` below with seed 1): a whole
realrl trial through the launcher on the tiny kit, greedy evaluation on the
whole held-out split (500 prompts) before the first step and after the last.
This script trains the same configurations with the given seeds, prints a
table of the initial and final accuracies, and with `--json` writes every
run. `--record` merges the measured runs into `benchmarks/learning_floors.json`,
the record the tests take their floors from (`floor(record, name)`);
`--markdown` prints the record's tables and `--docs` writes them into
docs/benchmarks.md (tests/benchmarks/test_learning_floors.py checks that the
docs and the README show the record as it is). `DOCUMENTED` runs are not the
suite's: the README's first command, whose figures the README quotes.

A floor is measured, not chosen: the lowest final accuracy of the recorded
seeds minus a margin, the seeds' range (highest minus lowest final) but at
least `MIN_MARGIN`. Why the range: with five seeds, a run ending a whole range
below the lowest of them is a ~3.5-sigma event if the finals are roughly
normal (the expected range of five is ~2.3 sigma, the lowest ~1.2 sigma below
the mean): such a run says the code learns worse, not that the seed was
unlucky. Why the minimum: a greedy accuracy on 500 prompts moves in steps of
0.002 and its binomial standard error near 0.5 is 0.022; a margin under
~2 standard errors would catch the evaluation's own graininess. Runs are
asynchronous, so a seed is not bit-reproducible (the machine's timing
decides staleness): the seeds' spread contains that too. Accuracies do not
depend on the machine's speed beyond that; measure on any machine, and the
record says when and under what load.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from realrl.base import faults  # noqa: E402
from realrl.experiment.config import algorithm_presets, load_config  # noqa: E402
from realrl.experiment.run import run_experiment  # noqa: E402

RECORD = os.path.join(_REPO, "benchmarks", "learning_floors.json")
MIN_MARGIN = 0.05
TOOL_AGENT = os.path.join(_REPO, "examples", "tool_agent", "agent.py")


@dataclasses.dataclass(frozen=True)
class FloorRun:
    """One configuration the suite trains; `overrides` on top of the defaults."""

    steps: int
    overrides: tuple[str, ...] = ()
    faults: str = ""  # REALRL_FAULTS for the trial (realrl/base/faults.py)
    what: str = ""

    def as_record(self) -> dict:
        # the repository path, not this checkout's: the record compares across clones
        overrides = [o.replace(_REPO + os.sep, "") for o in self.overrides]
        return {"steps": self.steps, "overrides": overrides, "faults": self.faults}


PRESET_STEPS = 30


def preset_keys(preset: str) -> str:
    """The text of a preset's file (realrl/configs/algorithm/<preset>.yaml)."""
    with open(os.path.join(_REPO, "realrl", "configs", "algorithm", f"{preset}.yaml")) as f:
        return f.read()


def _runs() -> dict[str, FloorRun]:
    runs = {
        # grpo, the default preset, with η = 2 (tests/e2e/test_async_ppo.py)
        "default": FloorRun(40, ("rollout.max_head_offpolicyness=2",), what="the default task (grpo), η 2"),
        "lora": FloorRun(
            16,
            (
                "model.lora.rank=8",
                "optimizer.lr=2e-3",
                "rollout.max_head_offpolicyness=0",
                "saver.save_final_model=true",
                "saver.checkpoint_every_n_steps=2",
                "recover=auto",
                "recover_retries=1",
            ),
            # the trainer is SIGKILLed in the step after its first checkpoint; the trial resumes
            faults="model_worker.step_after_checkpoint=kill",
            what="LoRA rank 8, η 0, trainer killed at step 3 and resumed",
        ),
        # at the default lr 3e-5 it went 0.182 -> 0.21 in 20 steps: too close to its start for a floor
        "tool-agent": FloorRun(
            30,
            (f"rollout.agent_fn={TOOL_AGENT}:run", "optimizer.lr=1e-4"),
            what="examples/tool_agent on the default kit, 2 turns, lr 1e-4",
        ),
    }
    for preset in algorithm_presets():
        if preset == "grpo":  # the default run is grpo's
            continue
        # Four optimizer steps per train step, as benchmarks/algorithms.py trains every preset (and
        # as dapo, gspo and cispo do anyway): with the presets' one, ppo ended 30 steps at 0.23 from
        # 0.178, too close to its start for a floor.
        minibatches = () if "ppo_n_minibatches" in preset_keys(preset) else ("ppo.ppo_n_minibatches=4",)
        runs[preset] = FloorRun(
            PRESET_STEPS,
            (f"algorithm={preset}", *minibatches),
            what=f"the `{preset}` preset{', 4 minibatches' if minibatches else ''}",
        )
    return runs


RUNS = _runs()
EXAMPLE = os.path.join(_REPO, "examples", "run_async_ppo.sh")


def example_recipe(path: str = EXAMPLE) -> tuple[str, ...]:
    """The overrides the README's first command puts on top of the defaults: its `recipe=(...)` line."""
    with open(path) as f:
        for line in f:
            if line.startswith("recipe=(") and line.rstrip().endswith(")"):
                return tuple(shlex.split(line.strip()[len("recipe=(") : -1]))
    raise ValueError(f"{path} has no recipe=(...) line")


# Runs whose figures the README and docs quote (no floor: too long for the suite).
DOCUMENTED = {
    "readme": FloorRun(
        200,
        ("eval.every_n_steps=50", *example_recipe()),
        what="the README's first command (examples/run_async_ppo.sh)",
    ),
    # the same run before the recipe decayed the learning rate (docs/benchmarks.md compares them)
    "readme-constant-lr": FloorRun(
        200, ("eval.every_n_steps=50",), what="the README's first command at the constant learning rate"
    ),
}


@contextlib.contextmanager
def _armed(spec: str):
    """The run's fault points armed for its trial (the launcher passes the environment on)."""
    if not spec:
        yield
        return
    saved = {k: os.environ.get(k) for k in (faults.FAULTS_ENV, faults.FAULTS_DIR_ENV)}
    with tempfile.TemporaryDirectory(prefix="realrl-faults-") as marks:
        os.environ[faults.FAULTS_ENV], os.environ[faults.FAULTS_DIR_ENV] = spec, marks
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def trial_name(name: str, seed: int) -> str:
    return f"{name}-s{seed}"


def train(name: str, seed: int, fileroot: str, kit_cache: str, timeout: float = 900) -> tuple[dict, list[dict]]:
    """Trains run `name` with `seed` (trial `<name>-s<seed>` under `fileroot`);
    returns its summary.json and its stats records. Raises if the trial failed."""
    run = RUNS[name] if name in RUNS else DOCUMENTED[name]
    cfg = load_config(
        [
            f"fileroot={fileroot}",
            f"trial_name={trial_name(name, seed)}",
            f"tiny_kit.cache_dir={kit_cache}",
            "heartbeat_ttl=3",
            f"seed={seed}",
            f"total_train_steps={run.steps}",
            "eval.every_n_steps=0",  # greedy evaluation before the first step and after the last
            "eval.max_prompts=0",  # the whole held-out split: 500 prompts
            "console.every_n_steps=1000",
            *run.overrides,
        ]
    )
    with _armed(run.faults):
        code, summary_path = run_experiment(cfg, timeout=timeout)
    if code == 130:  # Ctrl-C or SIGTERM stopped the trial: stop, do not go on to the next run
        raise KeyboardInterrupt
    if code != 0:
        raise RuntimeError(f"trial {trial_name(name, seed)} failed (exit {code}); logs in {fileroot}/logs")
    with open(summary_path) as f:
        summary = json.load(f)
    with open(summary["stats_path"]) as f:
        stats = [json.loads(line) for line in f]
    return summary, stats


def load_record(path: str = RECORD) -> dict:
    with open(path) as f:
        return json.load(f)


def finals(record: dict, name: str) -> list[float]:
    return [s["final"] for s in record["runs"][name]["seeds"].values()]


def margin(values: list[float]) -> float:
    return max(max(values) - min(values), MIN_MARGIN)


def floor(record: dict, name: str) -> float:
    """The floor of run `name`: its recorded seeds' lowest final accuracy minus the margin."""
    values = finals(record, name)
    return round(min(values) - margin(values), 3)


def check_recorded(record: dict, name: str) -> None:
    """The record was measured on this configuration (or the floor means nothing)."""
    measured = record["runs"][name]
    if {k: measured[k] for k in ("steps", "overrides", "faults")} != RUNS[name].as_record():
        raise AssertionError(
            f"the learning-floor record of {name!r} was measured on "
            f"{ {k: measured[k] for k in ('steps', 'overrides', 'faults')} }, the suite trains "
            f"{RUNS[name].as_record()}: re-measure (python benchmarks/learning_floors.py --runs {name} --record)"
        )


def assert_reaches_floor(summary: dict, name: str, seed: int = 1, record: dict | None = None) -> None:
    """A test's assertion: the run's final greedy accuracy reaches the recorded floor,
    from the recorded initial accuracy (the same kit)."""
    record = record or load_record()
    check_recorded(record, name)
    initial = record["runs"][name]["seeds"][str(seed)]["initial"]
    assert abs(summary["initial_eval_accuracy"] - initial) <= 0.01, (
        f"{name}: initial accuracy {summary['initial_eval_accuracy']} where the record's seed {seed} had {initial}: "
        "not the kit the floor was measured on; re-measure (benchmarks/learning_floors.py --record)"
    )
    assert summary["final_eval_accuracy"] >= floor(record, name), (
        f"{name}: final greedy accuracy {summary['final_eval_accuracy']} < floor {floor(record, name)} "
        f"(recorded seeds: {sorted(finals(record, name))}, benchmarks/learning_floors.json, docs/benchmarks.md)",
        summary["eval_history"],
    )


def readme_range(record: dict) -> str:
    """The README's figure: the documented default run's final accuracies, lowest to highest."""
    values = [r["final"] for r in record["documented"]["readme"]["runs"]]
    return f"{min(values):.3f}–{max(values):.3f}"


def markdown(record: dict) -> str:
    """The record's table (docs/benchmarks.md shows it verbatim)."""
    lines = [
        "| run | steps | initial | final, per seed | lowest | range | floor | floor - initial | wall s (mean) "
        "| measured |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, run in record["runs"].items():
        seeds = run["seeds"]
        values = [s["final"] for s in seeds.values()]
        initial = statistics.fmean(s["initial"] for s in seeds.values())
        f = floor(record, name)
        lines.append(
            f"| {name}: {run['what']} | {run['steps']} | {initial:.3f} | "
            + ", ".join(f"{seeds[k]['final']:.3f} ({k})" for k in sorted(seeds, key=int))
            + f" | {min(values):.3f} | {max(values) - min(values):.3f} | **{f:.3f}** | {f - initial:+.3f} | "
            f"{statistics.fmean(s['wall_s'] for s in seeds.values()):.0f} | {run['measured']} |"
        )
    return "\n".join(lines)


def markdown_documented(record: dict) -> str:
    """The documented runs' table, one row per run (docs/benchmarks.md shows it verbatim)."""
    lines = ["| run | steps | seed | initial | final | wall s | measured |", "|---|---|---|---|---|---|---|"]
    for name, doc in record.get("documented", {}).items():
        for r in doc["runs"]:
            lines.append(
                f"| {name}: {doc['what']} | {doc['steps']} | {r['seed']} | {r['initial']:.3f} | {r['final']:.3f} "
                f"| {r['wall_s']:.0f} | {r['measured']} |"
            )
    return "\n".join(lines)


DOCS = os.path.join(_REPO, "docs", "benchmarks.md")


def render_docs(text: str, record: dict) -> str:
    """docs/benchmarks.md with its two record tables (between `<!-- learning-floors: runs -->`
    or `documented` and `<!-- /learning-floors -->`) rendered from `record`."""
    for block, table in (("runs", markdown(record)), ("documented", markdown_documented(record))):
        start = f"<!-- learning-floors: {block} -->"
        head, sep, rest = text.partition(start)
        if not sep:
            raise ValueError(f"docs/benchmarks.md has no {start}")
        _, sep, tail = rest.partition("<!-- /learning-floors -->")
        text = f"{head}{start}\n{table}\n{sep}{tail}"
    return text


def measure(names: list[str], seeds: list[int], args) -> dict:
    out: dict = {}
    for name in names:
        for seed in seeds:
            t0 = time.monotonic()
            try:
                summary, stats = train(name, seed, args.fileroot, args.kit_cache)
            except RuntimeError as e:
                print(f"{name} seed {seed}: {e}", flush=True)
                out.setdefault(name, {})[str(seed)] = {"failed": str(e)}
                continue
            row = {
                "initial": summary["initial_eval_accuracy"],
                "final": summary["final_eval_accuracy"],
                "wall_s": round(time.monotonic() - t0, 1),
                "max_staleness_trained": summary.get("max_staleness_trained"),
                "restarts": len(summary.get("restarts", [])),
            }
            print(f"{name} seed {seed}: {row}", flush=True)
            out.setdefault(name, {})[str(seed)] = row
            if args.json:  # after every run: a long measurement keeps what it has
                _write(args.json, {"ratio": _ratio(out), "runs": out})
    return out


def _ratio(measured: dict) -> float | None:
    """The baseline is the warm start: the lowest final accuracy over the initial one, over all runs."""
    rows = [r for rows in measured.values() for r in rows.values() if "final" in r and r["initial"]]
    return min(r["final"] / r["initial"] for r in rows) if rows else None


def _write(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", default=",".join(RUNS), help=f"comma-separated, of {list(RUNS)} (the suite's) and {list(DOCUMENTED)}"
    )
    parser.add_argument("--seeds", default="1,2,3,4,5")
    parser.add_argument("--kit-cache", default=os.path.join(_REPO, "runs", "cache"))
    parser.add_argument("--fileroot", default=os.path.join(_REPO, "runs", "learning_floors"))
    parser.add_argument("--json", default=None, help="write every run's figures here")
    parser.add_argument("--record", action="store_true", help=f"merge the measured runs into {RECORD}")
    parser.add_argument("--conditions", default="", help="recorded with the date, e.g. 'shared machine, load 4-8'")
    parser.add_argument("--markdown", action="store_true", help="print the record's tables and train nothing")
    parser.add_argument("--docs", action="store_true", help="write the record's tables into docs/benchmarks.md")
    args = parser.parse_args()
    if args.markdown or args.docs:
        record = load_record()
        print(markdown(record), markdown_documented(record), sep="\n\n")
        if args.docs:
            with open(DOCS) as f:
                text = render_docs(f.read(), record)
            with open(DOCS, "w") as f:
                f.write(text)
        return 0
    names, seeds = args.runs.split(","), [int(s) for s in args.seeds.split(",")]
    unknown = [n for n in names if n not in RUNS and n not in DOCUMENTED]
    if unknown:
        parser.error(f"unknown runs {unknown}; runs: {list(RUNS) + list(DOCUMENTED)}")
    measured = measure(names, seeds, args)
    ok = all("failed" not in r for seeds_of in measured.values() for r in seeds_of.values())
    for name, rows in measured.items():
        values = [r["final"] for r in rows.values() if "final" in r]
        if values:
            print(
                f"{name}: finals {sorted(values)}, lowest {min(values):.3f}, floor {min(values) - margin(values):.3f}"
            )
    if args.record and ok:
        record = load_record() if os.path.exists(RECORD) else {"runs": {}}
        when = f"{datetime.date.today().isoformat()}{', ' + args.conditions if args.conditions else ''}"
        for name, rows in measured.items():
            if name in RUNS:  # a floor's seeds are measured together: they replace the record's
                record["runs"][name] = {
                    "what": RUNS[name].what,
                    **RUNS[name].as_record(),
                    "measured": when,
                    "seeds": rows,
                }
            else:  # a documented run's figures accumulate, each with its date
                doc = record.setdefault("documented", {}).setdefault(name, {"runs": []})
                doc.update(what=DOCUMENTED[name].what, **DOCUMENTED[name].as_record())
                doc["runs"] += [{"seed": int(k), **r, "measured": when} for k, r in rows.items()]
        record["runs"] = {n: record["runs"][n] for n in RUNS if n in record["runs"]}  # the suite's order
        _write(RECORD, record)
        print(markdown(record))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
