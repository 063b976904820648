"""Which GPUs each generation server and model worker sees (CUDA_VISIBLE_DEVICES),
decided before any process starts. Pure configuration: runs without a GPU."""

from __future__ import annotations

import pytest

from realrl.api.cli_args import ConfigError, validate
from realrl.experiment.build import place_gpus
from realrl.experiment.config import load_config


def placement(monkeypatch, visible: str, *overrides: str):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    cfg = load_config(list(overrides))
    return place_gpus(cfg, validate(cfg))


def devices(envs: list[dict]) -> list[str]:
    return [e["CUDA_VISIBLE_DEVICES"] for e in envs]


def test_cpu_trial_sets_no_devices(monkeypatch):
    assert placement(monkeypatch, "0,1") == ([], [])


def test_servers_take_the_first_gpus_and_trainers_the_next(monkeypatch):
    gen, train = placement(
        monkeypatch,
        "4,5,6,7,8,9,10,11",
        "allocation_mode=sglang.d2p1m2+d3p1m1",
        "train.device=cuda",
        "rollout.n_workers=3",
    )
    assert devices(gen) == ["4,5", "6,7"]
    assert devices(train) == ["8", "9", "10"]


def test_cpu_servers_leave_all_gpus_to_the_trainers(monkeypatch):
    gen, train = placement(
        monkeypatch, "2,3", "allocation_mode=torch.d2p1m1+d2p1m1", "train.device=cuda", "rollout.n_workers=2"
    )
    assert gen == [] and devices(train) == ["2", "3"]


def test_too_few_gpus_are_shared_round_robin(monkeypatch):
    gen, train = placement(monkeypatch, "0", "server.torch.device=cuda", "train.device=cuda")
    assert devices(gen) == ["0"] and devices(train) == ["0"]


@pytest.mark.parametrize(
    "visible, overrides, key",
    [
        ("", ["train.device=cuda"], "train.device"),
        ("", ["server.torch.device=cuda"], "server.torch.device"),
        (
            "0",
            ["allocation_mode=torch.d1p1m1+d2p1m1", "train.device=cuda", "rollout.n_workers=2"],
            "allocation_mode",
        ),  # NCCL: a GPU per rank
        ("0", ["allocation_mode=sglang.d1p1m2+d1p1m1"], "allocation_mode"),  # tp 2 on one GPU
    ],
)
def test_impossible_placement_is_a_config_error_naming_the_key(monkeypatch, visible, overrides, key):
    with pytest.raises(ConfigError, match=f"^{key}: "):
        placement(monkeypatch, visible, *overrides)
