"""User reward functions: named by a spec, run with a time limit, never fatal.

A reward function scores one completion of one prompt:

    def reward(prompt: str, completion: str, answer: str, **row) -> float: ...
    async def reward(prompt: str, completion: str, answer: str, **row) -> float: ...

`answer` is the dataset row's answer; `row` holds the row's other JSONL fields
(JSON values), passed as keyword arguments: all of them if the function takes
`**row`, else only those it names (`def reward(prompt, completion, answer,
target)` gets `target`). Any finite real number is a score (partial credit
passes through unchanged); a bool counts as 0.0/1.0.

Specs (`rollout.reward_fn=...`), tried in this order:
- a name registered with `register_reward_fn(name, fn)`, best by a plugin
  (child processes load the plugins; a function registered by other code is
  found in a child by its `module:qualname` when that is importable);
- `path/to/file.py:name` (relative to the cwd; imported as
  `realrl.base.plugins.load_object` does: siblings importable, never shadowing);
- `package.module:name` (importable from sys.path).
`load_reward_fn(spec)` turns a spec into the function; every failure is a
one-line ValueError naming the spec.

`RewardFunctionRunner(spec, timeout_s, n_procs, plugins)` runs it:
- a sync function runs in child processes (`python -m realrl.impl.reward_fn`,
  a pool of `n_procs` from `realrl.base.child_pool`, started lazily; each
  loads `plugins` then the spec, reports ready, then serves calls as JSON
  lines). A call that outlives `timeout_s` gets its child SIGKILLed (the
  next call starts a fresh child); a crash (segfault, os._exit) only loses
  that child. The time limit covers the call, not the child's start-up.
  Children die with the runner's process (parent-death signal, stdin EOF).
- an async function runs in the caller's event loop, cancelled after
  `timeout_s`. Cancellation happens only at an `await`: CPU-bound code in an
  async function cannot be cut off (write such a function as a sync one).
The runner also loads the spec in its own process (a bad spec fails at once,
and only the function tells whether it is async), so a file's module-level
code runs there as well as in each child.
`score(...)` never raises because of user code: a timeout, an exception, a
crashed child or a return value that is not a finite real number scores 0.0
and is counted. Counters: `calls`, `timeouts`, `errors` (exceptions, crashes,
bad return values, children that fail to start), and, for a function
that takes `judge` (realrl/impl/judge.py), `judge_failures` (its failed calls); `counts()` gives the totals,
`pop_stats()` those since its last call. The first failure of each kind is
logged as one line; later ones at most once a minute per kind, with a count.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from realrl.base.child_pool import ChildCrashed, ChildPool, ChildStartError, ChildTimeout, one_line_error, serve
from realrl.base.logging import getLogger
from realrl.base.plugins import IDENTIFIER_PATH, absolute_spec, load_object, load_plugins
from realrl.base.registry import Registry

logger = getLogger("reward_fn")

RewardFn = Callable[..., Any]  # (prompt, completion, answer, **row) -> float, or a coroutine function
REWARD_FNS: Registry[Any] = Registry("reward function")
# Keyword arguments a call always passes; row fields with these names are dropped.
_FIXED_ARGS = ("prompt", "completion", "answer")


def register_reward_fn(name: str, fn: RewardFn) -> None:
    """Makes `fn` loadable as the spec `name` (in every process that runs the
    registering code: use a plugin so child processes run it too)."""
    if not callable(fn):
        raise ValueError(f"reward function {name!r}: {fn!r} is not callable")
    REWARD_FNS.register(name, fn)


# ---------------------------------------------------------------- loading


def load_reward_fn(spec: str) -> RewardFn:
    """The function a spec names (see the module docstring); ValueError, one
    line naming the spec, for anything wrong with it."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"reward function spec must be a non-empty str, got {spec!r}")
    if spec in REWARD_FNS:
        fn, where = REWARD_FNS.get(spec), "registered"
    else:
        if ":" not in spec:
            raise ValueError(
                f"reward function {spec!r}: not a registered name (registered: {REWARD_FNS.names()}) "
                "and not 'path/to/file.py:function' or 'package.module:function'"
            )
        fn, where = load_object(spec, "reward function"), spec
    if not callable(fn):
        raise ValueError(f"reward function {spec!r}: {type(fn).__name__} {fn!r:.80} ({where}) is not callable")
    _row_keys_accepted(spec, fn)  # checks the signature
    return fn


def _absolute_spec(spec: str) -> str:
    """`spec` with a file path made absolute (a child may not share our cwd forever)."""
    return spec if spec in REWARD_FNS else absolute_spec(spec)


def _row_keys_accepted(spec: str, fn: RewardFn) -> frozenset[str] | None:
    """Which row fields a call passes: None for all (the function takes
    **kwargs or its signature cannot be read), else the keyword parameters it
    names. ValueError if prompt/completion/answer cannot be passed by keyword."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None  # e.g. some builtins: nothing to check, pass everything
    kinds = inspect.Parameter
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in params.values())
    by_keyword = {n for n, p in params.items() if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    positional_only = [n for n, p in params.items() if p.kind is kinds.POSITIONAL_ONLY and p.default is p.empty]
    missing = [n for n in _FIXED_ARGS if n not in by_keyword and not var_keyword]
    if positional_only:
        problem = f"positional-only {', '.join(positional_only)}"
    elif missing:
        problem = f"no parameter {', '.join(missing)}"
    else:
        return None if var_keyword else frozenset(by_keyword) - set(_FIXED_ARGS)
    raise ValueError(
        f"reward function {spec!r}: signature {getattr(fn, '__name__', 'fn')}{inspect.signature(fn)} cannot "
        f"accept prompt, completion, answer as keyword arguments ({problem})"
    )


def _defined_at(fn: RewardFn) -> str | None:
    """`module:qualname` of a module-level function, for a child to import it
    by when its registration did not happen in a plugin; None if unreachable."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not qualname or module == "__main__" or "<" in qualname or not IDENTIFIER_PATH.match(module):
        return None
    return f"{module}:{qualname}"


def is_async_fn(fn: RewardFn) -> bool:
    # An instance with `async def __call__` is async too.
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def takes_judge(fn: RewardFn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get("judge")
    return p is not None and p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def _call_kwargs(accepted: frozenset[str] | None, prompt: str, completion: str, answer: str, row: dict) -> dict:
    kwargs = {
        k: v for k, v in row.items() if k not in _FIXED_ARGS and k != "judge" and (accepted is None or k in accepted)
    }
    kwargs.update(prompt=prompt, completion=completion, answer=answer)
    return kwargs


class _BadScore(ValueError):
    pass


def _as_score(value: Any) -> float:
    """A finite float from what the function returned (real numbers, bool,
    numpy/torch scalars); _BadScore for anything else (str, None, NaN, inf)."""
    if isinstance(value, (str, bytes, bytearray)):
        score = None
    else:
        try:
            score = float(value)
        except Exception:  # a user type's __float__ may raise anything
            score = None
    if score is None or not math.isfinite(score):
        raise _BadScore(f"returned {type(value).__name__} {value!r:.80}, not a finite real number")
    return score


# ---------------------------------------------------------------- child side


def _child_main(argv: list[str]) -> int:
    """`python -m realrl.impl.reward_fn --serve CONFIG_JSON` (started by the runner)."""
    if len(argv) != 2 or argv[0] != "--serve":
        print("usage: python -m realrl.impl.reward_fn --serve CONFIG_JSON (started by the runner)", file=sys.stderr)
        return 2
    config = json.loads(argv[1])
    # The parent's import path first, so `package.module:name` and plugins
    # resolve to the same modules as in the parent.
    parent_path = [p for p in config["sys_path"] if isinstance(p, str)]
    sys.path[:] = parent_path + [p for p in sys.path if p not in parent_path]
    loaded: dict[str, Any] = {}

    def setup() -> None:
        load_plugins(config["plugins"])
        spec = config["spec"]
        if spec not in REWARD_FNS and ":" not in spec and config.get("defined_at"):
            spec = config["defined_at"]  # registered in the parent by code that is not a plugin
        fn = load_reward_fn(spec)
        loaded.update(fn=fn, accepted=_row_keys_accepted(config["spec"], fn))

    def handle(request: dict) -> dict:
        kwargs = _call_kwargs(
            loaded["accepted"], request["prompt"], request["completion"], request["answer"], request.get("row") or {}
        )
        try:
            value = loaded["fn"](**kwargs)
        except (Exception, SystemExit) as e:  # sys.exit() in user code is an error too, not the child's end
            return {"score": None, "kind": "exception", "error": one_line_error(e, where=True)}
        try:
            return {"score": _as_score(value), "error": None}
        except _BadScore as e:
            return {"score": None, "kind": "bad_value", "error": str(e)}

    return serve(handle, setup)


# ---------------------------------------------------------------- parent side


class _FailureLog:
    """One line for the first failure of each kind, then at most one line per
    kind every `interval_s`, saying how many were not logged."""

    def __init__(self, spec: str, interval_s: float = 60.0):
        self.spec = spec
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def __call__(self, kind: str, message: str) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        more = self._suppressed.pop(kind, 0)
        note = f" ({more} more since the last such line)" if more else ""
        logger.warning("reward function %s: %s; scored 0%s", self.spec, message, note)


class RewardFunctionRunner:
    """Runs one reward function safely; see the module docstring."""

    def __init__(
        self,
        spec: str,
        timeout_s: float = 10.0,
        n_procs: int = 2,
        plugins: list[str] | tuple[str, ...] = (),
        startup_timeout_s: float = 120.0,
        judge: Callable[[], Any] | None = None,
    ):
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s!r}")
        if isinstance(n_procs, bool) or not isinstance(n_procs, int) or n_procs < 1:
            raise ValueError(f"n_procs must be an int >= 1, got {n_procs!r}")
        self.spec = spec
        self.timeout_s = float(timeout_s)
        self.n_procs = n_procs
        self.plugins = list(plugins)
        # Loaded here too: a bad spec fails at start-up, a registered name needs
        # the plugins, and whether the function is async decides where it runs.
        try:
            load_plugins(self.plugins)
        except ImportError as e:
            raise ValueError(f"reward function {spec!r}: loading plugins failed: {one_line_error(e)}") from None
        self.fn = load_reward_fn(spec)
        self.is_async = is_async_fn(self.fn)
        self._accepted = _row_keys_accepted(spec, self.fn)
        # A function that takes `judge` gets the judge's client (realrl/impl/judge.py).
        self.takes_judge = takes_judge(self.fn)
        if self.takes_judge and not self.is_async:
            raise ValueError(f"reward function {spec!r} takes `judge`, so it must be an `async def` function")
        if self.takes_judge and judge is None:
            raise ValueError(f"reward function {spec!r} takes `judge` but no judge is configured (judge.model.path)")
        self._judge = judge
        self._pool: ChildPool | None = None
        if not self.is_async:
            config = {
                "spec": _absolute_spec(spec),
                "plugins": self.plugins,
                "sys_path": list(sys.path),
                "defined_at": _defined_at(self.fn) if spec in REWARD_FNS else None,
            }
            cmd = [sys.executable, "-m", "realrl.impl.reward_fn", "--serve", json.dumps(config)]
            self._pool = ChildPool(cmd, n_procs, startup_timeout_s, name="reward function child")
        self._log = _FailureLog(spec)
        self._lock = threading.Lock()
        self._totals = {"calls": 0, "timeouts": 0, "errors": 0, **({"judge_failures": 0} if self.takes_judge else {})}
        self._popped = dict(self._totals)
        self._closed = False

    async def score(self, prompt: str, completion: str, answer: str, row: dict | None = None) -> float:
        """The function's score, or 0.0 (counted) if it timed out, failed or
        returned no finite number."""
        return (await self.score_with_outcome(prompt, completion, answer, row))[0]

    async def score_with_outcome(
        self, prompt: str, completion: str, answer: str, row: dict | None = None
    ) -> tuple[float, str | None]:
        """(score, None), or (0.0, "timeouts" | "errors") for a call that failed."""
        if self._closed:
            raise RuntimeError(f"reward function runner for {self.spec!r} is closed")
        row = row or {}
        self._count("calls")
        if self.is_async:
            return await self._score_async(prompt, completion, answer, row)
        request = {"prompt": prompt, "completion": completion, "answer": answer, "row": row}
        try:
            reply = await self._pool.acall(request, self.timeout_s)
        except ChildTimeout as e:
            return self._failed("timeouts", "timeout", f"{e}; the child was killed")
        except ChildCrashed as e:
            return self._failed("errors", "crash", str(e))
        except ChildStartError as e:
            return self._failed("errors", "start", str(e))
        except (TypeError, ValueError) as e:  # a row JSON cannot carry (data, not the function)
            return self._failed("errors", "request", f"request not sendable: {one_line_error(e)}")
        if reply.get("error") or reply.get("score") is None:
            return self._failed("errors", reply.get("kind") or "exception", str(reply.get("error")))
        return float(reply["score"]), None

    def counts(self) -> dict[str, int]:
        """Totals since the runner was made."""
        with self._lock:
            return dict(self._totals)

    def pop_stats(self) -> dict[str, float]:
        """Counts since the last pop_stats() (calls, timeouts, errors)."""
        with self._lock:
            stats = {k: float(v - self._popped[k]) for k, v in self._totals.items()}
            self._popped = dict(self._totals)
        return stats

    def child_pids(self) -> list[int]:
        return self._pool.child_pids() if self._pool is not None else []

    def close(self) -> None:
        """Ends every child process (a call in flight scores 0); later calls raise.
        Pools are also closed at interpreter exit."""
        self._closed = True
        if self._pool is not None:
            self._pool.close()

    # -- internals
    async def _score_async(self, prompt: str, completion: str, answer: str, row: dict) -> tuple[float, str | None]:
        kwargs = _call_kwargs(self._accepted, prompt, completion, answer, row)
        try:
            if self.takes_judge:
                client = self._judge()  # the client, or an awaitable of it (realrl.impl.judge.JudgeAccess)
                kwargs["judge"] = await client if inspect.isawaitable(client) else client
            result = self.fn(**kwargs)
        except Exception as e:
            return self._failed("errors", "exception", one_line_error(e, where=True))
        if inspect.isawaitable(result):
            # asyncio.wait, not wait_for: a function that swallows its
            # cancellation cannot hold up the caller past the time limit.
            task = asyncio.ensure_future(result)
            try:
                done, _ = await asyncio.wait({task}, timeout=self.timeout_s)
            finally:
                if not task.done():
                    task.cancel()
                    task.add_done_callback(_consume_outcome)
            if not done:
                return self._failed("timeouts", "timeout", f"no result within {self.timeout_s}s; cancelled")
            if task.cancelled():
                return self._failed("errors", "exception", "the coroutine was cancelled")
            if task.exception() is not None:
                return self._failed("errors", "exception", one_line_error(task.exception(), where=True))
            result = task.result()
        try:
            return _as_score(result), None
        except _BadScore as e:
            return self._failed("errors", "bad_value", str(e))

    def _count(self, counter: str) -> None:
        with self._lock:
            self._totals[counter] += 1

    def _failed(self, counter: str, kind: str, message: str) -> tuple[float, str]:
        self._count(counter)
        if self.takes_judge:  # the judge timed out, failed or gave an answer the function could not read
            self._count("judge_failures")
        self._log(kind, message)
        return 0.0, counter


def _consume_outcome(task: asyncio.Future) -> None:
    """Reads a late-cancelled task's outcome, so asyncio does not log
    'exception was never retrieved' for it."""
    if not task.cancelled():
        task.exception()


if __name__ == "__main__":
    # The canonical module, not this __main__ copy: plugins register into
    # realrl.impl.reward_fn.REWARD_FNS, which the child must read.
    from realrl.impl.reward_fn import _child_main as main

    sys.exit(main(sys.argv[1:]))
