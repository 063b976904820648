"""Asynchronous PPO/GRPO training: `python training/main_async_ppo.py key=value ...`

The same as `realrl train key=value ...`: Hydra overrides of
`realrl/configs/async-ppo.yaml` (`--config-name NAME`, `--config-dir DIR` for
other defaults), every key in docs/config.md and under `--help`. Copy this
file to start your own entry: it needs only the installed `realrl` package.
"""

import sys

from realrl.base.process import exit_process
from realrl.cli.train import main

if __name__ == "__main__":
    # (exit_process: as sys.exit, without waiting for the interpreter to tear torch down)
    exit_process(main(sys.argv[1:], prog="python training/main_async_ppo.py"))
