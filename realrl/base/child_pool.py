"""A pool of JSON-line child processes for work that may hang or crash.

A thread cannot be killed, and code such as sympy or a user's reward function
can loop forever, or crash the interpreter. So that work runs in child
processes: fresh interpreters started as `python -m <module> <args>` (no fork
of a threaded parent, no pickle), one request at a time per child, JSON lines
on the child's stdin and stdout:

    parent  --{"id": n, ...request}\\n-->  child (stdin)
    parent  <--{"id": n, ...reply}\\n----  child (stdout)

Child side: `serve(handle, setup)` is the child's main loop. It keeps private
copies of the protocol's stdin/stdout and points fds 0/1 at /dev/null and
stderr, so a stray print() or input() in the handled code cannot corrupt the
protocol. It runs `setup()` (slow imports, loading user code), then writes
`{"ready": true}` (or `{"ready": false, "error": ...}` if setup raised), then
answers every request line with `handle(request)` plus the request's id; an
exception in `handle` becomes `{"id", "error"}` and the child lives on. It
exits when its stdin closes, or, checked once a second, when its parent is gone.

Parent side: `ChildPool(cmd, n_procs)` keeps up to `n_procs` children,
started lazily (a pool that is never called starts none). `call(request,
timeout_s)` is blocking; `acall` runs it on the pool's own thread pool so an
event loop is never blocked. A child that does not answer within `timeout_s`
is killed (SIGKILL, with any processes it started) and `ChildTimeout` is
raised; one that dies mid-call, or answers garbage, is killed and raises
`ChildCrashed`. The next call starts a fresh child. The timeout covers the
call only: a child first reports ready (bounded by `startup_timeout_s`,
failure: `ChildStartError`), then the per-call clock starts. Calls beyond
`n_procs` wait for a free child, so a call may take longer than `timeout_s` in
total, but no request may run longer than `timeout_s` in a child.

Parent death: a child gets SIGKILL when its parent dies (PR_SET_PDEATHSIG via
`realrl.base.process.with_parent_death_signal`), which works even while the
child's code holds the GIL. The kernel sends that signal when the *thread* that
started the child exits, so every child is started from one long-lived
spawner thread owned by the pool (never from a short-lived caller thread).
The stdin-EOF and parent-watchdog checks in `serve` remain as a second guard
(and the only one for a child started directly, as a `JsonLineChild`).
"""

from __future__ import annotations

import asyncio
import atexit
import importlib
import json
import os
import select
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import psutil

from realrl.base.logging import getLogger
from realrl.base.process import with_parent_death_signal

logger = getLogger("child_pool")

_MAX_ERROR_CHARS = 500


def one_line_error(e: BaseException, where: bool = False) -> str:
    """`Type: message` on one line (capped); with `where`, the innermost frame's
    file:line is appended, so a user sees where their code failed without a
    traceback."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    if where and not isinstance(e, SyntaxError):  # a SyntaxError names its file and line itself
        # The innermost frame of the code that failed, not of the machinery around it.
        frames = [f for f in traceback.extract_tb(e.__traceback__) if not _is_machinery(f.filename)]
        if frames:
            text += f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})"
    return text[:_MAX_ERROR_CHARS]


_REALRL_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_IMPORTLIB_DIR = os.path.dirname(importlib.__file__)


def _is_machinery(filename: str) -> bool:
    """Frozen or importlib frames, and realrl's own (the caller of user code)."""
    return filename.startswith(("<", _REALRL_DIR)) or os.path.dirname(filename) == _IMPORTLIB_DIR


# ---------------------------------------------------------------- child side


def serve(handle: Callable[[dict], dict], setup: Callable[[], None] | None = None) -> int:
    """A child's main loop (see the module docstring); returns the exit code."""
    # The protocol uses private copies of fds 0 and 1; fd 1 becomes stderr and
    # fd 0 /dev/null, so prints (even from C code) and input() cannot touch it.
    request_fd, reply_fd = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.stdin = open(os.devnull)
    requests = os.fdopen(request_fd, "r")
    replies = os.fdopen(reply_fd, "w", buffering=1)
    # If the parent dies while a request hangs, stdin EOF is never read: a
    # watchdog thread ends the child when it is re-parented.
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    if setup is not None:
        try:
            setup()
        except (Exception, SystemExit) as e:
            replies.write(json.dumps({"ready": False, "error": one_line_error(e)}) + "\n")
            return 1
    replies.write(json.dumps({"ready": True}) + "\n")
    for line in requests:
        if not line.strip():
            continue
        request_id = None
        try:
            request = json.loads(line)
            request_id = request["id"]
            reply = dict(handle(request))
            reply["id"] = request_id
            text = json.dumps(reply)
        except Exception as e:  # a request that fails gets an error reply; the child lives on
            text = json.dumps({"id": request_id, "error": one_line_error(e)})
        replies.write(text + "\n")
    return 0


# ---------------------------------------------------------------- parent side


class ChildGone(Exception):
    """The child timed out or died during a call; it has been killed."""


class ChildTimeout(ChildGone):
    pass


class ChildCrashed(ChildGone):
    pass


class ChildStartError(RuntimeError):
    """A child exited, failed its setup or did not report ready in time."""


class JsonLineChild:
    """One child process and a line reader over its stdout.

    `popen` starts the process (the pool passes one that runs on its spawner
    thread); the ready handshake runs in the calling thread."""

    def __init__(
        self,
        cmd: list[str],
        startup_timeout_s: float = 120.0,
        name: str = "child",
        env: dict[str, str] | None = None,
        popen: Callable[..., subprocess.Popen] = subprocess.Popen,
    ):
        self.name = name
        # Same process group as the parent: a launcher that kills the worker's
        # group kills these children too.
        self.proc = popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env)
        # Non-blocking stdin, so a child that stops reading cannot block a
        # write past the call's deadline.
        os.set_blocking(self.proc.stdin.fileno(), False)
        self._buf = b""
        self._next_id = 0
        try:
            self._handshake(time.monotonic() + startup_timeout_s, startup_timeout_s)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _handshake(self, deadline: float, startup_timeout_s: float) -> None:
        while True:
            try:
                line = self._read_line(deadline)
            except ChildGone as e:
                raise ChildStartError(f"{self.name} {self.pid} {e} before it was ready") from None
            if line is None:
                raise ChildStartError(f"{self.name} {self.pid} did not report ready within {startup_timeout_s}s")
            try:
                message = json.loads(line)
            except ValueError:
                message = None
            if not isinstance(message, dict) or "ready" not in message:
                # Output before serve() took over fd 1 (e.g. an import that
                # prints): not part of the protocol.
                logger.debug("%s %d wrote %r before it was ready", self.name, self.pid, line[:200])
                continue
            if message["ready"] is True:
                return
            raise ChildStartError(f"{self.name} {self.pid} failed to start: {message.get('error')}")

    def _read_line(self, deadline: float) -> bytes | None:
        """The next line; None at the deadline; ChildCrashed if the child closed stdout."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                try:
                    code = self.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    code = "?"
                raise ChildCrashed(f"exited with code {code}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _write_all(self, data: bytes, deadline: float) -> bool:
        """Writes `data` to the child's stdin; False at the deadline."""
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            _, writable, _ = select.select([], [fd], [], remaining)
            if not writable:
                return False
            try:
                view = view[os.write(fd, view) :]
            except BlockingIOError:
                continue
            except OSError as e:  # EPIPE: the child is gone
                raise ChildCrashed(f"stdin closed ({e})") from None
        return True

    def call(self, request: dict[str, Any], timeout_s: float, encoded: bytes | None = None) -> dict[str, Any]:
        """Sends one request (its "id" is set here) and returns the reply.
        Raises ChildTimeout / ChildCrashed; the caller must then kill() this child."""
        self._next_id += 1
        if encoded is None:
            encoded = _encode(request)
        # Splice the id into the encoded object: '{...}' -> '{"id": n, ...}'.
        line = b'{"id": %d%s' % (self._next_id, b"}" if encoded == b"{}" else b", " + encoded[1:])
        deadline = time.monotonic() + timeout_s
        if not self._write_all(line + b"\n", deadline):
            raise ChildTimeout(f"did not take the request within {timeout_s}s")
        reply_line = self._read_line(deadline)
        if reply_line is None:
            raise ChildTimeout(f"did not answer within {timeout_s}s")
        try:
            reply = json.loads(reply_line)
        except ValueError:
            raise ChildCrashed(f"sent a malformed reply {reply_line[:200]!r}") from None
        if not isinstance(reply, dict) or reply.get("id") != self._next_id:
            raise ChildCrashed(f"sent {reply_line[:200]!r} for request {self._next_id}")
        return reply

    def kill(self) -> None:
        """SIGKILL the child and whatever processes it started; reap it."""
        if self.proc.poll() is None:
            try:
                descendants = psutil.Process(self.proc.pid).children(recursive=True)
            except psutil.Error:
                descendants = []
            self.proc.kill()
            for p in descendants:
                try:
                    p.kill()
                except psutil.Error:
                    pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("%s %d did not exit after SIGKILL", self.name, self.proc.pid)
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


def _encode(request: dict[str, Any]) -> bytes:
    """The request as one JSON object line (without its id). Raises TypeError /
    ValueError for what JSON cannot carry, before any child is involved."""
    if not isinstance(request, dict):
        raise TypeError(f"a child request must be a dict, got {type(request).__name__}")
    request = {k: v for k, v in request.items() if k != "id"}
    return json.dumps(request).encode()


class ChildPool:
    """Up to `n_procs` children running `cmd`; see the module docstring."""

    def __init__(
        self,
        cmd: list[str],
        n_procs: int = 2,
        startup_timeout_s: float = 120.0,
        name: str = "child",
        env: dict[str, str] | None = None,
    ):
        if not isinstance(n_procs, int) or n_procs < 1:
            raise ValueError(f"n_procs must be an int >= 1, got {n_procs!r}")
        if not startup_timeout_s > 0:
            raise ValueError(f"startup_timeout_s must be > 0, got {startup_timeout_s!r}")
        self.cmd = list(cmd)
        self.n_procs = n_procs
        self.startup_timeout_s = startup_timeout_s
        self.name = name
        self.env = env
        self.n_children_started = 0
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(n_procs)
        self._idle: list[JsonLineChild] = []
        self._live: set[JsonLineChild] = set()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=n_procs, thread_name_prefix=name.replace(" ", "-"))
        # The one thread that starts children (see "Parent death" above).
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name.replace(" ", "-") + "-spawn")
        _POOLS.add(self)

    # -- public API
    def call(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Blocking: runs `request` in a free child and returns its reply.

        Raises ChildTimeout / ChildCrashed (that child is killed; the next call
        starts a fresh one), ChildStartError, TypeError / ValueError for a
        request JSON cannot carry, RuntimeError once the pool is closed."""
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        encoded = _encode(request)
        with self._slots:
            child = self._take_child()
            try:
                reply = child.call(request, timeout_s, encoded=encoded)
            except BaseException as e:
                with self._lock:
                    self._live.discard(child)
                child.kill()
                if isinstance(e, ChildGone):
                    raise type(e)(f"{self.name} {child.pid} {e}") from None
                raise
            with self._lock:
                if self._closed:
                    self._live.discard(child)
                    closed = True
                else:
                    self._idle.append(child)
                    closed = False
            if closed:
                child.kill()
            return reply

    async def acall(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """`call` on the pool's thread pool: never blocks the event loop."""
        self._check_open()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self.call, request, timeout_s)

    def close(self) -> None:
        """Kills every child (idle or busy; a busy call raises ChildCrashed);
        later calls raise RuntimeError. Idempotent."""
        with self._lock:
            self._closed = True
            children = list(self._live)
            self._idle.clear()
            self._live.clear()
        for child in children:
            child.kill()
        # Queued calls still run, and fail at once with "closed" (a cancelled
        # future would surface as a confusing CancelledError in the caller).
        self._executor.shutdown(wait=False)
        self._spawner.shutdown(wait=False)

    @property
    def closed(self) -> bool:
        return self._closed

    def child_pids(self) -> list[int]:
        with self._lock:
            return [c.pid for c in self._live]

    # -- internals
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name} pool is closed")

    def _popen(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        cmd = with_parent_death_signal(cmd, os.getpid())
        return self._spawner.submit(subprocess.Popen, cmd, **kwargs).result()

    def _take_child(self) -> JsonLineChild:
        with self._lock:
            self._check_open()
            if self._idle:
                return self._idle.pop()
            self.n_children_started += 1
        # Outside the lock: a start takes seconds when the child imports a lot.
        child = JsonLineChild(self.cmd, self.startup_timeout_s, self.name, self.env, popen=self._popen)
        with self._lock:
            closed = self._closed
            if not closed:
                self._live.add(child)
        if closed:
            child.kill()
            self._check_open()
        return child


# Every pool, for the exit hook; weak so a dropped pool can be collected (its
# children then see stdin EOF and their spawner thread end, and exit).
_POOLS: weakref.WeakSet[ChildPool] = weakref.WeakSet()


@atexit.register
def _close_all_pools() -> None:
    for pool in list(_POOLS):
        pool.close()
