"""The trainer trains only the tokens the policy sampled (docs/design.md §5).

A multi-turn sequence holds context between its sampled spans (tool results,
user turns, template tokens: loss_mask False in the trajectory). Hand-computed
cases: each fails when a context token enters the micro-batch's loss mask.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from realrl.api.cli_args import PPOConfig
from realrl.api.trajectory import Trajectory
from realrl.impl.ppo import functional as F
from realrl.impl.ppo.batch import SequenceBatch, make_micro_batch
from realrl.system.model_worker import _sampled_lens, _token_staleness
from tests.impl.trainer_kit import build_trainer

CPU = torch.device("cpu")
# Two answers to one 3-token prompt. Completion of sequence 0: sampled,
# sampled, context, context, sampled, context (a turn, a tool result, a turn,
# a trailing template token); sequence 1 is single-turn (no mask).
PROMPT = [5, 6, 7]
COMPLETIONS = [[10, 11, 12, 13, 14, 15], [20, 21, 22]]
MASK0 = [True, True, False, False, True, False]


def masked_batch(rewards=(1.0, 0.0), context_logprob: float = 0.0) -> SequenceBatch:
    behav0 = torch.tensor([-1.0, -2.0, context_logprob, context_logprob, -3.0, context_logprob])
    return SequenceBatch(
        [torch.tensor(PROMPT + c) for c in COMPLETIONS],
        [3, 3],
        [behav0, torch.tensor([-1.5, -2.5, -3.5])],
        torch.tensor(rewards),
        torch.zeros(2, dtype=torch.bool),
        [[0, 1]],
        loss_masks=[torch.tensor(MASK0), None],
    )


def test_the_micro_batch_loss_mask_is_each_sequences_sampled_tokens():
    batch = masked_batch()
    assert batch.n_completion_tokens() == 3 + 3 and batch.n_completion_tokens([0]) == 3
    for rows in ([[0], [1]], [[0, 1]]):  # separate rows, and one shared-prompt row
        mb = make_micro_batch(batch, rows, CPU)
        assert mb.loss_mask.tolist() == [[1, 1, 0, 0, 1, 0], [1, 1, 1, 0, 0, 0]]
        assert mb.targets[0].tolist() == COMPLETIONS[0]  # context tokens are still in the input


def test_trajectories_carry_their_mask_into_the_batch():
    traj = Trajectory(
        qid="q",
        task="t",
        birth_time=0.0,
        input_ids=[np.asarray(PROMPT + c, dtype=np.int32) for c in COMPLETIONS],
        prompt_len=[3, 3],
        logprobs=[np.zeros(6, np.float32), np.zeros(3, np.float32)],
        versions=[np.asarray([2, 2, -1, -1, 3, -1], np.int32), np.asarray([3, 3, 3], np.int32)],
        version_start=[2, 3],
        version_end=[3, 3],
        reward=[1.0, 0.0],
        no_eos=[False, False],
        loss_mask=[np.asarray(MASK0), np.ones(3, np.bool_)],
    ).validate()
    batch = SequenceBatch.from_trajectories([traj])
    assert [m.tolist() for m in batch.loss_masks] == [MASK0, [True] * 3]
    assert batch.n_completion_tokens() == 6
    # The trainer's stats count sampled tokens: gen_len 3 + 3, and the
    # staleness histogram has no entry for the context tokens' version -1.
    assert _sampled_lens(traj) == [3, 3]
    assert _token_staleness([traj], current_version=4) == {"1": 4, "2": 2}
    unmasked = Trajectory(**{**traj.__dict__, "loss_mask": []})
    assert SequenceBatch.from_trajectories([unmasked]).loss_masks is None
    assert _sampled_lens(unmasked) == [6, 3]


def test_grpo_advantages_are_zero_on_context_tokens(tiny_llama_dir):
    torch.set_num_threads(1)
    trainer, _ = build_trainer(tiny_llama_dir, PPOConfig(adv_estimator="grpo", group_size=2), CPU)
    advs, _ = trainer.advantages(masked_batch())
    a = 0.5 / (2**-0.5 + 1e-5)  # rewards (1, 0): (r - 0.5) / (unbiased std + eps)
    assert advs[0].tolist() == pytest.approx([a, a, 0, 0, a, 0])
    assert advs[1].tolist() == pytest.approx([-a] * 3)
    # token-mean normaliser: the sampled tokens only; seq-mean: sequences with one
    assert float(trainer._normalizers(trainer.trained_masks(masked_batch()), [[0, 1]])[0]) == 6
    mb = make_micro_batch(masked_batch(), [[0, 1]], CPU)
    behav = mb.scatter(masked_batch().behav_logprobs)
    # on-policy (logp = prox = behav): ratio 1, loss = -sum(adv) / n over sampled tokens
    loss, stats = F.decoupled_ppo_actor_loss(
        behav, behav, behav, mb.scatter(advs), mb.loss_mask, eps_clip=0.2, normalizer=torch.tensor(6.0)
    )
    assert float(loss) == pytest.approx(-(3 * a - 3 * a) / 6, abs=1e-6) and stats["n_tokens"] == 6


def test_gae_puts_the_reward_on_the_last_sampled_token_and_steps_over_context(tiny_llama_dir):
    torch.set_num_threads(1)
    ppo = PPOConfig(adv_estimator="gae", discount=0.5, gae_lambda=1.0, adv_norm=False)
    trainer, _ = build_trainer(tiny_llama_dir, ppo, CPU)
    batch = masked_batch(rewards=(1.0, 0.0))
    # values at the tokens before each completion token (P-1 .. L-1)
    batch.values = [torch.tensor([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7]), torch.zeros(4)]
    advs, returns = trainer.advantages(batch)
    # sampled t = 0, 1, 4; reward 1 at t = 4; context skipped, gamma 0.5:
    #   A4 = 1 - V4 = 0.5;  A1 = g*V4 - V1 + g*A4 = 0.5 * 1 - 0.2 = 0.3;  A0 = g*V1 - V0 + g*A1 = 0.25 - 0.1
    assert advs[0].tolist() == pytest.approx([0.15, 0.3, 0, 0, 0.5, 0])
    assert returns[0].tolist() == pytest.approx([0.25, 0.5, 0, 0, 1.0, 0])
    # whitened: over the 6 sampled tokens only, context stays 0
    trainer.cfg.adv_norm = True
    white, _ = trainer.advantages(batch)
    flat = torch.tensor([0.15, 0.3, 0.5, 0.0, 0.0, 0.0])
    expected = (flat - flat.mean()) / (flat.var(unbiased=False) + 1e-5).sqrt()
    got = torch.cat([white[0][[0, 1, 4]], white[1]])
    assert got.tolist() == pytest.approx(expected.tolist(), abs=1e-4)
    assert white[0][[2, 3, 5]].abs().sum() == 0


@pytest.mark.parametrize(
    "aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
)
def test_context_tokens_change_no_gradient(tiny_llama_dir, aggregation):
    # The same batch, once with the contract's logprob 0 on context tokens and
    # once with -30 there: a context token inside the loss would get another
    # behaviour weight (and clip) and so another update.
    torch.set_num_threads(1)
    ppo = PPOConfig(adv_estimator="grpo", group_size=2, kl_ctl=0.1, loss_agg_mode=aggregation)
    weights, stats = [], []
    for context_logprob in (0.0, -30.0):
        torch.manual_seed(0)
        trainer, _ = build_trainer(tiny_llama_dir, ppo, CPU)
        before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
        batch = masked_batch(context_logprob=context_logprob)
        trainer.inference(batch, decoupled=True)
        stats.append(trainer.train_step(batch))
        weights.append(trainer.actor.model.state_dict())
        assert any(not torch.equal(v, before[k]) for k, v in weights[-1].items())  # it trained
    assert all(torch.equal(v, weights[1][k]) for k, v in weights[0].items())
    assert stats[0]["n_completion_tokens"] == stats[1]["n_completion_tokens"] == 6
    assert stats[0]["behav_imp_weight_min"] == stats[1]["behav_imp_weight_min"]
