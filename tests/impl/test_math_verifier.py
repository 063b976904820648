"""The math verifier: numeric path in-process, math-verify in real child processes
that are killed on timeout or crash and replaced."""

from __future__ import annotations

import asyncio

import psutil
import pytest

from realrl.impl.verifiers import math_verifier
from realrl.impl.verifiers.math_verifier import (
    TEST_HOOK_CRASH,
    TEST_HOOK_SLEEP,
    MathVerifier,
    extract_answer,
    numeric_score,
)


@pytest.fixture
def verifier():
    v = MathVerifier(n_procs=1, test_hooks=True)
    yield v
    v.close()


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize(
    "text, expected",
    [
        ("81", "81"),
        ("A: 12 then 81", "81"),
        ("-7", "-7"),
        ("x = 3.25.", "3.25"),
        ("total 1,234,567 apples", "1234567"),
        (r"so the answer is \boxed{\frac{1}{2}} (I think 3)", r"\frac{1}{2}"),
        (r"\boxed{1} or \boxed{ {2} }", "{2}"),
        (r"\boxed{unclosed 5", "5"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "answer, solutions, expected",
    [
        ("81", ["81"], 1.0),
        ("81", ["81.0"], 1.0),
        ("81.00", ["81"], 1.0),
        ("80", ["81"], 0.0),
        ("-3", ["-3"], 1.0),
        ("3", ["-3"], 0.0),
        ("0.5", ["0.50"], 1.0),
        ("The answer: 1,000", ["1000"], 1.0),
        ("I think 12, no wait, 13", ["13"], 1.0),
        ("I think 13, no wait, 12", ["13"], 0.0),
        ("81abc!!", ["81"], 1.0),
        ("garbage", ["81"], 0.0),
        ("", ["81"], 0.0),
        ("7", ["5", "7"], 1.0),
        (r"\boxed{42}", ["42"], 1.0),
    ],
)
def test_numeric_answers_are_checked_in_process(verifier, answer, solutions, expected):
    assert numeric_score(answer, solutions) == expected
    assert verifier.verify(answer, solutions) == expected
    assert asyncio.run(verifier.averify(answer, solutions)) == expected
    assert verifier.n_children_started == 0, "numeric checks must not start a child process"


def test_latex_answers_use_math_verify_in_a_child(verifier):
    assert numeric_score(r"\boxed{\frac{1}{2}}", ["0.5"]) is None  # needs math-verify
    assert verifier.verify(r"so \boxed{\frac{1}{2}}", ["0.5"]) == 1.0
    assert verifier.verify("0.5", [r"\frac{1}{2}"]) == 1.0
    assert verifier.verify(r"\boxed{\sqrt{2}}", [r"\sqrt 2"]) == 1.0
    assert verifier.verify(r"\boxed{1+x^2}", ["$x^2+1$"]) == 1.0
    assert verifier.verify(r"\boxed{\frac{1}{3}}", [r"\frac{1}{2}"]) == 0.0
    assert verifier.verify("no idea", [r"\frac{1}{2}"]) == 0.0
    assert verifier.verify("", [r"\frac{1}{2}"]) == 0.0
    assert verifier.n_children_started == 1 and len(verifier.child_pids()) == 1  # one persistent child
    assert verifier.n_timeouts == verifier.n_crashes == 0


def test_hanging_check_is_cut_off_and_the_next_call_works(verifier):
    assert verifier.verify(r"\boxed{\frac{2}{4}}", [r"\frac{1}{2}"]) == 1.0
    (old_pid,) = verifier.child_pids()
    assert verifier.verify(r"\boxed{1}", [TEST_HOOK_SLEEP], timeout_s=1.0) == 0.0
    assert verifier.n_timeouts == 1 and verifier.n_crashes == 0
    assert _gone(old_pid), "the hung child must be killed"
    assert verifier.child_pids() == []
    # A fresh child answers the next call.
    assert verifier.verify(r"\boxed{\frac{2}{4}}", [r"\frac{1}{2}"]) == 1.0
    assert verifier.child_pids() and verifier.child_pids() != [old_pid]


def test_crashing_check_scores_zero_and_recovers(verifier):
    assert verifier.verify(r"\boxed{\pi}", [TEST_HOOK_CRASH]) == 0.0
    assert verifier.n_crashes == 1 and verifier.n_timeouts == 0
    assert verifier.verify(r"\boxed{\pi}", [r"\pi"]) == 1.0
    assert verifier.n_children_started == 2


def test_hooks_are_inert_without_the_flag():
    verifier = MathVerifier(n_procs=1, test_hooks=False)
    try:
        assert verifier.verify(r"\boxed{1}", [TEST_HOOK_SLEEP], timeout_s=30.0) == 0.0
        assert verifier.verify(r"\boxed{1}", [TEST_HOOK_CRASH], timeout_s=30.0) == 0.0
        assert verifier.n_timeouts == verifier.n_crashes == 0 and verifier.n_children_started == 1
    finally:
        verifier.close()


def test_async_checks_do_not_block_the_loop_and_a_hang_does_not_stall_other_children():
    verifier = MathVerifier(n_procs=2, test_hooks=True)

    async def main():
        # Start both children first (two concurrent checks), so what follows
        # measures scheduling, not process start-up.
        warm = await asyncio.gather(*(verifier.averify(r"\boxed{3}", ["$3$"]) for _ in range(2)))
        assert warm == [1.0, 1.0] and verifier.n_children_started == 2
        hung = asyncio.create_task(verifier.averify(r"\boxed{1}", [TEST_HOOK_SLEEP], timeout_s=3.0))
        await asyncio.sleep(0)  # let the hung check take its child
        # While the hung check waits on its thread, the loop keeps running and
        # the other child serves other checks.
        results = await asyncio.gather(
            verifier.averify(r"\boxed{\frac{1}{2}}", ["0.5"]),
            verifier.averify(r"\boxed{\frac{1}{3}}", ["0.5"]),
            verifier.averify("81", ["81"]),
        )
        assert not hung.done(), "the hung check returned before its timeout"
        return results, await hung

    try:
        results, hung_score = asyncio.run(main())
        assert results == [1.0, 0.0, 1.0]
        assert hung_score == 0.0 and verifier.n_timeouts == 1
    finally:
        verifier.close()


def test_close_kills_children():
    verifier = MathVerifier(n_procs=1)
    assert verifier.verify(r"\boxed{2}", ["$2$"]) == 1.0
    pids = verifier.child_pids()
    verifier.close()
    assert pids and all(_gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        verifier.verify(r"\boxed{2}", ["$2$"])


def test_module_level_functions_use_the_default_verifier():
    try:
        assert math_verifier.verify("A: 81", ["81"]) == 1.0
        assert asyncio.run(math_verifier.averify("A: 80", ["81"])) == 0.0
        assert math_verifier.verify(r"\boxed{0.25}", [r"\frac{1}{4}"]) == 1.0
    finally:
        math_verifier.shutdown_default_verifier()


PARENT_THAT_HANGS = """
import json, time
from realrl.impl.verifiers.math_verifier import TEST_HOOK_SLEEP, _Child
child = _Child(test_hooks=True, startup_timeout_s=120)
# The hanging request is in the child's pipe before we report its pid, so the
# child is (or will be) stuck in the check, not reading stdin, when we are killed.
request = {"id": 1, "answer": "x", "solutions": [TEST_HOOK_SLEEP], "timeout_s": 3600}
child.proc.stdin.write((json.dumps(request) + "\\n").encode())
print(child.proc.pid, flush=True)
time.sleep(3600)
"""


def test_child_exits_when_its_parent_is_killed_mid_check():
    import os
    import signal
    import subprocess
    import sys
    import time

    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_THAT_HANGS], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        assert not _gone(child_pid)
        parent.kill()  # SIGKILL to the parent alone, not its process group
        parent.wait(timeout=30)
        deadline = time.monotonic() + 60  # a generous bound on "eventually", not a speed check
        while not _gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _gone(child_pid), "verifier child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if child_pid is not None and not _gone(child_pid):
            os.kill(child_pid, signal.SIGKILL)
