"""Running a trial: `run_experiment(cfg)` builds the worker groups, launches
them with the launcher `mode` names (local, Ray, or from inside a Slurm job)
and returns (exit code, summary path). With `mode=slurm` outside the trial's
own job it checks the config and submits the job instead (docs/slurm.md).
"""

from __future__ import annotations

import json
import os
import sys
import time

from realrl.api.cli_args import AsyncPPOConfig, validate
from realrl.experiment.build import build_experiment
from realrl.experiment.checks import check_environment
from realrl.experiment.config import plugin_paths, trial_paths
from realrl.launcher.local import LocalLauncher


def run_experiment(cfg: AsyncPPOConfig, timeout: float | None = None) -> tuple[int, str]:
    """Runs the trial; returns (exit code, summary path). With recover=auto, a
    trial that fails (a worker died, the name service was lost) is restarted
    from its newest checkpoint, up to `recover_retries` times, each restart
    said on the console and recorded in summary.json under "restarts"."""
    restarts: list[dict] = []
    while True:
        started = time.time()
        code, summary_path, launcher = _run_trial_once(cfg, timeout)
        if code != 1 or cfg.recover != "auto" or len(restarts) >= cfg.recover_retries or launcher is None:
            break
        why = f"worker {launcher.failed_worker} failed" if launcher and launcher.failed_worker else "the trial failed"
        restarts.append({"after_s": round(time.time() - started, 1), "why": why})
        print(
            f"\nrealrl: {why}; restarting the trial from its newest checkpoint "
            f"(restart {len(restarts)} of at most {cfg.recover_retries})",
            file=sys.stderr,
            flush=True,
        )
    if restarts and summary_path and os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        summary["restarts"] = restarts
        tmp = summary_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, summary_path)
    return code, summary_path


def _run_trial_once(cfg: AsyncPPOConfig, timeout: float | None = None) -> tuple[int, str, LocalLauncher | None]:
    """One launch of the trial: (exit code, summary path, its launcher). With mode=slurm,
    outside the trial's own batch job: checks the config, submits the job and
    follows it (summary path "" when nothing ran: slurm.dry_run, slurm.follow=false)."""
    launcher: LocalLauncher | None = None
    if cfg.mode == "slurm":
        from realrl.launcher import slurm

        if not slurm.inside_job():
            check_environment(cfg, validate(cfg))  # before anything is written or submitted
            paths = trial_paths(cfg)
            # (recover=auto restarts happen inside the job, where its launcher runs)
            return (*slurm.submit_trial(cfg, paths.log_dir, paths.summary), None)

    def claim_trial() -> None:  # once the config is known to be good (the launcher needs valid names)
        nonlocal launcher
        args = (cfg.experiment_name, cfg.trial_name, trial_paths(cfg).fileroot, cfg.name_resolve)
        kwargs = dict(
            heartbeat_ttl=cfg.heartbeat_ttl,
            plugins=plugin_paths(cfg),
            echo_worker="master_worker",
            console_every_n_steps=cfg.console.every_n_steps,
            watchdog_timeout=cfg.watchdog.timeout,
            watchdog_action=cfg.watchdog.action,
            security=cfg.security.enabled,
        )
        if cfg.mode == "ray":
            from realrl.launcher.ray import RayLauncher

            launcher = RayLauncher(*args, ray_address=cfg.ray.address, bind_address=cfg.bind_address, **kwargs)
        elif cfg.mode == "slurm":
            from realrl.launcher.slurm import SlurmLauncher

            launcher = SlurmLauncher(
                *args,
                bind_address=cfg.bind_address,
                gpus_per_node=cfg.slurm.gpus_per_node,
                srun_args=cfg.slurm.srun_args,
                **kwargs,
            )
        else:
            launcher = LocalLauncher(*args, **kwargs)
        launcher.acquire_trial()

    try:
        experiment = build_experiment(cfg, claim_trial)
    except BaseException:
        if launcher is not None:
            launcher.release_trial()
        raise
    assert launcher is not None
    if cfg.recover != "auto" and os.path.exists(experiment.paths.summary):
        os.unlink(experiment.paths.summary)
    code = launcher.run(experiment.groups, timeout=timeout)
    if code == 0 and not os.path.exists(experiment.paths.summary):
        print("realrl: the trial ended without writing a summary", file=sys.stderr)
        code = 1
    return code, experiment.paths.summary, launcher
