"""A trial sampling from a nucleus (top_p < 1), end to end: the decoupled
loss's behaviour weight π_prox/μ takes μ from the servers' sampling logprobs,
so it sits below 1 by the probability mass top-p cut (docs/design.md §9)."""

from __future__ import annotations

from tests.e2e.test_async_ppo import run


def test_a_nucleus_trial_weights_by_the_distribution_it_sampled(tmp_path, kit_cache):
    steps = 4
    _, summary, stats = run(
        tmp_path,
        kit_cache,
        "nucleus",
        f"total_train_steps={steps}",
        "eval.every_n_steps=0",
        "eval.max_prompts=16",
        "rollout.gconfig.top_p=0.7",
        "ppo.ppo_n_minibatches=2",  # a proximal pass of its own: π_prox is the behaviour weights' own policy
        "rollout.max_head_offpolicyness=0",  # ... and the behaviour weights are the proximal ones
    )
    assert summary["steps"] == steps
    train = [s for s in stats if "train/behav_imp_weight_mean" in s]
    assert len(train) == steps
    # π_prox = π_behav (η = 0, same weights): the weight is the kept mass per token, <= 1, < 1 on average.
    assert all(s["train/behav_imp_weight_max"] <= 1.0 + 1e-3 for s in train), train
    assert all(s["train/behav_imp_weight_mean"] < 0.99 for s in train), train
    t = summary["trajectories"]
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
