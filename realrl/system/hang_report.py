"""Hang reports (docs/observability.md): every worker's progress record,
heartbeat and the stacks of all its threads in one file, with a guess at the
worker everybody else waits on.

Stacks are asked for through `names.stack_dump_request` (each worker has a
thread watching it, so this works for workers on any node, as long as the
requester sees the log directory); a worker that does not answer within a
few seconds (its interpreter wedged) and runs on this machine gets SIGUSR1,
which faulthandler serves from C. Written by the launcher's watchdog and by
`realrl status --stacks`.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import time
import uuid
from collections.abc import Callable

from realrl.base import names
from realrl.base.name_resolve import NameRecordRepository
from realrl.base.process import pid_alive
from realrl.system.trial_status import DEAD, Row, format_age, format_doing, format_table, read_rows
from realrl.system.worker_base import stacks_path

ANSWER_WAIT_S = 3.0  # for the request thread's answer; then SIGUSR1 to local workers that gave none
SIGNAL_WAIT_S = 2.0  # for faulthandler's answer to SIGUSR1
LONG_RPC_S = 10.0  # an RPC the master waits on for longer than this is worth naming

# Innermost frames of a main thread that is only waiting for work, as faulthandler
# prints them (file name, function): the event loop's select, the sync loop's
# sleep between polls, the trainer's zmq poll.
IDLE_FRAMES = {
    ("selectors.py", "select"),
    ("base_events.py", "_run_once"),
    ("worker_base.py", "_main_loop"),
    ("poll.py", "poll"),
    ("reply_server.py", "serve"),
}

_THREAD_LINE = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
_FRAME_LINE = re.compile(r'^\s+File "(.*)", line (\d+) in (.+)$')


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(1 << 20).decode(errors="replace")
    except OSError:
        return ""


def signal_local_worker(row: Row) -> bool:
    """SIGUSR1 to a worker of this machine (faulthandler dumps its stacks); False if it is elsewhere or gone."""
    if row.host != socket.gethostname() or not isinstance(row.pid, int) or not pid_alive(row.pid):
        return False
    try:
        os.kill(row.pid, signal.SIGUSR1)
        return True
    except OSError:
        return False


def request_stacks(
    repo: NameRecordRepository,
    experiment: str,
    trial: str,
    log_dir: str,
    rows: list[Row],
    signal_worker: Callable[[Row], bool] | None = signal_local_worker,
) -> dict[str, str]:
    """Asks every live worker of `rows` for its stacks; returns tag -> the dump
    ("" when none came). Blocks for at most ANSWER_WAIT_S + SIGNAL_WAIT_S."""
    live = [r for r in rows if r.alive]
    paths = {r.tag: stacks_path(log_dir, r.worker_type, r.index) for r in live}
    offsets = {tag: _size(path) for tag, path in paths.items()}
    request_id = f"{datetime.datetime.now():%Y%m%d-%H%M%S}-{uuid.uuid4().hex[:6]}"
    repo.add(names.stack_dump_request(experiment, trial), request_id, replace=True, delete_on_exit=False)
    end = f"=== end {request_id} ==="
    found: dict[str, str] = {}
    signalled: set[str] = set()
    t0 = time.monotonic()
    while True:
        for tag in paths:
            if tag not in found:
                text = _read_from(paths[tag], offsets[tag])
                if end in text:
                    start = text.rfind("=== stack dump ", 0, text.index(end))
                    found[tag] = text[max(start, 0) : text.index(end) + len(end)]
        waiting = [r for r in live if r.tag not in found]
        elapsed = time.monotonic() - t0
        if not waiting or elapsed > ANSWER_WAIT_S + SIGNAL_WAIT_S:
            break
        if elapsed > ANSWER_WAIT_S and signal_worker is not None:
            for r in waiting:
                if r.tag not in signalled and signal_worker(r):
                    signalled.add(r.tag)
            if signalled and all(r.tag in signalled for r in waiting) and elapsed > ANSWER_WAIT_S + 1.0:
                break  # faulthandler writes at once; a second is plenty
        time.sleep(0.1)
    for r in live:
        if r.tag not in found:
            text = _read_from(paths[r.tag], offsets[r.tag]).strip()
            if r.tag in signalled and text:
                found[r.tag] = f"(its stack dump thread did not answer; dumped on SIGUSR1)\n{text}"
            else:
                where = f"on {r.host}: kill -USR1 {r.pid}, then see {paths[r.tag]}" if r.host else ""
                found[r.tag] = f"(no stack dump: the worker did not answer{'; ask it ' + where if where else ''})"
    return found


def main_thread_frames(stacks: str, main_thread: str = "") -> list[tuple[str, int, str]]:
    """The main thread's frames in a faulthandler dump, innermost first:
    (file, line, function). The main thread is `main_thread` (0x...), else
    the one the dump's header names, else the dump's "Current thread"."""
    if not main_thread:
        m = re.search(r"main thread (0x[0-9a-f]+)", stacks)
        main_thread = m.group(1) if m else ""
    blocks: dict[str, list[tuple[str, int, str]]] = {}
    current = None
    current_id = ""
    for line in stacks.splitlines():
        m = _THREAD_LINE.match(line)
        if m:
            current = blocks.setdefault(m.group(1), [])
            if line.startswith("Current"):
                current_id = m.group(1)
            continue
        m = _FRAME_LINE.match(line)
        if m and current is not None:
            current.append((m.group(1), int(m.group(2)), m.group(3).strip()))
        elif not line.startswith(" "):
            current = None
    return blocks.get(main_thread) or blocks.get(current_id) or []


def busy_frame(stacks: str, main_thread: str = "") -> tuple[str, int, str] | None:
    """The main thread's innermost frame when it is not one of the usual idle waits."""
    frames = main_thread_frames(stacks, main_thread)
    if not frames:
        return None
    path, _, func = frames[0]
    return None if (os.path.basename(path), func) in IDLE_FRAMES else frames[0]


def _rpc_waits(master: Row | None) -> list[tuple[str, str, float]]:
    """(worker tag, RPC, seconds) the master's row says it waits on: those
    longer than LONG_RPC_S when there are some (a short one beside them is a
    call in its normal course), else every one it shows."""
    out = []
    for entry in (master.doing.get("waiting_on") or []) if master is not None else []:
        parts = str(entry).split()
        try:
            out.append((parts[0], parts[1], float(parts[2].rstrip("s"))))
        except (IndexError, ValueError):
            continue
    return [w for w in out if w[2] >= LONG_RPC_S] or out


def diagnose(rows: list[Row], stacks: dict[str, str]) -> tuple[list[str], str | None]:
    """Findings, one line each, and the worker every other one waits on
    (None when that cannot be told). Evidence, strongest first: a worker that
    is dead, or alive but whose loop stopped publishing while the others'
    run; the worker the master's long RPCs wait on; a main thread in a call
    that is not the usual idle wait."""
    by_tag = {r.tag: r for r in rows}
    master = by_tag.get("master_worker/0")
    lines: list[str] = []
    dead = [r for r in rows if r.state in (DEAD, "ERROR")]
    stale = [r for r in rows if r.stale]
    busy = {}
    for r in rows:
        frame = busy_frame(stacks.get(r.tag, ""), r.main_thread) if r.alive else None
        if frame is not None:
            busy[r.tag] = frame
    waits = _rpc_waits(master)

    if master is not None:
        d = master.doing
        lines.append(
            f"master_worker/0: step {d.get('step', '?')}/{d.get('total_steps', '?')}, stage {d.get('stage', '?')}"
            + "".join(f"; waits on {t} for {name} ({s:.0f}s)" for t, name, s in waits)
        )
        if d.get("stage") == "fetch":
            trainers = [r for r in rows if r.worker_type == "model_worker"]
            buffered = sum(int(r.doing.get("buffered", 0) or 0) for r in trainers)
            lines.append(f"  it waits for trajectories: the trainers hold {buffered}")
            for r in rows:
                if r.worker_type == "gserver_manager" and r.doing:
                    lines.append(f"  {r.tag}: {format_doing(r.doing)}")
    for r in dead:
        lines.append(f"{r.tag}: {r.state}" + (f" ({r.note})" if r.note else ""))
    for r in stale:
        lines.append(
            f"{r.tag}: alive, but its loop has not run for {format_age(r.age)} (its heartbeat thread still runs)"
        )
    for tag, (path, line, func) in busy.items():
        lines.append(f"{tag}: main thread in {func} ({path}:{line}), not an idle wait")

    culprit, why = None, ""
    strong = [r.tag for r in dead + stale]
    if len(strong) == 1:
        culprit, why = strong[0], "dead" if dead else "its loop stopped"
    elif not strong:
        targets = sorted({t for t, _, _ in waits})
        if len(targets) == 1:
            culprit, why = targets[0], "the master's RPC waits on it"
        elif targets and len([t for t in targets if t in busy]) == 1:
            culprit = next(t for t in targets if t in busy)
            why = "the master waits on it and its main thread is busy"
        elif not targets and len(busy) == 1:
            culprit, why = next(iter(busy)), "the only main thread outside an idle wait"
    if culprit is not None:
        lines.append(f"=> every other worker waits on {culprit} ({why})")
    else:
        lines.append(
            "=> could not tell which worker the others wait on"
            + (f" (candidates: {', '.join(strong)})" if strong else "")
        )
    return lines, culprit


def write_report(log_dir: str, title: list[str], rows: list[Row], stacks: dict[str, str], findings: list[str]) -> str:
    """Writes `<log_dir>/hang-report-<time>.txt`; returns its path."""
    os.makedirs(log_dir, exist_ok=True)
    stamp = f"{datetime.datetime.now():%Y%m%d-%H%M%S}"
    path = os.path.join(log_dir, f"hang-report-{stamp}.txt")
    n = 1
    while os.path.exists(path):
        n += 1
        path = os.path.join(log_dir, f"hang-report-{stamp}-{n}.txt")
    parts = [*title, "", "findings:", *(f"  {line}" for line in findings), "", "workers:", format_table(rows), ""]
    for r in rows:
        parts.append(f"---- {r.tag} (pid {r.pid if r.pid is not None else '?'} on {r.host or '?'}) ----")
        parts.append(
            f"state {r.state}, heartbeat {format_age(r.age)}, progress counter {r.progress}"
            + (f", {r.note}" if r.note else "")
        )
        parts.append(f"doing (queue depths among them): {format_doing(r.doing) or '-'}")
        parts.append("stacks:" if r.tag in stacks else "stacks: (not alive: none asked for)")
        if r.tag in stacks:
            parts.append(stacks[r.tag].rstrip())
        parts.append("")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(parts) + "\n")
    os.replace(tmp, path)
    return path


def build_report(
    repo: NameRecordRepository,
    experiment: str,
    trial: str,
    log_dir: str,
    workers,
    reason: str,
    signal_worker: Callable[[Row], bool] | None = signal_local_worker,
) -> tuple[str, list[str], str | None]:
    """Reads every worker's row, asks for stacks, diagnoses, writes the
    report. Returns (path, findings, culprit tag or None)."""
    rows = read_rows(repo, experiment, trial, workers)
    stacks = request_stacks(repo, experiment, trial, log_dir, rows, signal_worker)
    findings, culprit = diagnose(rows, stacks)
    title = [
        f"realrl hang report: trial {experiment}/{trial}, {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"why: {reason}",
        f"log directory: {log_dir}",
    ]
    return write_report(log_dir, title, rows, stacks, findings), findings, culprit
