"""LoRA training on a tiny HF Llama (peft): what trains, the reference model,
dropout and the proximal pass, checkpoints, the merged final model."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from realrl.api.cli_args import LoraConfig, PPOConfig
from realrl.impl import lora
from realrl.impl.ppo.models import AdapterDisabled
from realrl.impl.ppo.trainer import PPOTrainer, make_optimized
from realrl.system.model_worker import load_trainer_state, save_model, trainer_state
from tests.impl.trainer_kit import make_batch, make_groups

GROUPS = make_groups(1, 2, 2, (3, 6), (4, 8))
ATTENTION_AND_MLP = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]


def load(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def trainer(model_dir: str, rank: int = 4, dropout: float = 0.0, kl_ctl: float = 0.0, seed: int = 1) -> PPOTrainer:
    """A GRPO trainer over the tiny model, LoRA-wrapped unless rank is 0
    (the adapters' A initialised from `seed`)."""
    actor = load(model_dir)
    if rank:
        torch.manual_seed(seed)
        actor = lora.wrap(actor, LoraConfig(rank=rank, alpha=8, dropout=dropout))
    ref = None
    if kl_ctl:
        ref = AdapterDisabled(actor)
    ppo = PPOConfig(group_size=2, kl_ctl=kl_ctl, max_tokens_per_mb=64)
    optimized = make_optimized(actor, 1e-2, 0.0, (0.9, 0.999), 1e-8, "constant", 0, 10)
    return PPOTrainer(optimized, ppo, temperature=1.0, device=torch.device("cpu"), ref=ref)


def step(t: PPOTrainer) -> dict:
    batch = make_batch(GROUPS)
    t.inference(batch, decoupled=True)
    return t.train_step(batch)


def test_target_modules_resolve_to_the_attention_and_mlp_projections(tiny_llama_dir):
    model = load(tiny_llama_dir)
    assert lora.target_modules(model, ["all-linear"]) == ATTENTION_AND_MLP  # not lm_head
    assert lora.target_modules(model, ["v_proj", "q_proj"]) == ["q_proj", "v_proj"]
    with pytest.raises(ValueError, match=r"no linear layer named \['qkv'\]; its linear layers: .*lm_head"):
        lora.target_modules(model, ["qkv"])


def test_only_the_adapters_train_and_the_reference_is_the_base_model(tiny_llama_dir):
    t = trainer(tiny_llama_dir, kl_ctl=0.1)
    model = t.actor.model
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 2 * len(ATTENTION_AND_MLP)  # A and B, 2 layers, 7 projections
    optimized = {id(p) for group in t.actor.optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for n, p in model.named_parameters() if n in trainable}
    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if n not in trainable}

    base = load(tiny_llama_dir).eval()
    ids = torch.tensor([[0, 5, 9, 3, 17, 4]])
    with torch.no_grad():
        expected = base(ids).logits
    for _ in range(2):
        stats = step(t)
    assert stats["actor_grad_norm"] > 0
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]), f"frozen {n} changed"
    model.eval()
    with torch.no_grad():
        assert torch.equal(t.ref(input_ids=ids).logits, expected)  # the reference: adapters off
        assert not torch.allclose(model(input_ids=ids).logits, expected, atol=1e-3)  # trained adapters on
    # KL against that reference was part of the step: the reference logprobs are the base model's.
    batch = make_batch(GROUPS)
    t.inference(batch, decoupled=True)
    base_logprobs = trainer(tiny_llama_dir, rank=0).compute_logprobs(base, make_batch(GROUPS))
    for got, want in zip(batch.ref_logprobs, base_logprobs):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dropout, separate_pass", [(0.0, False), (0.1, True)])
def test_lora_dropout_makes_the_proximal_logprobs_a_pass_of_their_own(tiny_llama_dir, dropout, separate_pass):
    """With dropout the train-mode forward is random, so the proximal
    logprobs cannot come from it: `inference` computes them in eval mode."""
    t = trainer(tiny_llama_dir, dropout=dropout)
    batch = make_batch(GROUPS)
    t.inference(batch, decoupled=True)
    assert batch.prox_from_train_forward is not separate_pass
    assert (batch.prox_logprobs is not None) is separate_pass
    if separate_pass:  # eval mode: deterministic, and equal to the model without dropout
        again = make_batch(GROUPS)
        t.inference(again, decoupled=True)
        for a, b in zip(batch.prox_logprobs, again.prox_logprobs):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rank", [4, 0])
def test_a_checkpoint_resumes_training_exactly(tiny_llama_dir, rank):
    """A LoRA checkpoint holds the adapters and their optimizer state only;
    restored into a fresh trainer (other random adapters), the next step is
    bit-identical to the uninterrupted run's. Full fine-tuning likewise."""
    first = trainer(tiny_llama_dir, rank=rank)
    step(first)
    buffer = io.BytesIO()
    torch.save(trainer_state(first.actor, fsdp=False), buffer)
    step(first)
    state = torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)
    n_params = sum(1 for _ in first.actor.model.parameters())
    if rank:
        assert set(state["model"]) == set(lora.trainable_state(first.actor.model))  # adapters only
        assert len(state["model"]) < n_params
    assert len(state["optimizer"]["state"]) == len(lora.trainable_state(first.actor.model))

    resumed = trainer(tiny_llama_dir, rank=rank, seed=2)
    load_trainer_state(resumed.actor, state, fsdp=False)
    step(resumed)
    for (name, a), b in zip(first.actor.model.state_dict().items(), resumed.actor.model.state_dict().values()):
        assert torch.equal(a, b), name
    if rank:
        state["model"].popitem()
        with pytest.raises(ValueError, match="checkpoint adapters do not match the model: missing"):
            load_trainer_state(trainer(tiny_llama_dir).actor, state, fsdp=False)


def assert_loads_without_peft(model_dir: str, reference, tmp_path) -> None:
    """A process in which peft cannot be imported loads `model_dir` with
    AutoModelForCausalLM and gets the logits of `reference` (a peft model)."""
    ids = [[0, 5, 9, 3, 17, 4]]
    reference.eval()
    with torch.no_grad():
        torch.save(reference(input_ids=torch.tensor(ids)).logits, tmp_path / "expected.pt")
    check = f"""
import importlib.util, sys, torch

sys.modules["peft"] = None  # blocked: `import peft` fails and find_spec finds nothing
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained({model_dir!r}, dtype=torch.float32).eval()
assert importlib.util.find_spec("peft") is None and sys.modules["peft"] is None
try:
    import peft
    raise SystemExit("peft was importable")
except ImportError:
    pass
with torch.no_grad():
    logits = model(input_ids=torch.tensor({ids!r})).logits
expected = torch.load({str(tmp_path / "expected.pt")!r}, weights_only=True)
assert torch.allclose(logits, expected, atol=1e-4), float((logits - expected).abs().max())
print("same logits")
"""
    proc = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "same logits" in proc.stdout, proc.stderr[-3000:]


def test_the_merged_final_model_loads_without_peft(tiny_llama_dir, tmp_path):
    """The adapter is saved in peft's format; merged into the base it is a
    plain HF model that a process without peft loads, with the LoRA model's
    logits."""
    t = trainer(tiny_llama_dir)
    step(t)
    adapter, merged = str(tmp_path / "final" / "adapter"), str(tmp_path / "final")
    save_model(t.actor.model, adapter)
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(adapter))
    lora.save_merged(adapter, tiny_llama_dir, merged, torch.float32)
    assert "adapter_config.json" not in os.listdir(merged)  # (transformers would want peft for that)
    assert_loads_without_peft(merged, t.actor.model, tmp_path)
