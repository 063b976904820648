"""A CPU torch server's threads follow the idle cores only while its forwards
are long against the idle figure's sampling (realrl/base/cpu_threads.py)."""

from __future__ import annotations

import threading
import time

import torch

from realrl.impl.generation.torch_server.__main__ import follow_idle_cores


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


def test_short_forwards_stay_at_the_floor_long_ones_follow_within_the_bounds():
    short = _Timed(0.001)  # (a small model's decode step: shorter than one 0.1 s sample)
    follow_idle_cores(short, 1, 4)
    assert set(_forwards(short, 40)) == {1}
    long = _Timed(0.12)
    follow_idle_cores(long, 1, 4)
    counts = _forwards(long, 6)
    assert counts[0] == 1 and all(1 <= n <= 4 for n in counts)
