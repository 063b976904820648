"""Math answer verification: a fast numeric path and a sandboxed math-verify path.

Two kinds of answers reach the math environment:

- plain numbers (the synthetic arithmetic task, GSM8K-style data): the last
  number in the completion (or the content of its last `\\boxed{}`) is compared
  exactly, as a decimal, with each solution ("81" == "81.0" == "81.00",
  "-3" != "3", "1,000" == "1000"). This runs in-process: it is a regex and a
  `Decimal` comparison and cannot hang.
- anything else (LaTeX solutions such as `\\frac{1}{2}`, boxed expressions):
  checked with the maintained `math-verify` library (`parse` + `verify`), which
  runs sympy and can be slow, hang or crash on adversarial input. A thread
  cannot be killed, so these checks run in separate child processes:

      parent  --{"id", "answer", "solutions", "timeout_s"}\\n-->  child (stdin)
      parent  <--{"id", "score", "error"}\\n------------------  child (stdout)

  JSON lines between the parent and its own child (no pickle). A child that
  does not answer within `timeout_s` is killed (SIGKILL) and the call scores
  0.0; a child that dies mid-call scores 0.0 too. The next call starts a fresh
  child. A child exits on its own when its stdin closes (the parent died).

`MathVerifier` keeps a small pool of such children (`n_procs`, started lazily:
a run whose answers are all numeric never starts one). `verify()` is the
blocking call; `averify()` runs it on the verifier's own thread pool so an
event loop with many episodes in flight is never blocked. `extract_answer`,
`verify` and `averify` at module level use one process-wide default verifier.

The timeout covers the check itself, not the child's start-up (importing sympy
takes a second or two): a child first reports ready, and only then does the
per-call clock start. Calls beyond `n_procs` wait for a free child, so under
load a call may take longer than `timeout_s` in total, but no check may run
longer than `timeout_s`.

Test hooks: a verifier built with `test_hooks=True` starts children that treat
the solution strings `TEST_HOOK_SLEEP` (sleep forever) and `TEST_HOOK_CRASH`
(exit at once) specially; without the flag those are ordinary strings, so data
can never trigger them.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import math
import os
import re
import select
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation

from realrl.base.logging import getLogger

logger = getLogger(__name__)

DEFAULT_TIMEOUT_S = 5.0
TEST_HOOK_SLEEP = "__realrl_verifier_test_sleep__"
TEST_HOOK_CRASH = "__realrl_verifier_test_crash__"

# A number: thousands-separated ("1,234.5"), plain ("-12", "3.25", "7."), or
# leading-dot (".5"). Alternatives are tried in order, so "1,234" is one number.
_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")
_PLAIN_NUMBER_RE = re.compile(rf"^\s*(?:{_NUMBER_RE.pattern})\s*\.?\s*$")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BRACE_RE = re.compile(r"[{}]")


# ---------------------------------------------------------------- extraction


def _last_boxed(text: str) -> str | None:
    """Content of the last closed `\\boxed{...}` / `\\fbox{...}` (balanced braces).

    One pass over the braces, so long or adversarial completions (many unclosed
    boxes) cost linear time in the event loop."""
    box_opens = {m.end() - 1 for m in _BOXED_RE.finditer(text)}  # positions of their "{"
    if not box_opens:
        return None
    stack: list[int] = []
    best: tuple[int, int] | None = None
    for m in _BRACE_RE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            start = stack.pop()
            if start in box_opens and (best is None or start > best[0]):
                best = (start, m.start())
    return text[best[0] + 1 : best[1]].strip() if best else None


def extract_answer(text: str) -> str | None:
    """The answer a completion commits to: its last `\\boxed{}` content, else its
    last number (thousands separators removed), else None."""
    if not text:
        return None
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed
    numbers = _NUMBER_RE.findall(text)
    if not numbers:
        return None
    return numbers[-1].replace(",", "")


def _as_decimal(text: str) -> Decimal | None:
    if not _PLAIN_NUMBER_RE.match(text):
        return None
    try:
        value = Decimal(text.strip().rstrip(".").strip().replace(",", ""))
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def numeric_score(answer_text: str, solutions: list[str]) -> float | None:
    """The in-process check: 1.0/0.0 when it can decide, None when the answer or
    the solutions need math-verify (a solution that is not a plain number, or a
    boxed answer that is not one)."""
    gold = [_as_decimal(s) for s in solutions]
    if not gold or any(g is None for g in gold):
        return None
    extracted = extract_answer(answer_text)
    if extracted is None:
        return 0.0  # nothing that looks like an answer
    value = _as_decimal(extracted)
    if value is None:
        return None  # e.g. \boxed{\frac{1}{2}} against "0.5"
    return 1.0 if any(value == g for g in gold) else 0.0


def exact_numeric_score(answer_text: str, solutions: list[str]) -> float:
    """The strict check of answer_format="exact": the whole completion (after
    stripping whitespace) must be a plain number equal to a solution."""
    value = _as_decimal(answer_text.strip()) if answer_text and answer_text.strip() else None
    if value is None or not _PLAIN_NUMBER_RE.match(answer_text.strip()):
        return 0.0
    gold = [_as_decimal(s) for s in solutions]
    return 1.0 if any(g is not None and value == g for g in gold) else 0.0


# ---------------------------------------------------------------- child side


def _math_verify_score(answer: str, solutions: list[str], timeout_s: float) -> float:
    from math_verify import parse, verify

    # math-verify's own (SIGALRM) limits, in whole seconds; the parent's kill is
    # the real guarantee.
    limit = max(1, math.ceil(timeout_s))
    predicted = parse(answer, parsing_timeout=limit)
    if not predicted:
        return 0.0
    for solution in solutions:
        # Gold answers come bare ("\sqrt 2"), boxed or in $...$. A bare one is read
        # as inline math first: parsed as plain text, "\sqrt 2" would yield 2.
        delimited = any(d in solution for d in ("$", "\\boxed", "\\(", "\\["))
        candidates = [solution] if delimited else [f"${solution}$", solution]
        gold = next((g for g in (parse(c, parsing_timeout=limit) for c in candidates) if g), None)
        if gold and verify(gold, predicted, timeout_seconds=limit):
            return 1.0
    return 0.0


def _serve(test_hooks: bool) -> int:
    """Child main loop: one JSON request per stdin line, one JSON reply per line."""
    # Replies go to a private copy of stdout; fd 1 now points at stderr so a stray
    # print() in a library cannot corrupt the protocol.
    reply_fd = os.dup(1)
    os.dup2(2, 1)
    replies = os.fdopen(reply_fd, "w", buffering=1)
    # If the parent dies while a check hangs, stdin EOF is never read: a watchdog
    # thread ends the child when it is re-parented.
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch_parent, daemon=True).start()
    import math_verify  # noqa: F401  (pay the import before reporting ready)

    replies.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        request_id, score, error = None, 0.0, None
        try:
            request = json.loads(line)
            request_id = request["id"]
            solutions = [str(s) for s in request["solutions"]]
            if test_hooks and TEST_HOOK_SLEEP in solutions:
                while True:
                    time.sleep(3600)
            if test_hooks and TEST_HOOK_CRASH in solutions:
                os._exit(17)
            score = _math_verify_score(str(request["answer"]), solutions, float(request["timeout_s"]))
        except Exception as e:  # a check that fails scores 0, the child lives on
            error = f"{type(e).__name__}: {e}"[:500]
        replies.write(json.dumps({"id": request_id, "score": score, "error": error}) + "\n")
    return 0


# ---------------------------------------------------------------- parent side


class _ChildGone(Exception):
    """The child timed out or died; it has been killed and must not be reused."""


class _Child:
    """One verifier child process and a line reader over its stdout."""

    def __init__(self, test_hooks: bool, startup_timeout_s: float):
        cmd = [sys.executable, "-m", "realrl.impl.verifiers.math_verifier", "--serve"]
        if test_hooks:
            cmd.append("--test-hooks")
        # Same process group as the parent: a launcher that kills the worker's
        # group kills its verifiers too; a parent that dies closes our stdin.
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self._buf = b""
        self._next_id = 0
        try:
            line = self._read_line(time.monotonic() + startup_timeout_s)
            ready = line is not None and json.loads(line).get("ready") is True
        except (_ChildGone, ValueError, AttributeError) as e:
            ready, line = False, repr(e).encode()
        if not ready:
            self.kill()
            raise RuntimeError(f"math verifier child did not start within {startup_timeout_s}s (got {line!r})")

    def _read_line(self, deadline: float) -> bytes | None:
        """The next reply line; None at the deadline; _ChildGone if the child died."""
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
                raise _ChildGone(f"exited with code {self.proc.wait()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def check(self, answer: str, solutions: list[str], timeout_s: float) -> float:
        self._next_id += 1
        request = {"id": self._next_id, "answer": answer, "solutions": solutions, "timeout_s": timeout_s}
        try:
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
        except (BrokenPipeError, OSError) as e:
            raise _ChildGone(f"stdin closed ({e})") from None
        line = self._read_line(time.monotonic() + timeout_s)
        if line is None:
            raise _ChildGone(f"no answer within {timeout_s}s")
        try:
            reply = json.loads(line)
        except ValueError:
            raise _ChildGone(f"sent a malformed reply {line[:200]!r}") from None
        if not isinstance(reply, dict) or reply.get("id") != self._next_id:
            raise _ChildGone(f"sent {line[:200]!r} for request {self._next_id}")
        if reply.get("error"):
            logger.debug("math-verify failed on %r: %s", answer[:200], reply["error"])
        return float(reply["score"])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.warning("math verifier child %d did not exit after SIGKILL", self.proc.pid)
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass


class MathVerifier:
    """Scores answers against solutions (1.0/0.0); see the module docstring."""

    def __init__(self, n_procs: int = 2, test_hooks: bool = False, startup_timeout_s: float = 120.0):
        if n_procs < 1:
            raise ValueError(f"n_procs must be >= 1, got {n_procs}")
        self.n_procs = n_procs
        self.test_hooks = test_hooks
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(n_procs)
        self._idle: list[_Child] = []
        self._live: set[_Child] = set()
        self._closed = False
        self._executor = ThreadPoolExecutor(max_workers=n_procs, thread_name_prefix="math-verify")
        # Counters for logging / tests.
        self.n_child_calls = 0
        self.n_timeouts = 0
        self.n_crashes = 0
        self.n_children_started = 0

    # -- public API
    def verify(self, answer_text: str, solutions: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
        """Blocking check; 1.0 if the answer matches any solution, else 0.0."""
        solutions = [str(s) for s in solutions]
        fast = numeric_score(answer_text, solutions)
        if fast is not None:
            return fast
        if not answer_text or not answer_text.strip():
            return 0.0
        return self._check_in_child(answer_text, solutions, timeout_s)

    async def averify(self, answer_text: str, solutions: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
        """`verify` that never blocks the event loop (child checks run on a thread)."""
        solutions = [str(s) for s in solutions]
        fast = numeric_score(answer_text, solutions)
        if fast is not None:
            return fast
        if not answer_text or not answer_text.strip():
            return 0.0
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._check_in_child, answer_text, solutions, timeout_s)

    def close(self) -> None:
        """Kill every child (idle or busy); later calls raise."""
        with self._lock:
            self._closed = True
            children = list(self._live)
            self._idle.clear()
            self._live.clear()
        for child in children:
            child.kill()
        self._executor.shutdown(wait=False, cancel_futures=True)

    def child_pids(self) -> list[int]:
        with self._lock:
            return [c.proc.pid for c in self._live]

    # -- internals
    def _check_in_child(self, answer: str, solutions: list[str], timeout_s: float) -> float:
        with self._slots:
            child = self._take_child()
            try:
                score = child.check(answer, solutions, timeout_s)
            except _ChildGone as e:
                timed_out = child.proc.poll() is None
                with self._lock:
                    self.n_timeouts += timed_out
                    self.n_crashes += not timed_out
                    self._live.discard(child)
                child.kill()
                logger.warning("math verifier child %d %s; scored 0 and restarting", child.proc.pid, e)
                return 0.0
            with self._lock:
                self.n_child_calls += 1
                if self._closed:
                    child.kill()
                else:
                    self._idle.append(child)
            return score

    def _take_child(self) -> _Child:
        with self._lock:
            if self._closed:
                raise RuntimeError("MathVerifier is closed")
            if self._idle:
                return self._idle.pop()
            self.n_children_started += 1
        child = _Child(self.test_hooks, self.startup_timeout_s)  # outside the lock: takes seconds
        with self._lock:
            if self._closed:
                child.kill()
                raise RuntimeError("MathVerifier is closed")
            self._live.add(child)
        return child


# ---------------------------------------------------------------- process-wide default

_default: MathVerifier | None = None
_default_lock = threading.Lock()


def get_default_verifier() -> MathVerifier:
    """The process-wide verifier (children start only when first needed).
    `REALRL_MATH_VERIFY_PROCS` sets its pool size (default 2)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = MathVerifier(n_procs=int(os.environ.get("REALRL_MATH_VERIFY_PROCS", "2")))
        return _default


def shutdown_default_verifier() -> None:
    global _default
    with _default_lock:
        verifier, _default = _default, None
    if verifier is not None:
        verifier.close()


atexit.register(shutdown_default_verifier)


def verify(answer_text: str, solutions: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if `answer_text` matches any of `solutions`, else 0.0 (never raises on bad input)."""
    return get_default_verifier().verify(answer_text, solutions, timeout_s)


async def averify(answer_text: str, solutions: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    return await get_default_verifier().averify(answer_text, solutions, timeout_s)


if __name__ == "__main__":
    if "--serve" in sys.argv[1:]:
        sys.exit(_serve(test_hooks="--test-hooks" in sys.argv[1:]))
    print("usage: python -m realrl.impl.verifiers.math_verifier --serve [--test-hooks]", file=sys.stderr)
    sys.exit(2)
