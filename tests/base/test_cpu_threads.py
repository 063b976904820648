"""A trainer's torch threads follow the cores the rest of the machine leaves idle
(realrl/base/cpu_threads.py)."""

import os
import time

import torch

from realrl.base import cpu_threads


class _Idle:
    """What `IdleCores` would have measured (set by the test)."""

    idle: float | None = None


def test_the_thread_count_follows_idle_cores_in_forward_and_backward():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    cores, before = _Idle(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cpu_threads.follow_idle_cores(model, 1, 3, cores)
        model(torch.randn(2, 8))
        assert torch.get_num_threads() == 1  # nothing measured yet: as configured
        cores.idle = 1.7  # (rounded)
        loss = model(torch.randn(2, 8)).sum()
        assert torch.get_num_threads() == 2
        cores.idle = 0.2  # the servers generate: no fewer than the floor
        loss.backward()  # (switched after a gradient, on this thread)
        assert torch.get_num_threads() == 1
        cores.idle = 8.0  # no more than the ceiling
        model(torch.randn(2, 8))
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_idle_cores_are_measured_beside_this_process():
    cores = cpu_threads.IdleCores(interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 5
        while cores.idle is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cores.idle is not None and 0 <= cores.idle <= len(os.sched_getaffinity(0))
    finally:
        cores.stop()
