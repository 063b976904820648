"""The presets do what their papers claim, on a real tiny Llama (docs/algorithms.md).

Each preset's mechanism acts on a batch where it should (a clip range that
never binds is no clip-higher), and the estimators hold at their edges:
truncated answers, groups that shrank to one, multi-turn chains, overlong
turns of a chain. Every test here failed on the code before its fix.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from realrl.api.trajectory import Trajectory, TrajectoryError
from realrl.experiment.config import load_config
from realrl.impl.ppo import functional as F
from realrl.impl.ppo.batch import SequenceBatch
from tests.impl.trainer_kit import build_trainer, make_batch, make_groups

torch.set_num_threads(1)
CPU = torch.device("cpu")


def preset(name: str, **changes):
    """The preset's ppo keys, as `realrl train algorithm=<name>` loads them (group size 4: the kit's batches)."""
    return dataclasses.replace(load_config([f"algorithm={name}"]).ppo, **{"group_size": 4, **changes})


def one_step(trainer, groups) -> dict[str, float]:
    """One train step whose behaviour policy is the current one (every behaviour weight 1)."""
    batch = make_batch(groups)
    batch.behav_logprobs = trainer.compute_logprobs(trainer.actor.model, batch)
    trainer.inference(batch, decoupled=True)
    return trainer.train_step(batch)


# --------------------------------------------------------------------------- the clip ranges act


@pytest.mark.parametrize("name, acts", [("dapo", "clip_high_frac"), ("gspo", "clip_frac"), ("cispo", "clip_high_frac")])
def test_each_presets_clip_range_binds_within_a_step(tiny_llama_dir, name, acts):
    """With one optimizer step per train step the policy is the proximal one
    during its only update: every ratio is 1 and no clip acts. The presets
    take several minibatches per rollout batch, as their papers ran; from the
    second one on, the ratio moves and the preset's bound binds."""
    ppo = preset(name)
    assert ppo.ppo_n_minibatches > 1
    trainer, _ = build_trainer(tiny_llama_dir, ppo, CPU)
    stats = one_step(trainer, make_groups(3, 8, 4, (3, 5), (4, 8)))
    assert stats[acts] > 0.0, stats


def test_cispo_keeps_every_tokens_gradient_when_the_behaviour_weight_is_capped(tiny_llama_dir):
    """CISPO truncates the behaviour weight (TIS), it never masks a token: on
    a batch whose every behaviour weight exceeds the cap, masking would train
    nothing at all."""
    ppo = preset("cispo")
    assert ppo.behav_imp_weight_mode == "truncate"
    trainer, _ = build_trainer(tiny_llama_dir, ppo, CPU)
    batch = make_batch(make_groups(4, 4, 4, (3, 5), (4, 8)))
    trainer.inference(batch, decoupled=True)
    batch.behav_logprobs = [p - 3.0 for p in batch.prox_logprobs]  # w = e^3 > cap 5 on every token
    stats = trainer.train_step(batch)
    assert stats["behav_capped_frac"] == 1.0
    assert stats["actor_grad_norm"] > 0.0 and stats["actor_loss"] != 0.0


# --------------------------------------------------------------------------- DAPO's overlong penalty


def test_the_overlong_penalty_measures_each_sampled_turn_not_the_whole_chain(tiny_llama_dir):
    """A chain of chat turns holds context (tool results, user turns) between
    its sampled spans: each span is one call of at most max_new_tokens (16
    here, buffer 3: the penalty starts past 13 tokens). Chain 0: two turns of
    10 sampled tokens with 20 context tokens between, 40 completion tokens:
    no call came near its budget, no penalty. Chain 1: its second call hit
    the budget (16 tokens): -1."""
    ppo = preset("dapo")
    trainer, _ = build_trainer(tiny_llama_dir, ppo, CPU)
    assert trainer.max_new_tokens == 16 and trainer.overlong_buffer_len == 3
    spans = ([True] * 10 + [False] * 20 + [True] * 10, [True] * 10 + [False] * 20 + [True] * 16)
    masks = [torch.tensor(m) for m in spans]
    batch = SequenceBatch(
        [torch.arange(3 + len(m)) % 60 + 2 for m in masks],
        [3, 3],
        [torch.full((len(m),), -4.0) for m in masks],
        torch.tensor([1.0, 1.0]),
        torch.tensor([False, True]),
        [[0, 1]],
        loss_masks=masks,
    )
    assert trainer.shaped_rewards(batch).tolist() == [1.0, 0.0]


# --------------------------------------------------------------------------- GAE


def test_a_truncated_answers_return_is_its_reward_the_answer_is_terminal(tiny_llama_dir):
    """The scored answer ends the episode (as verl and OpenRLHF): no bootstrap
    from V(s_T), a value the critic never trains. With gamma = lambda = 1 the
    return of every token of a truncated answer is its reward r (not r + V_T)."""
    ppo = preset("ppo", adv_norm=False)
    assert (ppo.discount, ppo.gae_lambda) == (1.0, 1.0)
    trainer, _ = build_trainer(tiny_llama_dir, ppo, CPU)
    with torch.no_grad():  # a critic that has trained a little: its head is no longer zero
        torch.nn.init.normal_(trainer.critic.model.value_head.weight, std=0.5)
    groups = make_groups(5, 2, 4, (3, 5), (4, 8))
    for g in groups:
        for s in g:
            s["no_eos"] = True
    batch = make_batch(groups)
    trainer.inference(batch, decoupled=True)
    assert max(abs(float(v[-1])) for v in batch.values) > 1e-3  # V(s_T) is not 0: a bootstrap would show
    _, returns = trainer.advantages(batch)
    for i in range(batch.n_seqs):
        assert torch.allclose(returns[i], torch.full_like(returns[i], float(batch.rewards[i])), atol=1e-5), i


# --------------------------------------------------------------------------- groups of one


@pytest.mark.parametrize("name", ["rloo", "grpo", "dr_grpo"])
def test_a_group_of_one_gets_advantage_zero_and_is_counted(tiny_llama_dir, name):
    """A function agent that drops a failed episode can shrink a group to one
    answer at run time: it has no baseline, so no signal; the step trains
    the other groups and reports how many groups had one sample."""
    trainer, _ = build_trainer(tiny_llama_dir, preset(name), CPU)
    groups = make_groups(6, 3, 4, (3, 5), (4, 8))
    groups[1] = groups[1][:1]
    batch = make_batch(groups)
    advs, _ = trainer.advantages(batch)
    assert not advs[4].any() and advs[0].any()
    trainer.inference(batch, decoupled=True)
    stats = trainer.train_step(batch)
    assert stats["groups_of_one"] == 1.0 and math.isfinite(stats["actor_loss"])


# --------------------------------------------------------------------------- chains


def chain_trajectory(chains: list[list[float]], with_chain: bool = True) -> Trajectory:
    """One prompt's trajectory of multi-turn chains, one sequence per turn
    (as math-multi-turn sends them: chain-major); `chains` holds each
    chain's per-turn rewards."""
    ids, rewards, chain_of = [], [], []
    for c, turns in enumerate(chains):
        for t, r in enumerate(turns):
            ids.append(np.asarray([5, 6, 7] + [10 + c, 20 + t, 30], dtype=np.int32))
            rewards.append(r)
            chain_of.append(c)
    n = len(ids)
    return Trajectory(
        qid="q",
        task="math",
        birth_time=0.0,
        input_ids=ids,
        prompt_len=[3] * n,
        logprobs=[np.full(3, -1.0, np.float32)] * n,
        versions=[np.zeros(3, np.int32)] * n,
        version_start=[0] * n,
        version_end=[0] * n,
        reward=rewards,
        no_eos=[False] * n,
        metadata={"chain": chain_of} if with_chain else {},
    ).validate()


@pytest.mark.parametrize(
    "estimator, expected",
    [
        # over chains: rewards [-1, +1]; mean 0, Bessel std sqrt(2)
        ("grpo", [-1 / math.sqrt(2)] * 3 + [1 / math.sqrt(2)]),
        ("dr_grpo", [-1.0] * 3 + [1.0]),
        # leave one chain out: -1 - (+1) and +1 - (-1)
        ("rloo", [-2.0] * 3 + [2.0]),
    ],
)
def test_group_baselines_are_over_chains_not_turns(tiny_llama_dir, estimator, expected):
    """Chain 0 failed three turns (reward -1 each), chain 1 solved at once
    (+1). Each chain is one sample of the group: over turns, GRPO would
    weigh chain 0 three times (A = [-0.5, -0.5, -0.5, 1.5]) and RLOO's
    baseline for chain 0's turns would hold chain 0's other turns."""
    trainer, _ = build_trainer(tiny_llama_dir, preset(estimator, group_size=2), CPU)
    batch = SequenceBatch.from_trajectories([chain_trajectory([[-1.0, -1.0, -1.0], [1.0]])])
    advs, _ = trainer.advantages(batch)
    assert [float(a[0]) for a in advs] == pytest.approx(expected, abs=1e-4)
    assert all(torch.all(a == a[0]) for a in advs)


def test_a_chains_sequences_share_the_advantage_of_the_chains_first_turn(tiny_llama_dir):
    """With a turn-level discount a chain's turns carry different rewards
    (math-multi-turn: γ^(k-t)); the chain's reward is its first turn's, the
    episode's return from its start, and every turn gets the chain's advantage."""
    trainer, _ = build_trainer(tiny_llama_dir, preset("dr_grpo", group_size=2), CPU)
    batch = SequenceBatch.from_trajectories([chain_trajectory([[0.0, 1.0], [1.0], [-1.0]])])
    advs, _ = trainer.advantages(batch)
    # chains' rewards [0, 1, -1], mean 0
    assert [float(a[0]) for a in advs] == pytest.approx([0.0, 0.0, 1.0, -1.0], abs=1e-6)


def test_the_chain_field_is_checked():
    with pytest.raises(TrajectoryError, match="chain"):
        Trajectory(**{**chain_trajectory([[1.0], [0.0]]).__dict__, "metadata": {"chain": [0]}}).validate()
    with pytest.raises(TrajectoryError, match="chain"):
        Trajectory(**{**chain_trajectory([[1.0], [0.0]]).__dict__, "metadata": {"chain": [0, "a"]}}).validate()
    # no chain field: every sequence is its own chain
    batch = SequenceBatch.from_trajectories([chain_trajectory([[1.0], [0.0]], with_chain=False)])
    assert batch.chains == [[[0], [1]]]


# --------------------------------------------------------------------------- GSPO's staleness correction


def test_the_geometric_behaviour_weight_is_the_sequences_mean_token_weight():
    """w_b = exp((1/n_b) Σ_t (prox - behav)): a sequence of 200 tokens each
    1.05 stale has w = 1.05 (the product would be 1.05^200 ≈ 17292)."""
    n = 200
    prox = torch.zeros(2, n)
    behav = torch.full((2, n), -math.log(1.05))
    behav[1, n // 2 :] = 0.0  # the second sequence: half its tokens fresh
    mask = torch.ones(2, n)
    mask[1, -10:] = 0.0
    weight, raw, capped = F.behav_imp_weight(prox, behav, mask, cap=5.0, mode="mask", level="geometric")
    expected = torch.tensor([1.05, math.exp(math.log(1.05) * 100 / 190)])
    assert torch.allclose(raw[:, 0], expected, atol=1e-5) and not capped.any()
    assert torch.all(weight[1, -10:] == 0)
    product, _, product_capped = F.behav_imp_weight(prox, behav, mask, cap=5.0, mode="mask", level="sequence")
    assert product_capped[0].all() and not product[0].any()  # the product masks the whole answer


def test_the_gspo_preset_corrects_staleness_per_sequence_by_the_geometric_mean():
    assert preset("gspo").behav_imp_weight_level == "geometric"
