"""mode=slurm without a cluster: the batch script, the slurm.* checks, the
placement of workers on the job's nodes and GPUs, and what the launcher
reads from Slurm (CPU counts, srun's report of a task's end)."""

from __future__ import annotations

import dataclasses
import os
import subprocess

import pytest

from realrl.api.cli_args import ConfigError, SlurmConfig, validate
from realrl.experiment.config import load_config as load_cli_config
from realrl.experiment.run import run_experiment
from realrl.launcher.ray import Demand
from realrl.launcher.slurm import (
    Slot,
    SlurmStep,
    batch_script,
    dump_config,
    expand_cpus_per_node,
    load_config,
    plan_placement,
    sbatch_options,
)


def _cfg(*overrides: str):
    return load_cli_config(["mode=slurm", *overrides])


def test_the_default_script_runs_the_launcher_on_whole_nodes():
    cfg = _cfg("fileroot=/shared/runs", "trial_name=t1")
    log_dir = "/shared/runs/logs/async-ppo-tiny/t1"
    script = batch_script(
        cfg, log_dir, f"{log_dir}/slurm/trial.yaml", "/home/me/work", python="/venv/bin/python", package_parent="/repo"
    )
    assert script.splitlines()[0] == "#!/bin/bash"
    directives = [ln[len("#SBATCH ") :] for ln in script.splitlines() if ln.startswith("#SBATCH ")]
    assert directives == [
        "--job-name=realrl-async-ppo-tiny-t1",
        "--nodes=1",
        "--ntasks-per-node=1",
        "--exclusive",
        f"--output={log_dir}/slurm/job-%j.out",
        "--open-mode=append",
        "--chdir=/home/me/work",
        "--no-requeue",
    ]
    body = [ln for ln in script.splitlines() if ln and not ln.startswith("#")]
    assert body == [
        "export PYTHONUNBUFFERED=1",
        "export PYTHONPATH=/repo${PYTHONPATH:+:$PYTHONPATH}",
        f"exec /venv/bin/python -m realrl train --slurm-job {log_dir}/slurm/trial.yaml",
    ]


def test_every_slurm_key_maps_to_its_sbatch_option():
    cfg = _cfg(
        "slurm.partition=gpu",
        "slurm.nodes=4",
        "slurm.gpus_per_node=8",
        "slurm.cpus_per_node=64",
        "slurm.mem=480G",
        "slurm.time=2-00:00:00",
        "slurm.account=proj",
        "slurm.qos=high",
        "slurm.constraint='a100&ib'",
        "slurm.job_name=rl",
        "slurm.sbatch_args=['--exclude=n7','--reservation=rl']",
        "recover=auto",
    )
    opts = sbatch_options(cfg, "/runs/logs/e/t", "/work dir")
    assert opts == [
        "--job-name=rl",
        "--nodes=4",
        "--ntasks-per-node=1",
        "--cpus-per-task=64",
        "--gpus-per-node=8",
        "--mem=480G",
        "--time=2-00:00:00",
        "--partition=gpu",
        "--account=proj",
        "--qos=high",
        "--constraint=a100&ib",
        "--output=/runs/logs/e/t/slurm/job-%j.out",
        "--open-mode=append",
        '--chdir="/work dir"',
        "--requeue",
        "--exclude=n7",
        "--reservation=rl",
    ]
    cfg = _cfg("slurm.setup=[module load cuda/12.4,source /opt/env.sh]")
    script = batch_script(
        cfg, "/r/logs/e/t", "/r/logs/e/t/slurm/trial.yaml", "/w", python="/py", package_parent="/my repo"
    )
    lines = script.splitlines()
    assert "export PYTHONPATH='/my repo'${PYTHONPATH:+:$PYTHONPATH}" in lines
    # setup lines run after the environment is set and before the launcher
    assert lines[-3:] == [
        "module load cuda/12.4",
        "source /opt/env.sh",
        "exec /py -m realrl train --slurm-job /r/logs/e/t/slurm/trial.yaml",
    ]


@pytest.mark.parametrize(
    "override, key",
    [
        ("slurm.nodes=0", "slurm.nodes"),
        ("slurm.gpus_per_node=-1", "slurm.gpus_per_node"),
        ("slurm.cpus_per_node=-2", "slurm.cpus_per_node"),
        ("slurm.mem=lots", "slurm.mem"),
        ("slurm.time=soon", "slurm.time"),
        ("slurm.partition='a b'", "slurm.partition"),
        ("slurm.account='x;rm -rf /'", "slurm.account"),
        ("slurm.job_name='a\nb'", "slurm.job_name"),
        ("slurm.sbatch_args=[exclusive]", "slurm.sbatch_args"),
        ("slurm.srun_args=['--mpi=none\n#SBATCH --x']", "slurm.srun_args"),
        ("slurm.setup=['a\nb']", "slurm.setup"),
    ],
)
def test_a_bad_slurm_value_is_one_line_naming_the_key(override, key):
    cfg = _cfg(override)
    with pytest.raises(ConfigError) as e:
        validate(cfg)
    assert str(e.value).startswith(f"{key}: ") and "\n" not in str(e.value), str(e.value)


def test_valid_slurm_values_pass():
    validate(_cfg("slurm.time=30", "slurm.time=1-12", "slurm.mem=500M", "slurm.constraint='[rack1|rack2]'"))
    validate(_cfg("slurm.time=UNLIMITED", "slurm.srun_args=['--mpi=none','--cpu-bind=none']"))


def test_what_does_not_fit_the_job_is_refused_before_anything_is_submitted(tmp_path, monkeypatch):
    """Checked on the submitting machine: one line naming the key, nothing written or submitted."""
    fileroot = tmp_path / "runs"
    base = ["mode=slurm", f"fileroot={fileroot}"]
    cases = [
        (["train.device=cuda"], "slurm.gpus_per_node: model_worker needs 1 GPU(s) (train.device)"),
        (["server.torch.device=cuda"], "slurm.gpus_per_node: generation_server needs 1 GPU(s) (allocation_mode)"),
        (
            ["allocation_mode=torch.d1p1m1+d9p1m1", "train.device=cuda", "slurm.nodes=2", "slurm.gpus_per_node=4"],
            "allocation_mode: 9 trainer ranks need 9 GPUs (one each for NCCL), the job has 8",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
            run_experiment(load_cli_config(base + overrides))
    # No Slurm on PATH: one line saying so (the dry run needs none).
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match=r"^mode: slurm submits the trial with Slurm's sbatch, which is not on PATH"):
        run_experiment(load_cli_config(base))
    assert not fileroot.exists()


def test_the_resolved_config_round_trips_through_yaml(tmp_path):
    cfg = _cfg("fileroot=/r", "rollout.agent.args.x=1", "ppo.c_clip=3.0", "slurm.sbatch_args=['--exclude=n1']")
    path = tmp_path / "trial.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg


def _demands(n_train: int, train_gpus: int, n_gen: int, gen_gpus: int, n_rollout: int = 1) -> list[Demand]:
    return (
        [Demand("master_worker", 0, 0, 0)]
        + [Demand("model_worker", i, 1, train_gpus) for i in range(n_train)]
        + [Demand("generation_server", i, 1, gen_gpus) for i in range(n_gen)]
        + [Demand("gserver_manager", 0, 0, 0)]
        + [Demand("rollout_worker", i, 1, 0) for i in range(n_rollout)]
    )


def test_cpu_workers_share_one_node_and_split_across_two():
    plan, notes = plan_placement(["n0"], 0, _demands(1, 0, 1, 0))
    assert {s.node for s in plan.values()} == {"n0"} and not notes
    plan, notes = plan_placement(["n0", "n1"], 0, _demands(2, 0, 2, 0, n_rollout=3))
    assert plan[("model_worker", 0)] == plan[("model_worker", 1)] == Slot("n0")
    assert plan[("generation_server", 0)] == plan[("generation_server", 1)] == Slot("n1")
    assert plan[("master_worker", 0)].node == plan[("gserver_manager", 0)].node == "n0"
    assert [plan[("rollout_worker", i)].node for i in range(3)] == ["n1", "n1", "n1"]
    plan, _ = plan_placement(["n0", "n1", "n2"], 0, _demands(1, 0, 2, 0, n_rollout=2))
    assert [plan[("generation_server", i)].node for i in range(2)] == ["n1", "n2"]
    assert [plan[("rollout_worker", i)].node for i in range(2)] == ["n1", "n2"]


def test_gpu_trainers_and_servers_get_separate_nodes_when_there_are_enough():
    nodes = ["n0", "n1", "n2"]
    plan, notes = plan_placement(nodes, 8, _demands(8, 1, 4, 2))  # sglang.d4p1m2+d8p1m1
    assert [plan[("model_worker", i)] for i in range(8)] == [Slot("n0", (i,)) for i in range(8)]
    assert [plan[("generation_server", i)] for i in range(4)] == [
        Slot("n1", (0, 1)),
        Slot("n1", (2, 3)),
        Slot("n1", (4, 5)),
        Slot("n1", (6, 7)),
    ]
    assert not notes
    plan, _ = plan_placement(nodes, 4, _demands(4, 1, 4, 2))  # two server nodes
    assert [plan[("generation_server", i)] for i in range(4)] == [
        Slot("n1", (0, 1)),
        Slot("n1", (2, 3)),
        Slot("n2", (0, 1)),
        Slot("n2", (2, 3)),
    ]


def test_too_few_nodes_share_them_as_local_mode_does():
    # One node of 4 GPUs, 2 trainers + 2 servers: separate GPUs on the same node.
    plan, notes = plan_placement(["n0"], 4, _demands(2, 1, 2, 1))
    assert [plan[("model_worker", i)] for i in range(2)] == [Slot("n0", (0,)), Slot("n0", (1,))]
    assert [plan[("generation_server", i)] for i in range(2)] == [Slot("n0", (2,)), Slot("n0", (3,))]
    assert not notes
    # Two GPUs for 2 + 2: the servers share the trainers' GPUs, and a note says so.
    plan, notes = plan_placement(["n0"], 2, _demands(2, 1, 2, 1))
    assert [plan[("generation_server", i)] for i in range(2)] == [Slot("n0", (0,)), Slot("n0", (1,))]
    assert notes and "share GPUs" in notes[0]
    # 7 trainers on two nodes of 4 GPUs leave one GPU: a server of tp 2 shares two on one node.
    plan, notes = plan_placement(["n0", "n1"], 4, _demands(7, 1, 1, 2))
    assert [plan[("model_worker", i)].node for i in range(7)] == ["n0"] * 4 + ["n1"] * 3
    assert plan[("generation_server", 0)] == Slot("n0", (0, 1)) and notes


def test_gpu_shapes_that_cannot_fit_are_config_errors():
    with pytest.raises(ConfigError, match=r"^allocation_mode: a generation server needs 4 GPUs on one node"):
        plan_placement(["n0", "n1"], 2, _demands(1, 1, 1, 4))
    with pytest.raises(ConfigError, match=r"^slurm.gpus_per_node: model_worker needs 1 GPU"):
        plan_placement(["n0"], 0, _demands(1, 1, 1, 0))
    with pytest.raises(ConfigError, match=r"^allocation_mode: 3 trainer ranks need 3 GPUs"):
        plan_placement(["n0"], 2, _demands(3, 1, 1, 0))


def test_cpus_per_node_as_slurm_writes_them():
    assert expand_cpus_per_node("2") == [2]
    assert expand_cpus_per_node("72(x2),36") == [72, 72, 36]
    assert expand_cpus_per_node("") == [] and expand_cpus_per_node("x") == []


def test_a_steps_end_is_described_from_sruns_report(tmp_path):
    log = tmp_path / "w.log"
    popen = subprocess.Popen(["true"])
    popen.wait()
    step = SlurmStep("generation_server/0", "generation_server", 0, str(log), popen, node="n3")
    log.write_text("working\nsrun: error: n3: task 0: Killed\nsrun: Force Terminated StepId=7.4\n")
    assert step.describe_exit(137) == "signal SIGKILL on node n3"
    log.write_text("Traceback ...\nsrun: error: n3: task 0: Exited with exit code 1\n")
    assert step.describe_exit(1) == "exit code 1 on node n3"
    log.write_text("no srun line\n")
    assert step.describe_exit(1) == "exit code 1 of its srun step on node n3"
    assert step.describe_exit(-9) == "its srun ended by signal SIGKILL, node n3"


def test_slurm_config_defaults_are_whole_nodes_and_following():
    s = SlurmConfig()
    assert (s.nodes, s.gpus_per_node, s.cpus_per_node, s.dry_run, s.follow) == (1, 0, 0, False, True)
    assert dataclasses.asdict(s)["sbatch_args"] == [] and dataclasses.asdict(s)["setup"] == []


def test_a_gpu_worker_keeps_its_own_positions_among_the_visible_gpus(monkeypatch):
    from realrl.launcher import slurm

    calls = []
    monkeypatch.setattr(
        slurm.os, "execv", lambda path, argv: calls.append((path, argv, os.environ["CUDA_VISIBLE_DEVICES"]))
    )
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    slurm._exec_worker("1,2", "/specs/generation_server-0.json")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    slurm._exec_worker("3", "/specs/model_worker-0.json")
    assert [c[2] for c in calls] == ["5,6", "3"]
    assert calls[0][1][-3:] == ["realrl.system.worker_base", "--spec", "/specs/generation_server-0.json"]


def test_following_a_job_streams_its_output_and_returns_the_trials_code(tmp_path, monkeypatch, capsys):
    from realrl.launcher import slurm

    out, exit_file = tmp_path / "job-7.out", tmp_path / "job-7.exit"
    states = iter(
        [
            {"JobState": "PENDING", "Reason": "Resources"},
            {"JobState": "RUNNING", "NodeList": "n[1-2]"},
            {"JobState": "RUNNING"},
            {"JobState": "FAILED", "ExitCode": "1:0"},
        ]
    )

    def job_state(job_id):
        state = next(states)
        if state["JobState"] == "RUNNING":
            with open(out, "a") as f:
                f.write("step 1/2\n")
        if state["JobState"] == "FAILED":
            exit_file.write_text("1\n")
        return state

    monkeypatch.setattr(slurm, "job_state", job_state)
    assert slurm.follow_job("7", str(out), str(exit_file), poll_interval=0) == 1
    captured = capsys.readouterr()
    assert captured.out == "step 1/2\nstep 1/2\n"
    assert "slurm job 7 is pending (Resources)" in captured.err and "slurm job 7 is running on n[1-2]" in captured.err
    # Without the launcher's exit file: the job's state and ExitCode say it.
    exit_file.unlink()
    monkeypatch.setattr(
        slurm, "job_state", lambda job_id: {"JobState": "TIMEOUT", "ExitCode": "0:15", "Reason": "TimeLimit"}
    )
    monkeypatch.setattr(slurm, "_EXIT_FILE_GRACE_S", 0.0)
    assert slurm.follow_job("8", str(out), str(tmp_path / "none.exit"), poll_interval=0) == 1
    assert "slurm job 8 ended TIMEOUT (exit code 0:15, TimeLimit)" in capsys.readouterr().err
