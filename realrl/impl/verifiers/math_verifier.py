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

  JSON lines between the parent and its own child (no pickle), through the
  generic pool in `realrl.base.child_pool`. A child that does not answer
  within `timeout_s` is killed (SIGKILL) and the call scores 0.0; a child that
  dies mid-call scores 0.0 too. The next call starts a fresh child. A child
  exits on its own when its parent dies (parent-death signal, stdin EOF).

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

import atexit
import math
import os
import re
import sys
import threading
import time
from decimal import Decimal, InvalidOperation

from realrl.base.child_pool import ChildGone, ChildPool, ChildTimeout, JsonLineChild, serve
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
    """Child main loop: one JSON request per stdin line, one JSON reply per line
    (the generic loop in `realrl.base.child_pool.serve`)."""

    def setup() -> None:
        import math_verify  # noqa: F401  (pay the import before reporting ready)

    def handle(request: dict) -> dict:
        solutions = [str(s) for s in request["solutions"]]
        if test_hooks and TEST_HOOK_SLEEP in solutions:
            while True:
                time.sleep(3600)
        if test_hooks and TEST_HOOK_CRASH in solutions:
            os._exit(17)
        # An exception here becomes {"id", "error"}: the check scores 0, the child lives on.
        score = _math_verify_score(str(request["answer"]), solutions, float(request["timeout_s"]))
        return {"score": score, "error": None}

    return serve(handle, setup)


# ---------------------------------------------------------------- parent side


def _child_cmd(test_hooks: bool) -> list[str]:
    cmd = [sys.executable, "-m", "realrl.impl.verifiers.math_verifier", "--serve"]
    return cmd + ["--test-hooks"] if test_hooks else cmd


class _Child(JsonLineChild):
    """One verifier child on its own (tests drive one directly); `MathVerifier`
    keeps a `ChildPool` of the same command."""

    def __init__(self, test_hooks: bool, startup_timeout_s: float):
        super().__init__(_child_cmd(test_hooks), startup_timeout_s, name="math verifier child")


class MathVerifier:
    """Scores answers against solutions (1.0/0.0); see the module docstring."""

    def __init__(self, n_procs: int = 2, test_hooks: bool = False, startup_timeout_s: float = 120.0):
        if n_procs < 1:
            raise ValueError(f"n_procs must be >= 1, got {n_procs}")
        self.n_procs = n_procs
        self.test_hooks = test_hooks
        self.startup_timeout_s = startup_timeout_s
        self._pool = ChildPool(_child_cmd(test_hooks), n_procs, startup_timeout_s, name="math verifier child")
        self._lock = threading.Lock()
        # Counters for logging / tests.
        self.n_child_calls = 0
        self.n_timeouts = 0
        self.n_crashes = 0

    @property
    def n_children_started(self) -> int:
        return self._pool.n_children_started

    # -- public API
    def verify(self, answer_text: str, solutions: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
        """Blocking check; 1.0 if the answer matches any solution, else 0.0."""
        solutions = [str(s) for s in solutions]
        fast = numeric_score(answer_text, solutions)
        if fast is not None:
            return fast
        if not answer_text or not answer_text.strip():
            return 0.0
        request = {"answer": answer_text, "solutions": solutions, "timeout_s": timeout_s}
        try:
            reply = self._pool.call(request, timeout_s)
        except ChildGone as e:
            return self._child_lost(e)
        return self._score(reply, answer_text)

    async def averify(self, answer_text: str, solutions: list[str], timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
        """`verify` that never blocks the event loop (child checks run on a thread)."""
        solutions = [str(s) for s in solutions]
        fast = numeric_score(answer_text, solutions)
        if fast is not None:
            return fast
        if not answer_text or not answer_text.strip():
            return 0.0
        request = {"answer": answer_text, "solutions": solutions, "timeout_s": timeout_s}
        try:
            reply = await self._pool.acall(request, timeout_s)
        except ChildGone as e:
            return self._child_lost(e)
        return self._score(reply, answer_text)

    def close(self) -> None:
        """Kill every child (idle or busy); later calls raise."""
        self._pool.close()

    def child_pids(self) -> list[int]:
        return self._pool.child_pids()

    # -- internals
    def _score(self, reply: dict, answer: str) -> float:
        with self._lock:
            self.n_child_calls += 1
        if reply.get("error"):
            logger.debug("math-verify failed on %r: %s", answer[:200], reply["error"])
            return 0.0
        return float(reply["score"])

    def _child_lost(self, e: ChildGone) -> float:
        with self._lock:
            self.n_timeouts += isinstance(e, ChildTimeout)
            self.n_crashes += not isinstance(e, ChildTimeout)
        logger.warning("%s; scored 0 and restarting", e)
        return 0.0


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
