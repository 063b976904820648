"""What every worker of a trial is doing, read from its name_resolve keys
(docs/observability.md): one `Row` per worker, from its status key (the
heartbeat: held with a TTL) and its progress record (`names.worker_progress`,
rewritten by the worker's loop every two seconds).

Used by `realrl status` (realrl/cli/status.py), the launcher's hang watchdog
(realrl/launcher/watchdog.py) and the launcher's final snapshot. Reading
never writes anything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import time
from typing import Any

from realrl.base import names
from realrl.base.name_resolve import NameEntryNotFoundError, NameRecordRepository, ValueWatch
from realrl.base.process import pid_alive

LIVE_STATES = ("READY", "RUNNING", "PAUSED")
FINAL_STATES = ("COMPLETED", "STOPPED", "ERROR")
DEAD = "DEAD"  # no heartbeat (status key expired) or its process is gone, without a final state
NO_RECORD = "-"  # nothing published (not started yet, or the trial never got there)
STALE_S = 10.0  # a live worker whose loop has not published for this long is flagged "stale"


@dataclasses.dataclass
class Row:
    worker_type: str
    index: int
    state: str = NO_RECORD
    host: str = ""
    pid: int | None = None
    age: float | None = None  # seconds since the worker's loop last published its record
    progress: int | None = None  # the worker's work counter (monotonic within a process)
    doing: dict = dataclasses.field(default_factory=dict)
    main_thread: str = ""  # its main thread's id as faulthandler prints it
    note: str = ""  # how it ended, an error, ...

    @property
    def tag(self) -> str:
        return f"{self.worker_type}/{self.index}"

    @property
    def alive(self) -> bool:
        return self.state in LIVE_STATES

    @property
    def stale(self) -> bool:
        """Alive (heartbeat held) but its loop has not published for STALE_S."""
        return self.alive and self.age is not None and self.age > STALE_S


def expected_workers(log_dir: str) -> list[tuple[str, int]]:
    """The trial's workers as the launcher wrote their specs (`<log_dir>/specs/<type>-<index>.json`)."""
    out = []
    try:
        entries = os.listdir(os.path.join(log_dir, "specs"))
    except OSError:
        return out
    for name in entries:
        stem, ext = os.path.splitext(name)
        kind, sep, index = stem.rpartition("-")
        if ext == ".json" and sep and index.isdigit():
            out.append((kind, int(index)))
    return sort_workers(out)


_KIND_ORDER = (
    "master_worker",
    "model_worker",
    "generation_server",
    "judge_server",
    "gserver_manager",
    "rollout_worker",
)


def sort_workers(workers) -> list[tuple[str, int]]:
    order = {k: i for i, k in enumerate(_KIND_ORDER)}
    return sorted(set(workers), key=lambda w: (order.get(w[0], len(order)), w[0], w[1]))


def published_workers(repo: NameRecordRepository, experiment: str, trial: str) -> list[tuple[str, int]]:
    """Workers that have a status key or a progress record."""
    out = []
    for root in (names.worker_status_root(experiment, trial), names.worker_progress_root(experiment, trial)):
        for key in repo.find_subtree(root):
            kind, _, index = key[len(root) + 1 :].rpartition("/")
            if kind and index.isdigit():
                out.append((kind, int(index)))
    return out


def _get(repo: NameRecordRepository | ValueWatch, key: str) -> str | None:
    try:
        return repo.get(key)
    except NameEntryNotFoundError:
        return None


def read_row(
    repo: NameRecordRepository | ValueWatch,
    experiment: str,
    trial: str,
    worker_type: str,
    index: int,
    now: float | None = None,
    local_host: str | None = None,
) -> Row:
    """One worker's row. A live status whose process is gone on this host
    (`local_host`, default this machine's name) reads as DEAD at once,
    before its key's TTL runs out."""
    now = time.time() if now is None else now
    local_host = socket.gethostname() if local_host is None else local_host
    row = Row(worker_type, index)
    status = _get(repo, names.worker_status(experiment, trial, worker_type, index))
    raw = _get(repo, names.worker_progress(experiment, trial, worker_type, index))
    record: dict[str, Any] = {}
    if raw is not None:
        try:
            record = json.loads(raw)
        except ValueError:
            row.note = "unreadable progress record"
    if record:
        row.host = str(record.get("host", ""))
        row.pid = record.get("pid")
        row.age = max(0.0, now - float(record.get("time", now)))
        row.progress = record.get("progress")
        row.doing = record.get("doing") or {}
        row.main_thread = str(record.get("main_thread", ""))
    if status is not None:
        row.state = status
        if status in LIVE_STATES and row.host == local_host and isinstance(row.pid, int) and not pid_alive(row.pid):
            row.state, row.note = DEAD, f"process {row.pid} is gone"
    elif record:
        last = record.get("state", "")
        row.state = last if last in FINAL_STATES else DEAD
        if row.state == DEAD:
            row.note = "no heartbeat"
    if row.state == "ERROR" or row.state == DEAD:
        if _get(repo, names.worker_error(experiment, trial, worker_type, index)) is not None:
            row.note = (row.note + "; " if row.note else "") + "traceback recorded"
    return row


def read_rows(
    repo: NameRecordRepository, experiment: str, trial: str, workers=(), now: float | None = None
) -> list[Row]:
    """Rows of `workers` ((type, index) pairs) and of every worker that published anything."""
    everyone = sort_workers(list(workers) + published_workers(repo, experiment, trial))
    return [read_row(repo, experiment, trial, kind, index, now=now) for kind, index in everyone]


# ---- formatting ---------------------------------------------------------------------------------------


def format_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (list, tuple)):
        return "[" + "; ".join(format_value(v) for v in value) + "]" if value else "[]"
    if isinstance(value, dict):
        return "{" + " ".join(f"{k}={format_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def format_doing(doing: dict) -> str:
    """`step=3/40 stage=fetch ...`: key=value pairs in the worker's order;
    a step shows its total and empty lists are left out."""
    doing = dict(doing)
    parts = []
    if "step" in doing and "total_steps" in doing:
        parts.append(f"step={doing.pop('step')}/{doing.pop('total_steps')}")
    for key, value in doing.items():
        if value in (None, [], {}, ""):
            continue
        parts.append(f"{key}={format_value(value)}")
    return " ".join(parts)


def format_age(age: float | None) -> str:
    if age is None:
        return "-"
    if age < 60:
        return f"{age:.1f}s"
    if age < 3600:
        return f"{age / 60:.1f}m"
    return f"{age / 3600:.1f}h"


def format_table(rows: list[Row]) -> str:
    """One line per worker under a header; columns sized to fit."""
    header = ("WORKER", "HOST", "PID", "STATE", "HEARTBEAT", "DOING")
    lines = []
    for r in rows:
        state = r.state + (" (stale)" if r.stale else "")
        doing = format_doing(r.doing) if r.alive else ""
        if r.note:
            doing = f"{doing} ({r.note})" if doing else f"({r.note})"
        lines.append((r.tag, r.host or "-", str(r.pid) if r.pid is not None else "-", state, format_age(r.age), doing))
    widths = [max(len(x[i]) for x in [header, *lines]) for i in range(len(header) - 1)]
    out = []
    for cells in [header, *lines]:
        out.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)) + "  " + cells[-1])
    return "\n".join(line.rstrip() for line in out)


def row_to_json(row: Row) -> dict:
    return dataclasses.asdict(row)


def row_from_json(data: dict) -> Row:
    fields = {f.name for f in dataclasses.fields(Row)}
    return Row(**{k: v for k, v in data.items() if k in fields})
