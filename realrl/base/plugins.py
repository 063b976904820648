"""Importing user code (Agents, Environments, workers, functions) without editing realrl.

`load_plugins(["my_pkg.my_agent", "/path/to/my_env.py"])` imports each module
path or Python file once per process; every worker process calls it before it
makes agents and environments, so a plugin's `register_agent(...)` /
`register_environment(...)` calls run everywhere. Installed packages can also
advertise modules under the entry-point group `realrl.plugins`; those load too.

`load_object("path/to/file.py:name", kind)` or `load_object("pkg.module:name",
kind)` returns one object of a user's file or module, with no registration
(reward functions, agent functions, `rollout.agent.type=pkg.module:Class`).
A file path is relative to the cwd; the file is imported as a module named
after its real path (two files called `task.py` do not clash; loading the
same file again reuses the module). While it executes, its directory is
first on sys.path, so it imports its sibling files as `python file.py`
would; afterwards the directory stays on sys.path at the end only (imports
inside its functions still find siblings, but the directory can never shadow
stdlib or installed modules). Every failure is a one-line ValueError
`<kind> '<spec>': <what went wrong>`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import Any

from realrl.base.child_pool import one_line_error
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


# ---------------------------------------------------------------- single objects

IDENTIFIER_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def is_object_spec(spec: str) -> bool:
    """Whether `spec` names an object as `source:name` (not a registered name)."""
    source, sep, attr = spec.rpartition(":")
    return bool(sep and source and IDENTIFIER_PATH.match(attr))


def is_file_source(source: str) -> bool:
    return source.endswith(".py") or "/" in source or os.sep in source


def absolute_spec(spec: str) -> str:
    """`spec` with a file path made absolute (workers may not share the caller's cwd)."""
    source, sep, attr = spec.rpartition(":")
    return f"{os.path.abspath(source)}:{attr}" if sep and is_file_source(source) else spec


def load_object(spec: str, kind: str) -> Any:
    """The object `spec` (`path/to/file.py:name` or `pkg.module:name`, dotted
    names allowed after the colon) names; see the module docstring."""
    source, sep, attr = spec.rpartition(":")
    if not sep or not source:
        raise ValueError(f"{kind} {spec!r}: not 'path/to/file.py:name' or 'package.module:name'")
    if not IDENTIFIER_PATH.match(attr):
        raise ValueError(f"{kind} {spec!r}: {attr!r} after ':' is not a function name")
    if is_file_source(source):
        obj, where = _import_user_file(spec, source, kind), f"file {os.path.abspath(source)}"
    else:
        obj, where = _import_user_module(spec, source, kind), f"module {source}"
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise ValueError(f"{kind} {spec!r}: {where} has no attribute {attr!r}") from None
    return obj


def _import_user_file(spec: str, source: str, kind: str) -> ModuleType:
    path = os.path.abspath(source)
    if not os.path.isfile(path):
        raise ValueError(f"{kind} {spec!r}: file {path} does not exist")
    real = os.path.realpath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(real))[0])
    name = f"realrl_user_{stem}_{hashlib.sha1(real.encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, real)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"{kind} {spec!r}: {path} is not an importable Python file")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # during execution too: dataclasses and pickle look it up
    directory = os.path.dirname(real)
    sys.path.insert(0, directory)
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as e:
        sys.modules.pop(name, None)  # a failed import must not look loaded
        raise ValueError(f"{kind} {spec!r}: importing {path} failed: {one_line_error(e, where=True)}") from None
    finally:
        # Keep the directory only at the end of sys.path (see the module docstring).
        if sys.path and sys.path[0] == directory:
            sys.path.pop(0)
        elif directory in sys.path:
            sys.path.remove(directory)
        if directory not in sys.path:
            sys.path.append(directory)
    return module


def _import_user_module(spec: str, source: str, kind: str) -> ModuleType:
    if not IDENTIFIER_PATH.match(source):
        raise ValueError(f"{kind} {spec!r}: {source!r} is neither a .py file nor a module path")
    try:
        return importlib.import_module(source)
    except (Exception, SystemExit) as e:
        raise ValueError(
            f"{kind} {spec!r}: importing module {source} failed: {one_line_error(e, where=True)}"
        ) from None
