"""Deterministic fault points, for tests that must fail at an exact moment.

A fault point is a named place in the code: `faults.point("rollout_worker.
after_ack")`. It does nothing unless a test armed it through the environment
the launcher passes to every worker:

    REALRL_FAULTS="<name>=<action>[,<name>=<action>...]"
    REALRL_FAULTS_DIR=<directory for the markers>

Actions: `kill` (SIGKILL this process), `exit` (os._exit(1)), `stop`
(SIGSTOP this process: up, holding its sockets, answering nothing, until
the test sends SIGCONT to the pid `stopped_pid` reads), `hold:<s>`
(sleep s seconds), `fail:<s>` (the point returns True, "fail now", on every
hit during the s seconds after its first; what failing means is the
caller's: the manager answers 503, say), `fail_once` (True on its first hit
only: a retry then succeeds), `gate` (blocks until the test opens it with
`open_gate`: a trial held at an exact step for as long as the test's events
take, however fast the machine). `<action>;after=<other>` arms a
point only once point `<other>` has fired, so a test orders its faults.
Each point fires once per trial,
whatever restarts happen: its first hit creates `<dir>/<name>` atomically
(O_EXCL), and a later hit, in this process or any other, finds the marker.
Without `REALRL_FAULTS_DIR` nothing fires (no marker, no once-only promise).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from realrl.base.logging import getLogger

FAULTS_ENV = "REALRL_FAULTS"
FAULTS_DIR_ENV = "REALRL_FAULTS_DIR"

logger = getLogger("faults")
# A point that kills its process holds this from its marker to the kill: another thread's point
# armed `after` it must not see the marker and fire (consuming its own marker) in between.
_firing = threading.Lock()


def armed() -> dict[str, str]:
    """name -> action, from the environment."""
    spec = os.environ.get(FAULTS_ENV, "")
    out = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, sep, action = item.partition("=")
        if not sep or not name or not action:
            raise ValueError(f"{FAULTS_ENV}: {item!r} is not <name>=<action>")
        out[name] = action
    return out


def _first_hit(directory: str, name: str) -> float | None:
    """Creates the marker; None if it was there already, else now."""
    path = os.path.join(directory, name)
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except FileExistsError:
        return None
    now = time.time()
    with os.fdopen(fd, "w") as f:
        f.write(f"{now!r}\n")
    return now


def fired(name: str) -> bool:
    """Has point `name` fired in this trial (its marker exists)?"""
    directory = os.environ.get(FAULTS_DIR_ENV)
    return bool(directory) and os.path.exists(os.path.join(directory, name))


def is_armed(name: str) -> bool:
    """Is point `name` armed? (A caller on an event loop hops to a thread only then.)"""
    return name in armed() and bool(os.environ.get(FAULTS_DIR_ENV))


STOPPED_PID = ".pid"  # `<dir>/<name>.pid`: the process point `<name>` stopped


def stopped_pid(directory: str, name: str) -> int | None:
    """The pid of the process that point `name` (armed with `stop`) stopped, once it is stopping."""
    try:
        with open(os.path.join(directory, name + STOPPED_PID)) as f:
            return int(f.read())
    except (FileNotFoundError, ValueError):  # (not yet, or being written)
        return None


GATE_OPEN = ".open"  # `<dir>/<name>.open`: the test opened gate `<name>`
GATE_POLL_S = 0.05
_GATED = -1.0  # `_fire`'s "hold until the gate opens"


def open_gate(directory: str, name: str) -> None:
    """Lets gate point `name` (armed with `gate`, markers in `directory`) go on."""
    with open(os.path.join(directory, name + GATE_OPEN), "w"):
        pass


def point(name: str) -> bool:
    """Fault point `name`: acts if armed and not yet fired in this trial.
    Returns True only for a `fail:<s>` point within its s seconds."""
    action = armed().get(name)
    directory = os.environ.get(FAULTS_DIR_ENV)
    if action is None or not directory:
        return False
    with _firing:  # (a kill happens inside: the process dies holding it)
        failing, hold_s = _fire(name, action, directory)
    if hold_s == _GATED:
        opened = os.path.join(directory, name + GATE_OPEN)
        while not os.path.exists(opened):
            time.sleep(GATE_POLL_S)
        logger.warning("fault point %s: gate opened", name)
    elif hold_s:
        time.sleep(hold_s)
    return failing


def _fire(name: str, action: str, directory: str) -> tuple[bool, float]:
    """`point`'s decision under `_firing`: (fail now, seconds to hold or _GATED)."""
    action, _, condition = action.partition(";")
    if condition:
        key, _, other = condition.partition("=")
        if key != "after" or not other:
            raise ValueError(f"{FAULTS_ENV}: {name}: {condition!r} is not after=<point>")
        if not os.path.exists(os.path.join(directory, other)):
            return False, 0.0
    kind, _, arg = action.partition(":")
    if kind == "fail":
        started = _first_hit(directory, name)
        if started is None:
            with open(os.path.join(directory, name)) as f:
                text = f.read().strip()
            started = float(text) if text else time.time()  # half-written marker: its writer just started
        else:
            logger.warning("fault point %s: failing for %s s", name, arg)
        return time.time() - started < float(arg), 0.0
    if _first_hit(directory, name) is None:
        return False, 0.0
    logger.warning("fault point %s: %s", name, action)
    if kind == "fail_once":
        return True, 0.0
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "stop":
        path = os.path.join(directory, name + STOPPED_PID)
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.replace(path + ".tmp", path)
        os.kill(os.getpid(), signal.SIGSTOP)
    elif kind == "exit":
        os._exit(1)
    elif kind == "hold":
        return False, float(arg)
    elif kind == "gate":
        return False, _GATED
    else:
        raise ValueError(f"{FAULTS_ENV}: unknown action {action!r} for {name}")
    return False, 0.0
