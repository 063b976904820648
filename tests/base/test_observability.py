"""Observability pieces on their own (docs/observability.md): the plots from a
synthetic stats.jsonl, the console renderer in both modes, the generation
servers' utilization in the manager's router, wandb in the StatsLogger, and
the config keys. Whole runs check the same through the launcher in
tests/e2e/test_entry_point.py."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import signal
import subprocess
import sys
import types

import pytest

from realrl.api.cli_args import ConfigError
from realrl.base.console import ConsoleRenderer, parse_step_line
from realrl.base.plots import FIGURES, PLOTTER_NICE, LivePlots, write_plots
from realrl.base.stats import StatsLogger
from realrl.experiment.config import load_config
from realrl.system.router import RequestRouter

STEP_LINE = (
    "12:00:00.000 I [master_worker/0] realrl.steps: step {step}/{total} v{step} | acc 0.625 reward 0.500 | "
    "loss 0.0100 clip 0.000 | staleness max 2 | 0.50s (fetch 0.10, inf 0.10, train 0.30) | "
    "idle trainer 0.20 gen 0.05 | tokens/s gen 900 train 700"
)


def synthetic_stats(path, steps: int = 30, eval_every: int = 10) -> None:
    records = [{"step": 0, "eval/accuracy": 0.2, "eval/score": 0.25, "eval/n": 64, "time/elapsed_s": 2.0}]
    for s in range(1, steps + 1):
        records.append(
            {
                "step": s,
                "train/actor_loss": 0.01,
                "train/behav_ess": 0.99 - s / 200,
                "train/clip_high_frac": 0.02,
                "train/clip_low_frac": 0.01,
                "train/behav_capped_frac": s / 1000,
                "train/entropy": 1.5 - s / 100,
                "train/approx_kl": 0.001,
                "rollout/accuracy": 0.2 + s / 100,
                "rollout/reward/mean": 0.1 + s / 50,
                "staleness/mean": 1.0,
                "staleness/max": 2,
                "staleness/histogram": {"0": 4, "1": 8, "2": 4},
                "staleness/token_histogram": {"0": 40, "1": 90, "2": 30},
                "time/fetch_s": 0.3,
                "time/wait_data_s": 0.2,
                "time/inference_s": 0.1,
                "time/train_s": 0.5,
                "time/publish_s": 0.1,
                "time/step_s": 0.9,
                "perf/trainer_idle_ratio": 0.22,
                "perf/gen_idle_ratio": 0.05,
                "perf/gen_tokens_per_s": 1000.0 + s,
                "perf/train_tokens_per_s": 800.0,
                "time/elapsed_s": 2.0 + s,
            }
        )
        if s % eval_every == 0:
            records.append(
                {
                    "step": s,
                    "eval/accuracy": 0.2 + s / 100,
                    "eval/score": 0.25 + s / 100,
                    "eval/n": 64,
                    "time/elapsed_s": 2.5 + s,
                }
            )
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + '{"step": 31, "torn')  # a torn last line


def assert_png_has_data(path) -> None:
    import numpy as np
    from PIL import Image

    with Image.open(path) as image:
        assert image.format == "PNG" and image.width >= 300 and image.height >= 200, (path, image.size)
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    colours = np.unique(pixels, axis=0)
    assert len(colours) > 20, f"{path}: {len(colours)} colours: no data drawn"
    saturated = (pixels.max(axis=1).astype(int) - pixels.min(axis=1).astype(int)) > 60  # coloured, not grey
    assert saturated.mean() > 0.002, f"{path}: hardly any coloured pixels (lines, bars)"


def test_write_plots_from_a_synthetic_stats_file(tmp_path):
    stats = tmp_path / "stats.jsonl"
    synthetic_stats(stats)
    paths = write_plots(str(stats), str(tmp_path / "plots"))
    assert sorted(p.rsplit("/", 1)[1] for p in paths) == sorted(FIGURES)
    for path in paths:
        assert_png_has_data(path)
    assert not [p for p in (tmp_path / "plots").iterdir() if not p.name.endswith(".png")]  # no temp file left


def test_a_live_run_s_plots_are_drawn_by_a_niced_child_and_asks_fold(tmp_path, caplog):
    """The master's evaluation asks and goes on (`request` only schedules); a child process below the
    model processes' priority draws; asks made while one drawing is due fold into it; a failed
    drawing or a dead child is a warning and the next ask works; `close` ends the child."""
    stats = tmp_path / "stats.jsonl"
    synthetic_stats(stats)
    out = tmp_path / "plots"
    logger = logging.getLogger("test.live_plots")

    async def run():
        plots = LivePlots(str(stats), str(out), logger, min_interval_s=0.0)
        for _ in range(5):
            plots.request()
        paths = await plots.wait()
        assert plots.drawings == 1 and sorted(p.rsplit("/", 1)[1] for p in paths) == sorted(FIGURES)
        for path in paths:
            assert_png_has_data(path)
        child = plots._proc
        assert child.pid != os.getpid() and child.returncode is None  # drawn in a child, kept for the next ask
        assert os.getpriority(os.PRIO_PROCESS, child.pid) >= os.getpriority(os.PRIO_PROCESS, 0) + PLOTTER_NICE
        assert os.getsid(child.pid) == child.pid  # a session of its own: the niceness weighs against the trainers
        if os.path.exists(f"/proc/{child.pid}/autogroup"):  # (and so does its autogroup's, where there are any)
            with open(f"/proc/{child.pid}/autogroup") as f:
                assert f.read().split()[-1] == str(PLOTTER_NICE)

        plots.stats_path = str(tmp_path / "missing.jsonl")  # a drawing that fails: a warning, the child stays
        plots.request()
        assert await plots.wait() == paths and plots.drawings == 1
        assert "could not write the plots" in caplog.text and "FileNotFoundError" in caplog.text
        plots.stats_path = str(stats)

        assert plots._proc is child and child.returncode is None
        os.kill(child.pid, signal.SIGKILL)
        await child.wait()
        plots.request()  # a dead child: the next ask starts another
        assert await plots.wait() == paths and plots.drawings == 2 and plots._proc.pid != child.pid
        last = plots._proc
        await plots.close()
        assert last.returncode == 0 and plots._proc is None  # it exits when its stdin closes

    with caplog.at_level(logging.WARNING, logger="test.live_plots"):
        asyncio.run(run())


def test_live_plots_are_drawn_a_minimum_interval_apart_and_always_at_the_end(tmp_path):
    """An evaluation's ask within `min_interval_s` of training's start or of the last drawing is
    dropped (the drawing's CPU is the run's on a busy machine); the end's ask always draws."""
    stats = tmp_path / "stats.jsonl"
    synthetic_stats(stats)
    out = tmp_path / "plots"

    async def run():
        plots = LivePlots(str(stats), str(out), logging.getLogger("test.live_plots"), min_interval_s=60.0)
        plots.request()  # an evaluation right after training starts
        assert await plots.wait() == [] and plots.drawings == 0 and plots._proc is None  # no child either
        plots.request(final=True)
        assert len(await plots.wait()) == len(FIGURES) and plots.drawings == 1
        plots.request()  # right after a drawing: dropped
        await plots.wait()
        assert plots.drawings == 1
        plots._last -= 60.0  # a minute later
        plots.request()
        await plots.wait()
        assert plots.drawings == 2
        await plots.close()

    asyncio.run(run())


def test_every_label_fits_inside_its_figure(tmp_path):
    """The figures have fixed margins (no layout engine, which cost a third of the plotting's CPU):
    titles, axis labels and tick labels, six-digit ones included, must still lie inside the image."""
    from realrl.base.plots import read_stats

    stats = tmp_path / "stats.jsonl"
    synthetic_stats(stats)
    records = read_stats(str(stats))
    for r in records:  # wide tick labels
        if "perf/gen_tokens_per_s" in r:
            r["perf/gen_tokens_per_s"] *= 100
    for name, plot in FIGURES.items():
        fig = plot(records)
        fig.canvas.draw()
        box = fig.get_tightbbox(fig.canvas.get_renderer())  # of what was drawn, in inches
        width, height = fig.get_size_inches()
        assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, (name, box, (width, height))


def test_write_plots_skips_figures_without_data(tmp_path):
    stats = tmp_path / "stats.jsonl"
    stats.write_text(
        json.dumps(
            {
                "step": 1,
                "train/actor_loss": 0.1,
                "time/step_s": 1.0,
                "time/fetch_s": 0.5,
                "time/inference_s": 0.1,
                "time/train_s": 0.4,
            }
        )
        + "\n"
    )
    paths = write_plots(str(stats), str(tmp_path / "plots"))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["step_time.png"]  # no eval, staleness or perf data


def test_plots_command_line(tmp_path):
    synthetic_stats(tmp_path / "stats.jsonl")
    proc = subprocess.run(
        [sys.executable, "-m", "realrl.base.plots", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == sorted(str(tmp_path / "plots" / name) for name in FIGURES)
    missing = subprocess.run(
        [sys.executable, "-m", "realrl.base.plots", str(tmp_path / "nothing")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert missing.returncode == 1 and "no stats file" in missing.stderr


def test_step_lines_parse_and_other_lines_do_not():
    s = parse_step_line(STEP_LINE.format(step=7, total=40))
    assert (s.step, s.total, s.acc, s.reward, s.staleness) == (7, 40, 0.625, 0.5, 2)
    assert (
        parse_step_line("12:00:00.000 I [master_worker/0] realrl.master_worker: step 7/40 is not a step line") is None
    )
    assert parse_step_line("eval at step 10: greedy accuracy 0.5") is None


def test_redirected_console_prints_plain_lines_every_n_steps_and_no_carriage_return():
    now = [0.0]
    out = io.StringIO()
    console = ConsoleRenderer(out, every_n_steps=10, tty=False, clock=lambda: now[0])
    assert not console.tty
    for step in range(4, 26):  # a resumed run: its first step is 4
        now[0] += 0.5
        console.feed(STEP_LINE.format(step=step, total=25))
        if step == 12:
            console.feed("12:00:06.000 W [master_worker/0] realrl.master_worker: a warning")
            console.feed("a line some tool redrew\rwith a carriage return")
    console.close()
    text = out.getvalue()
    assert "\r" not in text
    lines = text.splitlines()
    assert [ln.split()[1] for ln in lines if ln.startswith("step ")] == ["4/25", "10/25", "20/25", "25/25"]
    assert "12:00:06.000 W [master_worker/0] realrl.master_worker: a warning" in lines
    assert "with a carriage return" in lines
    last = lines[-1]
    assert last.startswith("step 25/25 (100%) | acc 0.625 reward 0.500 stale 2 | 2.00 steps/s"), last


def test_terminal_console_draws_one_bar_and_prints_other_lines_above_it():
    out = io.StringIO()
    console = ConsoleRenderer(out, every_n_steps=10, tty=True)
    for step in range(1, 21):
        console.feed(STEP_LINE.format(step=step, total=20))
        if step == 5:
            console.feed("W a warning")
    text = out.getvalue()
    assert "realrl.steps" not in text  # no step line of the log: the bar shows them
    assert "\nW a warning\n" in text or text.startswith("W a warning\n") or "\rW a warning\n" in text
    assert "20/20" in text and "acc=0.625" in text and "stale=2" in text and "step/s" in text
    assert text.endswith("\n")  # the finished bar stays on its own line


def test_console_on_a_real_terminal_draws_the_bar(tmp_path):
    """Under a pseudo-terminal (whose size may read 0 x 0, where tqdm alone
    draws nothing), the renderer asks the stream and draws the bar."""
    import os
    import pty

    script = tmp_path / "render.py"
    script.write_text(
        "import sys\n"
        "from realrl.base.console import ConsoleRenderer\n"
        f"line = {STEP_LINE!r}\n"
        "console = ConsoleRenderer(sys.stdout, every_n_steps=10)\n"
        "assert console.tty\n"
        "for step in range(1, 9):\n"
        "    console.feed(line.format(step=step, total=8))\n"
        "    if step == 3:\n"
        "        console.feed('W a warning')\n"
        "console.close()\n"
    )
    main, sub = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=sub,
        stderr=subprocess.PIPE,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    os.close(sub)
    out = b""
    while True:
        try:
            chunk = os.read(main, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    os.close(main)
    assert proc.wait(timeout=60) == 0, proc.stderr.read()
    proc.stderr.close()
    text = out.decode(errors="replace")
    assert "realrl.steps" not in text
    assert "\rtrain: 100%" in text and "8/8" in text and "acc=0.625" in text and "step/s" in text, text[-2000:]
    assert "W a warning" in text.split("\rtrain: 100%")[0]  # printed while the bar ran, on a line of its own


def test_router_integrates_each_servers_idle_time_and_counts_generated_tokens():
    now = [100.0]
    r = RequestRouter(["a", "b"], [0, 0], clock=lambda: now[0])
    now[0] += 2  # both idle 2 s
    assert r.schedule(1, "a", 0)[0] == "a"
    now[0] += 3  # a busy, b idle
    assert r.schedule(1, "a", 0)[0] == "a"  # a second request on a
    now[0] += 1
    r.release("a", 1, n_tokens=10)  # a still has one in flight: busy
    now[0] += 1
    r.release("a", 1, n_tokens=5)
    now[0] += 4
    u = r.utilization()
    # a: idle 2 + 4; b: idle the whole 11 s
    assert u == {"gen_idle_s": 17.0, "gen_server_s": 22.0, "gen_tokens": 15, "gen_clock_s": 11.0}
    r.release("a", 1)  # a spurious release: no new idle period
    assert r.utilization()["gen_idle_s"] == 17.0


def test_wandb_offline_when_installed_and_one_warning_when_not(tmp_path, monkeypatch, realrl_caplog):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    log = StatsLogger(str(tmp_path / "a"), tensorboard=False, wandb={"project": "p", "name": "n"})
    log.log(1, {"x": 1.0})
    log.close()
    warnings = [r.getMessage() for r in realrl_caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "wandb is not installed" in warnings[0] and "\n" not in warnings[0]

    calls = []

    class Run:
        def log(self, data, step):
            calls.append(("log", data, step))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    log = StatsLogger(str(tmp_path / "b"), tensorboard=False, wandb={"project": "p", "name": "n"})
    log.log(3, {"x": 2.0, "hist": {"0": 1}, "flag": True})
    log.close()
    assert calls[0] == ("init", {"project": "p", "name": "n", "dir": str(tmp_path / "b"), "mode": "offline"})
    assert calls[1:] == [("log", {"x": 2.0}, 3), ("finish",)]


@pytest.mark.parametrize(
    "override, key",
    [
        ("console.every_n_steps=x", "console.every_n_steps"),
        ("stats.wandb=maybe", "stats.wandb"),
        ("stats.no_such_key=1", "stats.no_such_key"),
    ],
)
def test_console_and_stats_keys_are_typed(override, key):
    with pytest.raises(ConfigError, match=key) as e:
        load_config([override])
    assert "\n" not in str(e.value)
    cfg = load_config(["console.every_n_steps=3", "stats.wandb=true"])
    assert cfg.console.every_n_steps == 3 and cfg.stats.wandb is True
