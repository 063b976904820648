"""ChildPool: real `python -m` children speaking JSON lines, killed on timeout or
crash and replaced. This file is also the child: `python -m
tests.base.test_child_pool [--fail-setup | --slow-setup]` serves the requests below."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from realrl.base.child_pool import (
    ChildCrashed,
    ChildPool,
    ChildStartError,
    ChildTimeout,
    one_line_error,
    serve,
)

REPO = Path(__file__).resolve().parents[2]


def _handle(request: dict) -> dict:
    """The test child: request["op"] says what to do."""
    op = request["op"]
    if op == "echo":
        return {"value": request["value"], "pid": os.getpid()}
    if op == "noisy":  # prints (Python and C level) and reads stdin: none of it may touch the protocol
        print('{"id": 999, "value": "not a reply"}')
        os.write(1, b"raw write to fd 1\n")
        assert sys.stdin.read() == ""
        return {"value": request["value"]}
    if op == "raise":
        raise ValueError("bad\nrequest")
    if op == "sleep":
        time.sleep(3600)
    if op == "grandchild_then_sleep":
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
        with open(request["pid_file"], "w") as f:
            f.write(str(proc.pid))
        time.sleep(3600)
    if op == "exit":
        os._exit(5)
    raise AssertionError(f"unknown op {op}")


def _setup_for(argv: list[str]):
    def setup() -> None:
        if "--fail-setup" in argv:
            raise RuntimeError("setup\nfailed on purpose")
        if "--slow-setup" in argv:
            time.sleep(3600)

    return setup


def make_pool(*flags: str, n_procs: int = 1, startup_timeout_s: float = 60.0) -> ChildPool:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, "-m", "tests.base.test_child_pool", *flags]
    return ChildPool(cmd, n_procs=n_procs, startup_timeout_s=startup_timeout_s, name="test child", env=env)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.fixture
def pool():
    p = make_pool()
    yield p
    p.close()


def test_round_trip_reuses_one_child_and_ignores_stray_output(pool):
    first = pool.call({"op": "echo", "value": [1, "a", None]}, timeout_s=30)
    assert first["value"] == [1, "a", None] and first["pid"] == pool.child_pids()[0]
    assert pool.call({"op": "noisy", "value": "x"}, timeout_s=30)["value"] == "x"
    assert pool.call({"op": "echo", "value": 2}, timeout_s=30)["pid"] == first["pid"]
    assert pool.n_children_started == 1


def test_an_exception_is_a_one_line_error_reply_and_the_child_lives_on(pool):
    pid = pool.call({"op": "echo", "value": 0}, timeout_s=30)["pid"]
    reply = pool.call({"op": "raise"}, timeout_s=30)
    assert reply["error"] == "ValueError: bad request" and "value" not in reply
    assert pool.call({"op": "echo", "value": 1}, timeout_s=30)["pid"] == pid


def test_timeout_kills_the_child_and_its_children_and_the_next_call_gets_a_fresh_one(pool, tmp_path):
    pid = pool.call({"op": "echo", "value": 0}, timeout_s=30)["pid"]
    pid_file = tmp_path / "grandchild"
    with pytest.raises(ChildTimeout, match="did not answer within 1"):
        pool.call({"op": "grandchild_then_sleep", "pid_file": str(pid_file)}, timeout_s=1.0)
    assert _gone(pid) and pool.child_pids() == []
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 30  # a hang guard, not a speed check
    while not _gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(grandchild), "a process the timed-out child started outlived it"
    reply = pool.call({"op": "echo", "value": 1}, timeout_s=30)
    assert reply["value"] == 1 and reply["pid"] != pid and pool.n_children_started == 2


def test_a_crash_raises_child_crashed_and_the_pool_recovers(pool):
    with pytest.raises(ChildCrashed, match="exited with code 5"):
        pool.call({"op": "exit"}, timeout_s=30)
    assert pool.child_pids() == []
    assert pool.call({"op": "echo", "value": "ok"}, timeout_s=30)["value"] == "ok"


def test_a_request_json_cannot_carry_fails_before_any_child_starts(pool):
    with pytest.raises(TypeError):
        pool.call({"op": "echo", "value": object()}, timeout_s=30)
    with pytest.raises(ValueError, match="timeout_s"):
        pool.call({"op": "echo", "value": 1}, timeout_s=0)
    assert pool.n_children_started == 0


def test_setup_failure_and_startup_timeout_are_start_errors():
    failing = make_pool("--fail-setup")
    try:
        with pytest.raises(ChildStartError, match="failed to start: RuntimeError: setup failed on purpose"):
            failing.call({"op": "echo", "value": 1}, timeout_s=30)
        assert failing.child_pids() == []
    finally:
        failing.close()
    slow = make_pool("--slow-setup", startup_timeout_s=1.0)
    try:
        with pytest.raises(ChildStartError, match="did not report ready within 1.0s"):
            slow.call({"op": "echo", "value": 1}, timeout_s=30)
        assert slow.child_pids() == []
    finally:
        slow.close()


def test_concurrent_async_calls_share_n_procs_children():
    pool = make_pool(n_procs=2)

    async def main():
        return await asyncio.gather(*(pool.acall({"op": "echo", "value": i}, timeout_s=30) for i in range(20)))

    try:
        replies = asyncio.run(main())
        assert [r["value"] for r in replies] == list(range(20))
        assert len({r["pid"] for r in replies}) <= 2 and pool.n_children_started <= 2
    finally:
        pool.close()


def test_close_kills_every_child_and_later_calls_raise():
    pool = make_pool(n_procs=2)

    async def warm():
        return await asyncio.gather(*(pool.acall({"op": "echo", "value": i}, timeout_s=30) for i in range(4)))

    asyncio.run(warm())
    pids = pool.child_pids()
    pool.close()
    assert pids and all(_gone(p) for p in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.call({"op": "echo", "value": 1}, timeout_s=30)
    with pytest.raises(RuntimeError, match="closed"):
        asyncio.run(pool.acall({"op": "echo", "value": 1}, timeout_s=30))


PARENT_THAT_HANGS = """
import os, sys, threading
sys.path.insert(0, {repo!r})
from tests.base.test_child_pool import make_pool
pool = make_pool()
pid = pool.call({{"op": "echo", "value": 0}}, timeout_s=60)["pid"]
threading.Thread(target=pool.call, args=({{"op": "sleep"}}, 3600), daemon=True).start()
print(pid, flush=True)
threading.Event().wait()
"""


def test_a_child_dies_with_its_parent_mid_call():
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT_THAT_HANGS.format(repo=str(REPO))],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    child_pid = None
    try:
        child_pid = int(parent.stdout.readline())
        assert not _gone(child_pid)
        parent.kill()  # SIGKILL to the parent alone, not its process group
        parent.wait(timeout=30)
        deadline = time.monotonic() + 30  # a hang guard, not a speed check
        while not _gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(child_pid), "child outlived its parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(timeout=30)
        if child_pid is not None and not _gone(child_pid):
            os.kill(child_pid, 9)


def test_one_line_error():
    try:
        raise KeyError("a\nb")
    except KeyError as e:
        assert one_line_error(e) == "KeyError: 'a\\nb'"
        assert one_line_error(e, where=True).startswith("KeyError: 'a\\nb' (at test_child_pool.py:")
    assert one_line_error(RuntimeError("x\n  y")) == "RuntimeError: x y"


if __name__ == "__main__":
    sys.exit(serve(_handle, _setup_for(sys.argv[1:])))
