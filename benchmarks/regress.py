"""Did a change cost speed? The quick benchmarks' ratios against the last recorded ones.

    python benchmarks/regress.py [--only NAME ...] [--repeat N] [--results DIR]
    python benchmarks/regress.py --from-json DIR            # compare results already written
    python benchmarks/regress.py --repeat 3 --record "why"  # measure and make these the baseline
    python benchmarks/regress.py --against main --repeat 3  # against another commit, in the same sitting

Runs each quick benchmark (`--only` picks some), reads the ratio its JSON
reports (each compares realrl with a baseline measured in the same run, so
the ratios, unlike the raw rates, travel between machines of one kind), and
compares it with `benchmarks/baseline.json`:

| metric | benchmark | ratio |
|---|---|---|
| vs_inprocess | vs_inprocess.py --quick | realrl steps/min / its own one-process loop |
| stream | stream_throughput.py --quick | wire / raw pyzmq at 2k tokens (no acknowledgements) |
| stream_acked | stream_throughput.py --quick | acknowledged delivery / raw pyzmq at 2k tokens |
| async_vs_sync | async_vs_sync.py --quick | asynchronous / synchronous PPO steps per minute |
| generation | generation_throughput.py --quick | torch server / `model.generate` |

A metric "moved" when the new figure lies further from the baseline's median
than its tolerance: the spread (max - min) of the repeated runs the baseline
was recorded from, and at least `MIN_TOLERANCE` of the median (a spread of
three runs underestimates the true one). The table prints each metric's
baseline, spread, the new figure and `slower` / `faster` / `held`; the exit
status is 1 when something got slower, so it can gate a script.

It is not a CI test: CI machines are shared, and timing there is noise. Run
it on a quiet machine (nothing else running: the load average is printed
and a warning given above the core count) before landing a change that
touches a hot path, and again with `--record REASON` when a change moves a
figure on purpose.

The ratios travel between machines of one kind, not between kinds: a faster
core shortens a step's compute more than its fixed costs, so a baseline
recorded on another machine can read "slower" for code that did not change.
Each baseline entry names the machine it was recorded on (CPU model and core
count); against an entry from another machine the table says so, a warning
names both, and a "slower" there does not fail the exit status.
`--against REF` needs no stored figure: it checks REF (a commit, branch or
tag) out in a temporary git worktree and runs its benchmarks alternated with
this checkout's (REF first in odd runs, this first in even ones), each side
importing its own code, and compares the two medians with the larger of the
two sides' spreads (and `MIN_TOLERANCE`) as the tolerance. The baseline lives in `benchmarks/baseline.json`, which
git tracks, not under `benchmarks/results/`, which it ignores: a recorded
figure must travel with the code it was measured on, and every update is a
commit that says why (the `reason` field, with the commit, date, machine and
every run's figure).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = os.path.join(_REPO, "benchmarks", "baseline.json")
MIN_TOLERANCE = 0.03  # of the baseline's median: the least a figure must move to count

# metric -> (script, arguments, the JSON key holding the figure)
METRICS: dict[str, tuple[str, list[str], str]] = {
    "vs_inprocess": ("vs_inprocess.py", ["--quick"], "ratio"),
    "stream": ("stream_throughput.py", ["--quick"], "ratio"),
    "stream_acked": ("stream_throughput.py", ["--quick"], "acked_ratio"),
    "async_vs_sync": ("async_vs_sync.py", ["--quick"], "ratio"),
    "generation": ("generation_throughput.py", ["--quick"], "ratio"),
}


def this_machine() -> str:
    """The CPU model and the core count: what a ratio's baseline must share to be compared."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:  # not Linux
        pass
    return f"{model or platform.processor() or platform.machine()}, {os.cpu_count()} cores"


def verdict(baseline: dict, value: float) -> tuple[str, float]:
    """('slower' | 'faster' | 'held', tolerance) of `value` against one metric's
    baseline entry {"median", "runs"}. Every ratio is higher-is-better."""
    median = baseline["median"]
    runs = baseline.get("runs") or [median]
    tolerance = max(max(runs) - min(runs), MIN_TOLERANCE * abs(median))
    if value < median - tolerance:
        return "slower", tolerance
    if value > median + tolerance:
        return "faster", tolerance
    return "held", tolerance


def compare(baseline: dict, measured: dict[str, list[float]]) -> list[dict]:
    """One row per measured metric: its baseline, the new runs' median and the verdict."""
    rows = []
    for name, runs in measured.items():
        now = statistics.median(runs)
        entry = baseline.get("metrics", {}).get(name)
        if entry is None:
            rows.append({"metric": name, "now": now, "runs": runs, "verdict": "new"})
            continue
        word, tolerance = verdict(entry, now)
        rows.append(
            {
                "metric": name,
                "baseline": entry["median"],
                "baseline_runs": entry.get("runs", []),
                "tolerance": tolerance,
                "now": now,
                "runs": runs,
                "change": now / entry["median"] - 1 if entry["median"] else float("nan"),
                "verdict": word,
                "machine": entry.get("machine", ""),
            }
        )
    return rows


def format_table(rows: list[dict]) -> str:
    lines = [f"{'metric':<14}{'baseline':>9}{'spread':>16}{'now':>8}{'runs':>20}{'change':>8}  verdict"]
    for r in rows:
        runs = " ".join(f"{x:.2f}" for x in r["runs"])
        if "baseline" not in r:
            lines.append(f"{r['metric']:<14}{'-':>9}{'-':>16}{r['now']:>8.2f}{runs:>20}{'-':>8}  new (no baseline)")
            continue
        b = r["baseline_runs"] or [r["baseline"]]
        spread = f"{min(b):.2f}-{max(b):.2f}"
        lines.append(
            f"{r['metric']:<14}{r['baseline']:>9.2f}{spread:>16}{r['now']:>8.2f}{runs:>20}"
            f"{r['change'] * 100:>+7.1f}%  {r['verdict']}"
            + (f" (recorded on {r['machine']})" if r.get("machine") and r["machine"] != this_machine() else "")
        )
    return "\n".join(lines)


def read_figure(path: str, key: str) -> float:
    with open(path) as f:
        return float(json.load(f)[key])


def run_benchmarks(
    names: list[str], repeat: int, results: str, repos: dict[str, str] | None = None
) -> dict[str, dict[str, list[float]]]:
    """Runs each benchmark the metrics need `repeat` times in each of `repos`
    ({side: repository root}; default this one), the sides alternated within
    each run and their order reversed every other run; the figures per side
    and metric. Each side imports its own code (PYTHONPATH, passed on to the
    workers a benchmark starts)."""
    repos = repos or {"this": _REPO}
    os.makedirs(results, exist_ok=True)
    measured = {side: {name: [] for name in names} for side in repos}
    scripts: dict[tuple[str, tuple[str, ...]], list[str]] = {}
    for name in names:
        script, args, _ = METRICS[name]
        scripts.setdefault((script, tuple(args)), []).append(name)
    for i in range(repeat):
        order = list(repos) if i % 2 == 0 else list(reversed(repos))
        for (script, args), metrics in scripts.items():
            for side in order:
                repo = repos[side]
                tag = "" if len(repos) == 1 else f"{side}_"
                out = os.path.join(results, f"regress_{tag}{script.removesuffix('.py')}_{i}.json")
                cmd = [sys.executable, os.path.join(repo, "benchmarks", script), *args, "--json", out]
                print(f"[regress] run {i + 1}/{repeat} ({side}): {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
                env = {**os.environ, "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
                subprocess.run(cmd, check=True, cwd=repo, env=env, stdout=subprocess.DEVNULL)
                for name in metrics:
                    measured[side][name].append(read_figure(out, METRICS[name][2]))
    return measured


def checkout(ref: str, results: str) -> str:
    """A temporary worktree of `ref` under `results` (its own kit caches copied
    from this checkout's `runs/`, so that it builds none); removed by `remove`."""
    sha = subprocess.run(
        ["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=_REPO, capture_output=True, text=True
    )
    if sha.returncode != 0:
        raise SystemExit(f"--against: {ref!r} is not a commit here")
    path = os.path.join(os.path.abspath(results), f"against-{sha.stdout.strip()[:12]}")
    if os.path.exists(path):
        remove(path)
    subprocess.run(["git", "worktree", "add", "--detach", "-q", path, sha.stdout.strip()], cwd=_REPO, check=True)
    runs = os.path.join(_REPO, "runs")
    for sub in os.listdir(runs) if os.path.isdir(runs) else []:
        cache = os.path.join(runs, sub, "cache") if sub != "cache" else os.path.join(runs, "cache")
        if os.path.isdir(cache):
            shutil.copytree(cache, os.path.join(path, os.path.relpath(cache, _REPO)), dirs_exist_ok=True)
    return path


def remove(path: str) -> None:
    subprocess.run(["git", "worktree", "remove", "--force", path], cwd=_REPO, capture_output=True)
    shutil.rmtree(path, ignore_errors=True)
    subprocess.run(["git", "worktree", "prune"], cwd=_REPO, capture_output=True)


def compare_sides(ref: str, measured: dict[str, dict[str, list[float]]]) -> list[dict]:
    """One row per metric: this checkout against `ref`, measured in one sitting."""
    baseline = {
        "metrics": {
            name: {"median": statistics.median(runs), "runs": runs} for name, runs in measured["ref"].items() if runs
        }
    }
    rows = compare(baseline, measured["this"])
    for r in rows:  # the tolerance: the larger of the two sides' spreads
        if "baseline" in r:
            spread = max(r["runs"]) - min(r["runs"])
            if spread > r["tolerance"]:
                r["tolerance"] = spread
                lo, hi = r["baseline"] - spread, r["baseline"] + spread
                r["verdict"] = "slower" if r["now"] < lo else "faster" if r["now"] > hi else "held"
        r["against"] = ref
    return rows


def from_json(names: list[str], results: str) -> dict[str, list[float]]:
    """The figures of results already written (`regress_<script>_<i>.json` in `results`)."""
    measured: dict[str, list[float]] = {}
    for name in names:
        script, _, key = METRICS[name]
        prefix = f"regress_{script.removesuffix('.py')}_"
        files = sorted(f for f in os.listdir(results) if f.startswith(prefix) and f.endswith(".json"))
        if files:
            measured[name] = [read_figure(os.path.join(results, f), key) for f in files]
    return measured


def record(baseline: dict, measured: dict[str, list[float]], reason: str) -> dict:
    """`baseline` with the measured metrics as its new figures (others kept)."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=_REPO, capture_output=True, text=True)
    stamp = {
        "reason": reason,
        "commit": commit.stdout.strip(),
        "date": datetime.date.today().isoformat(),
        "machine": this_machine(),
    }
    metrics = dict(baseline.get("metrics", {}))
    for name, runs in measured.items():
        metrics[name] = {"median": statistics.median(runs), "runs": runs, **stamp}
    return {**baseline, "metrics": metrics}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="+", choices=sorted(METRICS), help="these metrics only")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each benchmark (the spread needs >= 3)")
    parser.add_argument("--results", default=os.path.join(_REPO, "benchmarks", "results"))
    parser.add_argument("--from-json", metavar="DIR", help="compare the results in DIR instead of running")
    parser.add_argument("--record", metavar="REASON", help="write the figures to the baseline, with this reason")
    parser.add_argument("--baseline", default=BASELINE)
    parser.add_argument("--against", metavar="REF", help="compare with REF's code run in the same sitting")
    args = parser.parse_args(argv)
    names = args.only or list(METRICS)
    if args.against and (args.record or args.from_json):
        parser.error("--against compares two checkouts measured now: not with --record or --from-json")

    load = os.getloadavg()[0]
    print(f"load average {load:.2f} on {os.cpu_count()} cores", file=sys.stderr)
    if load > (os.cpu_count() or 1):
        print("warning: the machine is busy; ratios measured now are noisy", file=sys.stderr)
    if args.against:
        ref_repo = checkout(args.against, args.results)
        try:
            measured = run_benchmarks(names, args.repeat, args.results, {"ref": ref_repo, "this": _REPO})
        finally:
            remove(ref_repo)
        rows = compare_sides(args.against, measured)
        print(f"against {args.against} (its runs as the baseline column), measured alternated just now")
        print(format_table(rows))
        return 1 if any(r["verdict"] == "slower" for r in rows) else 0
    measured = (
        from_json(names, args.from_json) if args.from_json else run_benchmarks(names, args.repeat, args.results)["this"]
    )

    baseline: dict = {}
    if os.path.exists(args.baseline):
        with open(args.baseline) as f:
            baseline = json.load(f)
    rows = compare(baseline, measured)
    print(format_table(rows))
    here = this_machine()
    elsewhere = sorted({r["machine"] for r in rows if r.get("machine") and r["machine"] != here})
    if elsewhere:
        print(
            f"warning: baseline figures recorded on {'; '.join(elsewhere)}, this is {here}: those verdicts are "
            "indicative only (record a baseline here, or compare with --against REF)",
            file=sys.stderr,
        )
    if args.record:
        with open(args.baseline, "w") as f:
            json.dump(record(baseline, measured, args.record), f, indent=1)
            f.write("\n")
        print(f"recorded {', '.join(measured)} in {args.baseline}")
    return 1 if any(r["verdict"] == "slower" and (r.get("machine") or here) == here for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
