"""`mode=ray` on a real two-node Ray cluster (two network namespaces, see
tests/ray_cluster.py): the user's command, run on the head node, places the
generation server on the other node, trains across both, and leaves no
worker behind on either.

The module's tests share one cluster (its start is most of a short test's
time): 1 CPU on the head and 3 on the other node, so one trainer fills the head
and the generation server goes to the other node. Each test checks that its
trials leave nothing behind on either node; the test that drops a node runs
last."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests.held_processes import HELD_ROOTS
from tests.ray_cluster import HEAD_IP, WORKER_IP, TwoNodeRayCluster

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ray_trial(cluster: TwoNodeRayCluster, fileroot, kit_cache, *overrides: str) -> list[str]:
    """The command line of a trial on `cluster` (from its head) with these overrides."""
    return [
        sys.executable,
        os.path.join(REPO, "training", "main_async_ppo.py"),
        "mode=ray",
        f"ray.address={cluster.address}",
        f"fileroot={fileroot}",
        f"tiny_kit.cache_dir={kit_cache}",
        *overrides,
    ]


# The two "nodes" are network namespaces, which only root can make (CI runs as root).
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a two-node Ray cluster needs root for `ip netns`")


@pytest.fixture(scope="module")
def module_cluster(tmp_path_factory):
    with TwoNodeRayCluster(str(tmp_path_factory.mktemp("ray")), cpus=(1, 3)) as cluster:
        roots = cluster.root_pids()
        HELD_ROOTS.update(roots)  # Ray keeps worker processes of its own between tests
        try:
            yield cluster
        finally:
            HELD_ROOTS.difference_update(roots)


@pytest.fixture
def cluster(module_cluster):
    if module_cluster.lost_nodes:
        pytest.fail(f"an earlier test dropped {module_cluster.lost_nodes} from the module's cluster (it must run last)")
    return module_cluster


def test_a_trial_runs_across_two_ray_nodes(tmp_path, kit_cache, cluster):
    # 40 steps, the local learning test's budget: from the format-3 kit's warm start, 30 failed once to learn
    fileroot, steps, eta = tmp_path / "runs", 40, 2
    proc = cluster.run_on_head(
        ray_trial(
            cluster,
            fileroot,
            kit_cache,
            f"total_train_steps={steps}",
            f"rollout.max_head_offpolicyness={eta}",
            "eval.every_n_steps=0",
            "heartbeat_ttl=3",
            "saver.save_final_model=false",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("summary: "), proc.stdout[-2000:]
    with open(last[len("summary: ") :]) as f:
        summary = json.load(f)
    assert summary["steps"] == steps and summary["trajectories"]["consumed"] == steps * 16
    assert summary["final_eval_accuracy"] > summary["initial_eval_accuracy"], summary["eval_history"]
    assert summary["max_staleness_trained"] <= eta
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    # The generation server ran on the other node and bound its address there;
    # the trainer and the rest on the head.
    log_dir = fileroot / "logs" / "async-ppo-tiny" / "run0"
    assert f"http://{WORKER_IP}:" in (log_dir / "generation_server-0.log").read_text()
    assert f"{HEAD_IP}:" in (log_dir / "model_worker-0.log").read_text()
    assert f"'generation_server/0': '{WORKER_IP}'" in proc.stderr, proc.stderr[-3000:]
    # A cluster too small for allocation_mode: one line, before any worker starts.
    small = cluster.run_on_head(
        ray_trial(
            cluster,
            fileroot,
            kit_cache,
            "trial_name=toosmall",
            "allocation_mode=torch.d4p1m1+d1p1m1",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert small.returncode == 2, small.stderr[-3000:]
    errors = [line for line in small.stderr.splitlines() if line.startswith("realrl: ")]
    assert errors == [errors[0]] and errors[0].startswith(
        "realrl: config error: allocation_mode: the Ray cluster has no room for generation_server"
    ), small.stderr[-3000:]
    assert not (fileroot / "logs" / "async-ppo-tiny" / "toosmall").exists()
    # Nothing of the trial is left on either node (the Ray cluster itself stays up).
    for ip in (HEAD_IP, WORKER_IP):
        left = [cmd for _, cmd in cluster.processes(ip) if "realrl" in cmd]
        assert not left, left


def test_data_parallel_trainers_on_two_nodes_train_in_lockstep(tmp_path, kit_cache, cluster):
    """One CPU on the head: trainer 0 there, trainer 1 on the other node; their
    gloo group runs over the link between the nodes."""
    fileroot = tmp_path / "runs"
    proc = cluster.run_on_head(
        ray_trial(
            cluster,
            fileroot,
            kit_cache,
            "allocation_mode=torch.d1p1m1+d2p1m1",
            "total_train_steps=3",
            "eval.every_n_steps=0",
            "eval.max_prompts=32",
            "heartbeat_ttl=3",
            "saver.save_final_model=false",
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"'model_worker/0': '{HEAD_IP}'" in proc.stderr and f"'model_worker/1': '{WORKER_IP}'" in proc.stderr, (
        proc.stderr[-2000:]
    )
    with open(proc.stdout.strip().splitlines()[-1][len("summary: ") :]) as f:
        summary = json.load(f)
    assert summary["steps"] == 3 and summary["trajectories"]["consumed"] == 3 * 16
    assert summary["dp_weights_identical"]
    for ip in (HEAD_IP, WORKER_IP):
        left = [cmd for _, cmd in cluster.processes(ip) if "realrl" in cmd]
        assert not left, left


def _start_trial(cluster: TwoNodeRayCluster, tmp_path, kit_cache, trial: str):
    out = open(tmp_path / f"{trial}.console", "wb")
    proc = cluster.popen_on_head(
        ray_trial(
            cluster,
            tmp_path / "runs",
            kit_cache,
            f"trial_name={trial}",
            "total_train_steps=400",
            "eval.every_n_steps=0",
            "eval.max_prompts=16",
            "heartbeat_ttl=3",
            "saver.save_final_model=false",
            # (by default a dead server or rollout worker is started again; here a failure must stop the trial)
            "server.max_restarts=0",
            "rollout.max_restarts=0",
        ),
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
    )
    stats = tmp_path / "runs" / "logs" / "async-ppo-tiny" / trial / "stats.jsonl"
    deadline = time.monotonic() + 600
    while not (stats.exists() and len(stats.read_text().splitlines()) >= 3):
        assert proc.poll() is None, (tmp_path / f"{trial}.console").read_text()[-3000:]
        assert time.monotonic() < deadline, "no training step"  # a hang guard
        time.sleep(0.2)
    return proc


def test_a_failed_worker_or_a_lost_node_stops_the_trial_and_names_the_node(tmp_path, kit_cache, cluster):
    # A worker on the other node dies: its traceback tail and its node are shown.
    proc = _start_trial(cluster, tmp_path, kit_cache, "workerdies")
    (victim,) = [
        pid for pid, cmd in cluster.processes(WORKER_IP) if "worker_base" in cmd and "generation_server-0" in cmd
    ]
    os.kill(victim, signal.SIGKILL)
    assert proc.wait(timeout=120) == 1
    console = (tmp_path / "workerdies.console").read_text()
    assert (
        f"\nrealrl: worker generation_server/0 failed (signal SIGKILL on node {WORKER_IP}); stopping the trial."
        in console
    ), console[-3000:]
    assert "---- generation_server/0 log tail ----" in console
    for ip in (HEAD_IP, WORKER_IP):
        left = [cmd for _, cmd in cluster.processes(ip) if "realrl" in cmd]
        assert not left, left

    # The launcher itself is SIGKILLed: Ray removes its actors, and every
    # worker dies with its actor (and would with the keep-alive key anyway).
    proc = _start_trial(cluster, tmp_path, kit_cache, "launcherdies")
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 120
    while any("realrl.system.worker_base" in cmd for ip in (HEAD_IP, WORKER_IP) for _, cmd in cluster.processes(ip)):
        assert time.monotonic() < deadline, "workers outlived their launcher"  # a hang guard
        time.sleep(0.5)

    # The other node drops out of the cluster (its raylet is killed).
    proc = _start_trial(cluster, tmp_path, kit_cache, "nodedies")
    cluster.kill_raylet(WORKER_IP)
    assert proc.wait(timeout=120) == 1
    console = (tmp_path / "nodedies.console").read_text()
    said = [line for line in console.splitlines() if line.startswith("realrl: ")]
    assert said and WORKER_IP in said[0] and ("was lost" in said[0] or "is gone" in said[0]), console[-3000:]
    deadline = time.monotonic() + 60  # the lost node's own workers notice by themselves
    while any("realrl" in cmd for ip in (HEAD_IP, WORKER_IP) for _, cmd in cluster.processes(ip)):
        assert time.monotonic() < deadline, [
            cmd for ip in (HEAD_IP, WORKER_IP) for _, cmd in cluster.processes(ip) if "realrl" in cmd
        ]
        time.sleep(0.5)
