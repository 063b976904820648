"""Where the ray launcher puts each worker (`plan_placement`, a pure function
of the cluster's free resources and the workers' demands)."""

from __future__ import annotations

import pytest

from realrl.api.cli_args import ConfigError
from realrl.launcher.ray import Demand, Node, plan_placement


def demands(n_train: int, train_gpus: int, n_gen: int, gen_gpus: int, n_rollout: int = 1) -> list[Demand]:
    out = [Demand("master_worker", 0, 0, 0), Demand("gserver_manager", 0, 0, 0)]
    out += [Demand("model_worker", i, 1, train_gpus) for i in range(n_train)]
    out += [Demand("generation_server", i, 1, gen_gpus) for i in range(n_gen)]
    out += [Demand("rollout_worker", i, 1, 0) for i in range(n_rollout)]
    return out


def test_trainers_pack_and_servers_keep_their_tensor_parallel_gpus_on_one_node():
    nodes = [Node("a", "10.0.0.1", 32, 8), Node("b", "10.0.0.2", 32, 8), Node("c", "10.0.0.3", 32, 8)]
    plan = plan_placement(nodes, demands(n_train=8, train_gpus=1, n_gen=4, gen_gpus=4), home="10.0.0.1")
    assert {plan[("model_worker", i)].address for i in range(8)} == {"10.0.0.1"}  # all ranks on one node
    gen = [plan[("generation_server", i)].address for i in range(4)]
    assert sorted(gen) == ["10.0.0.2", "10.0.0.2", "10.0.0.3", "10.0.0.3"]  # 4 GPUs each, away from the trainers
    assert plan[("master_worker", 0)].address == "10.0.0.1"  # light workers at home


def test_servers_share_the_trainers_node_only_when_there_is_no_other():
    nodes = [Node("a", "10.0.0.1", 8, 4)]
    plan = plan_placement(nodes, demands(n_train=2, train_gpus=1, n_gen=1, gen_gpus=2), home="10.0.0.1")
    assert plan[("generation_server", 0)].address == "10.0.0.1"


def test_a_cluster_too_small_is_one_config_error_naming_what_does_not_fit():
    nodes = [Node("a", "10.0.0.1", 16, 4), Node("b", "10.0.0.2", 16, 2)]
    with pytest.raises(
        ConfigError, match=r"^allocation_mode: the Ray cluster has no room for generation_server 1 \(1 CPU, 4 GPU\)"
    ):
        plan_placement(nodes, demands(n_train=0, train_gpus=0, n_gen=2, gen_gpus=4), home="10.0.0.1")
    # tensor-parallel GPUs of one server are never split over nodes
    with pytest.raises(ConfigError, match="generation_server 0"):
        plan_placement([Node("a", "x", 8, 2), Node("b", "y", 8, 2)], demands(0, 0, 1, 4), home="x")
