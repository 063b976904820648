"""Per-step statistics: one JSON line per step and TensorBoard scalars.

`StatsLogger(log_dir, resume_step)` appends `{"step": ..., **stats}` to
`stats.jsonl` and writes every numeric value to TensorBoard under
`tensorboard/` (tensorboardX, imported lazily; a machine without it still gets
the JSONL). A fresh trial (`resume_step=0`) starts both anew; a trial recovered
at step k keeps the records of steps <= k and drops the later ones, which the
resumed run is about to write again.

With `wandb={"project": ..., "name": ...}` the numeric values also go to
Weights & Biases in offline mode (under `<log_dir>/wandb/`; `wandb sync`
uploads them later). wandb is not a dependency: without it, one warning says
so and the JSONL and TensorBoard go on as usual.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from typing import Any

from realrl.base.logging import getLogger

logger = getLogger("stats")

TB_FLUSH_S = 2.0  # TensorBoard's writer thread flushes this often (and at close)
_INVALID_TAG_CHARACTERS = re.compile(r"[^-/\w.]")


class StatsLogger:
    def __init__(self, log_dir: str, resume_step: int = 0, tensorboard: bool = True, wandb: dict | None = None):
        os.makedirs(log_dir, exist_ok=True)
        self.path = os.path.join(log_dir, "stats.jsonl")
        tb_dir = os.path.join(log_dir, "tensorboard")
        if resume_step > 0:
            _truncate_after(self.path, resume_step)
        else:
            shutil.rmtree(tb_dir, ignore_errors=True)
        self._file = open(self.path, "a" if resume_step > 0 else "w")
        self._tb = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter

                # purge_step hides events a crashed run wrote after the checkpoint
                self._tb = SummaryWriter(
                    tb_dir, purge_step=resume_step + 1 if resume_step > 0 else None, flush_secs=TB_FLUSH_S
                )
                self._tags: dict[str, str] = {}
            except ImportError:
                logger.warning("tensorboardX is not installed: stats go to %s only", self.path)
        self._wandb = None
        if wandb is not None:
            self._wandb = _open_wandb(log_dir, **wandb)

    def log(self, step: int, stats: dict[str, Any]) -> None:
        record = {"step": step, **stats}
        self._file.write(json.dumps(record, default=_jsonable) + "\n")
        self._file.flush()
        scalars = {
            key: value
            for key, value in stats.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        }
        if self._tb is not None and scalars:
            # One event holding every scalar of the step, flushed by the writer's thread every
            # TB_FLUSH_S: tensorboardX hands each event to that thread through a multiprocessing
            # queue (a pickle and two thread wake-ups); one event per scalar and a flush per step
            # cost the master ~5 ms between two train steps (65 scalars).
            from tensorboardX.proto.summary_pb2 import Summary

            values = [Summary.Value(tag=self._tag(key), simple_value=value) for key, value in scalars.items()]
            self._tb.file_writer.add_summary(Summary(value=values), step)
        if self._wandb is not None:
            try:
                self._wandb.log(scalars, step=step)
            except Exception as e:  # a side channel: never fail the caller
                logger.warning("wandb logging failed, stopping it: %s: %s", type(e).__name__, e)
                self._wandb = None

    def _tag(self, key: str) -> str:
        """`key` as a TensorBoard tag (its characters outside [-/\\w.] become _, as tensorboardX's own)."""
        tag = self._tags.get(key)
        if tag is None:
            tag = self._tags[key] = _INVALID_TAG_CHARACTERS.sub("_", key).lstrip("/")
        return tag

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            try:
                self._wandb.finish()
            except Exception as e:
                logger.warning("wandb finish failed: %s: %s", type(e).__name__, e)
            self._wandb = None


def _open_wandb(log_dir: str, project: str = "realrl", name: str | None = None) -> Any:
    """A Weights & Biases run in offline mode, or None (with one warning) when
    wandb is not installed or does not start."""
    try:
        import wandb
    except ImportError:
        logger.warning(
            "stats.wandb=true, but wandb is not installed (pip install wandb): "
            "stats go to stats.jsonl and TensorBoard only"
        )
        return None
    try:
        run = wandb.init(project=project, name=name, dir=log_dir, mode="offline")
    except Exception as e:
        logger.warning(
            "stats.wandb=true, but wandb did not start (%s: %s): stats go to stats.jsonl and TensorBoard only",
            type(e).__name__,
            e,
        )
        return None
    logger.info("wandb: logging offline under %s (upload with `wandb sync`)", os.path.join(log_dir, "wandb"))
    return run


def _truncate_after(path: str, step: int) -> None:
    """Rewrites the JSONL at `path` (atomically) without records of steps > `step`."""
    if not os.path.exists(path):
        return
    with open(path) as f:
        kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def _jsonable(value: Any) -> Any:
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def summarize(values: list[float], prefix: str) -> dict[str, float]:
    """mean/min/max of a list under `prefix/...` (empty lists give nothing)."""
    if not values:
        return {}
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/min": min(values), f"{prefix}/max": max(values)}


def histogram(values: list[int]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for v in values:
        counts[str(v)] = counts.get(str(v), 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: int(kv[0])))
