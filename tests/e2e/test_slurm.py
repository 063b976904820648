"""`mode=slurm` against a real one-node Slurm cluster (tests/slurm_cluster.py:
Debian's slurm-wlm and munge, on 127.0.0.1): the user's command submits the
trial as one batch job, follows it to the end and returns its exit code; a
worker killed inside the job stops the job with its log tail; `scancel`
leaves no process behind, and re-running the command with `recover=auto`
resumes from the checkpoint; the dry run's script is one `sbatch --test-only`
accepts."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from tests.slurm_cluster import SlurmCluster, ensure_installed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = os.path.join(REPO, "training", "main_async_ppo.py")

# slurmd runs the jobs as root here, and only root can install the packages (CI runs as root).
pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason="a real Slurm cluster needs root (slurmd, apt-get install slurm-wlm munge)"
)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    problem = ensure_installed()
    if problem is not None:
        pytest.skip(problem)
    with SlurmCluster(str(tmp_path_factory.mktemp("slurm"))) as cluster:
        yield cluster


def _trial_args(fileroot, kit_cache, trial: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        MAIN,
        "mode=slurm",
        f"fileroot={fileroot}",
        f"trial_name={trial}",
        f"tiny_kit.cache_dir={kit_cache}",
        "heartbeat_ttl=3",
        "eval.every_n_steps=0",
        "saver.save_final_model=false",
        *overrides,
    ]


def _left(cluster: SlurmCluster) -> list[str]:
    return [cmd for _, cmd in cluster.job_processes()]


def _wait_nothing_left(cluster: SlurmCluster, timeout: float = 60) -> float:
    """Seconds until the cluster runs no job and no process of one."""
    start = time.monotonic()
    while cluster.jobs() or _left(cluster):
        assert time.monotonic() - start < timeout, (cluster.jobs(), _left(cluster))  # a hang guard
        time.sleep(0.1)
    return time.monotonic() - start


def _start(cluster: SlurmCluster, tmp_path, args: list[str], trial: str, min_steps: int = 3):
    """Starts the command and waits until the trial has trained `min_steps` steps."""
    out = open(tmp_path / f"{trial}.console", "wb")
    proc = subprocess.Popen(args, cwd=REPO, env=cluster.env, stdout=out, stderr=subprocess.STDOUT)
    stats = tmp_path / "runs" / "logs" / "async-ppo-tiny" / trial / "stats.jsonl"
    deadline = time.monotonic() + 600
    while not (
        stats.exists() and sum('"train/actor_loss"' in ln for ln in stats.read_text().splitlines()) >= min_steps
    ):
        assert proc.poll() is None, (tmp_path / f"{trial}.console").read_text()[-3000:]
        assert time.monotonic() < deadline, "no training step"  # a hang guard
        time.sleep(0.2)
    return proc


def _job_id(console: str) -> str:
    line = next(ln for ln in console.splitlines() if ln.startswith("realrl: submitted slurm job "))
    return line.split()[4]


def test_a_trial_runs_as_one_batch_job(slurm, tmp_path, kit_cache):
    fileroot, steps, eta = tmp_path / "runs", 30, 2
    start = time.monotonic()
    proc = subprocess.run(
        _trial_args(
            fileroot,
            kit_cache,
            "e2e",
            f"total_train_steps={steps}",
            "eval.max_prompts=64",
            f"rollout.max_head_offpolicyness={eta}",
        ),
        cwd=REPO,
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    wall = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: "), proc.stdout[-2000:]
    with open(last[len("summary: ") :]) as f:
        summary = json.load(f)
    # The usual assertions: learning, staleness, accounting.
    assert summary["steps"] == steps and summary["trajectories"]["consumed"] == steps * 16
    assert summary["final_eval_accuracy"] > summary["initial_eval_accuracy"], summary["eval_history"]
    assert summary["max_staleness_trained"] <= eta
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    # One batch script under the log directory, submitted as one job whose
    # output (the launcher's lines and the master's progress) was followed.
    log_dir = fileroot / "logs" / "async-ppo-tiny" / "e2e"
    job = _job_id(proc.stderr)
    script = (log_dir / "slurm" / "trial.sbatch").read_text()
    assert "#SBATCH --job-name=realrl-async-ppo-tiny-e2e" in script and "-m realrl train --slurm-job" in script
    assert f"step {steps}/{steps} " in proc.stdout
    assert "'generation_server/0': 'localhost'" in proc.stdout  # the placement, from inside the job
    assert (log_dir / "slurm" / f"job-{job}.exit").read_text().strip() == "0"
    state = slurm.run(["scontrol", "show", "job", "-o", job]).stdout
    assert "JobState=COMPLETED" in state and "ExitCode=0:0" in state, state
    # Every worker ran as its own srun step and bound its node's address (NodeAddr 127.0.0.1).
    for name in ("master_worker-0", "model_worker-0", "generation_server-0", "gserver_manager-0", "rollout_worker-0"):
        assert "exited with code 0" in (log_dir / f"{name}.log").read_text(), name
    assert "http://127.0.0.1:" in (log_dir / "generation_server-0.log").read_text()
    assert (fileroot / "run" / "async-ppo-tiny" / "e2e" / "fileroot-probe" / "localhost").exists()
    # Nothing of the trial is left (the cluster itself stays up).
    assert not slurm.jobs() and not _left(slurm), _left(slurm)
    print(f"\nslurm e2e: {steps} steps through sbatch in {wall:.1f}s")


def test_a_killed_worker_stops_the_job_with_its_log_tail(slurm, tmp_path, kit_cache):
    # (by default a dead server is started again; here its death must stop the job)
    proc = _start(
        slurm,
        tmp_path,
        _trial_args(
            tmp_path / "runs",
            kit_cache,
            "killed",
            "total_train_steps=400",
            "eval.max_prompts=16",
            "server.max_restarts=0",
        ),
        "killed",
    )
    (victim,) = [
        pid
        for pid, cmd in slurm.job_processes()
        if "realrl.system.worker_base" in cmd and "generation_server-0" in cmd and not cmd.startswith("srun")
    ]
    killed_at = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    ended = time.monotonic() - killed_at
    console = (tmp_path / "killed.console").read_text()
    assert (
        "\nrealrl: worker generation_server/0 failed (signal SIGKILL on node localhost); stopping the trial." in console
    ), console[-3000:]
    assert "---- generation_server/0 log tail ----" in console and "srun: error: localhost: task 0: Killed" in console
    assert ended < 60, ended  # a hang guard; the issue asks for the whole job within 30 s
    cleanup = _wait_nothing_left(slurm)
    print(f"\nslurm worker kill: command returned {ended:.1f}s after the kill, nothing left {cleanup:.1f}s later")


def test_scancel_leaves_nothing_and_recover_resumes(slurm, tmp_path, kit_cache):
    args = _trial_args(
        tmp_path / "runs",
        kit_cache,
        "cancelled",
        "total_train_steps=400",
        "eval.max_prompts=16",
        "saver.checkpoint_every_n_steps=2",
        "recover=auto",
    )
    proc = _start(slurm, tmp_path, args, "cancelled")
    job = _job_id((tmp_path / "cancelled.console").read_text())
    cancelled_at = time.monotonic()
    assert slurm.run(["scancel", job]).returncode == 0
    assert proc.wait(timeout=120) == 130
    gone = _wait_nothing_left(slurm)
    since_cancel = time.monotonic() - cancelled_at
    console = (tmp_path / "cancelled.console").read_text()
    assert f"realrl: slurm job {job} was cancelled" in console, console[-3000:]
    logs = tmp_path / "runs" / "logs" / "async-ppo-tiny" / "cancelled"
    saved = re.findall(r"checkpoint at step (\d+)", (logs / "master_worker-0.log").read_text())
    assert saved, (logs / "master_worker-0.log").read_text()[-3000:]
    checkpoint = int(saved[-1])

    # The same command with recover=auto (and a nearer end) resumes from the checkpoint.
    steps = checkpoint + 2
    again = [f"total_train_steps={steps}" if a.startswith("total_train_steps=") else a for a in args]
    resumed = subprocess.run(again, cwd=REPO, env=slurm.env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"recovered at step {checkpoint}" in (logs / "master_worker-0.log").read_text()
    stats = [json.loads(line) for line in (logs / "stats.jsonl").read_text().splitlines()]
    assert [s["step"] for s in stats if "train/actor_loss" in s] == list(range(1, steps + 1))  # no gap, no repeat
    summary = json.loads((logs / "summary.json").read_text())
    t = summary["trajectories"]
    assert summary["steps"] == steps and t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    _wait_nothing_left(slurm)
    print(f"\nslurm scancel: nothing left {since_cancel:.1f}s after scancel (the command returned, then {gone:.1f}s)")


def test_the_dry_run_prints_a_script_sbatch_accepts(slurm, tmp_path, kit_cache):
    fileroot = tmp_path / "runs"
    proc = subprocess.run(
        [
            sys.executable,
            MAIN,
            "mode=slurm",
            "slurm.dry_run=true",
            f"fileroot={fileroot}",
            f"tiny_kit.cache_dir={kit_cache}",
            "slurm.nodes=1",
            "slurm.time=10",
            "slurm.mem=1000M",
            "slurm.partition=debug",
            "slurm.setup=['echo setting up']",
        ],
        cwd=REPO,
        env=slurm.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("#!/bin/bash\n") and "summary:" not in proc.stdout
    assert "#SBATCH --time=10\n" in proc.stdout and "\necho setting up\n" in proc.stdout
    script = tmp_path / "printed.sbatch"
    script.write_text(proc.stdout)
    test = slurm.run(["sbatch", "--test-only", str(script)])
    assert test.returncode == 0, test.stderr
    assert "to start at" in test.stderr and "localhost" in test.stderr, test.stderr
    assert not slurm.jobs()  # nothing was submitted

    # A job of the trial already queued: the same command is refused before it submits another.
    held = slurm.run(
        ["sbatch", "--parsable", "--hold", "--job-name=realrl-async-ppo-tiny-run0", "--output=/dev/null", "--wrap=true"]
    ).stdout.strip()
    try:
        again = subprocess.run(
            [sys.executable, MAIN, "mode=slurm", f"fileroot={fileroot}", f"tiny_kit.cache_dir={kit_cache}"],
            cwd=REPO,
            env=slurm.env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert again.returncode == 2, again.stderr[-2000:]
        assert again.stderr.strip().splitlines() == [
            f"realrl: trial async-ppo-tiny/run0 already queued or running as slurm job {held}; leaving it alone"
        ]
        assert slurm.jobs() == [held]
    finally:
        slurm.run(["scancel", held])
    _wait_nothing_left(slurm)
