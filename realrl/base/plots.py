"""PNG plots of a run, from its `stats.jsonl` (docs/observability.md).

`write_plots(stats_path, out_dir)` reads the per-step records the master
writes (realrl/base/stats.py) and writes one PNG per figure into `out_dir`,
returning their paths. Only figures with data are written (a run without a
test split has no evaluation figure). A live run's master has `LivePlots` call
it at an evaluation a minute or more after the last drawing (or training's
start) and at the end, into `<log_dir>/plots/`, in a child process at a lower
CPU priority (the trainers do not wait for the drawing); it also works offline:

    python -m realrl.base.plots <log_dir or stats.jsonl> [out_dir]

matplotlib is imported here only, with the non-interactive Agg canvas and no
pyplot (no global state, safe off the main thread), so processes that never
plot never import it.

Figures:
- accuracy_reward.png: greedy eval accuracy and score, and the trained
  answers' accuracy and mean reward, per step and against wall time;
- staleness.png: histogram of the trained tokens' staleness (the trainer's
  version minus the version that generated each token), and per step;
- step_time.png: seconds per step by stage (waiting for data, assembling the
  batch, inference, train, publishing the weights);
- throughput.png: tokens generated per second and tokens trained per second;
- idle_ratios.png: the fraction of time the trainers waited for data and the
  generation servers had no request running;
- off_policy.png: the behaviour importance weights' effective sample size and
  the fraction of tokens each mechanism clipped or masked, then the policy's
  entropy and its KL to the proximal policy: an off-policy collapse shows
  here (ESS falling, masking rising) before the reward falls.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

PLOTS_DIR = "plots"

_COLORS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def read_stats(stats_path: str) -> list[dict[str, Any]]:
    """The records of a stats.jsonl (a torn last line is skipped)."""
    records = []
    with open(stats_path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), (int, float)):
                records.append(record)
    return records


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def _series(records: list[dict], key: str, x_key: str = "step") -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for r in records:
        x, y = _number(r.get(x_key)), _number(r.get(key))
        if x is not None and y is not None:
            xs.append(x)
            ys.append(y)
    return xs, ys


def _smooth(ys: list[float]) -> list[float] | None:
    """A trailing moving average over ~5% of the points (None when too few to need one)."""
    window = len(ys) // 20
    if window < 2:
        return None
    out, total = [], 0.0
    for i, y in enumerate(ys):
        total += y
        if i >= window:
            total -= ys[i - window]
        out.append(total / min(i + 1, window))
    return out


def _line(ax, xs, ys, label, color, marker=None, linestyle="-", raw_alpha=0.35) -> bool:
    if not xs:
        return False
    smooth = None if marker else _smooth(ys)
    if smooth is None:
        ax.plot(xs, ys, label=label, color=color, marker=marker, markersize=4, linewidth=1.5, linestyle=linestyle)
    else:
        ax.plot(xs, ys, color=color, alpha=raw_alpha, linewidth=0.8)
        ax.plot(xs, smooth, label=f"{label} (moving avg.)", color=color, linewidth=1.8)
    return True


def _figure(n_panels: int, title: str):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    # Fixed margins, not a layout engine: constrained layout measured a third of the plotting's CPU,
    # which an evaluation holds the trainers for (docs/benchmarks.md).
    width = 5.0 * n_panels
    fig = Figure(figsize=(width, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    fig.subplots_adjust(left=0.9 / width, right=1 - 0.3 / width, bottom=0.14, top=0.87, wspace=0.25)
    axes = fig.subplots(1, n_panels, squeeze=False)[0]
    fig.suptitle(title, fontsize=11)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    return fig, list(axes)


def _save(fig, path: str) -> str:
    tmp = f"{path}.tmp-{os.getpid()}"
    # zlib level 1 instead of 6: the encoding was a quarter of the drawing's CPU; files ~8% larger
    fig.savefig(tmp, format="png", pil_kwargs={"compress_level": 1})
    os.replace(tmp, path)  # a reader never sees half a file
    return path


# ---- the figures: each returns the figure, or None when it has no data -----------------


def _train_records(records):
    return [r for r in records if "train/actor_loss" in r or "time/step_s" in r]


def _eval_records(records):
    return [r for r in records if "eval/score" in r]  # the records the evaluation itself writes


def _plot_accuracy_reward(records):
    train, evals = _train_records(records), _eval_records(records)
    curves = [
        ("eval/accuracy", evals, "eval accuracy (greedy)", "o"),
        ("eval/score", evals, "eval score", "s"),
        ("rollout/accuracy", train, "trained answers: accuracy", None),
        ("rollout/reward/mean", train, "trained answers: reward (mean)", None),
    ]
    if not any(_series(recs, key)[0] for key, recs, _, _ in curves):
        return None
    fig, (by_step, by_time) = _figure(2, "accuracy and reward")
    for ax, x_key, x_label in ((by_step, "step", "train step"), (by_time, "time/elapsed_s", "wall time (min)")):
        for (key, recs, label, marker), color in zip(curves, _COLORS):
            xs, ys = _series(recs, key, x_key)
            if x_key != "step":
                xs = [x / 60 for x in xs]
            _line(ax, xs, ys, label, color, marker, linestyle="--" if key == "eval/score" else "-")
        ax.set_xlabel(x_label)
    by_step.set_ylabel("accuracy / reward")
    by_step.legend(fontsize=8, loc="best")
    return fig


def _plot_staleness(records):
    train = _train_records(records)
    totals: dict[int, float] = {}
    key, what = "staleness/token_histogram", "trained tokens"
    if not any(isinstance(r.get(key), dict) for r in train):
        key, what = "staleness/histogram", "trained trajectories"
    for r in train:
        hist = r.get(key)
        if isinstance(hist, dict):
            for k, v in hist.items():
                try:
                    totals[int(k)] = totals.get(int(k), 0) + float(v)
                except (TypeError, ValueError):
                    continue
    steps_mean = _series(train, "staleness/mean")
    if not totals and not steps_mean[0]:
        return None
    fig, (hist_ax, step_ax) = _figure(2, "staleness (trainer version - generating version)")
    if totals:
        xs = sorted(totals)
        total = sum(totals.values()) or 1.0
        hist_ax.bar(xs, [totals[x] / total for x in xs], color=_COLORS[0], width=0.8)
        hist_ax.set_xticks(xs)
    hist_ax.set_xlabel("staleness (versions)")
    hist_ax.set_ylabel(f"fraction of {what}")
    _line(step_ax, *steps_mean, "mean (trajectory)", _COLORS[0])
    _line(step_ax, *_series(train, "staleness/max"), "max (trajectory)", _COLORS[3])
    step_ax.set_xlabel("train step")
    step_ax.set_ylabel("staleness")
    step_ax.legend(fontsize=8)
    return fig


def _plot_step_time(records):
    train = [r for r in _train_records(records) if _number(r.get("time/step_s")) is not None]
    if not train:
        return None

    def get(r, key):
        return _number(r.get(key)) or 0.0

    stages: list[tuple[str, Callable[[dict], float]]] = [
        ("wait for data", lambda r: get(r, "time/wait_data_s")),
        ("assemble batch", lambda r: max(get(r, "time/fetch_s") - get(r, "time/wait_data_s"), 0.0)),
        ("inference", lambda r: get(r, "time/inference_s")),
        ("train", lambda r: max(get(r, "time/train_s") - get(r, "time/publish_s"), 0.0)),
        ("publish weights", lambda r: get(r, "time/publish_s")),
    ]
    xs = [r["step"] for r in train]
    fig, (ax,) = _figure(1, "seconds per step by stage")
    ax.stackplot(
        xs,
        *[[f(r) for r in train] for _, f in stages],
        labels=[name for name, _ in stages],
        colors=_COLORS[: len(stages)],
        alpha=0.85,
    )
    ax.set_xlabel("train step")
    ax.set_ylabel("seconds")
    ax.set_xlim(min(xs), max(xs) if len(xs) > 1 else min(xs) + 1)
    ax.legend(fontsize=8, loc="upper left")
    return fig


def _plot_throughput(records):
    train = _train_records(records)
    gen, trained = _series(train, "perf/gen_tokens_per_s"), _series(train, "perf/train_tokens_per_s")
    if not gen[0] and not trained[0]:
        return None
    fig, (ax,) = _figure(1, "throughput (tokens/s)")
    _line(ax, *gen, "generated (answer tokens)", _COLORS[0])
    _line(ax, *trained, "trained (prompt + answer tokens)", _COLORS[1])
    ax.set_xlabel("train step")
    ax.set_ylabel("tokens / s")
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=8)
    return fig


def _plot_idle(records):
    train = _train_records(records)
    trainer, gen = _series(train, "perf/trainer_idle_ratio"), _series(train, "perf/gen_idle_ratio")
    if not trainer[0] and not gen[0]:
        return None
    fig, (ax,) = _figure(1, "idle ratios")
    _line(ax, *trainer, "trainers waiting for data", _COLORS[1])
    _line(ax, *gen, "generation servers with no request", _COLORS[0])
    ax.set_xlabel("train step")
    ax.set_ylabel("fraction of wall time")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(fontsize=8)
    return fig


def _plot_off_policy(records):
    train = _train_records(records)
    fractions = [
        ("train/behav_ess", "behaviour weights: ESS"),
        ("train/clip_high_frac", "clipped high"),
        ("train/clip_low_frac", "clipped low"),
        ("train/dual_clip_frac", "dual-clipped"),
        ("train/behav_capped_frac", "behaviour weight capped"),
        ("train/truncated_masked_frac", "truncated answers masked"),
    ]
    if not _series(train, "train/behav_ess")[0]:
        return None
    fig, (frac_ax, policy_ax) = _figure(2, "off-policy diagnostics")
    for (key, label), color in zip(fractions, _COLORS):
        _line(frac_ax, *_series(train, key), label, color)
    frac_ax.set_xlabel("train step")
    frac_ax.set_ylabel("fraction (ESS: of the tokens)")
    frac_ax.set_ylim(-0.02, 1.02)
    frac_ax.legend(fontsize=8, loc="center right")
    _line(policy_ax, *_series(train, "train/entropy"), "entropy (nats/token)", _COLORS[0])
    _line(policy_ax, *_series(train, "train/approx_kl"), "KL(prox || policy), k3", _COLORS[3])
    policy_ax.set_xlabel("train step")
    policy_ax.legend(fontsize=8)
    return fig


FIGURES: dict[str, Callable] = {
    "accuracy_reward.png": _plot_accuracy_reward,
    "staleness.png": _plot_staleness,
    "step_time.png": _plot_step_time,
    "throughput.png": _plot_throughput,
    "idle_ratios.png": _plot_idle,
    "off_policy.png": _plot_off_policy,
}


def write_plots(stats_path: str, out_dir: str) -> list[str]:
    """Writes the figures that have data to `out_dir`; their paths."""
    records = read_stats(stats_path)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for name, plot in FIGURES.items():
        fig = plot(records)
        if fig is not None:
            written.append(_save(fig, os.path.join(out_dir, name)))
    return written


# ---- a live run's plots, drawn beside it ---------------------------------------------------

PLOTTER_NICE = 10  # below the trainers and the generation servers: it draws with the CPU they leave
# An evaluation's ask draws only this long after the last drawing (or training's start). On a machine
# whose cores the run keeps busy the drawing's CPU (~1 s for the child's start and first drawing) is the
# run's: drawn at each evaluation of the tiny run (4 in vs_inprocess --quick) it cost realrl 12-15% of
# its steps/min. A run shorter than this gets its plots at the end.
MIN_INTERVAL_S = 60.0


def serve(stdin=None, stdout=None) -> int:
    """The plotter process of a live run (`python -m realrl.base.plots --serve`, started by
    `LivePlots`): reads one JSON line `{"stats": path, "out": dir}` at a time, answers one line
    `{"paths": [...]}` or `{"error": "..."}`, until its stdin closes (its master is gone)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    try:
        os.nice(PLOTTER_NICE)
    except OSError:  # not permitted here: draw at the same priority rather than not at all
        pass
    if os.getsid(0) == os.getpid():  # its own session (LivePlots starts it so): its autogroup's too
        try:
            with open("/proc/self/autogroup", "w") as f:
                f.write(str(PLOTTER_NICE))
        except OSError:  # no autogroups (not Linux, or a kernel without them): the niceness is all
            pass
    for line in stdin:
        try:
            request = json.loads(line)
            reply = {"paths": write_plots(request["stats"], request["out"])}
        except Exception as e:  # the one drawing's failure, answered; the next may work
            reply = {"error": f"{type(e).__name__}: {e}"}
        stdout.write(json.dumps(reply) + "\n")
        stdout.flush()
    return 0


class _DrawingFailed(Exception):
    """The plotter process answered that one drawing failed."""


class LivePlots:
    """The master's plots of a running trial, drawn in a child process at nice +10 (in a session,
    so an autogroup, of its own at nice +10 too).

    An evaluation asks for them and goes on: the trainers do not wait while matplotlib draws (~0.7 s
    of CPU for a 200-step run, growing with the run), and the drawing takes the CPU the model
    processes leave. A child, not a thread: a low-priority thread holding the master's GIL would hold
    the master's loop, which drives every step. Asks while one drawing runs fold into one more
    drawing after it (of the stats as they are then). A failure is a warning, never the trial's; the
    next ask starts a new child.
    """

    def __init__(self, stats_path: str, out_dir: str, logger, min_interval_s: float = MIN_INTERVAL_S) -> None:
        self.stats_path, self.out_dir, self.logger = stats_path, out_dir, logger
        self.min_interval_s = min_interval_s
        self._last = time.monotonic()  # of the last drawing asked for (at first: training's start)
        self.paths: list[str] = []  # of the last drawing that succeeded
        self.drawings = 0
        self._proc = None
        self._task = None
        self._wanted = False

    def request(self, final: bool = False) -> None:
        """Draws the stats as they are now, soon; returns at once. An ask within `min_interval_s`
        of the last drawing asked for (or of this object's making) is dropped, unless `final`."""
        now = time.monotonic()
        if not final and now - self._last < self.min_interval_s:
            return
        self._last = now
        self._wanted = True
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def wait(self) -> list[str]:
        """Waits until every drawing asked for is done; the paths of the last."""
        if self._task is not None:
            await self._task
        return self.paths

    async def close(self) -> None:
        """Ends the child (it exits when its stdin closes)."""
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), timeout=10)
        except asyncio.TimeoutError:  # stuck in a drawing: it is only plots
            proc.kill()
            await proc.wait()

    async def _drain(self) -> None:
        while self._wanted:
            self._wanted = False
            try:
                self.paths = await self._draw()
                self.drawings += 1
            except _DrawingFailed as e:  # the child answered: it stays for the next ask
                self.logger.warning("could not write the plots to %s: %s", self.out_dir, e)
            except Exception as e:  # the child is gone or unusable: the next ask starts another
                self.logger.warning("could not write the plots to %s: %s: %s", self.out_dir, type(e).__name__, e)
                await self.close()

    async def _draw(self) -> list[str]:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "realrl.base.plots",
                "--serve",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,  # (its stderr is the master's: a traceback lands in its log)
                # With autogroups (Linux's sched_autogroup, on in many distributions) the kernel
                # shares the CPU between sessions first and a niceness only ranks a process inside
                # its own: in the master's session the child would take the master's share from the
                # trainers. In a session of its own it sets that session's niceness (`serve`).
                start_new_session=True,
            )
        self._proc.stdin.write((json.dumps({"stats": self.stats_path, "out": self.out_dir}) + "\n").encode())
        await self._proc.stdin.drain()
        line = await self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the plotter process exited with code {await self._proc.wait()}")
        reply = json.loads(line)
        if "error" in reply:
            raise _DrawingFailed(reply["error"])
        return list(reply["paths"])


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args == ["--serve"]:
        return serve()
    if not args or args[0] in ("-h", "--help") or len(args) > 2:
        print("usage: python -m realrl.base.plots <log_dir or stats.jsonl> [out_dir]", file=sys.stderr)
        return 0 if args and args[0] in ("-h", "--help") else 2
    source = args[0]
    stats_path = os.path.join(source, "stats.jsonl") if os.path.isdir(source) else source
    if not os.path.isfile(stats_path):
        print(f"realrl: no stats file at {stats_path}", file=sys.stderr)
        return 1
    out_dir = args[1] if len(args) > 1 else os.path.join(os.path.dirname(os.path.abspath(stats_path)), PLOTS_DIR)
    for path in write_plots(stats_path, out_dir):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
