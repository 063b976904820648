"""Data-parallel PPOTrainer ranks with uneven data stay in lockstep.

Two real processes (gloo on 127.0.0.1; NCCL in the CUDA variant) each run
`inference` + `train_step` on deliberately different amounts of data: more
and longer sequences on rank 0 (more micro-batches), fewer trajectories than
minibatches on rank 1, or none at all. Under FSDP every forward/backward pass
is a collective, so ranks that ran different numbers of them would hang; the
parent kills both after a deadline and fails. Also checked: identical weights
and stats on both ranks, and stats equal to one rank training the whole batch.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch

from realrl.api.cli_args import PPOConfig
from tests.impl.trainer_kit import build_trainer, make_groups, run_steps

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEADLINE_S = 240.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    tmp_path,
    model_dir: str,
    ppo: dict,
    data: list,
    mode: str,
    steps: int = 2,
    device: str = "cpu",
    lora_rank: int = 0,
    **extra,
) -> list[dict]:
    """Runs one child per entry of `data`; returns what each saved. Fails (after
    killing both) if either exits non-zero or they are not done by the deadline."""
    world = len(data)
    spec = {
        "world_size": world,
        "port": _free_port(),
        "model_dir": model_dir,
        "ppo": ppo,
        "data": data,
        "mode": mode,
        "steps": steps,
        "device": device,
        "lora_rank": lora_rank,
        **extra,
    }
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(json.dumps(spec))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false"}
    procs, logs = [], []
    for rank in range(world):
        log = open(tmp_path / f"rank{rank}.log", "wb")
        logs.append(log)
        out = tmp_path / f"rank{rank}.pt"
        cmd = [sys.executable, "-m", "tests.impl.trainer_kit", str(spec_path), str(rank), str(out)]
        procs.append(
            subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        )
    problem = None
    try:
        deadline = time.monotonic() + DEADLINE_S
        while any(p.poll() is None for p in procs):
            failed = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)]
            if failed:
                problem = f"rank {failed[0]} exited with {procs[failed[0]].returncode}"
                break
            if time.monotonic() > deadline:
                problem = f"ranks still running after {DEADLINE_S:.0f}s (hung in a collective?)"
                break
            time.sleep(0.2)
        else:
            failed = [r for r, p in enumerate(procs) if p.returncode != 0]
            if failed:
                problem = f"rank {failed[0]} exited with {procs[failed[0]].returncode}"
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(timeout=30)
        for log in logs:
            log.close()
    if problem:
        tails = "\n".join(
            f"--- rank {r} ---\n{(tmp_path / f'rank{r}.log').read_text(errors='replace')[-3000:]}" for r in range(world)
        )
        pytest.fail(f"{problem}\n{tails}")
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(world)]


def assert_lockstep(results: list[dict], n_seqs: int) -> None:
    r0, r1 = results
    # The same number of forward passes of every model: what FSDP's collectives need.
    assert r0["forwards"] == r1["forwards"]
    for model in r0["weights"]:
        for name, w in r0["weights"][model].items():
            assert torch.equal(w, r1["weights"][model][name]), f"{model}.{name} differs between ranks"
    assert r0["stats"] == r1["stats"]  # global stats, bit-identical on every rank
    for step in r0["stats"]:
        assert all(math.isfinite(v) for v in step.values()), step
        assert step["n_seqs"] == n_seqs


def assert_trained(results: list[dict], model_dir: str) -> None:
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    trained = results[0]["weights"]["actor"]
    assert any(not torch.equal(trained[k], initial[k]) for k in trained)


# rank 0: three trajectories of long sequences (several micro-batches);
# rank 1: one trajectory of short answers to one prompt (one shared-prompt row; fewer groups than minibatches).
UNEVEN = [make_groups(1, 3, 2, (3, 6), (20, 28)), make_groups(2, 1, 2, (3, 5), (2, 4), shared_prompt=True)]
PPO = dict(adv_estimator="gae", group_size=2, ppo_n_minibatches=2, max_tokens_per_mb=64, kl_ctl=0.1)
GRPO = dict(adv_estimator="grpo", group_size=2, ppo_n_minibatches=3, max_tokens_per_mb=64, kl_ctl=0.1)


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_fsdp_ranks_with_uneven_data_stay_in_lockstep(tmp_path, tiny_llama_dir, algorithm):
    results = run_ranks(tmp_path, tiny_llama_dir, PPO if algorithm == "ppo" else GRPO, UNEVEN, "fsdp")
    assert_lockstep(results, n_seqs=8)
    assert results[0]["forwards"]["actor"] > 2  # rank 1 alone would need only 1 per phase
    assert_trained(results, tiny_llama_dir)


@pytest.mark.parametrize("perturb_rank", [None, 1])
def test_fsdp_weights_check_compares_every_rank_shard_with_the_gathered_weights(tmp_path, tiny_llama_dir, perturb_rank):
    """Under FSDP ranks hold different shards, so the summary's
    `dp_weights_identical` compares each rank's shard checksum with the one
    rank 0 cuts from the full weights it gathered (and published) at the
    step. Healthy ranks: identical, and every checksum is the one of an
    unsharded model holding the trained weights. A rank whose shard was
    nudged after the step: not identical."""
    from transformers import AutoModelForCausalLM

    from realrl.system.weights_check import dp_weights_identical, expected_shard_checksums, weights_checksum

    ppo = {**GRPO, "ppo_n_minibatches": 1}
    results = run_ranks(
        tmp_path, tiny_llama_dir, ppo, UNEVEN, "fsdp", steps=1, checksums=True, perturb_rank=perturb_rank
    )
    specs = [r["spec"] for r in results]
    assert specs[0]["checksum"] == specs[0]["expected_shard_checksums"][0]  # rank 0 is untouched either way
    if perturb_rank is not None:
        assert dp_weights_identical(specs) is False
        assert specs[1]["checksum"] != specs[0]["expected_shard_checksums"][1]
        return
    assert dp_weights_identical(specs) is True
    assert specs[0]["checksum"] != specs[1]["checksum"]  # different shards: a real per-shard checksum
    unsharded = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    unsharded.load_state_dict(results[0]["weights"]["actor"], strict=False)  # the trained weights, gathered
    assert_trained(results, tiny_llama_dir)
    assert specs[0]["full_checksum"] == weights_checksum(unsharded)
    params = dict(unsharded.named_parameters())
    assert [s["checksum"] for s in specs] == expected_shard_checksums(unsharded, params, 2)


def test_rank_without_trajectories_joins_every_collective(tmp_path, tiny_llama_dir):
    # "hook" puts an all-reduce in every forward pass, so unequal counts hang;
    # gradients are summed by the ModelWorker's flat all-reduce.
    results = run_ranks(tmp_path, tiny_llama_dir, PPO, [UNEVEN[0], []], "hook")
    assert_lockstep(results, n_seqs=6)
    assert_trained(results, tiny_llama_dir)


@pytest.mark.parametrize("algorithm,mode", [("ppo", "fsdp"), ("grpo", "plain")])
def test_stats_are_global_and_match_one_rank(tmp_path, tiny_llama_dir, algorithm, mode):
    ppo = {**(PPO if algorithm == "ppo" else GRPO), "ppo_n_minibatches": 1}
    results = run_ranks(tmp_path, tiny_llama_dir, ppo, UNEVEN, mode, steps=1)
    assert results[0]["stats"] == results[1]["stats"]
    torch.set_num_threads(1)
    trainer, _ = build_trainer(tiny_llama_dir, PPOConfig(**ppo), torch.device("cpu"))
    (expected,) = run_steps(trainer, UNEVEN[0] + UNEVEN[1], steps=1)
    (got,) = results[0]["stats"]
    assert got.keys() == expected.keys()
    # The whole batch's loss is the SUM of the ranks' shares, not their mean.
    assert abs(expected["actor_loss"]) > 1e-3
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize("mode", ["plain", "fsdp"])
def test_a_lora_step_on_two_ranks_equals_one_rank(tmp_path, tiny_llama_dir, mode):
    """LoRA adapters (KL against the base with the adapters off) trained on
    two ranks, each with its part of the batch: the same adapters on both
    ranks, and the same as one rank training the whole batch."""
    ppo = {**GRPO, "ppo_n_minibatches": 1}
    results = run_ranks(tmp_path, tiny_llama_dir, ppo, UNEVEN, mode, steps=1, lora_rank=4)
    assert_lockstep(results, n_seqs=8)
    torch.set_num_threads(1)
    trainer, _ = build_trainer(tiny_llama_dir, PPOConfig(**ppo), torch.device("cpu"), lora_rank=4)
    (expected,) = run_steps(trainer, UNEVEN[0] + UNEVEN[1], steps=1)
    (got,) = results[0]["stats"]
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    weights = results[0]["weights"]["actor"]
    trained = {n for n, p in trainer.actor.model.named_parameters() if p.requires_grad}
    assert any(weights[n].abs().max() > 0 for n in trained if ".lora_B." in n)  # B starts at 0: it moved
    for name, p in trainer.actor.model.named_parameters():
        if name in trained:
            torch.testing.assert_close(weights[name], p.detach(), rtol=1e-4, atol=1e-6)
        else:  # the base is frozen on every rank
            assert torch.equal(weights[name], p.detach()), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_fsdp_nccl_ranks_with_uneven_data_stay_in_lockstep(tmp_path, tiny_llama_dir, algorithm):
    results = run_ranks(tmp_path, tiny_llama_dir, PPO if algorithm == "ppo" else GRPO, UNEVEN, "fsdp", device="cuda")
    assert_lockstep(results, n_seqs=8)
    assert_trained(results, tiny_llama_dir)
