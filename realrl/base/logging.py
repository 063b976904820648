"""One logger set-up for every realrl process.

`getLogger(name)` returns a logger under the `realrl` hierarchy. The first call
in a process installs a single stderr handler with a compact format; the level
comes from REALRL_LOG_LEVEL (default INFO). Worker processes call
`configure(worker_tag)` once so every line names the worker it came from.
"""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(asctime)s.%(msecs)03d %(levelname).1s %(tag)s%(name)s: %(message)s"
_DATEFMT = "%H:%M:%S"
_tag = ""
_installed = False


class _TagFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.tag = _tag
        return True


def _install() -> None:
    global _installed
    if _installed:
        return
    root = logging.getLogger("realrl")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(_FORMAT, _DATEFMT))
    handler.addFilter(_TagFilter())
    root.addHandler(handler)
    root.setLevel(os.environ.get("REALRL_LOG_LEVEL", "INFO").upper())
    root.propagate = False
    _installed = True


def configure(worker_tag: str = "", level: str | None = None) -> None:
    """Set the tag printed on every line (e.g. `model_worker/0`) and the level."""
    global _tag
    _install()
    _tag = f"[{worker_tag}] " if worker_tag else ""
    if level:
        logging.getLogger("realrl").setLevel(level.upper())


def getLogger(name: str) -> logging.Logger:
    _install()
    if not name.startswith("realrl"):
        name = f"realrl.{name}"
    return logging.getLogger(name)
