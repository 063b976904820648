"""A LoRA run of the default task, whole (docs/design.md §8): it learns,
publishes adapters only, the servers' behaviour logprobs equal the trainer's,
a trainer killed mid-run resumes from its adapter checkpoint, and the final
model is saved as the adapter and merged."""

from __future__ import annotations

import json
import os

import pytest
import torch

from benchmarks.learning_floors import RUNS, assert_reaches_floor, train, trial_name
from realrl.system import checkpoints
from tests.e2e.test_faults import TRAINED_LOGPROB_GAP
from tests.impl.test_lora import assert_loads_without_peft

STEPS = RUNS["lora"].steps


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft 0.21 on transformers 5
def test_a_lora_run_learns_publishes_adapters_and_resumes_after_a_crash(tmp_path, kit_cache):
    """benchmarks/learning_floors.py's run "lora", seed 1: rank 8, lr 2e-3, η = 0 (every
    trained token comes from the weights the step starts with, so the importance weight
    exp(prox - behav) compares server and trainer logprobs directly), a checkpoint every 2
    steps, and the trainer SIGKILLed (a fault point) in the step after the first one;
    recover=auto resumes the trial. Its final accuracy must reach the floor measured over
    seeds 1-5 (benchmarks/learning_floors.json, docs/benchmarks.md "Learning floors")."""
    summary, stats = train("lora", 1, str(tmp_path), kit_cache)
    assert summary["steps"] == STEPS and [r["why"] for r in summary["restarts"]] == ["worker model_worker/0 failed"]
    assert_reaches_floor(summary, "lora", seed=1)
    steps = [s for s in stats if "train/actor_loss" in s]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    # Logprobs agree (max |prox - behav| within float32's error), before the crash and after the resume
    # (the servers then serve the adapter the resumed trainer republished).
    for s in steps:
        assert max(s["train/behav_imp_weight_max"] - 1, 1 - s["train/behav_imp_weight_min"]) <= TRAINED_LOGPROB_GAP, s

    # Published versions are adapters; a checkpoint holds the adapters and their optimizer state.
    weights = os.path.join(tmp_path, "weights", "async-ppo-tiny", trial_name("lora", 1), "actor")
    for version in os.listdir(weights):
        files = set(os.listdir(os.path.join(weights, version)))
        assert {"adapter_model.safetensors", "adapter_config.json"} <= files and "model.safetensors" not in files
    newest = checkpoints.newest_valid(os.path.join(tmp_path, "checkpoints", "async-ppo-tiny", trial_name("lora", 1)))
    state = torch.load(os.path.join(newest, "model_worker.pt"), weights_only=True)["actor"]
    assert state["model"] and all(".lora_A." in k or ".lora_B." in k for k in state["model"])
    assert len(state["optimizer"]["state"]) == len(state["model"])

    # The final model: the adapter, and merged into a plain HF model that loads without peft.
    final = os.path.join(tmp_path, "models", "async-ppo-tiny", trial_name("lora", 1), "final")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = os.path.join(final, "adapter")
    with open(os.path.join(adapter, "adapter_config.json")) as f:
        base_path = json.load(f)["base_model_name_or_path"]  # the model the run trained
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32), adapter)
    assert_loads_without_peft(final, model, tmp_path)
