"""What a trial shows on the launcher's console (docs/observability.md).

The master logs one line per train step through the `STEP_LOGGER` logger
(`realrl.steps`) into its own log file, and never draws a progress bar there
(a log file holds no carriage return). The launcher copies the master's log to
its stdout line by line through a `ConsoleRenderer`, which turns the step
lines into:

- on a terminal (the launcher's stdout is a TTY): one progress bar with the
  ETA, steps/s and the key figures (accuracy, reward, staleness), redrawn in
  place; every other line (warnings, evaluations, ...) is printed above it;
- otherwise (redirected to a file or a pipe): a plain line for the first step,
  every `every_n_steps`-th step and the last one, and no carriage return
  anywhere.

Every other line of the master's log is copied as it is, so warnings show in
both modes; the per-step detail stays in the log file and in stats.jsonl.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import sys
import time
from typing import TextIO

STEP_LOGGER = "realrl.steps"
_STEP_MARK = f" {STEP_LOGGER}: "
_STEP = re.compile(r"step (\d+)/(\d+)\b")
_FIGURES = {
    "acc": re.compile(r"\bacc (-?[\d.]+(?:e[-+]?\d+)?|nan)"),
    "reward": re.compile(r"\breward (-?[\d.]+(?:e[-+]?\d+)?|nan)"),
    "staleness": re.compile(r"\bstaleness max (\d+)"),
}


@dataclasses.dataclass
class StepLine:
    step: int
    total: int
    acc: float | None = None
    reward: float | None = None
    staleness: int | None = None


def parse_step_line(line: str) -> StepLine | None:
    """The figures of a master's per-step log line, or None for any other line."""
    i = line.find(_STEP_MARK)
    if i < 0:
        return None
    message = line[i + len(_STEP_MARK) :]
    m = _STEP.match(message)
    if m is None:
        return None
    found = {}
    for key, pattern in _FIGURES.items():
        f = pattern.search(message)
        if f is not None:
            found[key] = int(f.group(1)) if key == "staleness" else float(f.group(1))
    return StepLine(int(m.group(1)), int(m.group(2)), **found)


def _size() -> tuple[int, int]:
    """The terminal's (columns, lines); 100 x 20 where it says 0 or nothing
    (e.g. a fresh pty), where tqdm would draw nothing at all."""
    size = shutil.get_terminal_size((100, 20))
    return size.columns, size.lines


def _clock(seconds: float) -> str:
    seconds = max(int(seconds), 0)
    h, rest = divmod(seconds, 3600)
    return f"{h}:{rest // 60:02d}:{rest % 60:02d}" if h else f"{rest // 60}:{rest % 60:02d}"


class ConsoleRenderer:
    """Renders the master's log lines on `stream` (see the module doc).
    `tty=None` asks the stream. Not thread-safe (the launcher's loop owns it)."""

    def __init__(
        self, stream: TextIO | None = None, every_n_steps: int = 10, tty: bool | None = None, clock=time.monotonic
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.stream = stream if stream is not None else sys.stdout
        if tty is None:
            try:
                tty = self.stream.isatty()
            except (AttributeError, ValueError):
                tty = False
        self.tty = bool(tty)
        self.every_n_steps = every_n_steps
        self._clock = clock
        self._bar = None
        self._first: tuple[int, float] | None = None  # (step, time) of the first step line seen
        self._last_printed = 0

    # ---- input -------------------------------------------------------------------
    def feed(self, line: str) -> None:
        """One line of the master's log (without its newline)."""
        step = parse_step_line(line)
        if step is not None:
            self.step(step)
        else:
            self.line(line)

    def line(self, text: str) -> None:
        """A line printed as it is (above the bar on a terminal)."""
        if not self.tty:  # the last state of a line redrawn with \r, and never a \r of ours
            parts = [p for p in text.split("\r") if p.strip()]
            text = parts[-1] if parts else ""
        if self._bar is not None:
            self._bar.clear()
            self.stream.write(text + "\n")
            self.stream.flush()
            self._bar.refresh()
        else:
            self.stream.write(text + "\n")
            self.stream.flush()

    def step(self, s: StepLine) -> None:
        now = self._clock()
        if self._first is None:
            self._first = (s.step, now)
        if self.tty:
            self._draw_bar(s)
        elif s.step in (self._first[0], s.total) or s.step % self.every_n_steps == 0:
            if s.step != self._last_printed:
                self._last_printed = s.step
                self.stream.write(self._plain(s, now) + "\n")
                self.stream.flush()

    # ---- output ------------------------------------------------------------------
    def pause(self) -> None:
        """Takes the bar off the screen before someone else writes (e.g. on stderr)."""
        if self._bar is not None:
            self._bar.clear()

    def resume(self) -> None:
        if self._bar is not None:
            self._bar.refresh()

    def close(self) -> None:
        """Leaves the bar's last state on its own line."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _figures(self, s: StepLine) -> dict[str, str]:
        figures = {}
        if s.acc is not None:
            figures["acc"] = f"{s.acc:.3f}"
        if s.reward is not None:
            figures["reward"] = f"{s.reward:.3f}"
        if s.staleness is not None:
            figures["stale"] = str(s.staleness)
        return figures

    def _rate(self, s: StepLine, now: float) -> float | None:
        first_step, first_time = self._first
        if s.step <= first_step or now <= first_time:
            return None
        return (s.step - first_step) / (now - first_time)

    def _plain(self, s: StepLine, now: float) -> str:
        parts = [f"step {s.step}/{s.total} ({100 * s.step // max(s.total, 1)}%)"]
        figures = self._figures(s)
        if figures:
            parts.append(" ".join(f"{k} {v}" for k, v in figures.items()))
        rate = self._rate(s, now)
        if rate is not None:
            eta = (s.total - s.step) / rate
            parts.append(f"{rate:.2f} steps/s, elapsed {_clock(now - self._first[1])}, ETA {_clock(eta)}")
        return " | ".join(parts)

    def _draw_bar(self, s: StepLine) -> None:
        from tqdm import tqdm

        if self._bar is None or self._bar.total != s.total:
            self.close()
            columns, lines = _size()
            # initial=this step: the rate (and ETA) counts from here, not from the trial's start-up
            self._bar = tqdm(
                total=s.total,
                initial=s.step,
                desc="train",
                unit="step",
                file=self.stream,
                ncols=columns,
                nrows=lines,
                mininterval=0.2,
                leave=True,
            )
        self._bar.ncols = _size()[0]  # follows a resized terminal
        self._bar.set_postfix(self._figures(s), refresh=False)
        self._bar.update(max(s.step - self._bar.n, 0))
        self._bar.refresh()
        if s.step >= s.total:  # done: what follows goes below it
            self.close()
