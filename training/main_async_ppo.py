"""Asynchronous PPO/GRPO training: `python training/main_async_ppo.py key=value ...`

Overrides use Hydra syntax against the structured config in
`realrl/api/cli_args.py`, with defaults from `training/configs/async-ppo.yaml`
(pick another file in that directory with `--config-name NAME`). A bad key or
value is reported in one line naming the key, before any process starts, and
so is a trial of the same experiment/trial name that is already running; both
exit with code 2. The last lines printed are `plots: <folder of the run's PNGs>`
and `summary: <path of summary.json>`.
"""

from __future__ import annotations

import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:  # `python training/main_async_ppo.py` from anywhere
    sys.path.insert(0, _REPO)

from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.config_store import ConfigStore  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from realrl.api.cli_args import AsyncPPOConfig, ConfigError  # noqa: E402
from realrl.launcher.local import TrialAlreadyRunning  # noqa: E402

CONFIG_DIR = os.path.join(_REPO, "training", "configs")
ConfigStore.instance().store(name="async_ppo_schema", node=AsyncPPOConfig)


# Free-form dicts: their keys are the plugin's to define, so a new key needs no
# Hydra `+` (an override of one becomes `++`, "add or replace").
FREE_FORM_KEYS = ("rollout.agent.args.", "rollout.env.args.")


def load_config(overrides: list[str], config_name: str = "async-ppo") -> AsyncPPOConfig:
    """Composes defaults + overrides into a typed AsyncPPOConfig; any error
    becomes a ConfigError whose message names the key."""
    overrides = [f"++{o}" if o.startswith(FREE_FORM_KEYS) else o for o in overrides]
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides)
        return OmegaConf.to_object(cfg)
    except Exception as e:  # Hydra / OmegaConf errors: keep the line that says what and where
        raise ConfigError(_one_line(e)) from None


def _one_line(e: Exception) -> str:
    cause = e.__cause__ or e
    text = str(cause).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    message = next((ln for ln in lines if not ln.startswith(("full_key:", "object_type", "reference_type"))), text)
    if full_key and full_key not in message:
        return f"{full_key}: {message}"
    return message


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    config_name = "async-ppo"
    if "--config-name" in args:
        i = args.index("--config-name")
        config_name = args[i + 1]
        del args[i : i + 2]
    if args and args[0] in ("-h", "--help"):
        print(__doc__)
        print(OmegaConf.to_yaml(OmegaConf.structured(load_config([], config_name))))
        return 0
    try:
        cfg = load_config(args, config_name)
        from training.utils import run_experiment

        code, summary = run_experiment(cfg)
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


if __name__ == "__main__":
    sys.exit(main())
