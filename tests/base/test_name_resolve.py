"""One behaviour suite over the three name_resolve backends.

The memory backend lives in one process, so its concurrency tests race
threads; the file and etcd3 backends race real processes, and their TTL tests
SIGKILL a real child. The etcd3 cases run against a real etcd server.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from realrl.base import name_resolve, names
from realrl.base.etcd_server import EtcdServer
from realrl.base.name_resolve import NameEntryExistsError, NameEntryNotFoundError
from tests.conftest import make_nr_config

ALL = ["memory", "file", "etcd3"]
SHARED = ["file", "etcd3"]  # backends several processes can share
CHILD = os.path.join(os.path.dirname(__file__), "nr_child.py")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


@pytest.fixture(params=ALL)
def backend(request, tmp_path, etcd_server):
    config = make_nr_config(request.param, tmp_path, etcd_server)
    repo = name_resolve.make_repository(config)
    yield request.param, config, repo
    repo.close()


@pytest.fixture(params=SHARED)
def shared_backend(request, tmp_path, etcd_server):
    config = make_nr_config(request.param, tmp_path, etcd_server)
    repo = name_resolve.make_repository(config)
    yield request.param, config, repo
    repo.close()


def spawn_child(config, *args) -> subprocess.Popen:
    env = dict(os.environ, **name_resolve.config_to_env(config))
    env["PYTHONPATH"] = REPO_ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.Popen(
        [sys.executable, CHILD, *args], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---- basic semantics (every backend) ----------------------------------------


def test_add_get_delete(backend, unique_prefix):
    _, _, repo = backend
    key = f"{unique_prefix}/a"
    repo.add(key, "v1")
    assert repo.get(key) == "v1"
    with pytest.raises(NameEntryExistsError):
        repo.add(key, "v2")
    repo.add(key, "v2", replace=True)
    assert repo.get(key) == "v2"
    repo.delete(key)
    with pytest.raises(NameEntryNotFoundError):
        repo.get(key)
    with pytest.raises(NameEntryNotFoundError):
        repo.delete(key)


def test_subtree_sorted_and_prefix_exact(backend, unique_prefix):
    _, _, repo = backend
    for k in ["b", "a", "c/d", "a/x"]:
        repo.add(f"{unique_prefix}/t/{k}", k)
    repo.add(f"{unique_prefix}/tt", "not below t")  # shares the string prefix only
    keys = repo.find_subtree(f"{unique_prefix}/t")
    assert keys == sorted(keys)
    assert [k.rsplit("/t/", 1)[1] for k in keys] == ["a", "a/x", "b", "c/d"]
    assert repo.get_subtree(f"{unique_prefix}/t") == ["a", "a/x", "b", "c/d"]
    assert repo.get_subtree(f"{unique_prefix}/nothing") == []
    items = repo.items_subtree(f"{unique_prefix}/t")
    assert list(items) == keys and list(items.values()) == ["a", "a/x", "b", "c/d"]
    repo.add(f"{unique_prefix}/t", "the root itself")
    assert repo.items_subtree(f"{unique_prefix}/t")[f"{unique_prefix}/t"] == "the root itself"


def test_add_subentry_unique(backend, unique_prefix):
    _, _, repo = backend
    keys = [repo.add_subentry(f"{unique_prefix}/subs", str(i)) for i in range(20)]
    assert len(set(keys)) == 20
    assert sorted(repo.get_subtree(f"{unique_prefix}/subs"), key=int) == [str(i) for i in range(20)]


def test_wait_timeout_and_wakeup(backend, unique_prefix):
    _, _, repo = backend
    key = f"{unique_prefix}/later"
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        repo.wait(key, timeout=0.3)
    assert time.monotonic() - t0 >= 0.3
    threading.Timer(0.3, lambda: repo.add(key, "here")).start()
    assert repo.wait(key, timeout=10) == "here"


def test_clear_subtree_leaves_other_trial(backend):
    _, _, repo = backend
    trial_a, trial_b = names.trial_root("exp", "trial-a"), names.trial_root("exp", "trial-b")
    for root in (trial_a, trial_b):
        repo.add(f"{root}/k1", "1")
        repo.add(f"{root}/deep/k2", "2")
    repo.add(names.trial_root("exp", "trial-aa") + "/k", "prefix twin")
    repo.clear_subtree(trial_a)
    assert repo.find_subtree(trial_a) == []
    assert repo.get_subtree(trial_b) == ["2", "1"]
    assert repo.get(names.trial_root("exp", "trial-aa") + "/k") == "prefix twin"
    repo.clear_subtree(trial_b)
    repo.clear_subtree(names.trial_root("exp", "trial-aa"))


@pytest.mark.parametrize("bad", ["", "/", "a/../b", "..", "a//b", "./a", None, 3, b"bytes"])
def test_bad_names_raise_value_error(backend, bad):
    _, _, repo = backend
    with pytest.raises(ValueError):
        repo.add(bad, "v")
    with pytest.raises(ValueError):
        repo.get(bad)


def test_values_must_be_strings(backend, unique_prefix):
    _, _, repo = backend
    with pytest.raises(ValueError):
        repo.add(f"{unique_prefix}/n", 3)


def test_reset_deletes_only_delete_on_exit_keys(backend, unique_prefix):
    _, _, repo = backend
    repo.add(f"{unique_prefix}/temp", "t")
    repo.add(f"{unique_prefix}/kept", "k", delete_on_exit=False)
    repo.reset()
    with pytest.raises(NameEntryNotFoundError):
        repo.get(f"{unique_prefix}/temp")
    assert repo.get(f"{unique_prefix}/kept") == "k"


def test_watch_names_calls_back_when_all_gone(backend, unique_prefix):
    _, _, repo = backend
    keys = [f"{unique_prefix}/w1", f"{unique_prefix}/w2"]
    for k in keys:
        repo.add(k, "x")
    fired = threading.Event()
    name_resolve.watch_names(keys, fired.set, poll_frequency=0.05, repository=repo)
    repo.delete(keys[0])
    assert not fired.wait(0.4), "fired while one key was still present"
    repo.delete(keys[1])
    assert fired.wait(5)


def test_watch_values_follow_the_keys_and_tell_listeners(backend, unique_prefix):
    kind, _, repo = backend
    a, b = f"{unique_prefix}/a", f"{unique_prefix}/b"
    repo.add(a, "1")
    watch = repo.watch_values([a, b], poll_interval=0.05)
    changed = threading.Event()
    watch.add_listener(changed.set)
    try:
        assert watch.live == (kind == "etcd3")  # (etcd pushes; the others read through)
        assert watch.get(a) == "1"
        with pytest.raises(NameEntryNotFoundError):
            watch.get(b)
        for step in ("put", "replace", "delete"):
            changed.clear()
            if step == "put":
                repo.add(b, "x")
            elif step == "replace":
                repo.add(a, "2", replace=True)
            else:
                repo.delete(a)
            assert changed.wait(10), f"no listener call after the {step}"
            deadline = time.monotonic() + 10  # (a poll may see the change a beat before get does)
            while time.monotonic() < deadline:
                try:
                    now = (watch.get(a), watch.get(b))
                except NameEntryNotFoundError:
                    now = (None, watch.get(b))
                if now == {"put": ("1", "x"), "replace": ("2", "x"), "delete": (None, "x")}[step]:
                    break
                time.sleep(0.01)
            else:
                pytest.fail(f"after the {step} the watch says {now}")
    finally:
        watch.close()


def test_watch_values_read_through_once_etcd_is_gone(tmp_path):
    """A watch whose etcd went away answers as a read would: it raises, so a
    worker's checks find the name service gone as they did when they read."""
    server = EtcdServer(str(tmp_path / "etcd")).start()
    repo = name_resolve.make_repository(make_nr_config("etcd3", tmp_path, server))
    try:
        repo.add("k", "v")
        watch = repo.watch_values(["k"])
        changed = threading.Event()
        watch.add_listener(changed.set)
        assert watch.live and watch.get("k") == "v"
        server.stop()
        assert changed.wait(10)
        assert not watch.live
        with pytest.raises(Exception) as e:
            watch.get("k")
        assert not isinstance(e.value, NameEntryNotFoundError)
    finally:
        server.stop()
        repo._client.close()


def test_etcd_stream_threads_wait_in_long_slices(tmp_path, etcd_server):
    """grpc's stream readers (the watch thread, the lease keep-alive) wait in slices of
    GRPC_STREAM_WAIT_S, not grpc's 0.1 s, once an etcd repository exists; a change still
    reaches the watch's listener (a message wakes the reader, whatever the slice)."""
    from grpc import _common

    repo = name_resolve.make_repository(make_nr_config("etcd3", tmp_path, etcd_server))
    try:
        assert _common.MAXIMUM_WAIT_TIMEOUT >= name_resolve.GRPC_STREAM_WAIT_S == 1.0
        key = f"slices/{os.getpid()}"
        watch = repo.watch_values([key])
        changed = threading.Event()
        watch.add_listener(changed.set)
        repo.add(key, "1", keepalive_ttl=3)
        assert changed.wait(10) and watch.get(key) == "1"
        watch.close()
    finally:
        repo.close()


def test_ttl_key_survives_while_owner_lives(backend, unique_prefix):
    _, _, repo = backend
    key = f"{unique_prefix}/alive"
    repo.add(key, "x", keepalive_ttl=1)
    time.sleep(2.5)  # several TTLs: the keep-alive thread must refresh it
    assert repo.get(key) == "x"


def _proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_etcd_keepalive_stream_times_out_and_reopens(tmp_path):
    """etcd's refreshes share one stream: a stalled etcd makes a refresh
    raise within its timeout (not hang); once etcd answers again the next
    refresh opens a new stream; a revoked lease reads as not ours."""
    server = EtcdServer(str(tmp_path / "etcd")).start()
    repo = name_resolve.make_repository(make_nr_config("etcd3", tmp_path, server))
    try:
        for key in ("k", "k2"):  # leased, without the keep-alive thread (the test refreshes)
            repo._add(key, "v", 30, replace=True)
        assert repo._refresh("k", 30) and repo._refresh("k2", 30)
        os.kill(server.process.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 10
            while _proc_state(server.process.pid) != "T":  # (stopped: the signal is taken asynchronously)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                repo._keepalive_stream.refresh(repo._leases["k"].id, timeout=0.5)
            assert time.monotonic() - started < 5
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
        assert repo._refresh("k", 30) and repo.get("k") == "v"
        repo._leases["k2"].revoke()
        assert not repo._refresh("k2", 30)
    finally:
        repo.close()
        server.stop()


# ---- several real processes (file, etcd3) ------------------------------------


def test_racing_processes_exactly_one_add_wins(shared_backend, unique_prefix, tmp_path):
    _, config, repo = shared_backend
    key, go = f"{unique_prefix}/race", str(tmp_path / "go")
    children = [spawn_child(config, "race_add", key, f"p{i}", go) for i in range(6)]
    try:
        time.sleep(1.5)  # let every child import and block on the go file
        open(go, "w").close()
        results = [c.communicate(timeout=60)[0].strip() for c in children]
    finally:
        for c in children:
            kill(c)
    assert sorted(results) == ["lost"] * 5 + ["won"]
    assert repo.get(key) in {f"p{i}" for i in range(6)}


def test_racing_threads_exactly_one_add_wins_memory():
    repo = name_resolve.MemoryNameRecordRepository()
    barrier, wins = threading.Barrier(8), []

    def racer(i):
        barrier.wait()
        try:
            repo.add("race/key", str(i))
            wins.append(i)
        except NameEntryExistsError:
            pass

    threads = [threading.Thread(target=racer, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and repo.get("race/key") == str(wins[0])


def test_concurrent_add_subentry_unique_across_processes(shared_backend, unique_prefix, tmp_path):
    _, config, repo = shared_backend
    root, go = f"{unique_prefix}/subs", str(tmp_path / "go")
    children = [spawn_child(config, "add_subentries", root, "15", go) for _ in range(4)]
    try:
        time.sleep(1.5)
        open(go, "w").close()
        keys = [k for c in children for k in c.communicate(timeout=60)[0].split()]
    finally:
        for c in children:
            kill(c)
    assert len(keys) == 60 and len(set(keys)) == 60
    assert len(repo.find_subtree(root)) == 60


def test_ttl_key_vanishes_after_sigkill(shared_backend, unique_prefix):
    _, config, repo = shared_backend
    ttl = 1.0
    key = f"{unique_prefix}/held"
    child = spawn_child(config, "hold", key, str(ttl))
    try:
        assert child.stdout.readline().strip() == "ready"
        time.sleep(2.5 * ttl)  # alive while the child lives (it refreshes)
        assert repo.get(key) == str(child.pid)
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        killed_at = time.monotonic()
        deadline = killed_at + 2 * ttl + 1.0  # etcd leases have 1 s granularity
        while time.monotonic() < deadline:
            try:
                repo.get(key)
            except NameEntryNotFoundError:
                break
            time.sleep(0.05)
        gone_after = time.monotonic() - killed_at
    finally:
        kill(child)
    with pytest.raises(NameEntryNotFoundError):
        repo.get(key)
    assert gone_after <= 2 * ttl + 1.0
    # The key is free again for a new owner.
    repo.add(key, "new owner")


def test_child_exit_deletes_its_delete_on_exit_keys(shared_backend, unique_prefix):
    _, config, repo = shared_backend
    key = f"{unique_prefix}/exit"
    child = spawn_child(config, "add_then_exit", key)
    assert child.communicate(timeout=60)[0].strip() == "ready"
    assert child.returncode == 0
    with pytest.raises(NameEntryNotFoundError):
        repo.get(key)
    assert repo.get(key + "_kept") == "stay"


# ---- configuration -----------------------------------------------------------


def test_reconfigure_switches_backend(tmp_path):
    name_resolve.reconfigure(name_resolve.NameResolveConfig(type="file", file_root=str(tmp_path / "a")))
    name_resolve.add("cfg/key", "in-a")
    name_resolve.reconfigure(name_resolve.NameResolveConfig(type="file", file_root=str(tmp_path / "b")))
    with pytest.raises(NameEntryNotFoundError):
        name_resolve.get("cfg/key")
    name_resolve.reconfigure(name_resolve.NameResolveConfig(type="memory"))


@pytest.mark.parametrize(
    "config, key",
    [
        (dict(type="zookeeper"), "name_resolve.type"),
        (dict(type="file"), "name_resolve.file_root"),
        (dict(type="etcd3", etcd3_addr="nohostport"), "name_resolve.etcd3_addr"),
    ],
)
def test_bad_config_names_the_key(config, key):
    with pytest.raises(ValueError, match=key.replace(".", r"\.")):
        name_resolve.make_repository(name_resolve.NameResolveConfig(**config))
