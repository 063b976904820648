"""Small process utilities shared by the launcher, workers and helpers.

realrl only ever ends processes it started, by PID or process group
(`signal_tree`, `stop_process_tree`), never by name.
"""

from __future__ import annotations

import atexit
import os
import re
import subprocess
import sys
import time
from typing import NoReturn

import psutil


def pid_alive(pid: int) -> bool:
    """Whether `pid` is a live (non-zombie) process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return True


# A tqdm progress bar: "desc:  40%|####      | 4/10 [00:01<00:02, 3.1it/s]"
_PROGRESS_BAR = re.compile(r"\d+%\|.*\|\s*\S+/\S+\s*\[")


def log_tail(path: str, n: int = 40) -> str:
    """The last `n` lines of a log file as a terminal would have shown them,
    without progress bars: carriage-return rewrites keep only their last
    state, and tqdm lines are dropped (a killed worker's tail should say what
    it was doing, not how far a bar had got). Reads at most the last 256 KiB."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 256 * 1024))
            text = f.read().decode(errors="replace")
    except OSError as e:
        return f"(no log: {e})"
    lines = []
    for line in text.split("\n"):
        shown = line.rstrip("\r").rsplit("\r", 1)[-1]
        if shown.strip() and not _PROGRESS_BAR.search(shown):
            lines.append(shown)
    return "\n".join(lines[-n:])


def signal_tree(pid: int, sig: int) -> None:
    """Signals process group `pid` (a process started with its own session)
    and every descendant of `pid`, also those that moved to another group."""
    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
    for p in descendants:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def stop_process_tree(proc: subprocess.Popen | None, grace_s: float = 10.0) -> None:
    """SIGTERM `proc` and all its descendants, SIGKILL what is left after
    `grace_s`, and reap `proc`."""
    if proc is None:
        return
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        descendants = []
    if proc.poll() is None:
        proc.terminate()
    for p in descendants:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    deadline = time.monotonic() + grace_s
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    _, alive = psutil.wait_procs(descendants, timeout=max(0.0, deadline - time.monotonic()))
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=5)


# Runs as the child before the real command: asks the kernel for SIGKILL when
# the parent dies, then execs the command in the same process (the
# death signal survives exec). This replaces a Popen preexec_fn, which runs
# Python between fork and exec and is unsafe with threads: the etcd client's
# gRPC threads made such children abort ("epoll_wait error: Bad file descriptor").
_PDEATHSIG_EXEC = """\
import ctypes, os, signal, sys
parent, argv = int(sys.argv[1]), sys.argv[2:]
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass  # not Linux: the launcher's process-group kill is the only guard
if os.getppid() != parent:  # the parent died before prctl took effect
    os._exit(1)
os.execvp(argv[0], argv)
"""


def with_parent_death_signal(cmd: list[str], parent_pid: int) -> list[str]:
    """`cmd`, started so that it gets SIGKILL when process `parent_pid` dies."""
    return [sys.executable, "-c", _PDEATHSIG_EXEC, str(parent_pid), *cmd]


def exit_process(code: int) -> NoReturn:
    """Ends this process with `code` as the interpreter would, minus its teardown
    of every module: the atexit handlers run (logging's flush, name-service keys,
    child pools), the standard streams are flushed, then `os._exit`. With torch
    and transformers imported that teardown alone takes 1-4 s of CPU (measured on
    2 busy cores), does nothing for a process that has finished its work, and
    its parent (a worker waiting for its server, the launcher for its workers)
    waits through it. For the `__main__` of a worker or server process only:
    threads still running end with it, as at a kill."""
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # closed or broken: nothing more can be said there
                pass
        os._exit(code)
