"""Child processes for the stream tests, plus the helpers that start and kill
them. The name_resolve backend comes from the REALRL_NAME_RESOLVE_*
environment (name_resolve.config_to_env).

    python stream_child.py pusher EXP TRIAL INDEX COUNT PULLER_COUNT N_MESSAGES
    python stream_child.py reply_server EXP TRIAL WORKER_INDEX [GO_FILE]

With TEST_TRIAL_SECRET naming a trial secret file, the child seals its streams with its keys.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- used by the tests -----------------------------------------------------------


def spawn(config, *args: str) -> subprocess.Popen:
    """Starts this file as a child in its own process group."""
    from realrl.base import name_resolve

    env = dict(os.environ, **name_resolve.config_to_env(config))
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), *args],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def message(pusher_index: int, seq: int) -> dict:
    """What pusher `pusher_index` sends as its `seq`-th message."""
    import numpy as np

    return {
        "pusher": pusher_index,
        "seq": seq,
        "tokens": np.arange(seq, seq + 7, dtype=np.int32) * (pusher_index + 1),
        "logprobs": np.full((2, 3), -0.5 * seq, dtype=np.float32),
        "meta": {"qid": f"q{pusher_index}-{seq}", "reward": float(seq) / 3},
    }


# ---- child actions ---------------------------------------------------------------


def run_pusher(exp: str, trial: str, index: int, count: int, puller_count: int, n_messages: int) -> None:
    from realrl.system.push_pull_stream import NameResolvingZmqPusher

    pusher = NameResolvingZmqPusher(exp, trial, index, count, puller_count, timeout=60)
    for seq in range(n_messages):
        pusher.push(message(index, seq), timeout=60)
    print(f"pushed {n_messages} to puller {pusher.puller_index}", flush=True)
    pusher.close(linger=30)


def remote_failing_function(data):
    raise ValueError(f"boom: {data!r}")


def run_reply_server(exp: str, trial: str, worker_index: int, go_file: str | None) -> None:
    from realrl.system.request_reply_stream.reply_server import NameResolvingReplyServer

    server = NameResolvingReplyServer(exp, trial, worker_index, connect_timeout=60)
    releases = threading.Semaphore(0)  # each "release" lets one "block" finish
    marks = [0]
    long_sequence = [0]

    def block(data):
        released = releases.acquire(timeout=60)
        return {"worker": worker_index, "released": released}

    def release(data):
        releases.release()
        return True

    def mark(data):
        marks[0] += 1
        return marks[0]

    def long_echo(data):
        long_sequence[0] += 1
        return {"worker": worker_index, "data": data, "sequence": long_sequence[0]}

    server.register("whoami", lambda data: {"worker": worker_index, "data": data})
    server.register("echo", lambda data: data)
    server.register("fail", remote_failing_function)
    server.register("release", release)
    server.register("mark", mark)
    server.register(
        "stats",
        lambda data: {"n_rejected": server.n_rejected, "n_forged": server.n_forged, "n_handled": server.n_handled},
    )
    server.register("unsendable", lambda data: {"x": object()})
    server.register("block", block, long_running=True)
    server.register("long_echo", long_echo, long_running=True)
    print("connected", flush=True)
    if go_file:
        while not os.path.exists(go_file):
            time.sleep(0.01)
    while True:
        server.serve(timeout=0.1)


def main() -> None:
    from realrl.base import trial_secret

    trial_secret.install(os.environ.get("TEST_TRIAL_SECRET", ""))  # a sealed stream's key (docs/design.md §14)
    action, args = sys.argv[1], sys.argv[2:]
    if action == "pusher":
        exp, trial, index, count, puller_count, n_messages = args
        run_pusher(exp, trial, int(index), int(count), int(puller_count), int(n_messages))
    elif action == "reply_server":
        exp, trial, worker_index, *rest = args
        run_reply_server(exp, trial, int(worker_index), rest[0] if rest else None)
    else:
        raise SystemExit(f"unknown action {action}")


if __name__ == "__main__":
    main()
