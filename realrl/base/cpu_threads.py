"""A trainer's torch CPU threads that follow the cores nobody else is using.

In local mode the trainer shares the machine's cores with CPU generation
servers, which are busy only part of each step: they generate up to the
staleness bound, then wait for the next version. A trainer given only the
cores the servers' threads leave idles the others while the servers wait; one
given every core fights the servers for them while they generate (OpenMP's
threads spin at each parallel region's barrier until the slowest arrives, so
one thread without a core holds the whole team back). `IdleCores` measures,
every `interval_s`, how many of the cores this process may run on the rest of
the machine left idle; `FollowIdleCores` hooks the models so that, between
two modules' forwards and between two parameters' gradients, the calling
thread's torch thread count becomes that many (no fewer than `floor`, the
cores the servers' threads leave, and no more than `ceiling`).

torch's intra-op thread count is the calling thread's (OpenMP's nthreads ICV),
so it is changed there, from hooks that run on the thread running the ops
(on CPU, autograd runs a backward on the thread that called it).

The figure is an average over `interval_s`, so it can only be followed by a
step that spans many of them: in a step of a few intervals (the tiny default
model's ~0.1 s) the servers turn from waiting to generating faster than the
figure moves, and a thread taken on a stale figure spins beside a busy core.
`FollowIdleCores.step_took` turns following off after a step shorter than
`MIN_STEP_INTERVALS` intervals (the count stays at the floor) and on again
after a longer one. A CPU generation server follows the same way with each
whole forward as its step (`FollowIdleCores.per_forward`): only while a
forward takes a sampling interval or more of thread time.
"""

from __future__ import annotations

import os
import threading
import time

import torch


def _busy_ticks(cpus: set[int]) -> int | None:
    """Busy clock ticks of `cpus` since boot (/proc/stat: all but idle and iowait)."""
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, _, rest = line.partition(" ")
                if not name.startswith("cpu") or name == "cpu":
                    continue
                if not name[3:].isdigit():
                    break
                if int(name[3:]) in cpus:
                    ticks = [int(x) for x in rest.split()]
                    busy += sum(ticks) - ticks[3] - ticks[4]
    except (OSError, ValueError, IndexError):
        return None
    return busy


def _own_ticks() -> int | None:
    """This process's CPU clock ticks (/proc/self/stat: utime + stime)."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rpartition(")")[2].split()
        return int(fields[11]) + int(fields[12])
    except (OSError, ValueError, IndexError):
        return None


class IdleCores:
    """How many of this process's cores the rest of the machine left idle over
    the last `interval_s` (a daemon thread samples /proc). `idle` is None where
    /proc cannot tell (not Linux)."""

    def __init__(self, interval_s: float = 0.1):
        self.cpus = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
        self.interval_s = interval_s
        self.idle: float | None = None
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> IdleCores:
        if _busy_ticks(self.cpus) is None or _own_ticks() is None:
            return self
        self._thread = threading.Thread(target=self._run, name="idle-cores", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        last = (time.monotonic(), _busy_ticks(self.cpus), _own_ticks())
        while not self._stop.wait(self.interval_s):
            now = (time.monotonic(), _busy_ticks(self.cpus), _own_ticks())
            if now[1] is None or now[2] is None:
                continue
            others = ((now[1] - last[1]) - (now[2] - last[2])) / self._hz / (now[0] - last[0])
            self.idle = max(0.0, len(self.cpus) - others)
            last = now

    def stop(self) -> None:
        self._stop.set()


MIN_STEP_INTERVALS = 10
"""A step must last this many sampling intervals for its threads to follow the figure."""


class FollowIdleCores:
    """The models' ops run on as many torch threads as the rest of the machine
    leaves cores idle (`cores`, rounded), no fewer than `floor` and no more
    than `ceiling`: checked before each module's forward and after each
    parameter's gradient (`every_module`; else before each whole forward), on
    the thread running them (a cheap comparison; the count changes only when
    the answer does). `step_took(seconds)` after each step: following holds
    only while steps take `min_step_s` or more (default `MIN_STEP_INTERVALS`
    samples), long against the sampling."""

    def __init__(
        self,
        models: list[torch.nn.Module],
        floor: int,
        ceiling: int,
        cores: IdleCores,
        *,
        min_step_s: float | None = None,
        every_module: bool = True,
        following: bool = True,
    ):
        self.models, self.floor, self.ceiling, self.cores = models, floor, ceiling, cores
        self.min_step_s = MIN_STEP_INTERVALS * cores.interval_s if min_step_s is None else min_step_s
        self.every_module = every_module
        self._counts = threading.local()  # (each thread's torch thread count is its own)
        self._hooks: list = []
        self._follow(following)

    @classmethod
    def per_forward(cls, model: torch.nn.Module, floor: int, ceiling: int, cores: IdleCores) -> FollowIdleCores:
        """A generation server's engine: the count is chosen before each forward of `model`, and
        followed only after a forward of a sampling interval or more of thread time (seconds x
        threads). A shorter one (a small model's decode step) would act on a figure older than
        itself, and a thread taken on a stale figure spins beside the trainer once it runs again;
        a long one (a larger model's prefill, or the first batch while the trainer waits for it)
        takes the trainer's idle cores and gives them back when it runs again."""
        threads = cls([model], floor, ceiling, cores, min_step_s=cores.interval_s, every_module=False, following=False)
        started = threading.local()

        def before(*_args) -> None:
            started.t = time.perf_counter()

        def after(*_args) -> None:
            threads.step_took((time.perf_counter() - started.t) * torch.get_num_threads())

        model.register_forward_pre_hook(before)
        model.register_forward_hook(after)
        return threads

    @property
    def following(self) -> bool:
        return bool(self._hooks)

    def step_took(self, seconds: float) -> None:
        self._follow(seconds >= self.min_step_s)

    def _follow(self, on: bool) -> None:
        if on == self.following:
            return
        if not on:
            for hook in self._hooks:
                hook.remove()
            self._hooks = []
            self._set(self.floor)  # (the calling thread: the one that runs the steps)
            return
        for model in self.models:
            if not self.every_module:
                self._hooks.append(model.register_forward_pre_hook(self._check))
                continue
            for module in model.modules():
                self._hooks.append(module.register_forward_pre_hook(self._check))
            for param in model.parameters():
                if param.requires_grad:
                    self._hooks.append(param.register_post_accumulate_grad_hook(self._check))

    def _check(self, *_args) -> None:
        idle = self.cores.idle
        if idle is not None:
            self._set(max(self.floor, min(self.ceiling, int(idle + 0.5))))

    def _set(self, n: int) -> None:
        if n != getattr(self._counts, "n", None):
            torch.set_num_threads(n)
            self._counts.n = n
