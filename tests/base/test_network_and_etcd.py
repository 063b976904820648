"""Port hand-out, loopback addresses, and the private etcd helper."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import psutil
import pytest

from realrl.base import name_resolve, names, network, trial_secret
from realrl.base.etcd_server import PRIVATE_ETCD_USER, EtcdServer, enable_auth, start_supervised
from tests.conftest import make_nr_config


def test_local_mode_binds_loopback_only():
    assert network.bind_address("local") == "127.0.0.1"
    assert network.advertise_address("local") == "127.0.0.1"
    with pytest.raises(ValueError, match="bind_address"):
        network.bind_address("slurm")


@pytest.mark.parametrize("kind", ["file", "etcd3"])
def test_ports_never_handed_out_twice_in_a_trial(kind, tmp_path, etcd_server):
    name_resolve.reconfigure(make_nr_config(kind, tmp_path, etcd_server))
    try:
        exp, trial = "ports", f"t{os.getpid()}{kind}"
        got: list[int] = []
        lock = threading.Lock()

        def grab():
            ports = network.find_free_ports(25, exp, trial, port_range=(40000, 40100))
            with lock:
                got.extend(ports)

        threads = [threading.Thread(target=grab) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(got) == 75 and len(set(got)) == 75  # 75 of 100 ports, no repeats
        for p in got[:5]:
            assert network.is_port_free(p)
        name_resolve.clear_subtree(names.trial_root(exp, trial))
    finally:
        name_resolve.reconfigure(name_resolve.NameResolveConfig(type="memory"))


def test_busy_port_is_skipped():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        assert not network.is_port_free(busy)
        ports = network.find_free_ports(5, port_range=(busy, busy + 6))
        assert busy not in ports


def test_etcd_server_start_stop(tmp_path):
    server = EtcdServer(str(tmp_path)).start()
    pid = server.process.pid
    assert server.addr.startswith("127.0.0.1:")
    repo = name_resolve.make_repository(name_resolve.NameResolveConfig(type="etcd3", etcd3_addr=server.addr))
    repo.add("hello", "world")
    assert repo.get("hello") == "world"
    repo.close()
    assert os.path.isdir(tmp_path / "etcd-data")
    server.stop()
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_supervised_etcd_outlives_parent_by_linger_then_stops(tmp_path):
    # A stand-in "launcher" process that we can SIGKILL.
    parent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    supervisor, addr = start_supervised(str(tmp_path), parent.pid, linger=2.0)
    try:
        etcd_pids = [c.pid for c in psutil.Process(supervisor.pid).children()]
        assert len(etcd_pids) == 1
        repo = name_resolve.make_repository(name_resolve.NameResolveConfig(type="etcd3", etcd3_addr=addr))
        repo.add("k", "v", delete_on_exit=False)
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        time.sleep(0.8)
        assert repo.get("k") == "v"  # still serving during the linger
        supervisor.wait(timeout=20)
        assert not psutil.pid_exists(etcd_pids[0])
        repo._closed.set()
    finally:
        for p in (parent, supervisor):
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def test_names_are_scoped_and_validated(monkeypatch):
    monkeypatch.setenv("REALRL_USER", "alice")
    assert names.model_version("exp", "t1", "actor") == "alice/exp/t1/model_version/actor"
    assert names.worker_status("exp", "t1", "model_worker", 0).startswith(names.trial_root("exp", "t1") + "/")
    with pytest.raises(ValueError, match="trial_name"):
        names.trial_root("exp", "a/b")


def test_an_etcd_write_without_the_trials_credentials_is_refused(tmp_path):
    """docs/design.md §14: the private etcd runs with authentication on (root,
    the password derived from the trial secret)."""
    secret = trial_secret.ensure_secret(str(tmp_path / "run"))
    server = EtcdServer(str(tmp_path / "etcd")).start()
    try:
        enable_auth(server.addr, trial_secret.load_keys(secret).etcd_password)
        enable_auth(server.addr, trial_secret.load_keys(secret).etcd_password)  # a resume: left as it is
        trial = name_resolve.NameResolveConfig(
            type="etcd3", etcd3_addr=server.addr, etcd3_user=PRIVATE_ETCD_USER, etcd3_secret=secret
        )
        repo = name_resolve.make_repository(trial)
        repo.add("trial/key", "ours", delete_on_exit=False)
        anonymous = name_resolve.make_repository(name_resolve.NameResolveConfig(type="etcd3", etcd3_addr=server.addr))
        with pytest.raises(Exception, match="user name is empty"):
            anonymous.add("trial/key", "theirs", replace=True)
        with pytest.raises(Exception, match="user name is empty"):
            anonymous.get("trial/key")
        other = trial_secret.ensure_secret(str(tmp_path / "other"))  # another trial's secret
        with pytest.raises(Exception, match="authentication failed"):
            name_resolve.make_repository(dataclasses.replace(trial, etcd3_secret=other))
        assert repo.get("trial/key") == "ours"
        anonymous.close()
        repo.close()
    finally:
        server.stop()
