"""`realrl train [KEY=VALUE ...] [--config-name NAME] [--config-dir DIR]`: runs a trial.

KEY=VALUE are Hydra overrides of the defaults `realrl/configs/async-ppo.yaml`
(`--config-name NAME` picks `NAME.yaml` there; `--config-dir DIR` reads it
from DIR, whose files may build on the package's in their `defaults` lists,
e.g. `[async-ppo, _self_]`). Every key is listed below with its type, default
and help, and in docs/config.md. A bad key or value is reported in one line
naming the key, before any process starts, and so is a trial of the same
experiment/trial name that is already running; both exit with code 2. The
last lines printed are `plots: <folder of the run's PNGs>` and
`summary: <path of summary.json>`.

Inside a Slurm job the batch script runs `realrl train --slurm-job
<trial.yaml>`: the resolved config the submitting command wrote (docs/slurm.md).
"""

from __future__ import annotations

import os
import sys

from realrl.api.cli_args import ConfigError
from realrl.cli.config import text_reference
from realrl.cli.trial import HelpRequested, UsageError, parse_trial_args
from realrl.experiment.config import load_config
from realrl.experiment.run import run_experiment
from realrl.launcher.local import TrialAlreadyRunning
from realrl.launcher.slurm import run_inside_job


def main(argv: list[str] | None = None, prog: str = "realrl train") -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        _, overrides, options = parse_trial_args(args, __doc__, valued=("--slurm-job",), positional_names=())
    except HelpRequested as e:
        print(f"{str(e).replace('realrl train', prog, 1)}\n\n{text_reference(load_config())}", end="")
        return 0
    except UsageError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    if options["--slurm-job"]:
        return run_inside_job(options["--slurm-job"], lambda cfg: run_experiment(cfg)[0])
    try:
        code, summary = run_experiment(load_config(overrides, options["--config-name"], options["--config-dir"]))
    except ConfigError as e:
        print(f"realrl: config error: {e}", file=sys.stderr)
        return 2
    except TrialAlreadyRunning as e:
        print(f"realrl: {e}", file=sys.stderr)
        return 2
    if code == 0 and summary:  # (mode=slurm with dry_run or follow=false runs nothing here)
        plots = os.path.join(os.path.dirname(summary), "plots")
        if os.path.isdir(plots):
            print(f"plots: {plots}", flush=True)
        print(f"summary: {summary}", flush=True)
    return code
