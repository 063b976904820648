"""model.gradient_checkpointing: recomputing activations in the backward pass
gives the train step of the plain model (same loss, same weights after)."""

from __future__ import annotations

import pytest
import torch

from realrl.api.cli_args import PPOConfig
from tests.impl.trainer_kit import build_trainer, full_weights, make_batch, make_groups


def test_gradient_checkpointing_gives_the_same_step(tiny_llama_dir):
    torch.set_num_threads(1)
    groups = make_groups(7, 2, 4, (3, 6), (2, 7))
    ppo = PPOConfig(adv_estimator="grpo", group_size=4, ppo_n_minibatches=1, max_tokens_per_mb=48)
    results = []
    for checkpointing in (False, True):
        trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
        if checkpointing:
            trainer.actor.model.gradient_checkpointing_enable()
            assert trainer.actor.model.is_gradient_checkpointing
        batch = make_batch(groups)
        trainer.inference(batch, decoupled=True)
        results.append((trainer.train_step(batch), full_weights(trainer.actor.model)))
    (plain, plain_weights), (checkpointed, checkpointed_weights) = results
    assert checkpointed["actor_loss"] == pytest.approx(plain["actor_loss"], abs=1e-6)
    for name, w in plain_weights.items():
        torch.testing.assert_close(checkpointed_weights[name], w, atol=1e-6, rtol=1e-6)
    untouched, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
    assert any(not torch.equal(w, full_weights(untouched.actor.model)[n]) for n, w in plain_weights.items())
