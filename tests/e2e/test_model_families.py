"""Whole trials on small random models of the real architectures
(realrl/impl/random_models.py): each family trains and generates end to end
through its chat template, and the torch server's behaviour logprobs equal the
trainer's recomputation (float32, max |Δ| <= 1e-4), sliding-window and hybrid
attention included."""

from __future__ import annotations

import json
import math
import os

import pytest

from realrl.impl.math_data import MathDataRecipe, generate_math_records, write_jsonl
from realrl.impl.random_models import FAMILIES, build_random_model
from tests.e2e.test_faults import Trial

STEPS = 2


def family_trial(tmp_path, kit_cache, family: str, *overrides: str, train_path: str = "") -> Trial:
    model = build_random_model(family, str(tmp_path / "model"))
    if not train_path:
        train, _ = generate_math_records(MathDataRecipe(n_train=16, n_test=4))
        train_path = str(tmp_path / "train.jsonl")
        write_jsonl(train_path, train)
    return Trial(
        tmp_path,
        kit_cache,
        family,
        f"model.path={model}",
        f"dataset.train_path={train_path}",
        f"total_train_steps={STEPS}",
        "ppo.group_size=2",
        "ppo.train_batch_size=2",
        # Answers cross the sliding window (16) of Mistral, Gemma 3 and Phi-3.
        "rollout.gconfig.max_new_tokens=24",
        # η = 0: every trained token comes from the weights the step starts with, so the
        # importance weight exp(prox - behav) compares server and trainer logprobs directly.
        "rollout.max_head_offpolicyness=0",
        *overrides,
    )


def max_logprob_gap(trial: Trial) -> float:
    """max |server - trainer| logprob over the run's trained tokens."""
    stats = [json.loads(line) for line in open(trial.summary()["stats_path"])]
    steps = [s for s in stats if "train/actor_loss" in s]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    return max(
        max(abs(math.log(s["train/behav_imp_weight_max"])), abs(math.log(s["train/behav_imp_weight_min"])))
        for s in steps
    )


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_trains_and_serves_what_it_trains(tmp_path, kit_cache, family):
    trial = family_trial(tmp_path, kit_cache, family)
    try:
        assert trial.wait(timeout=600) == 0, trial.console()[-4000:]
    finally:
        trial.kill()
    gap = max_logprob_gap(trial)
    print(f"{family}: max |server - trainer| logprob {gap:.1e}")
    assert gap <= 1e-4, f"{family}: {gap}"
    # The prompts went through the family's chat template, and the stop ids were logged.
    spec = FAMILIES[family]
    rollout_log = trial.log("rollout_worker-0")
    assert "prompts as the chat template renders them" in rollout_log, rollout_log[-2000:]
    for token in spec.eos:
        assert f"{token!r}" in rollout_log.split("stop ids", 1)[1].split("\n", 1)[0], rollout_log[-2000:]


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft 0.21 on transformers 5
def test_lora_on_a_moe_model_adapts_the_attention_and_serves_what_it_trains(tmp_path, kit_cache):
    """LoRA (all-linear) on the Qwen3-MoE architecture: the experts are fused
    tensors and the router is no linear layer, so the adapters sit on the
    attention projections; the server applies each published adapter exactly.
    A reward with a signal for a random model (a hash of the answer in [0, 1]:
    two different answers score differently) and a large lr make the adapter matter: a server that ignored
    it would be off by far more than 1e-4."""
    import glob

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    reward = tmp_path / "hashed.py"
    reward.write_text("def reward(prompt, completion, **row):\n    return sum(map(ord, completion)) % 97 / 96\n")
    trial = family_trial(
        tmp_path,
        kit_cache,
        "qwen3-moe",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        "optimizer.lr=1e-2",
        f"rollout.reward_fn={reward}:reward",
    )
    try:
        assert trial.wait(timeout=600) == 0, trial.console()[-4000:]
    finally:
        trial.kill()
    assert "LoRA rank 4 on ['k_proj', 'o_proj', 'q_proj', 'v_proj']" in trial.log("model_worker-0")
    assert max_logprob_gap(trial) <= 1e-4
    stats = [json.loads(line) for line in open(trial.summary()["stats_path"])]
    first = next(s for s in stats if "train/actor_loss" in s)
    assert first["train/actor_grad_norm"] > 0  # step 1 moved the adapter: step 2 sampled from a trained one

    adapter = max(
        glob.glob(str(tmp_path / "weights" / "**" / "actor" / "[0-9]*"), recursive=True),
        key=lambda p: int(p.rsplit("/", 1)[1]),
    )
    ids = torch.randint(0, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"), dtype=torch.float32)
        before = base(input_ids=ids).logits.log_softmax(-1)
        after = PeftModel.from_pretrained(base, adapter)(input_ids=ids).logits.log_softmax(-1)
    assert (after - before).abs().max() > 1e-2  # the trained adapter is far from the base


def test_parquet_conversations_in_bfloat16_to_a_model_you_can_use(tmp_path, kit_cache):
    """The real path of a new user: a Qwen2.5-architecture chat model, a Parquet
    file of `messages` rows with GSM8K-style answers under its own keys, bf16
    training (float32 master weights) with gradient checkpointing; the final model loads with
    transformers (the user's tokenizer files unchanged) and `realrl eval`
    scores it."""
    import filecmp
    import subprocess
    import sys

    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.e2e.test_faults import REPO

    train, test = generate_math_records(MathDataRecipe(n_train=16, n_test=6))

    def conversations(records):
        return [
            {
                "messages": [
                    {"role": "system", "content": "Answer with a number."},
                    {"role": "user", "content": r["prompt"]},
                ],
                "solution": f"Working it out.\n#### {r['answer']}",
                "uid": r["query_id"],
            }
            for r in records
        ]

    for name, records in (("train", train), ("test", test)):
        pq.write_table(pa.Table.from_pylist(conversations(records)), str(tmp_path / f"{name}.parquet"))
    keys = ["dataset.answer_key=solution", "dataset.id_key=uid"]
    trial = family_trial(
        tmp_path,
        kit_cache,
        "qwen2.5",
        *keys,
        "model.dtype=bfloat16",
        "server.torch.dtype=bfloat16",
        "model.gradient_checkpointing=true",
        "saver.save_final_model=true",
        train_path=str(tmp_path / "train.parquet"),
    )
    try:
        assert trial.wait(timeout=600) == 0, trial.console()[-4000:]
    finally:
        trial.kill()
    stats = [json.loads(line) for line in open(trial.summary()["stats_path"])]
    assert [s["step"] for s in stats if "train/actor_loss" in s] == list(range(1, STEPS + 1))
    assert all(math.isfinite(s["train/actor_loss"]) for s in stats if "train/actor_loss" in s)
    # The trainer (float32 master, bf16 autocast) and the server (the bf16 version it published)
    # compute the same logprobs up to bf16 rounding (measured: 2e-3).
    assert max_logprob_gap(trial) < 1e-2
    assert "<|im_start|>system\\nAnswer with a number." in trial.log("rollout_worker-0")

    final = str(tmp_path / "models" / "async-ppo-tiny" / "qwen2.5" / "final")
    model_dir = str(tmp_path / "model")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert filecmp.cmp(os.path.join(model_dir, name), os.path.join(final, name), shallow=False), name
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.dtype == torch.bfloat16
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Q: 1+2=?"}], add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    out = model.generate(torch.tensor([ids]), max_new_tokens=4, do_sample=False)
    assert out.shape[1] > len(ids)

    result_path = tmp_path / "eval.json"
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "realrl",
            "eval",
            f"model.path={final}",
            f"dataset.test_path={tmp_path / 'test.parquet'}",
            *keys,
            "rollout.gconfig.max_new_tokens=8",
            "--output",
            str(result_path),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(result_path.read_text())
    assert (
        result["n"] == 6
        and result["accuracy"] == result["n_correct"] / 6
        and json.loads(done.stdout.strip().splitlines()[-1]) == result
    )
    assert result["samples"][0]["prompt"].startswith("<|im_start|>system\nAnswer with a number.<|im_end|>")
