"""A trainer's torch threads follow the cores the rest of the machine leaves idle
(realrl/base/cpu_threads.py)."""

import os
import time

import torch

from realrl.base import cpu_threads


class _Idle:
    """What `IdleCores` would have measured (set by the test)."""

    idle: float | None = None
    interval_s = 0.1


def test_the_thread_count_follows_idle_cores_in_forward_and_backward():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    cores, before = _Idle(), torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        cpu_threads.FollowIdleCores([model], 1, 3, cores)
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


def test_short_steps_keep_the_floor_until_a_step_is_long_against_the_sampling():
    model = torch.nn.Linear(8, 1)
    cores, before = _Idle(), torch.get_num_threads()
    cores.interval_s, cores.idle = 0.1, 2.0
    try:
        torch.set_num_threads(1)
        threads = cpu_threads.FollowIdleCores([model], 1, 2, cores)
        model(torch.randn(2, 8))
        assert torch.get_num_threads() == 2
        threads.step_took(0.3)  # three samples: the figure is stale within such a step
        assert not threads.following and torch.get_num_threads() == 1
        model(torch.randn(2, 8)).sum().backward()
        assert torch.get_num_threads() == 1  # cores idle, but not followed
        threads.step_took(cpu_threads.MIN_STEP_INTERVALS * 0.1)
        model(torch.randn(2, 8))
        assert threads.following and torch.get_num_threads() == 2
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
