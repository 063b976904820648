"""Faults injected into the default trial, run as the user runs it
(`training/main_async_ppo.py` in a subprocess): a worker SIGKILLed, the
launcher SIGTERMed, etcd killed, the same trial launched twice. The trial
stops by itself: every remaining worker exits on its own (none is left for
the launcher's SIGKILL at its stop timeout), the console says what happened
on a line of its own, and nothing is left running."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKERS = ("master_worker", "model_worker", "generation_server", "gserver_manager", "rollout_worker")
# How far a server's float32 logprob of a trained token may be from the trainer's recomputation in a
# run that trains the tiny kit for tens of steps (η = 0, the same weights). Not 1e-4: trained, this
# model evaluates some tokens ill-conditioned (its last layer multiplies the relative rounding error 5x), so
# each float32 path is itself up to 6e-5 from a float64 evaluation (99.99th percentile 2-6e-5 over 27k
# tokens) and the two paths' kernels (KV-cached decode, packed training rows) round differently: one
# token in 45k differed by 1.7e-4. A server one version behind is off by ~0.3 (the default run's
# median per-step extreme importance weight at η = 4 is 1 ± 0.28-0.36).
TRAINED_LOGPROB_GAP = 1e-3


class Trial:
    """`main_async_ppo.py` in its own process group, stdout and stderr merged
    as on a terminal."""

    def __init__(self, tmp_path, kit_cache, trial: str, *overrides: str):
        self.log_dir = os.path.join(tmp_path, "logs", "async-ppo-tiny", trial)
        self.args = [
            sys.executable,
            os.path.join(REPO, "training", "main_async_ppo.py"),
            f"fileroot={tmp_path}",
            f"trial_name={trial}",
            f"tiny_kit.cache_dir={kit_cache}",
            "heartbeat_ttl=3",
            "eval.every_n_steps=0",
            "eval.max_prompts=16",
            "saver.save_final_model=false",
            "total_train_steps=400",
            *overrides,
        ]
        self.out_path = os.path.join(tmp_path, f"{trial}.console")
        with open(self.out_path, "wb") as out:
            self.proc = subprocess.Popen(
                self.args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True
            )

    def wait_for(self, what: str, predicate, timeout: float = 600):
        """The first true value of `predicate()`, polled while the trial runs."""
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            assert self.proc.poll() is None, f"the trial ended before {what}:\n{self.console()[-3000:]}"
            assert time.monotonic() < deadline, f"timed out waiting for {what}"  # a hang guard
            time.sleep(0.1)

    def wait_for_step(self, step: int, timeout: float = 600) -> None:
        path = os.path.join(self.log_dir, "stats.jsonl")
        self.wait_for(
            f"step {step}",
            lambda: os.path.exists(path) and any(json.loads(line).get("step", 0) >= step for line in open(path)),
            timeout,
        )

    def log(self, tag: str) -> str:
        try:
            with open(os.path.join(self.log_dir, f"{tag}.log"), errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def wait_for_log(self, tag: str, pattern: str, start: int = 0) -> re.Match:
        return self.wait_for(f"{pattern!r} in {tag}.log", lambda: re.search(pattern, self.log(tag)[start:]))

    def worker(self, tag: str) -> psutil.Process:
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            if f"specs/{tag}.json" in " ".join(p.cmdline()):
                return p
        raise AssertionError(f"no process of {tag}")

    def summary(self) -> dict:
        with open(os.path.join(self.log_dir, "summary.json")) as f:
            return json.load(f)

    def workers(self) -> dict[str, psutil.Process]:
        """tag (e.g. 'model_worker-0') -> its process."""
        found = {}
        for p in psutil.Process(self.proc.pid).children(recursive=True):
            m = re.search(r"specs/(\w+-\d+)\.json", " ".join(p.cmdline()))
            if m:
                found[m.group(1)] = p
        assert sorted(t.rsplit("-", 1)[0] for t in found) == sorted(WORKERS), found
        return found

    def wait(self, timeout: float = 180) -> int:
        return self.proc.wait(timeout=timeout)  # a hang guard, not a performance threshold

    def console(self) -> str:
        with open(self.out_path, errors="replace") as f:
            return f.read()

    def exited_by_themselves(self, tags) -> list[str]:
        """The workers whose log ends with their own exit (not SIGKILLed)."""
        return [
            t
            for t in tags
            if "exited with code" in open(os.path.join(self.log_dir, f"{t}.log"), errors="replace").read()
        ]

    def kill(self) -> None:
        try:
            descendants = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            descendants = []
        for p in [self.proc, *descendants]:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        psutil.wait_procs(descendants, timeout=10)


def check_stopped_by_a_killed_worker(trial: Trial, workers: dict, victim: str, code: int) -> None:
    """The trial whose worker `victim` was SIGKILLed stopped with exit code 1, said so on a
    line of its own with the worker's log tail, and every other worker exited by itself."""
    out = trial.console()
    kind = victim.rsplit("-", 1)[0]
    assert code == 1, out[-3000:]
    # Its own line, even right after a progress bar (stdout and stderr share the terminal).
    assert f"\nrealrl: worker {kind}/0 failed (signal SIGKILL); stopping the trial.\n" in out, out[-3000:]
    tail = out.split(f"---- {kind}/0 log tail ----", 1)[1].split("---- full log:", 1)[0]
    assert "%|" not in tail and "\r" not in tail, tail  # what it was doing, not progress bars
    # The master notices the abort while it waits on an RPC to a dead worker.
    others = [t for t in workers if t != victim]
    assert trial.exited_by_themselves(others) == others, out[-3000:]


# (rollout_worker-0: tests/e2e/test_status_watchdog.py's status trial kills it and checks the same,
# with `realrl status` before and after; one trial fewer.)
@pytest.mark.parametrize("victim", ["model_worker-0", "gserver_manager-0"])
def test_a_killed_worker_stops_the_trial_and_the_rest_exit_by_themselves(tmp_path, kit_cache, victim):
    trial = Trial(tmp_path, kit_cache, "kill", "rollout.max_restarts=0")
    try:
        trial.wait_for_step(2)
        workers = trial.workers()
        workers[victim].kill()
        code = trial.wait()
    finally:
        trial.kill()
    check_stopped_by_a_killed_worker(trial, workers, victim, code)


def test_second_launch_of_a_running_trial_exits_2_and_sigterm_stops_the_first(tmp_path, kit_cache):
    first = Trial(tmp_path, kit_cache, "twice")
    try:
        first.wait_for_step(2)
        workers = first.workers()
        second = subprocess.run(first.args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stderr
        lines = second.stderr.strip().splitlines()
        assert lines == [
            f"realrl: trial async-ppo-tiny/twice already running (pid {first.proc.pid}); leaving it alone"
        ], second.stderr
        assert second.stdout == ""
        # The running trial is untouched: same workers, still training.
        assert all(p.is_running() for p in workers.values())
        step = sum(1 for _ in open(os.path.join(first.log_dir, "stats.jsonl")))
        first.wait_for_step(step + 1)

        first.proc.send_signal(signal.SIGTERM)
        code = first.wait()
    finally:
        first.kill()
    out = first.console()
    assert code == 130, out[-3000:]
    assert "\nrealrl: interrupted; stopping trial async-ppo-tiny/twice\n" in out, out[-3000:]
    assert first.exited_by_themselves(workers) == list(workers), out[-3000:]


def test_losing_etcd_is_one_line_and_stops_everything(tmp_path, kit_cache):
    trial = Trial(tmp_path, kit_cache, "noetcd")
    try:
        trial.wait_for_step(2)
        trial.workers()
        etcd = [p for p in psutil.Process(trial.proc.pid).children(recursive=True) if p.name() == "etcd"]
        assert len(etcd) == 1
        etcd[0].kill()
        code = trial.wait()
    finally:
        trial.kill()
    out = trial.console()
    assert code == 1, out[-3000:]
    lost = [line for line in out.splitlines() if "name service lost" in line]
    assert len(lost) == 1, out[-3000:]
    assert re.fullmatch(
        r"realrl: name service lost \((the private etcd at 127\.0\.0\.1:\d+ exited|etcd at 127\.0\.0\.1:\d+ "
        r"does not answer)\); stopping trial async-ppo-tiny/noetcd",
        lost[0],
    ), lost[0]
    assert "Traceback" not in out and "keep-alive" not in out, out[-3000:]
