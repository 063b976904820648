"""A CPU torch server's threads follow the idle cores only while its forwards
are long against the idle figure's sampling (realrl/base/cpu_threads.py)."""

from __future__ import annotations

import threading
import time

import torch

from realrl.base.cpu_threads import FollowIdleCores, IdleCores


class _Timed(torch.nn.Module):
    """A forward of `seconds` that records the calling thread's torch thread count."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds, self.counts = seconds, []

    def forward(self, x):
        self.counts.append(torch.get_num_threads())
        time.sleep(self.seconds)
        return x


def _forwards(model: _Timed, n: int) -> list[int]:
    def run() -> None:  # (a thread of its own, as the engine's: its torch thread count is its own)
        torch.set_num_threads(1)
        for _ in range(n):
            model(torch.zeros(1))
            time.sleep(0.02)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return model.counts


class _Idle:
    """What `IdleCores` would have measured: three cores idle."""

    idle, interval_s = 3.0, 0.1


def test_short_forwards_stay_at_the_floor_long_ones_follow_within_the_bounds():
    short = _Timed(0.001)  # (a small model's decode step: shorter than one 0.1 s sample)
    FollowIdleCores.per_forward(short, 1, 4, _Idle())
    assert set(_forwards(short, 40)) == {1}
    long = _Timed(0.12)  # (a forward of more than one sample's thread time)
    FollowIdleCores.per_forward(long, 1, 2, _Idle())
    assert _forwards(long, 4) == [1, 2, 2, 2]  # the first runs as configured; then within the ceiling
    long.seconds = 0.001  # short again: back to the floor after the first short one
    assert _forwards(long, 3)[4:] == [2, 1, 1]


def test_a_server_follows_the_cores_measured_beside_it():
    cores = IdleCores().start()
    try:
        long = _Timed(0.12)
        FollowIdleCores.per_forward(long, 1, 4, cores)
        counts = _forwards(long, 6)
        assert counts[0] == 1 and all(1 <= n <= 4 for n in counts)
    finally:
        cores.stop()
