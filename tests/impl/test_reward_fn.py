"""User reward functions: loading by spec (file, module, registered name), and
RewardFunctionRunner running them in real child processes (sync) or in the
event loop (async), with timeouts, errors and crashes scored 0 and counted."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import textwrap
import uuid

import psutil
import pytest

from realrl.impl.reward_fn import REWARD_FNS, RewardFunctionRunner, load_reward_fn, register_reward_fn

TASK = """
import asyncio, math, os, sys, time
from task_helper_{tag} import HELPER_SCORE

def exact(prompt, completion, answer, **row):
    return 1.0 if completion.strip() == answer else 0.0

def partial(prompt, completion, answer, **row):
    return 0.37

def uses_row(prompt, completion, answer, **row):
    return row["weight"] * len(row["items"]) + (0.5 if row["flag"] is None else 0.0)

def named_field_only(prompt, completion, answer, target):
    return float(target == int(completion))

def sibling(prompt, completion, answer):
    return HELPER_SCORE

def echo_float(prompt, completion, answer, **row):
    return float(completion)

def hang_on_request(prompt, completion, answer, **row):
    if completion == "hang":
        while True:
            time.sleep(3600)
    return float(completion)

def raises(prompt, completion, answer, **row):
    if completion == "raise":
        raise ZeroDivisionError("boom\\nsecond line")
    return 2.5

def exits(prompt, completion, answer, **row):
    if completion == "exit":
        os._exit(3)
    return 1.5

def returns(prompt, completion, answer, **row):
    return {{"abc": "abc", "nan": math.nan, "inf": math.inf, "none": None, "true": True, "int": 7}}[completion]

def prints(prompt, completion, answer, **row):
    print('{{"id": 1, "score": 99.0, "error": null}}')
    print("chatty reward", file=sys.stdout, flush=True)
    os.write(1, b"raw fd write\\n")
    return 0.25

def whoami(prompt, completion, answer, **row):
    return float(os.getpid())

async def async_partial(prompt, completion, answer, **row):
    await asyncio.sleep(0)
    return 0.37 + row.get("bonus", 0.0)

async def async_hang(prompt, completion, answer, **row):
    if completion == "hang":
        await asyncio.sleep(3600)
    return 1.0

async def async_raises(prompt, completion, answer, **row):
    raise KeyError(completion)

async def async_nan(prompt, completion, answer, **row):
    return math.nan

class Scorer:
    async def __call__(self, prompt, completion, answer, **row):
        return 0.75

scorer = Scorer()
not_callable = 42

def two_args(prompt, completion):
    return 1.0

def positional_only(prompt, completion, answer, /):
    return 1.0
"""


@pytest.fixture
def task(tmp_path, monkeypatch):
    """A reward file (and a sibling module it imports) in tmp_path; sys.path
    and sys.modules are restored afterwards."""
    tag = uuid.uuid4().hex[:8]
    (tmp_path / f"task_helper_{tag}.py").write_text("HELPER_SCORE = 0.625\n")
    path = tmp_path / "task.py"
    path.write_text(TASK.format(tag=tag))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    return path


@pytest.fixture
def runners():
    made: list[RewardFunctionRunner] = []

    def make(spec, **kwargs) -> RewardFunctionRunner:
        kwargs.setdefault("timeout_s", 30.0)
        runner = RewardFunctionRunner(spec, **kwargs)
        made.append(runner)
        return runner

    yield make
    for r in made:
        r.close()


def score(runner: RewardFunctionRunner, completion: str, answer: str = "", row: dict | None = None) -> float:
    return asyncio.run(runner.score("the prompt", completion, answer, row or {}))


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


# ---------------------------------------------------------------- loading


def test_file_spec_loads_relative_or_absolute_and_imports_siblings(task, monkeypatch):
    monkeypatch.chdir(task.parent)
    fn = load_reward_fn("task.py:exact")
    assert fn("p", " 4 ", "4") == 1.0
    assert load_reward_fn(f"{task}:exact") is fn, "the same file is one module"
    assert load_reward_fn("./task.py:sibling")("p", "c", "a") == 0.625
    # The file's directory stays on sys.path only at the end: it cannot shadow anything.
    directory = str(task.parent)
    assert sys.path.count(directory) == 1 and sys.path[-1] == directory


def test_module_spec_loads(task, monkeypatch):
    pkg = task.parent / f"rewardpkg_{uuid.uuid4().hex[:8]}"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "scores.py").write_text("def half(prompt, completion, answer, **row):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(task.parent))
    assert load_reward_fn(f"{pkg.name}.scores:half")("p", "c", "a") == 0.5


def registered_reward(prompt, completion, answer, **row):
    return 0.125


def test_registered_name_loads_and_runs_in_a_child(runners):
    register_reward_fn("test-reward-fn/registered", registered_reward)
    assert load_reward_fn("test-reward-fn/registered") is registered_reward
    # Registered by this test module, not by a plugin: the child finds it by module:qualname.
    runner = runners("test-reward-fn/registered")
    assert score(runner, "x") == 0.125 and runner.child_pids()


def test_plugin_registered_name_runs_in_a_child(tmp_path, runners):
    name = f"test-reward-fn/plugin-{uuid.uuid4().hex[:8]}"
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(
        textwrap.dedent(f"""
        from realrl.impl.reward_fn import register_reward_fn

        def reward(prompt, completion, answer, **row):
            return 0.875 + len(row)

        register_reward_fn({name!r}, reward)
    """)
    )
    runner = runners(name, plugins=[str(plugin)])
    assert name in REWARD_FNS
    assert score(runner, "x", row={"a": 1}) == 1.875 and runner.child_pids()


@pytest.mark.parametrize(
    "spec, message",
    [
        ("missing.py:reward", "does not exist"),
        ("broken.py:reward", "SyntaxError"),
        ("bad_import.py:reward", "ModuleNotFoundError: No module named 'no_such_module_zz' (at bad_import.py:2)"),
        ("raises_on_import.py:reward", "ZeroDivisionError: division by zero (at raises_on_import.py:1)"),
        ("task.py:no_such_fn", "has no attribute 'no_such_fn'"),
        ("task.py:not_callable", "is not callable"),
        ("task.py:two_args", "cannot accept prompt, completion, answer as keyword arguments (no parameter answer)"),
        ("task.py:positional_only", "(positional-only prompt, completion, answer)"),
        ("task.py:", "is not a function name"),
        ("no_such_module_zz.sub:reward", "ModuleNotFoundError"),
        ("json:no_such_fn", "module json has no attribute"),
        ("not-registered-anywhere", "not a registered name"),
    ],
)
def test_every_load_error_is_a_one_line_value_error_naming_the_spec(task, monkeypatch, spec, message):
    monkeypatch.chdir(task.parent)
    (task.parent / "broken.py").write_text("def reward(:\n    pass\n")
    (task.parent / "bad_import.py").write_text("import os\nimport no_such_module_zz\n")
    (task.parent / "raises_on_import.py").write_text("x = 1 / 0\n")
    with pytest.raises(ValueError) as info:
        load_reward_fn(spec)
    text = str(info.value)
    assert "\n" not in text and repr(spec) in text and message in text, text
    with pytest.raises(ValueError) as info:
        RewardFunctionRunner(spec)
    assert str(info.value) == text


@pytest.mark.parametrize(
    "kwargs, name", [({"timeout_s": 0}, "timeout_s"), ({"timeout_s": -1.0}, "timeout_s"), ({"n_procs": 0}, "n_procs")]
)
def test_runner_arguments_are_validated(task, kwargs, name):
    with pytest.raises(ValueError, match=name):
        RewardFunctionRunner(f"{task}:exact", **kwargs)


# ---------------------------------------------------------------- sync functions in children


def test_sync_scores_pass_through_and_row_fields_arrive(task, runners):
    exact = runners(f"{task}:exact")
    assert [score(exact, "4", "4"), score(exact, "5", "4")] == [1.0, 0.0]
    assert not exact.is_async and len(exact.child_pids()) == 1
    assert score(runners(f"{task}:partial"), "x") == 0.37
    row = {"weight": 0.5, "items": [1, {"a": 2}, "3"], "flag": None}
    assert score(runners(f"{task}:uses_row"), "x", row=row) == 2.0
    # Without **row, only the fields the function names are passed.
    named = runners(f"{task}:named_field_only")
    assert score(named, "12", row={"target": 12, "other": "ignored"}) == 1.0
    assert score(runners(f"{task}:sibling"), "x") == 0.625  # the child imports the sibling too
    assert exact.pop_stats() == {"calls": 2.0, "timeouts": 0.0, "errors": 0.0}


def test_a_hung_call_is_cut_off_and_the_next_call_gets_a_fresh_child(task, runners):
    runner = runners(f"{task}:hang_on_request", timeout_s=1.0, n_procs=1)
    assert score(runner, "0.5") == 0.5
    (old_pid,) = runner.child_pids()
    assert score(runner, "hang") == 0.0
    assert runner.pop_stats() == {"calls": 2.0, "timeouts": 1.0, "errors": 0.0}
    assert _gone(old_pid) and runner.child_pids() == []
    assert score(runner, "0.25") == 0.25
    assert runner.child_pids() and runner.child_pids() != [old_pid]


def test_an_exception_scores_zero_is_counted_and_logged_once(task, runners):
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("realrl.reward_fn")
    logger.addHandler(handler)
    try:
        runner = runners(f"{task}:raises")
        assert score(runner, "ok") == 2.5
        pid = runner.child_pids()
        assert [score(runner, "raise") for _ in range(3)] == [0.0, 0.0, 0.0]
        assert runner.child_pids() == pid, "an exception must not cost the child"
        assert score(runner, "ok") == 2.5
    finally:
        logger.removeHandler(handler)
    assert runner.pop_stats() == {"calls": 5.0, "timeouts": 0.0, "errors": 3.0}
    assert runner.counts() == {"calls": 5, "timeouts": 0, "errors": 3}
    assert runner.pop_stats() == {"calls": 0.0, "timeouts": 0.0, "errors": 0.0}
    (record,) = records  # later failures of the same kind are rate-limited
    message = record.getMessage()
    assert "\n" not in message and "ZeroDivisionError: boom second line (at task.py:" in message


def test_a_crashing_child_scores_zero_and_the_next_call_works(task, runners):
    runner = runners(f"{task}:exits", n_procs=1)
    assert score(runner, "ok") == 1.5
    (old_pid,) = runner.child_pids()
    assert score(runner, "exit") == 0.0
    assert _gone(old_pid) and runner.counts()["errors"] == 1
    assert score(runner, "ok") == 1.5 and runner.child_pids() != [old_pid]


def test_bad_return_values_score_zero_and_are_counted(task, runners):
    runner = runners(f"{task}:returns")
    assert [score(runner, c) for c in ("abc", "nan", "inf", "none")] == [0.0] * 4
    assert runner.counts() == {"calls": 4, "timeouts": 0, "errors": 4}
    assert score(runner, "true") == 1.0 and score(runner, "int") == 7.0  # bool and int are numbers
    assert runner.counts()["errors"] == 4


def test_stdout_prints_do_not_corrupt_the_protocol(task, runners):
    runner = runners(f"{task}:prints")
    assert [score(runner, "x") for _ in range(3)] == [0.25] * 3
    assert runner.counts()["errors"] == 0


def test_concurrent_calls_all_get_their_own_answers(task, runners):
    runner = runners(f"{task}:echo_float", n_procs=2)

    async def main():
        return await asyncio.gather(*(runner.score("p", str(i / 8), "", {}) for i in range(20)))

    assert asyncio.run(main()) == [i / 8 for i in range(20)]
    assert 1 <= len(runner.child_pids()) <= 2 and runner.counts() == {"calls": 20, "timeouts": 0, "errors": 0}


def test_close_ends_every_child(task):
    runner = RewardFunctionRunner(f"{task}:whoami", n_procs=2)

    async def main():
        return await asyncio.gather(*(runner.score("p", "c", "a", {}) for _ in range(6)))

    reported = {int(s) for s in asyncio.run(main())}
    pids = runner.child_pids()
    assert pids and set(pids) == reported
    runner.close()
    assert all(_gone(p) for p in pids)
    ours = [p for p in psutil.Process().children(recursive=True) if str(task) in " ".join(_cmdline(p))]
    assert not ours, "a reward child outlived close()"
    with pytest.raises(RuntimeError, match="closed"):
        score(runner, "c")


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


# ---------------------------------------------------------------- async functions in the loop


def test_async_functions_run_in_the_loop(task, runners):
    runner = runners(f"{task}:async_partial")
    assert runner.is_async
    assert score(runner, "x") == 0.37 and score(runner, "x", row={"bonus": 0.25}) == 0.62
    assert runner.child_pids() == []
    instance = runners(f"{task}:scorer")  # an object with `async def __call__`
    assert instance.is_async and score(instance, "x") == 0.75


def test_async_timeout_exception_and_bad_value_score_zero(task, runners):
    hang = runners(f"{task}:async_hang", timeout_s=1.0)
    assert score(hang, "hang") == 0.0 and score(hang, "ok") == 1.0
    assert hang.pop_stats() == {"calls": 2.0, "timeouts": 1.0, "errors": 0.0}
    raising = runners(f"{task}:async_raises")
    assert score(raising, "x") == 0.0
    nan = runners(f"{task}:async_nan")
    assert score(nan, "x") == 0.0
    assert raising.counts()["errors"] == 1 and nan.counts()["errors"] == 1
    assert not math.isnan(score(nan, "x"))
