"""Recovery checkpoints on disk: written atomically, verified before use.

Layout under the trial's checkpoint directory:

    step<N>/                    one complete checkpoint
        model_worker.pt         models, optimizers, schedules (trainer rank 0)
        meta.json               weight version, step, data-parallel size
        buffer-rank<r>.wire     the trajectories rank r held (wire format)
        master_state.json       counters, the data ledger, rollout cursors, eval history
        MANIFEST.json           size and sha256 of every file above
    step<N>.tmp-<id>/           one being written (never read)

The master makes a temporary directory, has every part written into it,
writes the manifest last, fsyncs and renames it to `step<N>`: a crash leaves
either the whole checkpoint or a temporary directory that is ignored (and
removed by the next checkpoint). `newest_valid` checks the manifest of the
newest checkpoint and falls back to the previous one when a file is missing,
truncated or changed. The last `KEEP` checkpoints are kept.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid

from realrl.base.logging import getLogger

logger = getLogger("checkpoints")

MANIFEST = "MANIFEST.json"
KEEP = 2
_STEP_DIR = re.compile(r"step(\d+)")


def new_temp_dir(root: str, step: int) -> str:
    path = os.path.join(root, f"step{step}.tmp-{uuid.uuid4().hex[:8]}")
    os.makedirs(path)
    return path


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(temp_dir: str, root: str, step: int) -> str:
    """Writes the manifest of everything in `temp_dir`, makes it durable and
    renames it to `step<step>`; removes older checkpoints beyond KEEP and
    leftover temporary directories. Returns the checkpoint's path."""
    files = {}
    for name in sorted(os.listdir(temp_dir)):
        path = os.path.join(temp_dir, name)
        _fsync(path)
        files[name] = {"size": os.path.getsize(path), "sha256": _sha256(path)}
    with open(os.path.join(temp_dir, MANIFEST), "w") as f:
        json.dump({"step": step, "files": files}, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    final = os.path.join(root, f"step{step}")
    if os.path.exists(final):  # the same step again (a resumed trial): replace it whole
        shutil.rmtree(final)
    os.rename(temp_dir, final)
    _fsync(root)
    _prune(root)
    return final


def _steps(root: str) -> list[int]:
    if not os.path.isdir(root):
        return []
    return sorted((int(m.group(1)) for m in map(_STEP_DIR.fullmatch, os.listdir(root)) if m), reverse=True)


def _prune(root: str) -> None:
    for step in _steps(root)[KEEP:]:
        shutil.rmtree(os.path.join(root, f"step{step}"), ignore_errors=True)
    for name in os.listdir(root):
        if ".tmp-" in name:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def problem(path: str) -> str | None:
    """Why the checkpoint at `path` cannot be used, or None if it is whole."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"no readable {MANIFEST} ({type(e).__name__})"
    for name, want in files.items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            return f"{name} is missing"
        if os.path.getsize(file) != want["size"]:
            return f"{name} has {os.path.getsize(file)} bytes, the manifest says {want['size']}"
        if _sha256(file) != want["sha256"]:
            return f"{name} does not match its sha256 in the manifest"
    return None


def newest_valid(root: str) -> str | None:
    """The newest checkpoint that passes `problem`, saying (warning) why any
    newer one was skipped; None if there is none."""
    for step in _steps(root):
        path = os.path.join(root, f"step{step}")
        why = problem(path)
        if why is None:
            return path
        logger.warning("checkpoint %s is damaged (%s); falling back to the previous one", path, why)
    return None
