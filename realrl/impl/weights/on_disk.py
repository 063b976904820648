"""The versions on disk: `<weights_dir>/<version>/`, each renamed into place
whole by the trainer (docs/design.md §8). Temp directories of a write in
progress, other files and symlinks are never taken for a version."""

from __future__ import annotations

import os


def version_dirs(weights_dir: str) -> dict[int, str]:
    """`<weights_dir>/<u>` for every integer u (directories, not symlinks); {} without the directory."""
    try:
        entries = list(os.scandir(weights_dir))
    except FileNotFoundError:
        return {}
    return {int(e.name): e.path for e in entries if e.name.isdigit() and e.is_dir(follow_symlinks=False)}
