"""The broadcast transport (realrl/impl/weights/broadcast.py, docs/design.md §8)
with real gloo groups on 127.0.0.1: the members are real processes
(`broadcast_member.py`) holding tiny real models; what they end up with is
compared bit for bit with what the disk path gives the same model."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file

from realrl.base import trial_secret
from realrl.impl.generation.torch_server.weights import WeightTargets, read_weights_dir
from realrl.impl.weights.broadcast import (
    GroupError,
    GroupSpec,
    Manifest,
    Receiver,
    SealedStore,
    Sender,
    StoreServer,
    published_tensors,
)
from realrl.system.model_worker import publish_weights
from tests.impl.weights.models import tiny_model, train_a_little

MEMBER = os.path.join(os.path.dirname(__file__), "broadcast_member.py")
HOST = "127.0.0.1"


@pytest.fixture
def secret_file(tmp_path):
    return trial_secret.ensure_secret(str(tmp_path / "run"))


@pytest.fixture
def store():
    server = StoreServer(HOST)
    yield server
    server.close()


def _members(spec: GroupSpec, secret_file: str, kind: str, dtype: str, tmp_path):
    procs = []
    for rank in range(1, spec.world_size):
        out = str(tmp_path / f"member{rank}")
        cmd = [sys.executable, MEMBER, json.dumps(spec.to_json()), str(rank), secret_file, kind, dtype, out]
        procs.append((subprocess.Popen(cmd), out))
    return procs


def _finish(procs, timeout=120):
    results = []
    for proc, out in procs:
        try:
            rc = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        with open(out + ".json") as f:
            results.append((rc, json.load(f), out))
    return results


def _through_disk(trainer: torch.nn.Module, kind: str, dtype: torch.dtype, weights_dir: str, version: int) -> dict:
    """What a server holding version 0 holds after loading `trainer`'s version from disk."""
    path = publish_weights(trainer, weights_dir, version, dtype=dtype)
    server = tiny_model(kind, seed=0, dtype=dtype)
    targets = WeightTargets(server)
    loaded = read_weights_dir(path)
    targets.check(loaded)
    targets.copy_in(loaded)
    return server.state_dict(), loaded


# (one member each: two torch servers in one group, bit for bit alike, are tests/system/test_weight_broadcast.py's)
@pytest.mark.parametrize("kind,dtype", [("tied", "float32"), ("untied", "bfloat16")])
def test_members_get_the_newest_version_bit_exact_with_the_disk_path(kind, dtype, store, secret_file, tmp_path):
    torch_dtype = getattr(torch, dtype)
    trainer = tiny_model(kind, seed=1)  # the trainer's float32 weights
    tensors = published_tensors(trainer)
    manifest = Manifest.of(tensors, torch_dtype)
    spec = GroupSpec("realrl-t-e1", HOST, store.port, 2, bucket_bytes=8192, timeout_s=60)
    sender = Sender(spec, trial_secret.load_keys(secret_file).weights_group_key, manifest, HOST)
    # Three versions before the members have joined: only the newest goes out.
    for version in (1, 2, 3):
        train_a_little(trainer, version)
        sender.publish(version, published_tensors(trainer))
    procs = _members(spec, secret_file, kind, dtype, tmp_path)
    try:
        assert sender.wait_sent(3, 120), sender.error
        train_a_little(trainer, 4)
        sender.publish(4, published_tensors(trainer))
        assert sender.wait_sent(4, 120), sender.error
        sender.close()
        results = _finish(procs)
    finally:
        for proc, _ in procs:
            proc.kill()
            proc.wait()
    assert sender.skipped == [1, 2] and sender.error is None
    expected, on_disk = _through_disk(trainer, kind, torch_dtype, str(tmp_path / "weights"), 4)
    # The tensor list is what save_pretrained writes: the same names, tied ones once.
    assert [e.name for e in manifest.entries] == list(tensors)
    assert set(tensors) == set(on_disk)
    if kind == "tied":
        assert len(tensors) == len(trainer.state_dict()) - 1
    for rc, result, out in results:
        assert rc == 0 and result == {"received": [3, 4], "error": None, "closed": True}
        got = load_file(out + ".safetensors")
        assert set(got) == set(expected)
        for name, t in expected.items():
            assert got[name].dtype == torch_dtype
            assert torch.equal(got[name], t), name


def test_a_process_without_the_secret_cannot_join_or_read_the_group(store, secret_file, tmp_path):
    trainer = tiny_model("untied", seed=1)
    manifest = Manifest.of(published_tensors(trainer))
    spec = GroupSpec("realrl-t-e3", HOST, store.port, 2, timeout_s=2)
    key = trial_secret.load_keys(secret_file).weights_group_key
    other_key = trial_secret.TrialKeys.from_secret(os.urandom(32)).weights_group_key
    failures: list[str] = []
    outsider = Receiver(
        spec, 1, other_key, HOST, check=lambda m: None, on_version=lambda v, t: None, on_failure=failures.append
    )
    sender = Sender(spec, key, manifest, HOST)
    sender.publish(1, published_tensors(trainer))
    # The outsider cannot read the sender's announcement, so it never enters the rendezvous,
    # and the sender's rendezvous ends at the group's timeout without it.
    assert not sender.wait_sent(1, 60)
    outsider.join(60)
    assert "cannot join" in sender.error
    assert len(failures) == 1 and "not sealed by this trial" in failures[0] and outsider.received == []
    # What the store holds is sealed: the sender's address is not readable without the key.
    # (the member's group of two with the sender, under a prefix of its own: `GroupSpec.member_group`)
    client = dist.TCPStore(HOST, store.port, None, False, datetime.timedelta(seconds=10))
    rank0 = f"{spec.member_group(1)[0]}/0/0"
    raw = client.get(f"{spec.name}/{rank0}")
    address = SealedStore(dist.PrefixStore(spec.name, client), key, spec.name).get(rank0)
    assert len(address) > 8 and address not in raw
    with pytest.raises(GroupError):
        SealedStore(dist.PrefixStore(spec.name, client), other_key, spec.name).get(rank0)
    # Nor can a value sealed for one group be replayed into another.
    with pytest.raises(GroupError):
        SealedStore(dist.PrefixStore(spec.name, client), key, "realrl-t-e4").get(rank0)


def test_a_tensor_list_that_does_not_fit_fails_the_member_only(store, secret_file):
    trainer = tiny_model("untied", seed=1)
    manifest = Manifest.of(published_tensors(trainer))
    spec = GroupSpec("realrl-t-e5", HOST, store.port, 2, timeout_s=30)
    key = trial_secret.load_keys(secret_file).weights_group_key
    other = tiny_model("tied", seed=0)  # another architecture
    done = threading.Event()
    member = Receiver(
        spec,
        1,
        key,
        HOST,
        check=lambda m: WeightTargets(other).check(m.placeholders()),
        on_version=lambda v, t: None,
        on_failure=lambda e: done.set(),
    )
    sender = Sender(spec, key, manifest, HOST)
    assert done.wait(60) and "missing tensors" in member.error
    sender.publish(1, published_tensors(trainer))
    assert not sender.wait_sent(1, 60) and sender.failed  # the member left: the group ends


def test_a_malformed_tensor_list_is_refused():
    good = Manifest.of({"a": torch.zeros(3), "b": torch.zeros(2, 2, dtype=torch.bfloat16)})
    assert Manifest.from_bytes(good.to_bytes()) == good
    assert [e.offset for e in good.entries] == [0, 64] and good.nbytes == 128
    raw = json.loads(good.to_bytes())
    for tensors in (
        [["a", "float32", [3], 0], ["b", "bfloat16", [2, 2], 8]],  # overlapping, misaligned
        [["a", "float32", [300], 0]],  # out of bounds
        [["a", "complex64", [3], 0]],  # no such dtype here
        [["a", "float32", [3], 0], ["a", "float32", [3], 64]],  # a name twice
    ):
        with pytest.raises(GroupError):
            Manifest.from_bytes(json.dumps({**raw, "tensors": tensors}).encode())
    with pytest.raises(GroupError):
        Manifest.from_bytes(b"\xff not json")
    # Packed (SGLang's FlattenedTensorBucket): back to back, buckets of whole tensors.
    packed = Manifest.of({"a": torch.zeros(3), "b": torch.zeros(40), "c": torch.zeros(2)}, packed=True)
    assert [e.offset for e in packed.entries] == [0, 12, 172] and packed.nbytes == 180
    assert Manifest.from_bytes(packed.to_bytes()) == packed
    assert [[e.name for e in g] for g in packed.bucket_entries(64)] == [["a"], ["b"], ["c"]]  # b alone: 160 B
    assert packed.buckets(200) == [(0, 180)] and packed.buckets(64) == [(0, 12), (12, 172), (172, 180)]
    raw = json.loads(packed.to_bytes())
    for tensors in (
        [["a", "float32", [3], 0], ["b", "float32", [40], 16]],  # a gap
        [["a", "bfloat16", [3], 0], ["b", "float32", [40], 6]],  # misaligned for its dtype
    ):
        with pytest.raises(GroupError):
            Manifest.from_bytes(json.dumps({**raw, "tensors": tensors}).encode())
    with pytest.raises(GroupError):  # a layout SGLang could not read: no padding to align b
        Manifest.of({"a": torch.zeros(3, dtype=torch.bfloat16), "b": torch.zeros(2)}, packed=True)


def test_a_member_whose_sender_never_comes_gives_up_within_its_bound_or_when_told(store, secret_file):
    """The wait for an epoch's sender is bounded by the spec's join_timeout_s
    (the manager's, docs/design.md §8) and ends at once on `stop` (a new epoch
    or a leave): the helper thread is not held."""
    key = trial_secret.load_keys(secret_file).weights_group_key
    failures: list[str] = []
    bounded = GroupSpec("realrl-t-e6", HOST, store.port, 2, timeout_s=5, join_timeout_s=0.5)
    member = Receiver(
        bounded, 1, key, HOST, check=lambda m: None, on_version=lambda v, t: None, on_failure=failures.append
    )
    member.join(30)
    assert not member._thread.is_alive() and failures == [member.error]
    assert "no sender within 0.5 s" in member.error
    waiting = GroupSpec("realrl-t-e7", HOST, store.port, 2, timeout_s=5, join_timeout_s=600)
    member = Receiver(waiting, 1, key, HOST, check=lambda m: None, on_version=lambda v, t: None)
    member.stop(timeout_s=5)
    assert not member._thread.is_alive() and member.error is None
