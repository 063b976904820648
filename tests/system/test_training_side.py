"""Master + data-parallel model workers (gloo) as real processes, fed by
synthetic trajectories through the real push-pull stream."""

from __future__ import annotations

import json
import os

import pytest
import torch

from realrl.api.cli_args import OptimizerConfig, PPOConfig
from realrl.api.system_api import MasterWorkerConfig, ModelWorkerConfig
from realrl.base.name_resolve import NameResolveConfig
from realrl.launcher.local import LocalLauncher, WorkerGroup


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model

    path = str(tmp_path_factory.mktemp("tiny"))
    tok = build_char_tokenizer()
    model = build_tiny_model(tok, TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128))
    model.save_pretrained(path)
    tok.save_pretrained(path)
    test = os.path.join(path, "test.jsonl")
    with open(test, "w") as f:
        for i in range(6):
            f.write(json.dumps({"query_id": str(i), "prompt": f"Q: {i}+1=?\nA:", "answer": str(i + 1), "task": "math"}) + "\n")
    return path, len(tok), test


def run_trial(tmp_path, tiny_model_dir, algorithm: str, dp: int = 2, device: str = "cpu", fsdp: bool = False,
              pushers: int | None = None):  # fmt: skip
    """Master + `dp` model workers + synthetic rollout pushers (one per rank
    unless `pushers` says otherwise); returns (summary, weights_dir, stats)."""
    pushers = dp if pushers is None else pushers
    model_path, vocab, test_path = tiny_model_dir
    steps, B, eta = 3, 4, 1
    weights_dir = str(tmp_path / "weights")
    ppo = PPOConfig(algorithm=algorithm, group_size=2, train_batch_size=B, ppo_n_minibatches=2, max_tokens_per_mb=64)
    mw = ModelWorkerConfig(model_path=model_path, dp_size=dp, ppo=ppo, optimizer=OptimizerConfig(lr=1e-3),
                           total_train_steps=steps, weights_dir=weights_dir, checkpoint_dir=str(tmp_path / "ckpt"),
                           eval_dataset_path=test_path, eval_max_new_tokens=4, device=device, fsdp=fsdp)  # fmt: skip
    master = MasterWorkerConfig(n_model_workers=dp, total_train_steps=steps, train_batch_size=B,
                                max_head_offpolicyness=eta, algorithm=algorithm, checkpoint_every_n_steps=2,
                                checkpoint_dir=str(tmp_path / "ckpt"), final_model_dir=str(tmp_path / "final"))  # fmt: skip
    pusher_cfg = {"seed": 0, "n_pullers": dp, "batch_per_worker": B // pushers, "stale_every": 5, "invalid_every": 7,
                  "group_size": 2,
                  "prompt_len": 5, "gen_len": 4, "vocab": vocab}  # fmt: skip
    gpus = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(dp)] if device == "cuda" else []
    launcher = LocalLauncher("trainside", f"{algorithm}-{device}", str(tmp_path), NameResolveConfig(type="etcd3"),
                             heartbeat_ttl=3)  # fmt: skip
    code = launcher.run([
        WorkerGroup("master_worker", 1, master),
        WorkerGroup("model_worker", dp, mw, env={"OMP_NUM_THREADS": "1"}, env_per_index=gpus),
        WorkerGroup("tests.system.trainer_test_workers:SyntheticRolloutWorker", pushers, pusher_cfg),
    ], timeout=300)  # fmt: skip
    assert code == 0, open(launcher.log_path("master_worker", 0)).read()[-3000:]
    summary = json.load(open(os.path.join(launcher.log_dir, "summary.json")))
    assert summary["steps"] == steps and summary["final_version"] == steps
    assert summary["dp_weights_identical"] is True
    t = summary["trajectories"]
    assert t["consumed"] == steps * B
    assert t["dropped_stale"] >= 1  # every 5th pushed trajectory is 100 versions old
    # Every 7th breaks the schema: rejected at the puller, counted as dropped (its budget comes back).
    assert t["dropped_invalid"] >= 1 and t["dropped"] == t["dropped_stale"] + t["dropped_invalid"]
    # No manager in this trial: nobody counted what was produced, and the summary says so.
    assert t["produced"] is None and "did not report" in t["note"]
    assert summary["max_staleness_trained"] <= eta
    # Published weights: the newest version is complete and loadable.
    assert os.path.isfile(os.path.join(weights_dir, str(steps), "config.json"))
    assert not [d for d in os.listdir(weights_dir) if d.startswith(".tmp")]
    assert os.path.isdir(tmp_path / "ckpt" / "step2") and os.path.isfile(tmp_path / "final" / "config.json")
    stats = [json.loads(line) for line in open(os.path.join(launcher.log_dir, "stats.jsonl"))]
    train_stats = [s for s in stats if "train/actor_loss" in s]
    assert len(train_stats) == steps
    assert all(torch.isfinite(torch.tensor(s["train/actor_loss"])) for s in train_stats)
    if algorithm == "ppo":
        assert all("train/critic_loss" in s for s in train_stats)
    return summary, weights_dir, train_stats


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_two_model_workers_train_in_lockstep(tmp_path, tiny_model_dir, algorithm):
    run_trial(tmp_path, tiny_model_dir, algorithm)


def test_a_step_takes_its_batch_from_all_ranks_together(tmp_path, tiny_model_dir):
    """Every trajectory lands on rank 0 (one pusher, two pullers): with a
    quota per rank, rank 1 would wait forever. The master takes the batch from
    what the ranks hold together and moves half of it to rank 1."""
    _, _, train_stats = run_trial(tmp_path, tiny_model_dir, "grpo", pushers=1)
    assert all(s["batch/moved_between_ranks"] >= 1 for s in train_stats)
    assert all(s["batch/rank_tokens_max_over_mean"] <= 1.5 for s in train_stats)  # balanced by tokens


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_fsdp_model_workers_on_cuda(tmp_path, tiny_model_dir, algorithm):
    """NCCL + FSDP2: sharded training, full state dicts gathered for publishing,
    the final model and checkpoints (two ranks when two GPUs are visible)."""
    from transformers import AutoModelForCausalLM

    dp = 2 if torch.cuda.device_count() >= 2 else 1
    _, weights_dir, _ = run_trial(tmp_path, tiny_model_dir, algorithm, dp=dp, device="cuda", fsdp=True)
    published = AutoModelForCausalLM.from_pretrained(os.path.join(weights_dir, "3"))
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir[0])
    changed = [not torch.equal(a, b) for a, b in zip(published.state_dict().values(), initial.state_dict().values())]
    assert any(changed)  # full (unsharded) trained weights were written
