"""The trainer's version writes off the train step (realrl/system/version_announce.py), against a real etcd."""

from __future__ import annotations

import threading

import pytest

from realrl.base import name_resolve
from realrl.system.version_announce import VersionAnnouncer
from tests.conftest import make_nr_config


@pytest.fixture
def etcd_repo(tmp_path, etcd_server):
    repo = name_resolve.make_repository(make_nr_config("etcd3", tmp_path, etcd_server))
    yield repo
    repo.close()


def test_versions_reach_etcd_in_order_and_flush_waits_for_the_newest(etcd_repo, unique_prefix):
    key = f"{unique_prefix}/model_version/actor"
    seen: list[int] = []
    gate = threading.Event()

    def write(version: int) -> None:
        gate.wait(30)  # (the first write holds the thread: the versions behind it wait together)
        etcd_repo.add(key, str(version), replace=True)
        seen.append(version)

    announcer = VersionAnnouncer(write)
    try:
        for v in range(1, 6):
            announcer.announce(v)  # returns at once, whatever the write takes
        gate.set()
        announcer.flush(30)
        assert etcd_repo.get(key) == "5" and announcer.written == 5
        assert seen == sorted(seen) and seen[-1] == 5 and len(seen) <= 5  # in order; overtaken ones skipped
        announcer.announce(6)
    finally:
        announcer.close()
    assert etcd_repo.get(key) == "6"  # close writes what waits


def test_a_failed_write_is_raised_by_the_next_announce_or_flush(etcd_repo, unique_prefix):
    key = f"{unique_prefix}/v"

    def write(version: int) -> None:
        if version == 2:
            raise ConnectionError("name service gone")
        etcd_repo.add(key, str(version), replace=True)

    announcer = VersionAnnouncer(write)
    try:
        announcer.announce(1)
        announcer.flush(30)
        announcer.announce(2)
        with pytest.raises(RuntimeError, match="name service gone"):
            announcer.flush(30)
        announcer.announce(3)  # (the error was raised once; the next versions go on)
        announcer.flush(30)
        assert etcd_repo.get(key) == "3"
    finally:
        announcer.close()
    with pytest.raises(RuntimeError, match="closed"):
        announcer.announce(4)
