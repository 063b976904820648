"""PPOTrainer on one rank (no process group: nothing here may call a collective)."""

from __future__ import annotations

import math

import pytest
import torch

from realrl.api.cli_args import PPOConfig
from realrl.impl.ppo import functional as F
from realrl.impl.ppo.batch import make_micro_batch
from realrl.impl.ppo.trainer import PPOTrainer, make_optimized
from tests.impl.trainer_kit import build_trainer, full_weights, make_batch, make_groups, run_steps


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_empty_completion_trains_no_token_and_crashes_nothing(tiny_llama_dir, algorithm, aggregation):
    torch.set_num_threads(1)
    groups = make_groups(3, 3, 3, (3, 5), (3, 6))
    # Answers aborted before their first token: prompt only, no logprobs.
    # One in group 0; all of group 2 (a minibatch may hold no token at all).
    for s in [groups[0][1], *groups[2]]:
        s["ids"], s["behav"] = s["ids"][: s["prompt_len"]], []
    groups[0][1]["reward"] = 1.0
    ppo = PPOConfig(
        adv_estimator="gae" if algorithm == "ppo" else "grpo",
        group_size=3,
        ppo_n_minibatches=3,
        max_tokens_per_mb=32,
        kl_ctl=0.1,
        loss_agg_mode=aggregation,
    )
    trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
    batch = make_batch(groups)
    trainer.inference(batch, decoupled=True)

    advs, returns = trainer.advantages(batch)
    empty = {1, 6, 7, 8}
    assert all((len(advs[i]) == 0) == (i in empty) for i in range(batch.n_seqs))
    if algorithm == "grpo":
        # Its reward still counts in the group's normalisation: at the last
        # token, advantage = group-normalised reward + that token's KL reward.
        seq_adv = F.group_normalized_advantages(batch.rewards[:3], 3)
        for i in (0, 2):
            kl_last = -ppo.kl_ctl * F.kl_penalty(batch.prox_logprobs[i][-1:], batch.ref_logprobs[i][-1:])
            assert float(advs[i][-1]) == pytest.approx(float(seq_adv[i] + kl_last[0]), abs=1e-5)
    else:
        assert all((len(returns[i]) == 0) == (i in empty) for i in range(batch.n_seqs))

    stats = trainer.train_step(batch)
    assert all(math.isfinite(v) for v in stats.values()), stats
    assert stats["n_seqs"] == 9 and stats["n_completion_tokens"] == batch.n_completion_tokens()
    assert stats["reward_mean"] == pytest.approx(float(batch.rewards.mean()))
    if algorithm == "ppo":
        assert "critic_loss" in stats


def test_padding_micro_batch_is_inert():
    # What a rank with fewer micro-batches runs to join the others' collectives.
    batch = make_batch(make_groups(0, 1, 2, (3, 4), (2, 3)))
    mb = make_micro_batch(batch, [], torch.device("cpu"))
    assert mb.input_ids.shape == (1, 2) and mb.attention_mask.sum() == 2
    assert mb.loss_mask.sum() == 0 and mb.gather(torch.zeros(1, 1)) == []
    assert mb.scatter(batch.behav_logprobs).abs().sum() == 0


def test_empty_batch_changes_nothing(tiny_llama_dir):
    torch.set_num_threads(1)
    trainer, forwards = build_trainer(tiny_llama_dir, PPOConfig(adv_estimator="gae", kl_ctl=0.1), torch.device("cpu"))
    before = {k: v.clone() for k, v in trainer.actor.model.state_dict().items()}
    batch = make_batch([])
    trainer.inference(batch, decoupled=True)
    stats = trainer.train_step(batch)
    assert stats["n_seqs"] == 0 and all(math.isfinite(v) for v in stats.values())
    assert sum(forwards.values()) == 0  # no optimizer step either: the weights are untouched
    assert all(torch.equal(v, before[k]) for k, v in trainer.actor.model.state_dict().items())


def test_proximal_logprobs_from_the_train_forward_equal_a_separate_pass(tiny_llama_dir):
    # With one minibatch the decoupled loss takes the proximal logprobs from
    # the train step's own forward (no pass of their own). The step must be
    # the one a separate proximal pass gives: same weights after, same stats.
    torch.set_num_threads(1)
    groups = make_groups(5, 4, 4, (3, 6), (2, 7))
    ppo = PPOConfig(adv_estimator="grpo", group_size=4, ppo_n_minibatches=1, max_tokens_per_mb=48)
    results = []
    for fused in (True, False):
        trainer, forwards = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
        # No model runs in `inference`: the master sends no request for it (train_step runs it).
        assert not trainer.inference_computes(decoupled=True)
        batch = make_batch(groups)
        trainer.inference(batch, decoupled=True)
        assert batch.prox_from_train_forward and batch.prox_logprobs is None
        assert sum(forwards.values()) == 0  # the pass was saved
        if not fused:
            batch.prox_from_train_forward = False
            batch.prox_logprobs = trainer.compute_logprobs(trainer.actor.model, batch)
        results.append((trainer.train_step(batch), full_weights(trainer.actor.model)))
    (fused_stats, fused_weights), (separate_stats, separate_weights) = results
    for key in ("actor_loss", "clip_frac", "behav_imp_weight_mean", "approx_kl"):
        assert fused_stats[key] == pytest.approx(separate_stats[key], abs=1e-5), key
    for name, w in fused_weights.items():
        torch.testing.assert_close(w, separate_weights[name], atol=1e-5, rtol=1e-5)
    # The weights moved: the comparison is not between two untouched models.
    untouched, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
    assert any(not torch.equal(w, full_weights(untouched.actor.model)[n]) for n, w in fused_weights.items())


def test_proximal_logprobs_get_their_own_pass_with_several_minibatches_or_kl(tiny_llama_dir):
    torch.set_num_threads(1)
    groups = make_groups(6, 4, 2, (3, 5), (2, 5))
    for ppo in (
        PPOConfig(adv_estimator="grpo", group_size=2, ppo_n_minibatches=2),
        PPOConfig(adv_estimator="grpo", group_size=2, kl_ctl=0.1),
    ):
        trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
        assert trainer.inference_computes(decoupled=True)  # a stage of its own
        batch = make_batch(groups)
        trainer.inference(batch, decoupled=True)
        assert not batch.prox_from_train_forward and len(batch.prox_logprobs) == batch.n_seqs


def test_a_random_train_forward_keeps_its_proximal_pass_whatever_its_config_says(tiny_llama_dir):
    """Issue 24 item 5: whether the proximal logprobs may come from the train
    forward is decided from what the model does (a probe of two train
    forwards against an eval one), not from its config's key names: Llama's
    functional `attention_dropout` is noise; a key that merely says "dropout"
    (read by nothing) is not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.set_num_threads(1)

    def trainer_for(**overrides):
        config = AutoConfig.from_pretrained(tiny_llama_dir)
        for key, value in overrides.items():
            setattr(config, key, value)
        model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, config=config, dtype=torch.float32)
        optimized = make_optimized(model, 1e-3, 0.0, (0.9, 0.999), 1e-8, "constant", 0, 10)
        return PPOTrainer(optimized, PPOConfig(adv_estimator="grpo"), 1.0, torch.device("cpu"), 1.0)

    state = torch.random.get_rng_state()
    assert trainer_for()._deterministic_train_forward
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe leaves the RNG as it was
    assert not trainer_for(attention_dropout=0.5)._deterministic_train_forward
    assert trainer_for(summary_dropout_unused=0.5, jitter_note=1.0)._deterministic_train_forward


def _shared_prompt_groups() -> list[list[dict]]:
    # Short answers after one prompt per group (rows that share it pay), one
    # empty answer, and two groups with the same prompt (rows may mix them).
    groups = make_groups(7, 4, 4, (6, 9), (1, 4), shared_prompt=True)
    groups[0][2]["ids"], groups[0][2]["behav"] = groups[0][2]["ids"][: groups[0][2]["prompt_len"]], []
    prompt = groups[1][0]["ids"][: groups[1][0]["prompt_len"]]
    for s in groups[3]:
        s["ids"] = prompt + s["ids"][s["prompt_len"] :]
        s["prompt_len"] = len(prompt)
    return groups


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("algorithm,kl_ctl,n_minibatches", [("grpo", 0.0, 1), ("grpo", 0.1, 2), ("ppo", 0.0, 1)])
def test_shared_prompt_rows_train_exactly_like_separate_rows(tiny_llama_dir, attn, algorithm, kl_ctl, n_minibatches):
    # A prompt computed once for all of its answers (4-D mask, own positions)
    # must give the logprobs, values, stats and updated weights that one row
    # per sequence gives.
    from realrl.impl.ppo.packing import plan_micro_batches

    torch.set_num_threads(1)
    groups = _shared_prompt_groups()
    results = []
    for share in (True, False):
        ppo = PPOConfig(
            adv_estimator="gae" if algorithm == "ppo" else "grpo",
            group_size=4,
            kl_ctl=kl_ctl,
            ppo_n_minibatches=n_minibatches,
            max_tokens_per_mb=40,
            share_prompts=share,
        )
        trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"), attn_implementation=attn)
        batch = make_batch(groups)
        rows = [
            row for mb in plan_micro_batches(batch, list(range(batch.n_seqs)), 40, trainer._share_hidden) for row in mb
        ]
        assert max(map(len, rows)) == (8 if share else 1)  # groups 1 and 3 in one row
        batch = make_batch(groups)
        trainer.inference(batch, decoupled=True)
        logprobs = trainer.compute_logprobs(trainer.actor.model, batch)
        stats = trainer.train_step(batch)
        grads = {n: p.grad.clone() for n, p in trainer.actor.model.named_parameters()}  # the last minibatch's
        results.append((logprobs, batch.values, stats, grads))
    (logp, values, stats, grads), (logp_1, values_1, stats_1, grads_1) = results
    assert [len(x) for x in logp] == [len(x) for x in logp_1] and len(logp[2]) == 0
    for a, b in zip(logp, logp_1):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if algorithm == "ppo":
        for a, b in zip(values, values_1):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert stats.keys() == stats_1.keys()
    for key, value in stats.items():
        assert value == pytest.approx(stats_1[key], rel=1e-4, abs=1e-5), key
    assert abs(stats["actor_loss"]) > 1e-4
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_1[name], atol=1e-6, rtol=1e-4)
    assert sum(float(g.abs().sum()) for g in grads.values()) > 0


def test_prompts_are_shared_where_the_flop_estimate_says_it_pays():
    from realrl.impl.ppo.packing import share_prompt_rows

    def batch_of(prompt_len: int, answer_lens: list[int]):
        prompt = list(range(2, 2 + prompt_len))
        return make_batch(
            [
                [
                    {
                        "ids": prompt + [5] * n,
                        "prompt_len": prompt_len,
                        "behav": [-1.0] * n,
                        "reward": 0.0,
                        "no_eos": False,
                    }
                    for n in answer_lens
                ]
            ]
        )

    short = batch_of(200, [8] * 8)  # long prompt, short answers: one row
    assert share_prompt_rows(short, list(range(8)), 1024, 8192) == [list(range(8))]
    long = batch_of(16, [2000] * 8)  # short prompt, long answers: dense attention over 16k would cost more
    assert share_prompt_rows(long, list(range(8)), 1024, 8192 * 4) == [[i] for i in range(8)]
    assert share_prompt_rows(short, list(range(8)), 1024, 240) == [[0, 1, 2, 3], [4, 5, 6, 7]]  # row budget
    assert share_prompt_rows(short, list(range(8)), None, 8192) == [[i] for i in range(8)]  # sharing off
    mixed = make_batch(
        [
            [
                {"ids": [2, 3, 4, 5], "prompt_len": 3, "behav": [-1.0], "reward": 0.0, "no_eos": False},
                {"ids": [2, 3, 9, 5], "prompt_len": 3, "behav": [-1.0], "reward": 0.0, "no_eos": False},
                {"ids": [2, 3, 4, 6], "prompt_len": 3, "behav": [-1.0], "reward": 0.0, "no_eos": False},
            ]
        ]
    )
    assert share_prompt_rows(mixed, [0, 1, 2], 64, 8192) == [[0, 2], [1]]  # only identical prompts share


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_rows_side_by_side_train_exactly_like_separate_rows(tiny_llama_dir, attn, algorithm):
    # Shared rows of uneven widths go side by side in fewer rows (each keeps
    # its prompt, positions and mask): the logprobs, values, stats and
    # updated weights must be those of one row per sequence.
    from realrl.impl.ppo.packing import plan_micro_batches

    torch.set_num_threads(1)
    groups = make_groups(3, 8, 4, (5, 8), (1, 4), shared_prompt=True)
    for group in groups[:2]:  # two groups of long answers: the others' rows are half as wide
        for s in group:
            s["ids"] += s["ids"][s["prompt_len"] :] * 3
            s["behav"] = s["behav"] * 4
    results = []
    for share in (True, False):
        ppo = PPOConfig(adv_estimator="gae" if algorithm == "ppo" else "grpo", group_size=4, share_prompts=share)
        trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"), attn_implementation=attn)
        batch = make_batch(groups)
        (plan,) = plan_micro_batches(batch, list(range(batch.n_seqs)), 8192, trainer._share_hidden)
        packed = [row for row in plan if isinstance(row[0], list)]
        assert bool(packed) == share and all(len(block) == 4 for row in packed for block in row)
        trainer.inference(batch, decoupled=True)
        logprobs = trainer.compute_logprobs(trainer.actor.model, batch)
        stats = trainer.train_step(batch)
        grads = {n: p.grad.clone() for n, p in trainer.actor.model.named_parameters()}
        results.append((logprobs, batch.values, stats, grads))
    (logp, values, stats, grads), (logp_1, values_1, stats_1, grads_1) = results
    for a, b in zip(logp, logp_1):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if algorithm == "ppo":
        for a, b in zip(values, values_1):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for key, value in stats.items():
        assert value == pytest.approx(stats_1[key], rel=1e-4, abs=1e-5), key
    assert abs(stats["actor_loss"]) > 1e-4
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_1[name], atol=1e-6, rtol=1e-4)


def test_rows_go_side_by_side_only_where_the_flop_estimate_says_it_pays():
    from realrl.impl.ppo.packing import pack_rows

    assert pack_rows([40] * 8, 128, 8192) == [[j] for j in range(8)]  # even widths: nothing to fill
    assert pack_rows([50, 50, 25, 25, 24, 26], 128, 8192) == [[0], [1], [4, 5], [2, 3]]  # two narrow rows fill one
    assert pack_rows([50, 50, 25, 25, 24, 26], 128, 150) == [[j] for j in range(6)]  # the budget: 4 x 50 > 150
    assert pack_rows([3000, 1500, 1500], 128, 10**6) == [[0], [1, 2]]  # as wide as the widest: fewer rows
    assert pack_rows([1000, 900, 900], 128, 10**6) == [[0], [1], [2]]  # wider rows: attention would cost more
    assert pack_rows([], 128, 8192) == []


@pytest.mark.parametrize("arch,shares", [("gpt2", True), ("bloom", False), ("mistral-sliding", False)])
def test_shared_prompt_rows_only_for_models_that_give_them_the_same_outputs(arch, shares):
    # Learned absolute positions come from position_ids: shared rows are exact.
    # ALiBi (Bloom) builds its position bias from the 2-D mask, and a custom
    # mask would replace a sliding window: those train one sequence per row.
    from transformers import (
        BloomConfig,
        BloomForCausalLM,
        GPT2Config,
        GPT2LMHeadModel,
        MistralConfig,
        MistralForCausalLM,
    )

    from realrl.impl.ppo.trainer import PPOTrainer, make_optimized

    torch.manual_seed(0)
    model = {
        "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64)),
        "bloom": lambda: BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=2)),
        "mistral-sliding": lambda: MistralForCausalLM(
            MistralConfig(
                vocab_size=64,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                num_key_value_heads=2,
                sliding_window=8,
            )
        ),
    }[arch]()
    trainer = PPOTrainer(
        make_optimized(model, 1e-3, 0.0, (0.9, 0.999), 1e-8, "constant", 0, 10), PPOConfig(), 1.0, torch.device("cpu")
    )
    assert (trainer._share_hidden is not None) == shares
    # Either way a step trains: the logprobs it uses are those of separate rows.
    batch = make_batch(make_groups(3, 2, 3, (4, 6), (2, 4), shared_prompt=True))
    expected = PPOTrainer(
        make_optimized(model, 1e-3, 0.0, (0.9, 0.999), 1e-8, "constant", 0, 10),
        PPOConfig(share_prompts=False),
        1.0,
        torch.device("cpu"),
    ).compute_logprobs(model, batch)
    for a, b in zip(trainer.compute_logprobs(model, batch), expected):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_lr_schedule_ends_where_it_should_whatever_the_minibatches_take(tiny_llama_dir):
    """Issue 24 item 5: the schedule advances once per train step, so a
    linear decay over 3 steps reaches 0 at the third, also when a step runs
    fewer minibatches (2 groups) than ppo_n_minibatches (4)."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    optimized = make_optimized(model, 1e-3, 0.0, (0.9, 0.999), 1e-8, "linear", 0, 3)
    trainer = PPOTrainer(optimized, PPOConfig(adv_estimator="grpo", ppo_n_minibatches=4), 1.0, torch.device("cpu"), 1.0)
    stats = run_steps(trainer, make_groups(0, 2, 2, (3, 4), (2, 3)), 3)
    assert [round(s["lr"] / 1e-3, 6) for s in stats] == [round(2 / 3, 6), round(1 / 3, 6), 0.0]


def test_cosine_decays_to_its_minimum_and_holds_there(tiny_llama_dir):
    """`optimizer.min_lr_ratio`: the cosine schedule ends at min_lr_ratio x lr at the
    last train step (verl's min_lr_ratio), not at 0, and passes the midpoint halfway."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    optimized = make_optimized(model, 1e-3, 0.0, (0.9, 0.999), 1e-8, "cosine", 0, 4, min_lr_ratio=0.1)
    trainer = PPOTrainer(optimized, PPOConfig(adv_estimator="grpo"), 1.0, torch.device("cpu"), 1.0)
    stats = run_steps(trainer, make_groups(0, 2, 2, (3, 4), (2, 3)), 4)
    # the lr after each step (as the linear test above reads it): a quarter of the way down ... the minimum
    expected = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * k / 4)) for k in range(1, 5)]
    assert [round(s["lr"] / 1e-3, 6) for s in stats] == [round(e, 6) for e in expected]
    assert optimized.scheduler.get_last_lr()[0] == pytest.approx(1e-4)
