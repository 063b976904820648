"""The algorithm menu (docs/algorithms.md) against its papers' formulas.

Every expected number is derived by hand in a comment from the paper's
formula, or computed by an independent, literal implementation of that
formula (never by calling the function under test again). The trainer tests
run a real tiny Llama; the data-parallel ones two real gloo ranks.
"""

from __future__ import annotations

import math

import pytest
import torch

from realrl.api.agent_api import AgentSettings
from realrl.api.cli_args import PPOConfig, validate
from realrl.experiment.config import algorithm_presets, load_config
from realrl.impl.ppo import functional as F
from tests.impl.test_trainer_lockstep import UNEVEN, run_ranks
from tests.impl.trainer_kit import build_trainer, make_batch, make_groups, run_steps

torch.set_num_threads(1)


def close(a, b, tol=1e-5):
    return torch.allclose(
        torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32), atol=tol, rtol=0
    )


# --------------------------------------------------------------------------- advantage estimators


def test_grpo_and_dr_grpo_advantages_on_the_papers_formulas():
    # One group of G = 4, rewards [1, 0, 0, 0]: mean 0.25; Bessel std
    # sqrt((0.75^2 + 3 * 0.25^2) / 3) = sqrt(0.25) = 0.5.
    # GRPO (DeepSeekMath eq. 3): (r - mean) / std = [1.5, -0.5, -0.5, -0.5].
    # Dr. GRPO (Liu et al. 2025): r - mean = [0.75, -0.25, -0.25, -0.25].
    # A second group, all equal: no signal, exactly 0 either way.
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    assert close(F.group_normalized_advantages(r, 4), [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0], tol=1e-4)
    assert close(F.group_normalized_advantages(r, 4, std_normalize=False), [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])


def test_rloo_advantages():
    # RLOO: A_i = r_i - mean of the others. Group [1, 0, 0, 0]:
    # A_0 = 1 - 0 = 1, A_1 = 0 - (1 + 0 + 0) / 3 = -1/3. Group [2, 4]: A = [-2, 2].
    r = torch.tensor([1.0, 0.0, 0.0, 0.0])
    assert close(F.rloo_advantages(r, 4), [1.0, -1 / 3, -1 / 3, -1 / 3])
    assert close(F.rloo_advantages(torch.tensor([2.0, 4.0]), 2), [-2.0, 2.0])
    with pytest.raises(ValueError):
        F.rloo_advantages(torch.tensor([1.0]), 1)


def test_reinforce_plus_plus_advantages(tiny_llama_dir):
    # The return G_t = sum_{t' >= t} gamma^(t'-t) r_t', gamma = 0.5, rewards
    # [0, -0.1, 1] (a KL penalty on token 1, the reward on the last):
    # G = [0 - 0.05 + 0.25, -0.1 + 0.5, 1] = [0.2, 0.4, 1.0].
    rewards = torch.tensor([[0.0, -0.1, 1.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert close(F.discounted_returns(rewards, mask, 0.5), [[0.2, 0.4, 1.0, 0.0]])

    # In the trainer (REINFORCE++, Hu 2025): token reward = -kl_ctl * k1 per token, the
    # sequence's reward added on its last token, the returns (gamma 1: suffix sums)
    # whitened over every token of the batch.
    trainer, _ = build_trainer(
        tiny_llama_dir, PPOConfig(adv_estimator="reinforce_plus_plus", group_size=2, kl_ctl=0.1), torch.device("cpu")
    )
    batch = make_batch(make_groups(0, 2, 2, (3, 5), (2, 4)))
    trainer.inference(batch, decoupled=True)
    advs, returns = trainer.advantages(batch)
    assert returns is None
    raw = []
    for i in range(batch.n_seqs):
        kl = [p - q for p, q in zip(batch.prox_logprobs[i].tolist(), batch.ref_logprobs[i].tolist())]
        token_rewards = [-0.1 * k for k in kl]
        token_rewards[-1] += float(batch.rewards[i])
        raw.append([sum(token_rewards[t:]) for t in range(len(token_rewards))])
    flat = [x for seq in raw for x in seq]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat) + 1e-5)
    for a, seq in zip(advs, raw):
        assert close(a, [(x - mean) / std for x in seq], tol=1e-4)


# --------------------------------------------------------------------------- policy losses


def test_clip_higher_and_dual_clip_by_hand():
    # DAPO's clip-higher, eps_low 0.2, eps_high 0.28, token-mean over 3 tokens:
    # token 0: A = +1, ratio 1.25 < 1.28: not clipped, loss -1.25, d/dlogp = -A*ratio = -1.25
    # token 1: A = +1, ratio 1.5: clipped at 1.28, loss -1.28, no gradient (clip_high)
    # token 2: A = -1, ratio 0.7 < 0.8: max(0.7, 0.8) = 0.8, no gradient (clip_low)
    prox = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.25, 1.5, 0.7]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3)
    loss, st = F.decoupled_ppo_actor_loss(logp, prox, prox, adv, mask, 0.2, eps_clip_high=0.28)
    assert close(loss, (-1.25 - 1.28 + 0.8) / 3)
    (grad,) = torch.autograd.grad(loss, logp)
    assert close(grad, [[-1.25 / 3, 0.0, 0.0]])
    assert close(st["clip_high_frac"], 1 / 3) and close(st["clip_low_frac"], 1 / 3) and close(st["clip_frac"], 2 / 3)
    # symmetric eps 0.2: token 0 is clipped too (1.25 > 1.2)
    loss, st = F.decoupled_ppo_actor_loss(logp, prox, prox, adv, mask, 0.2)
    assert close(loss, (-1.2 - 1.2 + 0.8) / 3) and close(st["clip_high_frac"], 2 / 3)
    # dual clip c = 3 (Ye et al. 2020): A = -1 at ratio 5 costs min(max(5, 1.2), 3) = 3
    loss, st = F.decoupled_ppo_actor_loss(
        torch.log(torch.tensor([[5.0]])),
        torch.zeros(1, 1),
        torch.zeros(1, 1),
        -torch.ones(1, 1),
        torch.ones(1, 1),
        0.2,
        c_clip=3.0,
        eps_clip_high=0.28,
    )
    assert close(loss, 3.0) and st["dual_clip_frac"] == 1.0


def _gspo_by_the_paper(logp, prox, adv, lengths, eps_low, eps_high):
    """GSPO eq. (5)-(7), literally: per sequence s = (prod_t pi/pi_old)^(1/|y|), the
    clipped objective per sequence, averaged over sequences."""
    losses = []
    for b, n in enumerate(lengths):
        s = torch.exp((logp[b, :n] - prox[b, :n]).sum() / n)
        a = adv[b, 0]
        losses.append(torch.maximum(-a * s, -a * s.clamp(1 - eps_low, 1 + eps_high)))
    return torch.stack(losses).mean()


def test_gspo_by_hand():
    # Sequence 0: two tokens, ratios 1.2 and 0.8: s = sqrt(0.96) = 0.979796, A = 1,
    #   inside [1 - 0.2, 1 + 0.2]: loss -0.979796; d/dlogp_t = -A * s / |y| = -0.489898.
    # Sequence 1: one token, ratio 2: s = 2, clipped to 1.2: loss -1.2, no gradient.
    # seq-mean-token-mean: (-0.979796 - 1.2) / 2 = -1.089898; gradients halved.
    prox = torch.zeros(2, 2)
    logp = torch.log(torch.tensor([[1.2, 0.8], [2.0, 1.0]])).requires_grad_()
    adv = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    kw = dict(policy_loss="gspo", loss_agg_mode="seq-mean-token-mean")
    loss, st = F.decoupled_ppo_actor_loss(logp, prox, prox, adv, mask, 0.2, **kw)
    assert close(loss, -1.089898)
    (grad,) = torch.autograd.grad(loss, logp)
    assert close(grad, [[-0.244949, -0.244949], [0.0, 0.0]])
    assert close(st["clip_high_frac"], 1 / 3)  # sequence 1's one token
    # and against the paper's sequence-level form with its own clip range, on random numbers
    g = torch.Generator().manual_seed(0)
    prox = -torch.rand(3, 5, generator=g)
    logp = (prox + 1e-3 * torch.randn(3, 5, generator=g)).requires_grad_()
    adv = torch.randn(3, 1, generator=g).expand(3, 5)
    lengths = [5, 2, 4]
    mask = (torch.arange(5)[None] < torch.tensor(lengths)[:, None]).float()
    ours, _ = F.decoupled_ppo_actor_loss(logp, prox, prox, adv, mask, 3e-4, eps_clip_high=4e-4, **kw)
    paper = _gspo_by_the_paper(logp, prox, adv, lengths, 3e-4, 4e-4)
    assert close(ours, paper, tol=1e-6)
    assert close(torch.autograd.grad(ours, logp)[0], torch.autograd.grad(paper, logp)[0], tol=1e-6)


def test_cispo_by_hand():
    # CISPO (MiniMax-M1 eq. 4): loss_t = -sg(clip(r_t, 1 - 0.2, 1 + 0.28)) * A_t * logp_t.
    # ratios [1.5, 0.5, 1.1], A [1, -1, 1] -> weights [1.28, 0.8, 1.1];
    # token-mean gradient -w * A / 3 = [-1.28, 0.8, -1.1] / 3: the clipped tokens keep a gradient.
    prox = torch.full((1, 3), -1.0)
    logp = (prox + torch.log(torch.tensor([[1.5, 0.5, 1.1]]))).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, st = F.decoupled_ppo_actor_loss(
        logp, prox, prox, adv, torch.ones(1, 3), 0.2, eps_clip_high=0.28, policy_loss="cispo"
    )
    expected = -(torch.tensor([1.28, 0.8, 1.1]) * adv[0] * logp.detach()[0]).sum() / 3
    assert close(loss, expected)
    (grad,) = torch.autograd.grad(loss, logp)
    assert close(grad, [[-1.28 / 3, 0.8 / 3, -1.1 / 3]])
    assert close(st["clip_high_frac"], 1 / 3) and close(st["clip_low_frac"], 1 / 3)


# --------------------------------------------------------------------------- aggregation


def test_loss_agg_modes_by_hand():
    # per-token losses (ratio 1, loss = -A): seq 0 [1, 2, 3], seq 1 [6] (then padding)
    # token-mean              (1 + 2 + 3 + 6) / 4         = 3
    # seq-mean-token-mean     (mean(1,2,3) + 6) / 2       = 4
    # seq-mean-token-sum      (6 + 6) / 2                 = 6
    # seq-mean-token-sum-norm (6 + 6) / (2 * max_len=4)   = 1.5
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = -torch.tensor([[1.0, 2.0, 3.0], [6.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    expected = {
        "token-mean": 3.0,
        "seq-mean-token-mean": 4.0,
        "seq-mean-token-sum": 6.0,
        "seq-mean-token-sum-norm": 1.5,
    }
    for mode, value in expected.items():
        loss, _ = F.decoupled_ppo_actor_loss(
            logp, logp.detach(), logp.detach(), adv, mask, 0.2, loss_agg_mode=mode, max_len=4.0
        )
        assert close(loss, value), mode


def test_token_mean_is_global_not_a_mean_of_micro_batch_means():
    # The two sequences above in two micro-batches: the mean of the micro-batch
    # means would be (2 + 6) / 2 = 4; with the batch's token count (4) as the
    # normaliser they add up to the batch's token mean, 6/4 + 6/4 = 3.
    per_token = torch.tensor([[1.0, 2.0, 3.0], [6.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    parts = [F.aggregate_loss(per_token[[b]], mask[[b]], "token-mean", normalizer=4) for b in (0, 1)]
    assert close(sum(parts), 3.0)
    assert close(sum(F.aggregate_loss(per_token[[b]], mask[[b]], "token-mean") for b in (0, 1)) / 2, 4.0)
    counts = [F.loss_agg_count(mask[[b]], "token-mean") for b in (0, 1)]
    assert [int(c) for c in counts] == [3, 1]


# --------------------------------------------------------------------------- rollout correction


def test_behaviour_correction_truncate_mask_token_and_sequence():
    # log(prox / behav): seq 0 tokens [ln 2, ln 4], seq 1 [ln 0.5]; cap 3.
    # token:    w = [2, 4], [0.5];   truncate -> [2, 3], [0.5]; mask -> [2, 0], [0.5]
    # sequence: w = 2 * 4 = 8 for both of seq 0's tokens, 0.5 for seq 1;
    #           truncate -> [3, 3], [0.5]; mask -> [0, 0], [0.5]
    behav = torch.zeros(2, 2)
    prox = torch.log(torch.tensor([[2.0, 4.0], [0.5, 1.0]]))
    mask = torch.tensor([[1, 1], [1, 0]])
    cases = {
        ("truncate", "token"): [[2, 3], [0.5, 0]],
        ("mask", "token"): [[2, 0], [0.5, 0]],
        ("truncate", "sequence"): [[3, 3], [0.5, 0]],
        ("mask", "sequence"): [[0, 0], [0.5, 0]],
    }
    for (mode, level), expected in cases.items():
        weight, raw, capped = F.behav_imp_weight(prox, behav, mask, 3.0, mode, level)
        assert close(weight, expected), (mode, level)
        assert capped.tolist() == (
            [[False, True], [False, False]] if level == "token" else [[True, True], [False, False]]
        )
    # in the loss: ratio 1, A = 1 -> per-token loss -w; token-mean over 3 tokens
    logp = prox.clone().requires_grad_()
    loss, st = F.decoupled_ppo_actor_loss(
        logp, prox, behav, torch.ones(2, 2), mask, 0.2, behav_imp_weight_cap=3.0, behav_imp_weight_mode="truncate"
    )
    assert close(loss, -(2 + 3 + 0.5) / 3) and close(st["behav_capped_frac"], 1 / 3)
    # no cap: the raw weights
    weight, _, capped = F.behav_imp_weight(prox, behav, mask, None)
    assert close(weight, [[2, 4], [0.5, 0]]) and not capped.any()


def test_effective_sample_size():
    # ESS = (sum w)^2 / (n sum w^2): equal weights 1; [4, 0, 0, 0] -> 16 / (4 * 16) = 0.25;
    # [2, 1, 1] -> 16 / (3 * 6) = 8/9. Masked entries do not count.
    assert close(F.effective_sample_size(torch.ones(1, 4), torch.ones(1, 4)), 1.0)
    assert close(F.effective_sample_size(torch.tensor([[4.0, 0, 0, 0]]), torch.ones(1, 4)), 0.25)
    assert close(F.effective_sample_size(torch.tensor([[2.0, 1, 1, 50]]), torch.tensor([[1, 1, 1, 0]])), 8 / 9)
    # the actor loss reports it (over the raw weights, before the cap)
    behav = torch.zeros(1, 3)
    prox = torch.log(torch.tensor([[2.0, 1.0, 1.0]]))
    _, st = F.decoupled_ppo_actor_loss(prox.clone(), prox, behav, torch.ones(1, 3), torch.ones(1, 3), 0.2, 1.5)
    assert close(st["behav_ess"], 8 / 9)


# --------------------------------------------------------------------------- KL loss, entropy, DAPO's data side


@pytest.mark.parametrize(
    "kind, x, grad",
    [
        # d/dx of each estimator at log_ratio x = logp - ref_logp:
        ("k1", 0.5, 1.0),  # x -> 1
        ("k2", 0.5, 0.5),  # x^2 / 2 -> x
        ("k3", 0.5, 1 - math.exp(-0.5)),  # e^-x - 1 + x -> 1 - e^-x
        ("low-var", 0.5, 1 - math.exp(-0.5)),  # k3 where below 10 ...
        ("low-var", -5.0, 0.0),  # ... e^5 - 1 - 5 = 142.4 is clamped to 10: no gradient
    ],
)
def test_kl_loss_gradient_is_the_estimators(kind, x, grad):
    logp = torch.tensor([[x]], requires_grad=True)
    zeros = torch.zeros(1, 1)
    # ratio 1 and A = 0: the policy term is 0, so the loss is coef * KL
    loss, st = F.decoupled_ppo_actor_loss(
        logp,
        logp.detach(),
        logp.detach(),
        zeros,
        torch.ones(1, 1),
        0.2,
        ref_logprobs=zeros,
        kl_loss_coef=0.1,
        kl_estimator=kind,
    )
    (g,) = torch.autograd.grad(loss, logp)
    assert close(g, 0.1 * grad)
    assert close(st["kl_loss"], F.kl_penalty(logp.detach(), zeros, kind))


def test_overlong_penalty():
    # DAPO eq. 13, L_max = 20, L_cache = 4 (punishment from 16 tokens on):
    # 10 -> 0; 16 -> 0; 18 -> (16 - 18) / 4 = -0.5; 20 -> -1; 21 -> -1
    got = F.overlong_penalty(torch.tensor([10, 16, 18, 20, 21]), 20, 4)
    assert close(got, [0.0, 0.0, -0.5, -1.0, -1.0])


def test_the_entropy_bonus_alone_raises_the_entropy(tiny_llama_dir):
    # Every group scores the same: all advantages 0, so the only gradient is the bonus.
    groups = make_groups(1, 2, 2, (3, 5), (3, 6))
    for g in groups:
        for s in g:
            s["reward"] = 1.0
    ppo = PPOConfig(group_size=2, entropy_coef=1.0)
    trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
    first, second = run_steps(trainer, groups, steps=2)
    assert first["entropy"] > 0 and second["entropy"] > first["entropy"] + 1e-4
    # without the bonus nothing moves
    trainer, _ = build_trainer(tiny_llama_dir, PPOConfig(group_size=2), torch.device("cpu"))
    first, second = run_steps(trainer, groups, steps=2)
    assert second["entropy"] == pytest.approx(first["entropy"], abs=1e-6)


def test_overlong_filtering_trains_as_if_truncated_answers_were_not_there(tiny_llama_dir):
    # Group 0: rewards [0, 1], the rewarded answer truncated; group 1: [0, 1], none truncated.
    groups = make_groups(2, 2, 2, (3, 5), (3, 6))
    for g in groups:
        for k, s in enumerate(g):
            s["reward"], s["no_eos"] = float(k), False
    groups[0][1]["no_eos"] = True
    ppo = PPOConfig(group_size=2, mask_truncated=True)
    trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
    batch = make_batch(groups)
    # behaviour = the current policy: every ratio and weight is 1, the loss is -A per token
    batch.behav_logprobs = trainer.compute_logprobs(trainer.actor.model, batch)
    advs, _ = trainer.advantages(batch)
    # the truncated answer trains nothing, but still counts in its group's baseline: its
    # partner keeps the advantage GRPO gives [0, 1], i.e. -0.7071
    assert not advs[1].any()
    assert close(advs[0], torch.full_like(advs[0], -1 / math.sqrt(2)), tol=1e-4)
    # ... and the loss is that of the batch without it: token-mean over the other answers' tokens
    stats = trainer.train_step(batch)
    kept = [0, 2, 3]
    assert stats["truncated_masked_frac"] == 0.25
    loss_by_hand = -sum(float(advs[i].sum()) for i in kept) / sum(len(advs[i]) for i in kept)  # ratio 1
    assert stats["actor_loss"] == pytest.approx(loss_by_hand, abs=1e-5)


def test_dynamic_sampling_rejects_groups_that_all_score_the_same():
    on = AgentSettings(dynamic_sampling=True)
    assert not on.keep_group(1.0, [1.0, 1.0, 1.0]) and not on.keep_group(0.0, [0.0, 0.0])
    assert on.keep_group(0.5, [1.0, 0.0]) and on.keep_group(0.0, [0.3, 0.0])  # partial credit differs
    assert on.for_evaluation().keep_group(1.0, [1.0])  # evaluation keeps everything
    assert AgentSettings().keep_group(1.0, [1.0, 1.0])  # off by default


# --------------------------------------------------------------------------- micro-batches and ranks

# Each covers a different estimator, policy loss, aggregation and correction.
MENU = {
    "dapo-like": dict(
        adv_estimator="grpo",
        eps_clip_high=0.28,
        loss_agg_mode="token-mean",
        overlong_buffer_len=8,
        overlong_penalty_factor=1.0,
        mask_truncated=True,
        behav_imp_weight_mode="truncate",
        behav_imp_weight_level="sequence",
        use_kl_loss=True,
        kl_loss_estimator="k3",
        entropy_coef=0.01,
    ),
    "dr_grpo+cispo": dict(adv_estimator="dr_grpo", policy_loss="cispo", loss_agg_mode="seq-mean-token-sum-norm"),
    "rloo+gspo": dict(adv_estimator="rloo", policy_loss="gspo", loss_agg_mode="seq-mean-token-mean"),
    "reinforce++": dict(adv_estimator="reinforce_plus_plus", kl_ctl=0.1, loss_agg_mode="seq-mean-token-sum"),
}


@pytest.mark.parametrize("name", MENU)
def test_every_algorithm_is_exact_over_micro_batches_and_ranks(tmp_path, tiny_llama_dir, name):
    """Two gloo ranks with uneven data, each micro-batching its share, take
    the same step as one rank on the whole batch in one micro-batch."""
    ppo = dict(group_size=2, ppo_n_minibatches=1, max_tokens_per_mb=64, **MENU[name])
    results = run_ranks(tmp_path, tiny_llama_dir, ppo, UNEVEN, "plain", steps=1)
    assert results[0]["stats"] == results[1]["stats"]
    trainer, _ = build_trainer(tiny_llama_dir, PPOConfig(**{**ppo, "max_tokens_per_mb": 4096}), torch.device("cpu"))
    (expected,) = run_steps(trainer, UNEVEN[0] + UNEVEN[1], steps=1)
    (got,) = results[0]["stats"]
    assert abs(expected["actor_loss"]) > 1e-4
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    for pname, p in trainer.actor.model.named_parameters():
        # Adam's first step is about lr * sign(g) (scale-free: the loss and grad norm above check the
        # normalisation): round-off in a near-zero gradient element moves its weight by a part of lr
        torch.testing.assert_close(results[0]["weights"]["actor"][pname], p.detach(), rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- configuration


def test_every_preset_is_valid():
    presets = algorithm_presets()
    assert presets == ["cispo", "dapo", "dr_grpo", "grpo", "gspo", "ppo", "reinforce_plus_plus", "rloo"]
    expected = {
        "grpo": ("grpo", "ppo", "token-mean"),
        "dapo": ("grpo", "ppo", "token-mean"),
        "dr_grpo": ("dr_grpo", "ppo", "seq-mean-token-sum-norm"),
        "gspo": ("grpo", "gspo", "seq-mean-token-mean"),
        "rloo": ("rloo", "ppo", "token-mean"),
        "reinforce_plus_plus": ("reinforce_plus_plus", "ppo", "token-mean"),
        "cispo": ("grpo", "cispo", "token-mean"),
        "ppo": ("gae", "ppo", "token-mean"),
    }
    for name in presets:
        cfg = load_config([f"algorithm={name}"])
        validate(cfg)
        p = cfg.ppo
        assert (p.adv_estimator, p.policy_loss, p.loss_agg_mode) == expected[name], name
    dapo = load_config(["algorithm=dapo"])
    assert dapo.ppo.eps_clip_high == 0.28 and dapo.rollout.dynamic_sampling and dapo.ppo.overlong_penalty_factor == 1.0
    assert load_config([]).ppo == load_config(["algorithm=grpo"]).ppo  # grpo is the default
    # a command-line key beats the preset's
    assert load_config(["algorithm=gspo", "ppo.eps_clip=0.1"]).ppo.eps_clip == 0.1


@pytest.mark.parametrize(
    "override, message",
    [
        ("ppo.algorithm=ppo", "ppo.algorithm: was replaced by ppo.adv_estimator"),
        ("ppo.loss_aggregation=seq", "ppo.loss_aggregation: was replaced by ppo.loss_agg_mode"),
        ("ppo.group_std_norm=false", "ppo.group_std_norm: was replaced by ppo.adv_estimator"),
        ("algorithm=grpo_v2", "algorithm: no preset 'algorithm/grpo_v2'; presets: cispo, dapo"),
    ],
)
def test_replaced_keys_and_unknown_presets_say_what_to_use(override, message):
    from realrl.api.cli_args import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config([override])
    assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_replaced_keys_in_a_config_file_say_what_to_use(tmp_path):
    from realrl.api.cli_args import ConfigError

    (tmp_path / "mine.yaml").write_text("defaults:\n  - async-ppo\n  - _self_\nppo:\n  algorithm: ppo\n")
    with pytest.raises(ConfigError, match=r"^ppo.algorithm: was replaced by ppo.adv_estimator"):
        load_config([], config_name="mine", config_dir=str(tmp_path))


@pytest.mark.parametrize(
    "override, key",
    [
        ("ppo.adv_estimator=ppo", "ppo.adv_estimator"),
        ("ppo.policy_loss=dpo", "ppo.policy_loss"),
        ("ppo.loss_agg_mode=token", "ppo.loss_agg_mode"),
        ("ppo.behav_imp_weight_mode=clip", "ppo.behav_imp_weight_mode"),
        ("ppo.behav_imp_weight_level=group", "ppo.behav_imp_weight_level"),
        ("ppo.kl_loss_estimator=k4", "ppo.kl_loss_estimator"),
        ("ppo.overlong_penalty_factor=1.0", "ppo.overlong_penalty_factor"),  # no buffer
        ("ppo.overlong_buffer_len=9", "ppo.overlong_buffer_len"),  # > max_new_tokens (8)
        ("ppo.c_clip=3.0 ppo.policy_loss=gspo", "ppo.c_clip"),
        ("rollout.max_rejected_batches=-1", "rollout.max_rejected_batches"),
    ],
)
def test_bad_algorithm_keys_name_the_key(override, key):
    from realrl.api.cli_args import ConfigError

    with pytest.raises(ConfigError, match=rf"^{key}: "):
        validate(load_config(override.split()))


def test_the_rejection_cap_counts_from_the_steps_start():
    from realrl.system.rejections import TooManyRejectedGroups, check_rejections

    check_rejections(3, before=10, now=26, cap=16, have=0, want=8)  # 16 rejected: at the cap, not past it
    check_rejections(3, before=None, now=99, cap=16, have=0, want=8)  # the manager did not answer: no verdict
    with pytest.raises(TooManyRejectedGroups, match=r"^step 3: the agent rejected 17 groups .*\(have 2/8"):
        check_rejections(3, before=10, now=27, cap=16, have=2, want=8)
