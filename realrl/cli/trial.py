"""What the commands share: their arguments, `[EXPERIMENT [TRIAL]]
[KEY=VALUE ...] [--config-name NAME] [--config-dir DIR]` (the names only for
`realrl status` and `realrl add-server`), finding a trial the way its run
found it (the same defaults and overrides), and reaching its name service.
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.request

from realrl.base import name_resolve, names, trial_secret
from realrl.base.etcd_server import PRIVATE_ETCD_USER
from realrl.experiment.config import DEFAULT_CONFIG, load_config


class UsageError(ValueError):
    pass


class HelpRequested(Exception):
    """`-h`/`--help`: the command prints this (its usage) and exits 0."""


def load_settings(overrides: list[str], config_name: str = DEFAULT_CONFIG, config_dir: str | None = None) -> dict:
    """experiment_name, trial_name, fileroot and name_resolve as the run saw
    them: composed as `realrl train` does (same defaults and overrides)."""
    cfg = load_config(overrides, config_name, config_dir)
    nr = cfg.name_resolve
    return {
        "experiment_name": cfg.experiment_name,
        "trial_name": cfg.trial_name,
        "fileroot": cfg.fileroot,
        "name_resolve": name_resolve.NameResolveConfig(nr.type, nr.etcd3_addr, nr.file_root),
    }


def parse_trial_args(
    argv: list[str],
    doc: str,
    flags: tuple[str, ...] = (),
    valued: tuple[str, ...] = (),
    positional_names: tuple[str, ...] = ("EXPERIMENT", "TRIAL"),
) -> tuple[list[str], list[str], dict]:
    """`[EXPERIMENT [TRIAL]] [KEY=VALUE ...]` (the `positional_names`) plus
    `--config-name NAME`, `--config-dir DIR`, the `flags` (True when given)
    and the `valued` options (their string): (positional values, overrides,
    {option: value}). UsageError on anything else; `-h`/`--help` raises
    HelpRequested with `doc`."""
    positional, overrides = [], []
    valued = ("--config-name", "--config-dir", *valued)
    options: dict = {**{f: False for f in flags}, **{v: None for v in valued}, "--config-name": DEFAULT_CONFIG}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            raise HelpRequested(doc.strip())
        if a in flags:
            options[a] = True
        elif a in valued:
            if i + 1 >= len(argv):
                raise UsageError(f"{a} needs a value")
            options[a] = argv[i + 1]
            i += 1
        elif a.startswith("-"):
            known = ", ".join([*flags, *(f"{v} VALUE" for v in valued)])
            raise UsageError(f"unknown option {a!r} (options: {known})")
        elif "=" in a:
            overrides.append(a)
        else:
            positional.append(a)
        i += 1
    if len(positional) > len(positional_names):
        expected = (
            f"at most {' and '.join(positional_names)}" if positional_names else "only KEY=VALUE overrides and options"
        )
        raise UsageError(f"{expected}, got {positional}")
    return positional, overrides, options


def resolve_trial(
    positional: list[str], overrides: list[str], config_name: str, config_dir: str | None = None
) -> tuple[dict, str, str, str, str]:
    """[experiment [trial]] + overrides -> (settings, experiment, trial, run dir,
    log dir); a UsageError/ValueError says what is wrong."""
    overrides = list(overrides) + [
        f"{key}={value}" for key, value in zip(("experiment_name", "trial_name"), positional)
    ]
    settings = load_settings(overrides, config_name, config_dir)
    exp, trial = settings["experiment_name"], settings["trial_name"]
    names.trial_root(exp, trial)  # checks the names
    fileroot = os.path.abspath(settings["fileroot"])
    return settings, exp, trial, os.path.join(fileroot, "run", exp, trial), os.path.join(fileroot, "logs", exp, trial)


def _etcd_healthy(addr: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{addr}/health", timeout=2) as r:
            return json.load(r).get("health") == "true"
    except Exception:
        return False


def connect(nr: name_resolve.NameResolveConfig, run_dir: str):
    """(repository, None) or (None, why the name service cannot be reached)."""
    if nr.type == "memory":
        return None, "name_resolve.type=memory lives inside one process"
    if nr.type == "file":
        if not os.path.isdir(nr.file_root):
            return None, f"no name_resolve directory {nr.file_root}"
        return name_resolve.make_repository(nr), None
    addr = nr.etcd3_addr
    if not addr:  # a private etcd: its supervisor wrote where it listens
        try:
            with open(os.path.join(run_dir, "etcd", "etcd.addr")) as f:
                addr = f.read().strip()
        except OSError:
            return None, "no etcd address (the trial's private etcd never started)"
    if not _etcd_healthy(addr):
        return None, f"etcd at {addr} does not answer"
    config = dataclasses.replace(nr, etcd3_addr=addr)
    secret = trial_secret.secret_path(run_dir)
    if not nr.etcd3_addr and os.path.exists(secret):  # the private etcd of a trial with security on (§14)
        config = dataclasses.replace(config, etcd3_user=PRIVATE_ETCD_USER, etcd3_secret=secret)
    try:
        return name_resolve.make_repository(config), None
    except Exception as e:  # a refused password, or etcd gone meanwhile
        return None, f"etcd at {addr}: {type(e).__name__}: {e}"[:300]


def read_json(path: str) -> dict | None:
    """The JSON object in `path`, or None (missing, unreadable, not an object)."""
    try:
        with open(path) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else None
    except (OSError, ValueError):
        return None
