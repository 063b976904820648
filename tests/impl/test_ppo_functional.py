"""Tests for realrl.impl.ppo.functional and realrl.impl.ppo.logprobs on hand-computed numbers.

Every expected value below is derived in a comment, not by calling the same
formula again; the few comparisons against another implementation use an
independent one (torch.distributions, or the textbook PPO objective).
"""

import json
import math
import subprocess
import sys

import pytest
import torch

from realrl.impl.ppo import functional as F
from realrl.impl.ppo import logprobs

torch.set_num_threads(1)

LN2 = math.log(2.0)


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=0
    )


# --------------------------------------------------------------------------- logprobs


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_gather_logprobs_matches_torch_distributions(temperature, monkeypatch):
    # small chunks so the chunked forward and backward loops run several times
    monkeypatch.setattr(logprobs, "_CHUNK_ELEMENTS", 3 * 11)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 5), generator=g)
    upstream = torch.randn(2, 5, generator=g)

    got = logprobs.gather_logprobs(logits, labels, temperature)
    (got * upstream).sum().backward()
    grad_got = logits.grad.clone()

    logits.grad = None
    t = temperature if temperature != 0 else 1.0
    expected = torch.distributions.Categorical(logits=logits / t).log_prob(labels)
    (expected * upstream).sum().backward()

    assert got.dtype == torch.float32 and got.shape == (2, 5)
    assert close(got, expected)
    assert close(grad_got, logits.grad)


def test_gather_logprobs_bf16_and_ignored_labels():
    logits = torch.tensor([[[0.0, LN2, 0.0], [1.0, 1.0, 1.0]]]).to(torch.bfloat16).requires_grad_()
    labels = torch.tensor([[1, -100]])
    logp = logprobs.gather_logprobs(logits, labels)
    # softmax([0, ln2, 0]) = [1/4, 1/2, 1/4]; bf16 ln2 = 0.69140625
    assert logp.dtype == torch.float32
    assert close(logp[0, 0], math.log(0.5), tol=3e-3)
    assert logp[0, 1].item() == 0.0  # ignored label
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    assert torch.all(logits.grad[0, 1] == 0)
    # d logp / d logits = onehot - softmax = [-1/4, 1/2, -1/4]
    assert close(logits.grad[0, 0].float(), [-0.25, 0.5, -0.25], tol=5e-3)


def test_entropy_from_logits():
    logits = torch.tensor([[[0.0, 0.0, 0.0, 0.0], [0.0, LN2, 0.0, -1e4]]])
    ent = logprobs.entropy_from_logits(logits)
    # uniform over 4: ln 4 ; [1/4, 1/2, 1/4, 0]: 1.5 ln 2
    assert close(ent, [[math.log(4.0), 1.5 * LN2]])
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 4, 7, generator=g)
    assert close(
        logprobs.entropy_from_logits(logits, 0.5), torch.distributions.Categorical(logits=logits / 0.5).entropy()
    )


# --------------------------------------------------------------------------- masked stats


def test_masked_stats_ignore_garbage():
    x = torch.tensor([[1.0, 2.0, float("inf")], [3.0, float("nan"), 6.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert F.masked_sum(x, mask).item() == 6.0
    assert F.masked_mean(x, mask).item() == 2.0
    assert close(F.masked_mean(x, mask, dim=-1), [1.5, 3.0])
    assert F.masked_mean(x, torch.zeros_like(mask)).item() == 0.0
    # values 1, 2, 3: population var 2/3, unbiased var 1
    assert close(F.masked_var(x, mask), 2.0 / 3.0)
    assert close(F.masked_var(x, mask, unbiased=True), 1.0)


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # mean 2, var 2/3 -> (x - 2) / sqrt(2/3) = [-1.2247, 0, 1.2247]
    s = math.sqrt(1.5)
    assert close(F.masked_whiten(x, mask, eps=0.0), [[-s, 0.0, s, 0.0]])
    assert close(F.masked_whiten(x, mask, eps=0.0, shift_mean=False), [[2 - s, 2.0, 2 + s, 0.0]])


_WHITEN_WORKER = """
import json, sys
import torch
from realrl.impl.ppo.functional import masked_whiten
torch.set_num_threads(1)
rank, init_file = int(sys.argv[1]), sys.argv[2]
torch.distributed.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
# rank 0 holds 1, 2 ; rank 1 holds 3 (and garbage at a masked slot)
x = torch.tensor([[1.0, 2.0]]) if rank == 0 else torch.tensor([[3.0, 50.0]])
mask = torch.tensor([[1, 1]]) if rank == 0 else torch.tensor([[1, 0]])
y = masked_whiten(x, mask, eps=0.0, process_group=torch.distributed.group.WORLD)
torch.distributed.destroy_process_group()
print(json.dumps(y.tolist()))
"""


def test_masked_whiten_across_ranks(tmp_path):
    init_file = str(tmp_path / "init")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WHITEN_WORKER, str(rank), init_file],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    results = [json.loads(out) for out, _ in outputs]
    # global values 1, 2, 3: mean 2, population std sqrt(2/3)
    s = math.sqrt(1.5)
    assert close(results[0], [[-s, 0.0]])
    assert close(results[1], [[s, 0.0]])


# --------------------------------------------------------------------------- rewards


def test_shape_reward():
    assert F.shape_reward(1.0, bias=0.0, scaling=1.0) == 1.0
    assert F.shape_reward(0.0, bias=0.0, scaling=1.0) == -1.0
    # ((1 - .5) * 2 - .5) * 2 = 1 ; ((0 - .5) * 2 - .5) * 2 = -3
    assert close(F.shape_reward(torch.tensor([1.0, 0.0]), bias=0.5, scaling=2.0), [1.0, -3.0])


def test_reward_to_token_rewards_and_last_index():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
    assert F.last_valid_index(mask).tolist() == [2, 3, -1]
    token_rewards = F.reward_to_token_rewards(torch.tensor([2.0, -1.0, 7.0]), mask)
    assert token_rewards.tolist() == [[0, 0, 2, 0], [0, 0, 0, -1], [0, 0, 0, 0]]
    values = torch.tensor([[9.0, 0.1, 0.2, 9.0], [0.1, 0.2, 0.3, 0.4], [1.0, 1.0, 1.0, 1.0]])
    assert close(F.last_token_values(values, mask), [0.2, 0.4, 0.0])
    assert F.broadcast_to_tokens(torch.tensor([2.0, -1.0, 7.0]), mask).tolist() == [
        [0, 2, 2, 0],
        [-1, -1, -1, -1],
        [0, 0, 0, 0],
    ]


def test_group_normalized_advantages():
    # group [1, 0, 1, 1]: mean 0.75, Bessel std sqrt((3 * .0625 + .5625) / 3) = 0.5
    adv = F.group_normalized_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=4, eps=0.0)
    assert close(adv, [0.5, -1.5, 0.5, 0.5])
    # with the default eps the denominator is 0.50001
    adv = F.group_normalized_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), group_size=4)
    assert close(adv, [0.25 / 0.50001, -0.75 / 0.50001, 0.25 / 0.50001, 0.25 / 0.50001], tol=1e-6)
    # population std sqrt(0.1875) = 0.4330127
    adv = F.group_normalized_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 4, eps=0.0, unbiased_std=False)
    assert close(adv, [0.57735, -1.73205, 0.57735, 0.57735])
    # no std: r - mean
    adv = F.group_normalized_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), 4, std_normalize=False)
    assert close(adv, [0.25, -0.75, 0.25, 0.25])
    # a group with zero spread gets exactly 0 (0.1 * 3 / 3 != 0.1 in float32)
    adv = F.group_normalized_advantages(torch.tensor([1.0, 0.0, 0.1, 0.1, 0.1, 0.1]), group_size=2)
    assert adv[2:].tolist() == [0.0, 0.0, 0.0, 0.0]
    assert close(adv[:2], [1 / (math.sqrt(0.5) + 1e-5) * 0.5, -1 / (math.sqrt(0.5) + 1e-5) * 0.5])
    # group_size 1: nothing to compare against
    assert F.group_normalized_advantages(torch.tensor([3.0, -2.0]), group_size=1).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        F.group_normalized_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=2)


def test_kl_estimators_known_values():
    logp = torch.tensor([math.log(0.5), math.log(0.25)])
    ref = torch.tensor([math.log(0.25), math.log(0.5)])
    # log ratios: +ln2, -ln2
    assert close(F.kl_penalty(logp, ref, "k1"), [LN2, -LN2])
    assert close(F.kl_penalty(logp, ref, "k2"), [0.5 * LN2**2, 0.5 * LN2**2])  # 0.240227
    # k3 = ref/pi - 1 - ln(ref/pi): 0.5 - 1 + ln2 = 0.193147 ; 2 - 1 - ln2 = 0.306853
    assert close(F.kl_penalty(logp, ref, "k3"), [0.193147, 0.306853])
    assert close(F.kl_penalty(logp, ref, "abs"), [LN2, LN2])
    assert F.kl_penalty(logp, logp, "k3").abs().max().item() == 0.0
    with pytest.raises(ValueError):
        F.kl_penalty(logp, ref, "k4")


def test_apply_kl_to_rewards():
    token_rewards = torch.tensor([[0.0, 1.0, 5.0]])
    logp = torch.tensor([[math.log(0.5), math.log(0.5), 0.0]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), math.log(0.5), -3.0]])
    mask = torch.tensor([[1, 1, 0]])
    out = F.apply_kl_to_rewards(token_rewards, logp, ref, mask, kl_ctl=0.1, kind="k1")
    # 0 - 0.1 * ln2 ; 1 - 0 ; masked -> 0
    assert close(out, [[-0.1 * LN2, 1.0, 0.0]])
    assert not out.requires_grad


# --------------------------------------------------------------------------- GAE


def test_gae_three_tokens_by_hand():
    # One sequence: a prompt slot (mask 0), three completion tokens, one pad.
    # gamma = 0.9, lam = 0.8 (gamma * lam = 0.72); rewards 0, 0, 1; values .5, .6, .7
    #   t=2: delta = 1 + 0.9*0   - 0.7 = 0.30 ; A = 0.30
    #   t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03 ; A = 0.03 + 0.72*0.30  = 0.246
    #   t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04 ; A = 0.04 + 0.72*0.246 = 0.21712
    #   returns = A + V = 0.71712, 0.846, 1.0
    # Second row: the same sequence truncated (no EOS), bootstrapped with the
    # last token's value 0.7:
    #   t=2: delta = 1 + 0.63 - 0.7 = 0.93 ; A = 0.93
    #   t=1: A = 0.03 + 0.72*0.93   = 0.6996
    #   t=0: A = 0.04 + 0.72*0.6996 = 0.543712
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0, 0.0]] * 2)
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7, 9.0]] * 2)  # 9.0: garbage in masked slots
    mask = torch.tensor([[0, 1, 1, 1, 0]] * 2)
    bootstrap = torch.tensor([0.0, 0.7])
    adv, ret = F.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8, bootstrap_values=bootstrap)
    assert close(adv[0], [0.0, 0.21712, 0.246, 0.30, 0.0])
    assert close(ret[0], [0.0, 0.71712, 0.846, 1.0, 0.0])
    assert close(adv[1], [0.0, 0.543712, 0.6996, 0.93, 0.0])
    # without bootstrap both rows are the EOS case
    adv0, _ = F.gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    assert close(adv0[1], adv[0])


def test_gae_skips_masked_gap():
    # valid tokens at t=0 and t=2 (t=1 masked, e.g. an environment turn);
    # gamma = lam = 1: A_t = sum of later rewards - V_t over the valid tokens.
    #   t=2: A = 2 - 0.5 = 1.5 ; t=0: delta = 0 + 0.5 - 0.25 = 0.25, A = 0.25 + 1.5 = 1.75
    rewards = torch.tensor([[0.0, 100.0, 2.0]])
    values = torch.tensor([[0.25, 100.0, 0.5]])
    mask = torch.tensor([[1, 0, 1]])
    adv, _ = F.gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    assert close(adv, [[1.75, 0.0, 1.5]])


def test_grpo_recipe_gives_sequence_advantage_on_every_token():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1]])
    seq_adv = F.group_normalized_advantages(torch.tensor([1.0, 0.0]), group_size=2, eps=0.0)
    # [1, 0]: mean .5, Bessel std sqrt(.5) -> +-0.5 / 0.70711 = +-0.70711
    token_rewards = F.reward_to_token_rewards(seq_adv, mask)
    adv, _ = F.gae_advantages(token_rewards, torch.zeros(2, 4), mask, gamma=1.0, lam=1.0)
    h = 0.5 / math.sqrt(0.5)
    assert close(adv, [[0, h, h, 0], [-h, -h, -h, -h]])
    assert close(adv, F.broadcast_to_tokens(seq_adv, mask))


# --------------------------------------------------------------------------- actor loss


def _textbook_ppo(logp, old_logp, adv, mask, eps):
    """Standard PPO-clip, token mean: mean over valid tokens of -min(r A, clip(r) A)."""
    ratio = torch.exp(logp - old_logp)
    objective = torch.min(ratio * adv, torch.clamp(ratio, 1 - eps, 1 + eps) * adv)
    return -(objective * mask).sum() / mask.sum()


def _random_batch(seed, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(b, t, generator=g) * 3).requires_grad_()
    behav = logp.detach() + 0.4 * torch.randn(b, t, generator=g)
    prox = logp.detach() + 0.4 * torch.randn(b, t, generator=g)
    adv = torch.randn(b, t, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = (torch.arange(t)[None, :] < lengths[:, None]).float()
    return logp, prox, behav, adv, mask


def test_decoupled_reduces_to_standard_ppo():
    logp, _, behav, adv, mask = _random_batch(0)
    loss, stats = F.decoupled_ppo_actor_loss(logp, behav, behav, adv, mask, eps_clip=0.2, behav_imp_weight_cap=5.0)
    (grad,) = torch.autograd.grad(loss, logp)
    expected = _textbook_ppo(logp, behav, adv, mask, 0.2)
    (expected_grad,) = torch.autograd.grad(expected, logp)
    assert close(loss, expected, tol=1e-6)
    assert close(grad, expected_grad, tol=1e-6)
    assert stats["behav_imp_weight_mean"] == 1.0 and stats["behav_capped_frac"] == 0.0
    assert stats["n_tokens"] == mask.sum().item()


def test_decoupled_two_tokens_by_hand():
    # eps = 0.2.
    # token 0: A = +1, ratio = exp(ln 1.5) = 1.5 -> clipped to 1.2:
    #          max(-1.5, -1.2) = -1.2 ; behaviour weight exp(ln 2) = 2   -> -2.4
    # token 1: A = -1, ratio = 0.5 -> clipped to 0.8:
    #          max(0.5, 0.8) = 0.8    ; behaviour weight exp(ln .5) = .5 -> 0.4
    # token mean: (-2.4 + 0.4) / 2 = -1.0
    # with cap 1.5 token 0 (weight 2) is dropped but still counted: 0.4 / 2 = 0.2
    prox = torch.tensor([[-1.0, -1.0]])
    logp = (prox + torch.log(torch.tensor([[1.5, 0.5]]))).requires_grad_()
    behav = prox - torch.tensor([[LN2, -LN2]])
    adv = torch.tensor([[1.0, -1.0]])
    mask = torch.ones(1, 2)

    loss, stats = F.decoupled_ppo_actor_loss(logp, prox, behav, adv, mask, eps_clip=0.2)
    assert close(loss, -1.0)
    assert stats["clip_frac"] == 1.0
    assert close(stats["behav_imp_weight_mean"], 1.25)
    assert close(stats["behav_imp_weight_max"], 2.0) and close(stats["behav_imp_weight_min"], 0.5)
    assert stats["behav_capped_frac"] == 0.0
    # both tokens clipped: no gradient
    (grad,) = torch.autograd.grad(loss, logp)
    assert grad.abs().max().item() == 0.0

    loss, stats = F.decoupled_ppo_actor_loss(logp, prox, behav, adv, mask, eps_clip=0.2, behav_imp_weight_cap=1.5)
    assert close(loss, 0.2)
    assert stats["behav_capped_frac"] == 0.5
    assert stats["n_tokens"] == 2.0
    # weight stats are taken before the cap
    assert close(stats["behav_imp_weight_max"], 2.0)


def test_gradient_flows_only_through_logprobs():
    # token 0: A = +1, ratio 0.5 (below 1 - eps but A > 0: the unclipped term
    #          -0.5 is the max), weight 2 -> loss -1.0, d/dlogp = -A*ratio*w = -1.0
    # token 1: A = +1, ratio 1.5 -> clipped, no gradient
    # token mean over 2 tokens: grads [-0.5, 0]
    prox = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    behav = (prox.detach() - LN2).requires_grad_()
    logp = (prox.detach() + torch.log(torch.tensor([[0.5, 1.5]]))).requires_grad_()
    adv = torch.ones(1, 2, requires_grad=True)
    loss, _ = F.decoupled_ppo_actor_loss(logp, prox, behav, adv, torch.ones(1, 2), eps_clip=0.2)
    loss.backward()
    assert close(loss, (-1.0 + -1.2 * 2) / 2)
    assert close(logp.grad, [[-0.5, 0.0]])
    assert prox.grad is None and behav.grad is None and adv.grad is None


def test_dual_clip():
    # eps 0.2, c_clip 3.
    # token 0: A = -1, ratio 5: max(5, 1.2) = 5 -> dual clip min(5, 3) = 3 (no gradient)
    # token 1: A = -1, ratio 2: max(2, 1.2) = 2 < 3 -> stays 2 (gradient -A*r = 2)
    # token 2: A = +1, ratio 5: max(-5, -1.2) = -1.2; positive A is never dual-clipped
    prox = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]])).requires_grad_()
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    mask = torch.ones(1, 3)
    loss, stats = F.decoupled_ppo_actor_loss(logp, prox, prox, adv, mask, eps_clip=0.2, c_clip=3.0)
    assert close(loss, (3.0 + 2.0 - 1.2) / 3)
    assert close(stats["dual_clip_frac"], 1 / 3)
    assert close(stats["clip_frac"], 1 / 3)  # token 2
    (grad,) = torch.autograd.grad(loss, logp)
    assert close(grad, [[0.0, 2.0 / 3, 0.0]])
    # without dual clip token 0 costs 5
    loss, stats = F.decoupled_ppo_actor_loss(logp, prox, prox, adv, mask, eps_clip=0.2)
    assert close(loss, (5.0 + 2.0 - 1.2) / 3)
    assert stats["dual_clip_frac"] == 0.0
    with pytest.raises(ValueError):
        F.decoupled_ppo_actor_loss(logp, prox, prox, adv, mask, eps_clip=0.2, c_clip=1.0)


def test_token_vs_seq_aggregation_unequal_lengths():
    # ratio 1 everywhere, so the per-token loss is -A.
    # seq 0: 3 tokens, losses -1, -2, -3 ; seq 1: 1 token, loss -6 (rest padding)
    # token: (-1 - 2 - 3 - 6) / 4 = -3 ; seq: mean(-2, -6) = -4
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, 3.0], [6.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    loss_tok, _ = F.decoupled_ppo_actor_loss(logp, logp.detach(), logp.detach(), adv, mask, 0.2)
    loss_seq, _ = F.decoupled_ppo_actor_loss(
        logp, logp.detach(), logp.detach(), adv, mask, 0.2, loss_agg_mode="seq-mean-token-mean"
    )
    assert close(loss_tok, -3.0)
    assert close(loss_seq, -4.0)
    with pytest.raises(ValueError):
        F.decoupled_ppo_actor_loss(logp, logp, logp, adv, mask, 0.2, loss_agg_mode="batch")


@pytest.mark.parametrize("aggregation", F.LOSS_AGG_MODES)
def test_micro_batches_sum_to_batch_loss(aggregation):
    logp, prox, behav, adv, mask = _random_batch(3, b=4, t=9)
    kwargs = dict(eps_clip=0.2, behav_imp_weight_cap=2.0, c_clip=3.0, loss_agg_mode=aggregation, max_len=9.0)
    full, _ = F.decoupled_ppo_actor_loss(logp, prox, behav, adv, mask, **kwargs)
    (full_grad,) = torch.autograd.grad(full, logp)

    normalizer = mask.sum() if aggregation == "token-mean" else 4
    total = 0.0
    for rows in ([0, 2], [1, 3]):
        # each micro-batch is trimmed to its own longest sequence, as the trainer pads
        t_mb = int(mask[rows].sum(-1).max().item())
        sl = (rows, slice(0, t_mb))
        part, _ = F.decoupled_ppo_actor_loss(
            logp[sl], prox[sl], behav[sl], adv[sl], mask[sl], normalizer=normalizer, **kwargs
        )
        total = total + part
    (mb_grad,) = torch.autograd.grad(total, logp)
    assert close(total, full, tol=1e-6)
    assert close(mb_grad, full_grad, tol=1e-7)
    assert full_grad.abs().sum() > 0


def test_actor_loss_empty_mask_is_zero():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, stats = F.decoupled_ppo_actor_loss(logp, logp, logp, torch.ones(1, 2), torch.zeros(1, 2), 0.2)
    assert loss.item() == 0.0 and stats["n_tokens"] == 0.0
    assert all(math.isfinite(v) for v in stats.values())


# --------------------------------------------------------------------------- critic


def test_critic_loss_by_hand():
    # eps 0.2.
    # token 0: V = 1.0, V_old = 0.5, R = 2: V_clip = 0.7;
    #          max((1 - 2)^2, (0.7 - 2)^2) = max(1, 1.69) = 1.69 -> 0.845 (clipped, no grad)
    # token 1: V = 1.0, V_old = 0.9, R = 0: V_clip = 1.0 -> 0.5 * 1 = 0.5, grad (V - R) = 1
    # token 2: padding
    # mean: (0.845 + 0.5) / 2 = 0.6725 ; grads [0, 0.5, 0]
    values = torch.tensor([[1.0, 1.0, 7.0]], requires_grad=True)
    old_values = torch.tensor([[0.5, 0.9, 0.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = F.critic_loss(values, old_values, returns, mask, value_eps_clip=0.2)
    loss.backward()
    assert close(loss, 0.6725)
    assert close(values.grad, [[0.0, 0.5, 0.0]])
    assert old_values.grad is None
    assert stats["clip_frac"] == 0.5 and stats["n_tokens"] == 2.0
    assert close(stats["value_mean"], 1.0) and close(stats["returns_mean"], 1.0)
    # no clipping: 0.5 * (1 + 1) / 2
    loss, stats = F.critic_loss(values, old_values, returns, mask, value_eps_clip=None)
    assert close(loss, 0.5) and stats["clip_frac"] == 0.0
