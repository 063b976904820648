"""Master + data-parallel model workers (gloo) as real processes, fed by
synthetic trajectories through the real push-pull stream."""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
import uuid

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from realrl.api.cli_args import LoraConfig, OptimizerConfig, PPOConfig
from realrl.api.system_api import MasterWorkerConfig, ModelWorkerConfig
from realrl.api.trajectory import Trajectory
from realrl.base import faults, name_resolve
from realrl.base.name_resolve import NameResolveConfig
from realrl.launcher.local import LocalLauncher, WorkerGroup
from realrl.system.push_pull_stream import NameResolvingZmqPusher
from realrl.system.stream_dataset import PullerStreamDataset
from tests.conftest import make_nr_config


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
            f.write(
                json.dumps({"query_id": str(i), "prompt": f"Q: {i}+1=?\nA:", "answer": str(i + 1), "task": "math"})
                + "\n"
            )
    return path, len(tok), test


_ROWS = itertools.count()  # each test trajectory its own admitted rollout


def _trajectory(qid: str, prompt: list[int], completion: list[int]) -> Trajectory:
    ids = np.array(prompt + completion, dtype=np.int32)
    n_gen = len(completion)
    return Trajectory(
        qid=qid,
        task="math",
        birth_time=time.time(),
        input_ids=[ids],
        prompt_len=[len(prompt)],
        logprobs=[np.full(n_gen, -1.0, np.float32)],
        versions=[np.zeros(n_gen, np.int32)],
        version_start=[0],
        version_end=[0],
        reward=[1.0],
        no_eos=[False],
        rollout_id=f"0:0:{next(_ROWS)}",
    )


def test_puller_drops_out_of_vocabulary_trajectories_as_invalid(tmp_path, etcd_server, caplog):
    """Through a real pusher and the dataset's real puller (etcd name_resolve):
    token ids == vocab_size or negative are invalid, vocab_size-1 and 0 are
    not; the invalid ones are counted and logged rate-limited, and the count
    of suppressed lines is reported at close."""
    name_resolve.reconfigure(make_nr_config("etcd3", tmp_path, etcd_server))
    trial = uuid.uuid4().hex[:8]
    realrl_logger = logging.getLogger("realrl")  # realrl's loggers do not propagate to caplog's root handler
    realrl_logger.addHandler(caplog.handler)
    dataset = PullerStreamDataset("oov", trial, 0, vocab_size=10)
    pusher = NameResolvingZmqPusher("oov", trial, 0, 1, 1, timeout=30)
    try:
        sent = [
            ("ok-bounds", [0, 5], [9]),
            ("bad-high", [1, 2], [10]),
            ("bad-negative", [-1, 2], [3]),
            ("bad-prompt-high", [10, 2], [3]),
            ("ok", [3, 4], [5, 6]),
        ]
        for qid, prompt, completion in sent:
            pusher.push(_trajectory(qid, prompt, completion).to_wire(), timeout=10)
        give_up = time.monotonic() + 30
        while dataset.stats()["received"] < len(sent) and time.monotonic() < give_up:
            time.sleep(0.02)
        stats = dataset.stats()
        assert stats["invalid"] == 3 and stats["buffered"] == 2 and stats["received"] == 5
        items, _ = dataset.inventory(0, 10)
        assert sorted(t.qid for t in dataset.take([k for k, *_ in items])) == ["ok", "ok-bounds"]
        drops = [r.getMessage() for r in caplog.records if "dropped an invalid trajectory" in r.getMessage()]
        assert len(drops) == 1 and "token id 10" in drops[0] and "outside the vocabulary 0..9" in drops[0]
    finally:
        pusher.close()
        dataset.close()
        realrl_logger.removeHandler(caplog.handler)
        name_resolve.reconfigure(NameResolveConfig())
    summary = [r.getMessage() for r in caplog.records if "similar messages suppressed" in r.getMessage()]
    assert len(summary) == 1 and summary[0].startswith("2 similar messages suppressed")
    assert "(3 so far)" in summary[0] and "token id 10" in summary[0]


def test_puller_sorts_out_what_a_trainer_must_not_take(tmp_path, etcd_server):
    """Issue 33 item 2: beyond the vocabulary, the puller checks what the
    trainer relies on: length within the model's positions (8 tokens here),
    weight versions within 0..the trainer's newest (asked per trajectory, so
    a newer version admits what it did not before), logprobs <= 0."""
    name_resolve.reconfigure(make_nr_config("etcd3", tmp_path, etcd_server))
    trial = uuid.uuid4().hex[:8]
    newest = [2]
    dataset = PullerStreamDataset("fit", trial, 0, vocab_size=10, max_positions=8, newest_version=lambda: newest[0])
    pusher = NameResolvingZmqPusher("fit", trial, 0, 1, 1, timeout=30)

    def traj(qid, prompt, completion, version=0, logprob=-1.0):
        t = _trajectory(qid, prompt, completion)
        t.versions[0][:] = version
        t.version_start, t.version_end = [version], [version]
        t.logprobs[0][:] = logprob
        return t

    try:
        sent = [
            traj("ok-8-positions", [1, 2, 3, 4], [5, 6, 7, 8]),
            traj("too-long", [1, 2, 3, 4], [5, 6, 7, 8, 9]),
            traj("too-long-40k", [1] * 5000, [2] * 35_000),
            traj("ok-newest", [1, 2], [3], version=2),
            traj("version-from-the-future", [1, 2], [3], version=3),
            traj("negative-version", [1, 2], [3], version=-1),
            traj("positive-logprob", [1, 2], [3], logprob=0.5),
            traj("ok-zero-logprob", [1, 2], [3], logprob=0.0),
        ]
        for t in sent:
            pusher.push(t.to_wire(), timeout=10)

        def wait_received(n):
            give_up = time.monotonic() + 30
            while dataset.stats()["received"] < n and time.monotonic() < give_up:
                time.sleep(0.02)
            return dataset.stats()

        stats = wait_received(len(sent))
        assert stats["invalid"] == 5 and stats["buffered"] == 3, stats
        newest[0] = 3  # the trainer published version 3
        pusher.push(traj("now-current", [1, 2], [3], version=3).to_wire(), timeout=10)
        stats = wait_received(len(sent) + 1)
        assert stats["invalid"] == 5 and stats["buffered"] == 4, stats
        items, _ = dataset.inventory(0, 10)
        assert sorted(t.qid for t in dataset.take([k for k, *_ in items])) == [
            "now-current",
            "ok-8-positions",
            "ok-newest",
            "ok-zero-logprob",
        ]
    finally:
        pusher.close()
        dataset.close()
        name_resolve.reconfigure(NameResolveConfig())


def run_trial(
    tmp_path,
    tiny_model_dir,
    algorithm: str,
    dp: int = 2,
    device: str = "cpu",
    fsdp: bool = False,
    pushers: int | None = None,
    stale_every: int = 5,
    invalid_every: int = 7,
    oov_every: int = 0,
    dtype: str = "float32",
    lora: LoraConfig | None = None,
    kl_ctl: float = 0.0,
    worker_env: dict | None = None,
    weights_identical: bool = True,
):
    """Master + `dp` model workers + synthetic rollout pushers (one per rank
    unless `pushers` says otherwise), every `stale_every`-th trajectory stale,
    every `invalid_every`-th one breaking the schema and every `oov_every`-th
    one carrying an out-of-vocabulary token id (0: none); returns (summary,
    weights_dir, stats, log_dir)."""
    pushers = dp if pushers is None else pushers
    model_path, vocab, test_path = tiny_model_dir
    steps, B, eta = 3, 4, 1
    weights_dir = str(tmp_path / "weights")
    ppo = PPOConfig(
        adv_estimator="gae" if algorithm == "ppo" else "grpo",
        group_size=2,
        train_batch_size=B,
        ppo_n_minibatches=2,
        max_tokens_per_mb=64,
        kl_ctl=kl_ctl,
    )
    mw = ModelWorkerConfig(
        model_path=model_path,
        dp_size=dp,
        ppo=ppo,
        optimizer=OptimizerConfig(lr=1e-3),
        total_train_steps=steps,
        weights_dir=weights_dir,
        checkpoint_dir=str(tmp_path / "ckpt"),
        eval_dataset_path=test_path,
        eval_max_new_tokens=4,
        device=device,
        fsdp=fsdp,
        dtype=dtype,
        lora=lora or LoraConfig(),
    )
    master = MasterWorkerConfig(
        n_model_workers=dp,
        total_train_steps=steps,
        train_batch_size=B,
        max_head_offpolicyness=eta,
        adv_estimator="gae" if algorithm == "ppo" else "grpo",
        kl_ctl=kl_ctl,
        checkpoint_every_n_steps=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
        final_model_dir=str(tmp_path / "final"),
    )
    pusher_cfg = {
        "seed": 0,
        "n_pullers": dp,
        "batch_per_worker": B // pushers,
        "stale_every": stale_every,
        "stale_from": eta + 1,  # (a version-0 trajectory is stale from the trainer's version eta + 1 on)
        "invalid_every": invalid_every,
        "oov_every": oov_every,
        "group_size": 2,
        "prompt_len": 5,
        "gen_len": 4,
        "vocab": vocab,
    }
    gpus = [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(dp)] if device == "cuda" else []
    launcher = LocalLauncher(
        "trainside", f"{algorithm}-{device}", str(tmp_path), NameResolveConfig(type="etcd3"), heartbeat_ttl=3
    )
    code = launcher.run(
        [
            WorkerGroup("master_worker", 1, master),
            WorkerGroup("model_worker", dp, mw, env={"OMP_NUM_THREADS": "1", **(worker_env or {})}, env_per_index=gpus),
            WorkerGroup("tests.system.trainer_test_workers:SyntheticRolloutWorker", pushers, pusher_cfg),
        ],
        timeout=300,
    )
    assert code == 0, open(launcher.log_path("master_worker", 0)).read()[-3000:]
    summary = json.load(open(os.path.join(launcher.log_dir, "summary.json")))
    assert summary["steps"] == steps and summary["final_version"] == steps
    assert summary["dp_weights_identical"] is weights_identical
    t = summary["trajectories"]
    assert t["consumed"] == steps * B
    if stale_every:
        assert t["dropped_stale"] >= 1  # every 5th pushed trajectory is 100 versions old
    # Every 7th breaks the schema (or every `oov_every`-th holds a token id outside the vocabulary):
    # rejected at the puller and counted apart: never accepted, so no budget comes back (§12).
    assert t["dropped_invalid"] >= 1 and t["dropped"] == t["dropped_stale"]
    # No manager in this trial: nobody counted what was produced, and the summary says so.
    assert t["produced"] is None and "did not report" in t["note"]
    assert summary["max_staleness_trained"] <= eta
    # Published weights: the newest version is complete and loadable, with the
    # user's tokenizer and generation config beside the weights (an HF directory).
    newest = os.path.join(weights_dir, str(steps))
    published = "adapter_config.json" if lora else "config.json"
    assert os.path.isfile(os.path.join(newest, published))
    assert AutoTokenizer.from_pretrained(newest).get_vocab() == AutoTokenizer.from_pretrained(model_path).get_vocab()
    with (
        open(os.path.join(newest, "generation_config.json")) as a,
        open(os.path.join(model_path, "generation_config.json")) as b,
    ):
        assert json.load(a) == json.load(b)
    assert not [d for d in os.listdir(weights_dir) if d.startswith(".tmp")]
    assert os.path.isdir(tmp_path / "ckpt" / "step2") and os.path.isfile(tmp_path / "final" / "config.json")
    stats = [json.loads(line) for line in open(os.path.join(launcher.log_dir, "stats.jsonl"))]
    train_stats = [s for s in stats if "train/actor_loss" in s]
    assert len(train_stats) == steps
    assert all(torch.isfinite(torch.tensor(s["train/actor_loss"])) for s in train_stats)
    if algorithm == "ppo":
        assert all("train/critic_loss" in s for s in train_stats)
    return summary, weights_dir, train_stats, launcher.log_dir


def test_two_model_workers_train_in_lockstep_with_a_critic(tmp_path, tiny_model_dir):
    """ppo (a critic) with stale and schema-breaking trajectories among the pushed ones. (grpo on
    two plain ranks: test_a_step_takes_its_batch_from_all_ranks_together; the stale and invalid
    drops do not depend on the algorithm.)"""
    run_trial(tmp_path, tiny_model_dir, "ppo")


def test_bf16_fsdp_ranks_train_a_float32_master_and_publish_bf16(tmp_path, tiny_model_dir):
    """model.dtype=bfloat16 (fp32_master, the default) under FSDP with a
    critic: the ranks train float32 weights in lockstep, the checkpoint holds
    them (and Adam's state) in float32, and every published version and the
    final model are bf16 directories."""
    from safetensors.torch import load_file

    _, weights_dir, _, _ = run_trial(tmp_path, tiny_model_dir, "ppo", fsdp=True, dtype="bfloat16")
    for directory in (os.path.join(weights_dir, "3"), str(tmp_path / "final")):
        with open(os.path.join(directory, "config.json")) as f:
            assert json.load(f)["dtype"] == "bfloat16", directory
        tensors = load_file(os.path.join(directory, "model.safetensors"))
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}, directory
    state = torch.load(tmp_path / "ckpt" / "step2" / "model_worker.pt", weights_only=True)
    for model in ("actor", "critic"):
        assert {t.dtype for t in state[model]["model"].values() if t.is_floating_point()} == {torch.float32}


def test_a_step_takes_its_batch_from_all_ranks_together(tmp_path, tiny_model_dir):
    """Every trajectory lands on rank 0 (one pusher, two pullers): with a
    quota per rank, rank 1 would wait forever. The master takes the batch from
    what the ranks hold together and moves half of it to rank 1. (No stale
    trajectories here: with one pusher whether one is still buffered when it
    becomes stale depends on timing; the other trials check those drops.)"""
    _, _, train_stats, _ = run_trial(tmp_path, tiny_model_dir, "grpo", pushers=1, stale_every=0)
    assert all(s["batch/moved_between_ranks"] >= 1 for s in train_stats)
    assert all(s["batch/rank_tokens_max_over_mean"] <= 1.5 for s in train_stats)  # balanced by tokens


def test_one_model_worker_takes_its_batch_in_one_request(tmp_path, tiny_model_dir):
    """One rank: a step's batch is one `assemble` with `oldest: B` (no inventory before
    it), which drops the stale ones and reports the invalid ones as the inventory does."""
    summary, _, train_stats, log_dir = run_trial(tmp_path, tiny_model_dir, "grpo", dp=1)
    assert summary["trajectories"]["dropped_stale"] >= 1 and summary["trajectories"]["dropped_invalid"] >= 1
    assert all(s["batch/moved_between_ranks"] == 0 for s in train_stats)
    assert all(0 <= s["time/wait_data_s"] <= s["time/fetch_s"] for s in train_stats)


def check_out_of_vocabulary_ids_dropped(summary: dict, log_dir: str, vocab: int) -> None:
    """A trial whose every 4th pushed trajectory is well-formed but holds a token id
    outside the vocabulary (== vocab size, or -1): fed to the model it would raise
    IndexError in the embedding and kill the trainer. The pullers reject them as
    invalid, the master counts them as dropped_invalid (neither stale nor
    schema-breaking ones in the trial, so all of dropped_invalid is theirs) and
    the run completes."""
    t = summary["trajectories"]
    # However the 12 trained ones split over the two pushers, the pushers had pushed at least 2 bad
    # ones before them (a pusher's pushes reach its puller in order).
    assert t["dropped_invalid"] >= 2
    assert t["dropped"] == t["dropped_stale"] == 0
    logs = "".join(open(os.path.join(log_dir, f"model_worker-{i}.log")).read() for i in range(2))
    # Each puller logs its first invalid one in full: pusher 0's is vocab itself, pusher 1's is -1.
    assert f"token id {vocab} " in logs and "token id -1 " in logs
    assert "IndexError" not in logs


def test_an_fsdp_rank_whose_weights_drift_is_reported(tmp_path, tiny_model_dir):
    """Two FSDP2 ranks; after each of its steps the last rank's shard drifts
    (fault point `model_worker.weights_drift`). Ranks hold different shards,
    so the check compares each rank's shard with the one rank 0 cut from the
    weights it gathered at the step: the summary says not identical, and
    the master logs it. (Healthy FSDP ranks: the LoRA trial below.)"""
    (tmp_path / "faults").mkdir()
    env = {faults.FAULTS_ENV: "model_worker.weights_drift=fail:600", faults.FAULTS_DIR_ENV: str(tmp_path / "faults")}
    _, _, _, log_dir = run_trial(tmp_path, tiny_model_dir, "grpo", fsdp=True, worker_env=env, weights_identical=False)
    assert "data-parallel ranks hold different weights" in open(os.path.join(log_dir, "master_worker-0.log")).read()
    assert os.path.exists(tmp_path / "faults" / "model_worker.weights_drift")


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft 0.21 on transformers 5
def test_lora_ranks_without_fsdp_stay_identical_and_out_of_vocabulary_ids_are_dropped(tmp_path, tiny_model_dir):
    """Two data-parallel ranks (no FSDP) training LoRA adapters: each rank
    initialises its own adapters, so they must be drawn from the same seed
    on every rank or the ranks train different models for ever (run_trial
    asserts `dp_weights_identical`, full checksums compared across ranks)."""
    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj"])
    # The same trial's pushers send out-of-vocabulary token ids (one trial for both: each trial
    # costs the start of three processes).
    summary, _, _, log_dir = run_trial(
        tmp_path, tiny_model_dir, "grpo", lora=lora, stale_every=0, invalid_every=0, oov_every=4
    )
    assert summary["dp_weights_identical"] is True
    check_out_of_vocabulary_ids_dropped(summary, log_dir, tiny_model_dir[1])


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft 0.21 on transformers 5
def test_lora_model_workers_under_fsdp_publish_checkpoint_and_save_adapters(tmp_path, tiny_model_dir):
    """Two FSDP2 ranks (gloo on CPU) training LoRA adapters with a KL
    reference: the adapters are gathered from the shards for every version,
    for the checkpoints (with their optimizer state) and for the final model,
    saved as the adapter and merged."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    _, weights_dir, _, _ = run_trial(tmp_path, tiny_model_dir, "grpo", fsdp=True, lora=lora, kl_ctl=0.1)
    model_path = tiny_model_dir[0]
    versions = sorted(int(v) for v in os.listdir(weights_dir) if v.isdigit())
    # The adapter, and the user's files but its weights and config.json (tokenizer, generation config, ...).
    users = [f for f in os.listdir(model_path) if f != "config.json" and not f.endswith(".safetensors")]
    for v in versions:
        assert sorted(os.listdir(os.path.join(weights_dir, str(v)))) == sorted(
            ["adapter_config.json", "adapter_model.safetensors", *users]
        )
    with open(os.path.join(weights_dir, "3", "adapter_config.json")) as f:
        config = json.load(f)
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    state = torch.load(tmp_path / "ckpt" / "step2" / "model_worker.pt", weights_only=True)["actor"]
    assert len(state["model"]) == 2 * 2 * 3 and all(".lora_" in k for k in state["model"])  # 2 layers, 3 modules
    assert len(state["optimizer"]["state"]) == len(state["model"])
    # The final model: the adapter, and the same weights merged into a plain model.
    base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, str(tmp_path / "final" / "adapter")).merge_and_unload()
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), dtype=torch.float32)
    initial = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    final = merged.state_dict()
    for name, value in adapted.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=0, atol=1e-6)
    assert any(not torch.equal(final[k], initial[k]) for k in final if "q_proj" in k)  # trained
    assert all(torch.equal(final[k], initial[k]) for k in final if "k_proj" in k)  # not adapted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CI has none)")
@pytest.mark.parametrize("algorithm, dtype", [("grpo", "bfloat16"), ("ppo", "float32")])
def test_fsdp_model_workers_on_cuda(tmp_path, tiny_model_dir, algorithm, dtype):
    """NCCL + FSDP2: sharded training (in bf16 too), full state dicts gathered
    for publishing, the final model and checkpoints (two ranks when two GPUs
    are visible)."""
    from transformers import AutoModelForCausalLM

    dp = 2 if torch.cuda.device_count() >= 2 else 1
    _, weights_dir, _, _ = run_trial(tmp_path, tiny_model_dir, algorithm, dp=dp, device="cuda", fsdp=True, dtype=dtype)
    published = AutoModelForCausalLM.from_pretrained(os.path.join(weights_dir, "3"))
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir[0])
    # (the initial weights in the published dtype: rounding alone is no change)
    pairs = zip(published.state_dict().values(), initial.state_dict().values())
    changed = [not torch.equal(a, b.to(a.dtype)) for a, b in pairs]
    assert any(changed)  # full (unsharded) trained weights were written
    assert {t.dtype for t in published.state_dict().values()} == {getattr(torch, dtype)}
