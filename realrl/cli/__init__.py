"""`realrl <command>` (also `python -m realrl <command>`), one module per command:

    realrl train [KEY=VALUE ...] [--config-name NAME] [--config-dir DIR]
        run a trial (realrl/cli/train.py; `training/main_async_ppo.py` is the same)
    realrl config [KEY=VALUE ...] [--markdown] [--config-name NAME] [--config-dir DIR]
        every config key with its type, default and help (docs/config.md)
    realrl status [EXPERIMENT [TRIAL]] [KEY=VALUE ...] [--stacks] [--config-name NAME]
        what every worker of a trial is doing (realrl/cli/status.py)
    realrl eval model.path=DIR dataset.test_path=FILE [KEY=VALUE ...] [--output FILE]
        score a model directory as training evaluates (realrl/cli/eval.py)
    realrl add-server [EXPERIMENT [TRIAL]] [KEY=VALUE ...] [--config-name NAME] [--timeout S]
        one more generation server for a running local trial (realrl/cli/add_server.py)

`realrl <command> --help` says more.
"""

from __future__ import annotations

import importlib
import sys

# Imported when run: `realrl status` does not pay for what `realrl train` imports.
COMMANDS = {
    "train": "realrl.cli.train",
    "config": "realrl.cli.config",
    "status": "realrl.cli.status",
    "add-server": "realrl.cli.add_server",
    "eval": "realrl.cli.eval",
}


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command not in COMMANDS:
        print(f"realrl: unknown command {command!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command]).main(rest)
