"""Importing user plugins (Agents, Environments, workers) without editing realrl.

`load_plugins(["my_pkg.my_agent", "/path/to/my_env.py"])` imports each module
path or Python file once per process; every worker process calls it before it
makes agents and environments, so a plugin's `register_agent(...)` /
`register_environment(...)` calls run everywhere. Installed packages can also
advertise modules under the entry-point group `realrl.plugins`; those load too.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from types import ModuleType

from realrl.base.logging import getLogger

logger = getLogger("plugins")

ENTRY_POINT_GROUP = "realrl.plugins"
_loaded: dict[str, ModuleType] = {}


class PluginError(ImportError):
    pass


def _import_file(path: str) -> ModuleType:
    name = "realrl_plugin_" + os.path.splitext(os.path.basename(path))[0].replace("-", "_")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise PluginError(f"plugin {path!r} is not an importable Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)  # a failed import must not look loaded
        raise
    return module


def _key(spec: str) -> str:
    """One key per plugin however it is named: a file by its real path, a
    module by the real path of its file when it is importable from one."""
    if spec.endswith(".py") or os.sep in spec:
        return os.path.realpath(spec)
    found = importlib.util.find_spec(spec) if importlib.util.find_spec is not None else None
    origin = getattr(found, "origin", None)
    return os.path.realpath(origin) if origin and origin.endswith(".py") else spec


def load_plugin(spec: str) -> ModuleType:
    """Imports one plugin given as a module path or a .py file path."""
    try:
        key = _key(spec)
    except (ImportError, ValueError) as e:
        raise PluginError(f"could not import plugin {spec!r}: {type(e).__name__}: {e}") from e
    if key in _loaded:
        return _loaded[key]
    try:
        if spec.endswith(".py") or os.sep in spec:
            if not os.path.isfile(spec):
                raise PluginError(f"plugin file {spec!r} does not exist")
            module = _import_file(key)
        else:
            module = importlib.import_module(spec)
    except PluginError:
        raise
    except Exception as e:
        raise PluginError(f"could not import plugin {spec!r}: {type(e).__name__}: {e}") from e
    _loaded[key] = module
    logger.debug("loaded plugin %s", spec)
    return module


def load_entry_point_plugins() -> list[str]:
    loaded = []
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"entry_point:{ep.name}={ep.value}"
        if key in _loaded:
            continue
        try:
            _loaded[key] = ep.load()
        except Exception as e:
            raise PluginError(f"entry point {ep.name!r} ({ep.value}) of group {ENTRY_POINT_GROUP} failed: {e}") from e
        loaded.append(ep.name)
    return loaded


def load_plugins(specs: list[str] | tuple[str, ...] = ()) -> None:
    """Entry-point plugins first, then the configured ones, each once."""
    load_entry_point_plugins()
    for spec in specs:
        load_plugin(spec)
