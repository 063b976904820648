"""The trainer and the sampling parameters each sequence records (docs/design.md
§5, §9): it recomputes logprobs at every sequence's own temperature, the
decoupled loss's behaviour weight π_prox/μ takes μ from the sampling logprobs
(the distribution the tokens were drawn from), and a sequence drawn without
filters trains exactly as before. The sequences come from a real torch server
over the same tiny model, one call per answer as an agent's chat calls make
them, each at its own temperature."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import torch

from realrl.api.cli_args import PPOConfig
from realrl.api.trajectory import Sampling, Trajectory
from realrl.impl.generation.client import GenerationClient
from realrl.impl.ppo.batch import SequenceBatch
from tests.impl.trainer_kit import build_trainer, full_weights

PROMPTS = [[0, 5, 9], [0, 7, 9, 11, 3], [0, 3, 3, 8, 20, 41], [0, 12, 30, 2]]
N_NEW = 12


def sample(url: str, calls: list[tuple[list[int], float, float]]) -> list:
    """One /generate per (prompt, temperature, top_p)."""

    async def go():
        async with GenerationClient(timeout_s=120) as client:
            params = [{"max_new_tokens": N_NEW, "temperature": t, "top_p": p, "ignore_eos": True} for _, t, p in calls]
            return await asyncio.gather(*(client.generate(url, c[0], q) for c, q in zip(calls, params)))

    return asyncio.run(go())


def trajectories(calls, results, record: bool) -> list[Trajectory]:
    """Two answers per trajectory (rewards 1, 0: a GRPO signal); `record`:
    with their sampling logprobs and parameters, else as before either existed."""
    out = []
    for k in range(0, len(calls), 2):
        pair = list(zip(calls[k : k + 2], results[k : k + 2]))
        out.append(
            Trajectory(
                qid=f"q{k}@0",
                task="math",
                birth_time=time.time(),
                input_ids=[np.asarray(c[0] + r.output_ids, dtype=np.int32) for c, r in pair],
                prompt_len=[len(c[0]) for c, _ in pair],
                logprobs=[np.asarray(r.output_logprobs, dtype=np.float32) for _, r in pair],
                versions=[np.zeros(N_NEW, dtype=np.int32)] * 2,
                version_start=[0, 0],
                version_end=[0, 0],
                reward=[1.0, 0.0],
                no_eos=[True, True],
                sampling_logprobs=[np.asarray(r.output_sampling_logprobs, dtype=np.float32) for _, r in pair]
                if record
                else [],
                sampling=[Sampling(c[1], top_p=c[2]) for c, _ in pair] if record else [],
            ).validate()
        )
    return out


def test_a_per_call_temperature_trains_with_exact_prox_behaviour_alignment(shared_server, tiny_llama_dir):
    torch.set_num_threads(1)
    calls = [(PROMPTS[0], 0.5, 0.8), (PROMPTS[1], 1.6, 0.8), (PROMPTS[2], 1.0, 1.0), (PROMPTS[3], 0.7, 0.6)]
    results = sample(shared_server.url, calls)
    ppo = PPOConfig(adv_estimator="grpo", group_size=2, ppo_n_minibatches=2)  # a proximal pass of its own
    trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))  # the run's temperature: 1.0

    batch = SequenceBatch.from_trajectories(trajectories(calls, results, record=True))
    trainer.inference(batch, decoupled=True)
    # Same weights, each sequence at its own temperature: π_prox is the server's unfiltered π_behav.
    for prox, behav in zip(batch.prox_logprobs, batch.behav_logprobs):
        torch.testing.assert_close(prox, behav, atol=1e-4, rtol=0)
    # At the run's one temperature (all a trainer could do before) they part for every call at another.
    unrecorded = SequenceBatch.from_trajectories(trajectories(calls, results, record=False))
    trainer.inference(unrecorded, decoupled=True)
    gaps = [float((p - b).abs().max()) for p, b in zip(unrecorded.prox_logprobs, unrecorded.behav_logprobs)]
    assert gaps[2] < 1e-4 and min(gaps[0], gaps[1], gaps[3]) > 0.05, gaps

    # The behaviour weight is π_prox / μ with μ the distribution sampled from: with π_prox = π_behav,
    # per token the probability mass top-p kept (1 where nothing was filtered).
    expected = torch.cat([(b - s).exp() for b, s in zip(batch.behav_logprobs, batch.sampling_logprobs)])
    assert float(expected.min()) < 0.9  # top-p cut real mass
    stats = trainer.train_step(batch)
    assert stats["behav_imp_weight_mean"] == pytest.approx(float(expected.mean()), abs=1e-4)
    assert stats["behav_imp_weight_min"] == pytest.approx(float(expected.min()), abs=1e-4)
    assert stats["behav_imp_weight_max"] == pytest.approx(1.0, abs=1e-4)  # the call with top_p = 1


def test_top_p_1_changes_nothing(shared_server, tiny_llama_dir):
    """Sequences drawn without filters at the run's temperature, with their
    sampling logprobs and parameters recorded, train bit for bit as the same
    sequences without them (the behaviour before either existed)."""
    torch.set_num_threads(1)
    calls = [(p, 1.0, 1.0) for p in PROMPTS]
    results = sample(shared_server.url, calls)
    assert all(r.output_sampling_logprobs == r.output_logprobs for r in results)  # the server: equal floats
    ppo = PPOConfig(adv_estimator="grpo", group_size=2, ppo_n_minibatches=2)
    outcomes = []
    for record in (True, False):
        trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
        batch = SequenceBatch.from_trajectories(trajectories(calls, results, record))
        assert (batch.temperatures is not None) == record
        trainer.inference(batch, decoupled=True)
        outcomes.append((batch.prox_logprobs, trainer.train_step(batch), full_weights(trainer.actor.model)))
    (prox, stats, weights), (prox_before, stats_before, weights_before) = outcomes
    assert all(torch.equal(a, b) for a, b in zip(prox, prox_before))
    assert stats == stats_before
    assert all(torch.equal(w, weights_before[name]) for name, w in weights.items())
    untouched, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
    assert any(not torch.equal(w, full_weights(untouched.actor.model)[n]) for n, w in weights.items())


def test_without_decoupling_the_old_policy_is_the_unfiltered_one(shared_server, tiny_llama_dir):
    """Standard PPO (no proximal pass): the ratio's old policy is the
    unfiltered behaviour logprob and the weight exactly 1, whatever top-p cut."""
    torch.set_num_threads(1)
    calls = [(p, 1.0, 0.6) for p in PROMPTS]
    results = sample(shared_server.url, calls)
    ppo = PPOConfig(adv_estimator="grpo", group_size=2, ppo_n_minibatches=2, use_decoupled_loss=False)
    trainer, _ = build_trainer(tiny_llama_dir, ppo, torch.device("cpu"))
    batch = SequenceBatch.from_trajectories(trajectories(calls, results, record=True))
    trainer.inference(batch, decoupled=False)
    stats = trainer.train_step(batch)
    assert stats["behav_imp_weight_mean"] == stats["behav_imp_weight_min"] == stats["behav_imp_weight_max"] == 1.0
    assert any(not torch.equal(s, b) for s, b in zip(batch.sampling_logprobs, batch.behav_logprobs))


def test_trajectories_from_results_keep_what_each_sequence_was_sampled_with():
    from realrl.api.agent_api import PromptRecord
    from realrl.api.generation_api import GenerationResult

    def result(sampling, sampling_logprobs):
        return GenerationResult("q", [1, 2], [[3, 4]], [[-1.0, -2.0]], [[0, 0]], [False], [0], [0],
                                sampling_logprobs, sampling)  # fmt: skip

    prompt = PromptRecord("q", "p", [1, 2], [])
    traj = Trajectory.from_results(
        prompt, [result(Sampling(0.5, top_p=0.9), [[-0.5, -1.0]]), result(Sampling(1.0), None)], [0, 1], [0, 1]
    )
    assert traj.sampling == [Sampling(0.5, top_p=0.9), Sampling(1.0)]
    assert [x.tolist() for x in traj.sampling_logprobs] == [[-0.5, -1.0], [-1.0, -2.0]]
    plain = Trajectory.from_results(prompt, [result(None, None)], [0], [0])
    assert plain.sampling == [] and plain.sampling_logprobs == []  # nothing recorded, nothing filtered
    mixed = [result(Sampling(1.0), None), result(None, None)]
    with pytest.raises(ValueError, match="some results record their sampling parameters"):
        Trajectory.from_results(prompt, mixed, [0, 1], [0, 1])
