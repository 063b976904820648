"""The trainer's side of `weights.transport=broadcast` (realrl/system/weight_broadcast.py,
docs/design.md §8): without an epoch it leaves the version to the disk path;
with one, each version goes through the group and its HF directory exists
before `model_version` announces it, in order, with `weights_sent` saying
which group carried it."""

from __future__ import annotations

import json
import os
import uuid

import torch

from realrl.api.system_api import WeightTransportConfig
from realrl.base import name_resolve, names
from realrl.impl.generation.torch_server.weights import read_weights_dir
from realrl.impl.weights.broadcast import GroupSpec, Receiver, StoreServer, published_tensors
from realrl.system.model_worker import publish_weights
from realrl.system.weight_broadcast import BroadcastPublisher
from tests.impl.weights.models import tiny_model, train_a_little

HOST = "127.0.0.1"


def test_each_version_goes_through_the_group_and_is_on_disk_before_it_is_announced(tmp_path):
    exp, trial = "wire-test", uuid.uuid4().hex[:8]
    model = tiny_model("tied", seed=1)
    weights_dir = str(tmp_path / "weights")
    announced: list[tuple[int, bool]] = []
    publisher = BroadcastPublisher(
        WeightTransportConfig(transport="broadcast"),
        model,
        None,
        lambda v, state: publish_weights(model, weights_dir, v, state_dict=state),
        exp,
        trial,
        HOST,
    )
    announce = lambda v: announced.append((v, os.path.isdir(os.path.join(weights_dir, str(v)))))  # noqa: E731
    assert not publisher.publish(1, None, announce)  # no epoch yet: the disk path's turn
    store = StoreServer(HOST)
    spec = GroupSpec(f"realrl-{trial}-e1", HOST, store.port, 2, timeout_s=30)
    received: list[int] = []
    member = Receiver(spec, 1, b"", HOST, check=lambda m: None, on_version=lambda v, t: received.append(v))
    name_resolve.add(names.weights_group(exp, trial, "actor"), json.dumps(spec.to_json()), replace=True)
    try:
        for version in (2, 3):
            train_a_little(model, version)
            assert publisher.publish(version, None, announce)
            assert publisher.sender.wait_idle(60)
        sent = json.loads(name_resolve.get(names.weights_sent(exp, trial, "actor")))
    finally:
        publisher.close()
        member.join(30)
        store.close()
    assert received == [2, 3] and member.closed and member.error is None
    assert announced == [(2, True), (3, True)]  # in order, each once its directory existed
    assert sent == {"group": spec.name, "version": 3, "ok": True}
    on_disk = read_weights_dir(os.path.join(weights_dir, "3"))
    for name, t in published_tensors(model).items():
        assert torch.equal(on_disk[name], t), name
