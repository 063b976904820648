"""The RL algorithms of realrl as plain, stateless tensor functions.

Everything the PPO / GRPO trainer computes that is "math" rather than "model
plumbing" lives here, one function per idea with its formula in its
docstring, so each can be read and unit tested on hand-computed numbers.
(Log-probabilities from logits are in `realrl.impl.ppo.logprobs`.)

The file is laid out by kind; a new algorithm is one more short function
beside its kind, with the same arguments and results:

- masked statistics: `masked_sum/mean/var/whiten`;
- rewards: from a sequence's score to per-token rewards;
- KL to the reference model: per-token estimators and the reward penalty;
- advantage estimators: rewards (and values) -> advantages. Per-sequence
  estimators take [N] rewards in consecutive groups (`group_size` answers per
  prompt) and return [N]; per-token ones take [B, T] and return [B, T];
- loss aggregation: a [B, T] per-token loss -> a scalar (`aggregate_loss`);
- policy losses: (logp, prox_logp, A) [B, T] -> (per-token loss, clipped,
  dual_clipped), before behaviour correction and aggregation;
- behaviour correction: the importance weight of the proximal policy over
  the (stale) behaviour policy, and which tokens it keeps;
- the value loss.

`decoupled_ppo_actor_loss` composes a policy loss, the behaviour correction
and the aggregation, and reports the step's statistics.

Data layout
-----------
Per-token tensors are padded 2-D tensors of shape [B, T] (B sequences of a
micro-batch, T = the longest one), already aligned with the *predicted* token
positions: entry [b, t] belongs to the token `labels[b, t]` that the model
predicted from the logits at [b, t] (the trainer shifts logits/labels before
calling in here). `loss_mask` [B, T] is 1.0 on completion tokens that are
trained and 0.0 on prompt tokens and padding. Masks are applied explicitly
with `torch.where`, so garbage (even inf/nan) at masked positions never leaks
into a result.

Recipes
-------
PPO (with a critic)::

    token_rewards = reward_to_token_rewards(shape_reward(r, bias, scale), loss_mask)
    token_rewards = apply_kl_to_rewards(token_rewards, behav_logp, ref_logp, loss_mask, kl_ctl)
    bootstrap = torch.where(no_eos, last_token_values(values, loss_mask), 0.0)
    adv, returns = gae_advantages(token_rewards, values, loss_mask, gamma, lam, bootstrap)
    adv = masked_whiten(adv, loss_mask)

GRPO (no critic)::

    seq_adv = group_normalized_advantages(r, group_size)
    token_rewards = reward_to_token_rewards(seq_adv, loss_mask)
    token_rewards = apply_kl_to_rewards(...)        # optional
    adv, _ = gae_advantages(token_rewards, torch.zeros_like(token_rewards),
                            loss_mask, gamma=1.0, lam=1.0)
    # without KL, every completion token of a sequence gets its sequence's advantage

Actor loss (decoupled PPO, AReaL): `decoupled_ppo_actor_loss`; passing the
behaviour log-probs as the proximal ones gives standard PPO exactly.

Micro-batches: losses take a `normalizer` (total valid tokens, or sequences,
of the whole batch), so summing the micro-batch losses, and their gradients,
gives exactly the whole-batch loss.
"""

from __future__ import annotations

from typing import Literal

import torch

# ---------------------------------------------------------------------------
# Masked statistics
# ---------------------------------------------------------------------------


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """sum(x * mask) over `dim` (all dims if None).

    `mask` is read as boolean (nonzero = valid); masked entries contribute 0
    even if they hold inf/nan.
    """
    masked = torch.where(mask.bool(), x, torch.zeros_like(x))
    if dim is None:
        return masked.sum()
    return masked.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """sum(x * mask) / sum(mask) over `dim` (all dims if None); 0 where the mask is empty.

    `mask` is read as boolean (nonzero = valid).
    """
    numerator = masked_sum(x, mask, dim)
    count = masked_sum(torch.ones_like(x), mask, dim)
    return numerator / count.clamp(min=1.0)


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = False) -> torch.Tensor:
    """Variance of the masked entries of x (over all dims).

    var = sum(mask * (x - mean)^2) / (n - 1 if unbiased else n)
    """
    mean = masked_mean(x, mask)
    count = mask.bool().sum().to(torch.float32)
    sq_dev = masked_sum((x - mean) ** 2, mask)
    denom = count - 1.0 if unbiased else count
    return sq_dev / denom.clamp(min=1.0)


def masked_whiten(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-5,
    shift_mean: bool = True,
    process_group: torch.distributed.ProcessGroup | None = None,
) -> torch.Tensor:
    """Normalise the masked entries of x to zero mean and unit variance.

        y = (x - mean) / sqrt(var + eps)        (mean kept if shift_mean=False)

    mean and (population) var are taken over all masked entries. With a
    `process_group`, they are taken over the masked entries of every rank of
    that group (one all-reduce each), so data-parallel ranks whiten the batch
    as one. Masked-out entries of the result are 0.
    """
    valid = mask.bool()
    x32 = x.float()
    total = torch.stack([masked_sum(x32, valid), valid.sum().to(torch.float32)])
    if process_group is not None:
        torch.distributed.all_reduce(total, group=process_group)
    mean = total[0] / total[1].clamp(min=1.0)
    sq_dev = masked_sum((x32 - mean) ** 2, valid).reshape(1)
    if process_group is not None:
        torch.distributed.all_reduce(sq_dev, group=process_group)
    var = sq_dev[0] / total[1].clamp(min=1.0)
    whitened = (x32 - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(valid, whitened, torch.zeros_like(whitened)).to(x.dtype)


# ---------------------------------------------------------------------------
# Rewards
# ---------------------------------------------------------------------------


def shape_reward(r, bias: float, scaling: float):
    """The legacy math-reward mapping: ((r - 0.5) * 2 - bias) * scaling.

    A 0/1 correctness score becomes -1/+1 before the bias and scale, e.g.
    bias=0, scaling=1 maps {0, 1} -> {-1, +1}. Works on floats and tensors.
    """
    return ((r - 0.5) * 2.0 - bias) * scaling


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the last position where mask[b] is nonzero (-1 if none)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values


def last_token_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] values[b, last valid t] (0 for a sequence with no valid token).

    The usual bootstrap for a truncated (no_eos) sequence in `gae_advantages`.
    """
    last = last_valid_index(mask)
    picked = values.gather(-1, last.clamp(min=0)[:, None]).squeeze(-1)
    return torch.where(last >= 0, picked, torch.zeros_like(picked))


def reward_to_token_rewards(seq_rewards: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence's reward on its last completion token.

        token_rewards[b, t] = seq_rewards[b] if t == last t with loss_mask[b, t] else 0

    Args:
        seq_rewards: [B].
        loss_mask: [B, T].
    Returns:
        [B, T] float32 (rows without any valid token are all zero).
    """
    last = last_valid_index(loss_mask)
    token_rewards = torch.zeros(loss_mask.shape, dtype=torch.float32, device=loss_mask.device)
    has_token = last >= 0
    rows = torch.arange(loss_mask.shape[0], device=loss_mask.device)[has_token]
    token_rewards[rows, last[has_token]] = seq_rewards[has_token].to(torch.float32)
    return token_rewards


def broadcast_to_tokens(seq_values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, T]: every valid token of sequence b gets seq_values[b], others 0."""
    full = seq_values.to(torch.float32)[:, None].expand(loss_mask.shape)
    return torch.where(loss_mask.bool(), full, torch.zeros_like(full))


# ---------------------------------------------------------------------------
# KL to the reference model
# ---------------------------------------------------------------------------

KLKind = Literal["k1", "k2", "k3", "abs"]


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: KLKind = "k1") -> torch.Tensor:
    """Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi.

    With log_ratio = logp - ref_logp (Schulman, "Approximating KL divergence"):
        k1  = log_ratio                          unbiased, can be negative
        k2  = 0.5 * log_ratio^2                  biased, low variance, >= 0
        k3  = exp(-log_ratio) - 1 + log_ratio    unbiased, low variance, >= 0
        abs = |log_ratio|
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; expected k1, k2, k3 or abs")


def apply_kl_to_rewards(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_ctl: float,
    kind: KLKind = "k1",
) -> torch.Tensor:
    """Subtract the KL penalty from per-token rewards (no gradient flows).

        r'[b, t] = (r[b, t] - kl_ctl * KL_kind[b, t]) * mask[b, t]

    `logprobs` are those of the policy that sampled the tokens (behaviour or
    proximal log-probs).
    """
    kl = kl_penalty(logprobs.detach(), ref_logprobs.detach(), kind)
    shaped = token_rewards.float() - kl_ctl * kl
    return torch.where(mask.bool(), shaped, torch.zeros_like(shaped))


# ---------------------------------------------------------------------------
# Advantage estimators
# ---------------------------------------------------------------------------


def group_normalized_advantages(
    rewards: torch.Tensor,
    group_size: int,
    eps: float = 1e-5,
    std_normalize: bool = True,
    unbiased_std: bool = True,
) -> torch.Tensor:
    """GRPO advantages: each reward normalised within its group of answers.

        A_i = (r_i - mean_group) / (std_group + eps)     (std_normalize=True)
        A_i =  r_i - mean_group                          (std_normalize=False, "Dr. GRPO")

    `rewards` holds consecutive groups: rewards[k*group_size:(k+1)*group_size]
    are the answers to prompt k. std is Bessel-corrected by default (like
    torch.std); a group of size 1 has std 0.

    A group whose rewards are all equal (all right or all wrong) has no
    learning signal: its advantages are exactly 0 (not (r - mean)/eps, which
    would amplify float round-off).

    Args:
        rewards: [N], N a multiple of group_size.
    Returns:
        [N] float32 advantages.
    """
    if rewards.numel() % group_size != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    grouped = rewards.to(torch.float32).view(-1, group_size)
    centered = grouped - grouped.mean(dim=-1, keepdim=True)
    all_equal = grouped.max(dim=-1, keepdim=True).values == grouped.min(dim=-1, keepdim=True).values
    centered = torch.where(all_equal, torch.zeros_like(centered), centered)
    if std_normalize:
        if group_size > 1:
            std = grouped.std(dim=-1, keepdim=True, unbiased=unbiased_std)
        else:
            std = torch.zeros_like(centered)
        centered = centered / (std + eps)
    return centered.view(-1)


@torch.no_grad()
def gae_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    bootstrap_values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the valid tokens of each sequence.

    Walking backwards over the valid tokens t of a sequence, with t' the next
    valid token:

        delta_t = r_t + gamma * V_{t'} - V_t
        A_t     = delta_t + gamma * lam * A_{t'}
        returns_t = A_t + V_t

    After the last valid token V_{t'} = bootstrap_values[b] (0 by default: the
    episode ended at EOS) and A_{t'} = 0. For a truncated (no_eos) sequence
    pass the value of its last token (see `last_token_values`) as its
    bootstrap. Positions with mask == 0 are skipped (the recursion jumps over
    them) and get advantage and return 0.

    Args:
        rewards, values, mask: [B, T].
        bootstrap_values: optional [B].
    Returns:
        (advantages [B, T], returns [B, T]), float32, no gradient.
    """
    batch_size, seq_len = rewards.shape
    valid = mask.bool()
    rewards = rewards.float()
    values = values.float()
    next_value = (
        torch.zeros(batch_size, device=rewards.device) if bootstrap_values is None else bootstrap_values.float().clone()
    )
    next_advantage = torch.zeros(batch_size, device=rewards.device)
    advantages = torch.zeros_like(rewards)
    for t in reversed(range(seq_len)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        is_valid = valid[:, t]
        advantages[:, t] = torch.where(is_valid, advantage, torch.zeros_like(advantage))
        # carry the recursion only through valid tokens
        next_value = torch.where(is_valid, values[:, t], next_value)
        next_advantage = torch.where(is_valid, advantage, next_advantage)
    returns = torch.where(valid, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


# ---------------------------------------------------------------------------
# Loss aggregation
# ---------------------------------------------------------------------------

Aggregation = Literal["token", "seq"]


def aggregate_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    aggregation: Aggregation = "token",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar.

    token: sum over valid tokens / normalizer, normalizer = number of valid
           tokens (DAPO-style token-level loss; long answers weigh more).
    seq:   sum over sequences of (mean over that sequence's valid tokens)
           / normalizer, normalizer = number of sequences with a valid token.

    Pass `normalizer` = the count over the *whole batch* (valid tokens for
    "token", sequences for "seq") when the batch is split into micro-batches:
    the sum of the micro-batch losses is then exactly the whole-batch loss.
    """
    valid = loss_mask.bool()
    if aggregation == "token":
        total = masked_sum(per_token_loss, valid)
        default_normalizer = valid.sum()
    elif aggregation == "seq":
        tokens_per_seq = valid.sum(dim=-1)
        seq_sums = masked_sum(per_token_loss, valid, dim=-1)
        total = (seq_sums / tokens_per_seq.clamp(min=1)).sum()
        default_normalizer = (tokens_per_seq > 0).sum()
    else:
        raise ValueError(f"unknown aggregation {aggregation!r}; expected 'token' or 'seq'")
    if normalizer is None:
        normalizer = default_normalizer.clamp(min=1)
    return total / normalizer


# ---------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------
# Each takes [B, T] fp32 tensors: the current policy's log-probs (the only
# input with gradient), the proximal policy's and the advantages, and returns
# (per-token loss, clipped, dual_clipped): the loss before the behaviour
# correction and the aggregation, and the tokens each clip acted on (stats).


def ppo_clip_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    c_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate (Schulman et al. 2017), with the dual clip
    (Ye et al. 2020) for negative advantages, per token:

        ratio  = exp(logp - prox_logp)
        L_clip = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps))
        L      = min(L_clip, -c_clip * A)   where A < 0   (dual clip, if c_clip)
    """
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip must be > 1, got {c_clip}")
    ratio = torch.exp(logprobs - proximal_logprobs)
    clipped_ratio = ratio.clamp(1.0 - eps_clip, 1.0 + eps_clip)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * clipped_ratio
    pg_loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    if c_clip is None:
        return pg_loss, clipped, torch.zeros_like(clipped)
    loss_dual = -advantages * c_clip
    dual_clipped = (advantages < 0) & (loss_dual < pg_loss)
    return torch.where(dual_clipped, loss_dual, pg_loss), clipped, dual_clipped


# ---------------------------------------------------------------------------
# Behaviour correction
# ---------------------------------------------------------------------------


def behav_imp_weight(
    proximal_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decoupled PPO's behaviour importance weight (AReaL), per token:

        w       = exp(prox_logp - behav_logp)
        trained = loss_mask and (w <= cap)              (cap None: every valid token)

    The behaviour policy (the possibly stale weights that sampled the tokens)
    is corrected towards the proximal one; tokens whose weight exceeds the
    cap are dropped. Returns (w, trained), both [B, T].
    """
    weight = torch.exp(proximal_logprobs - behav_logprobs)
    valid = loss_mask.bool()
    if cap is None:
        return weight, valid
    return weight, valid & (weight <= cap)


# ---------------------------------------------------------------------------
# The actor loss
# ---------------------------------------------------------------------------


def decoupled_ppo_actor_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float,
    behav_imp_weight_cap: float | None = None,
    c_clip: float | None = None,
    aggregation: Aggregation = "token",
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Decoupled PPO policy loss (AReaL), per token:

        L    = ppo_clip_loss(logp, prox_logp, A, eps, c_clip)   (gradient through logp only)
        w    = behav_imp_weight(prox_logp, behav_logp)          (no gradient)
        loss = w * L,   with w * L := 0 where w > behav_imp_weight_cap

    then aggregated. The proximal policy (weights at the start of this train
    step) anchors the trust region; the behaviour policy is corrected by
    importance weighting. Passing the behaviour log-probs as
    `proximal_logprobs` makes w == 1 exactly: this is then standard PPO with
    ratio = exp(logp - behav_logp).

    Tokens masked by the cap still count in the normalizer (they contribute
    0), so the normalizer depends on loss_mask only and micro-batches add up.

    Args:
        logprobs: [B, T] log pi_theta(token), with gradient.
        proximal_logprobs, behav_logprobs: [B, T] (detached here).
        advantages: [B, T] (detached here).
        loss_mask: [B, T] 1 on trained tokens.
        eps_clip: PPO clip range eps.
        behav_imp_weight_cap: drop tokens whose w exceeds this (None: keep all).
        c_clip: dual-clip constant (> 1) for negative advantages (None: off).
        aggregation, normalizer: see `aggregate_loss`.

    Returns:
        (scalar loss, stats) with stats over this micro-batch's valid tokens:
        clip_frac, dual_clip_frac (over tokens kept after the cap),
        behav_imp_weight_mean/max/min (before the cap), behav_capped_frac,
        approx_kl (k3 estimate of KL(prox || theta)), ratio_mean, n_tokens.
    """
    proximal_logprobs = proximal_logprobs.detach().float()
    behav_logprobs = behav_logprobs.detach().float()
    advantages = advantages.detach().float()
    valid = loss_mask.bool()

    pg_loss, clipped, dual_clipped = ppo_clip_loss(logprobs.float(), proximal_logprobs, advantages, eps_clip, c_clip)
    weight, trained = behav_imp_weight(proximal_logprobs, behav_logprobs, valid, behav_imp_weight_cap)
    per_token_loss = torch.where(trained, pg_loss * weight, torch.zeros_like(pg_loss))
    loss = aggregate_loss(per_token_loss, valid, aggregation, normalizer)

    with torch.no_grad():
        log_ratio = logprobs.detach().float() - proximal_logprobs
        n_tokens = valid.sum()
        n_trained = trained.sum().clamp(min=1)
        inf = torch.tensor(float("inf"), device=log_ratio.device)
        stats_tensor = torch.stack(
            [
                (clipped & trained).sum() / n_trained,
                (dual_clipped & trained).sum() / n_trained,
                masked_mean(weight, valid),
                torch.where(valid, weight, -inf).max() if valid.numel() else -inf,
                torch.where(valid, weight, inf).min() if valid.numel() else inf,
                (valid & ~trained).sum() / n_tokens.clamp(min=1),
                masked_mean(torch.expm1(-log_ratio) + log_ratio, valid),
                masked_mean(torch.exp(log_ratio), valid),
                n_tokens.float(),
            ]
        ).tolist()
    names = [
        "clip_frac",
        "dual_clip_frac",
        "behav_imp_weight_mean",
        "behav_imp_weight_max",
        "behav_imp_weight_min",
        "behav_capped_frac",
        "approx_kl",
        "ratio_mean",
        "n_tokens",
    ]
    stats = dict(zip(names, stats_tensor))
    if stats["n_tokens"] == 0:
        stats["behav_imp_weight_max"] = 0.0
        stats["behav_imp_weight_min"] = 0.0
    return loss, stats


# ---------------------------------------------------------------------------
# The value loss
# ---------------------------------------------------------------------------


def critic_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    value_eps_clip: float | None,
    aggregation: Aggregation = "token",
    normalizer: float | torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss, per token:

        V_clip = V_old + clip(V - V_old, -eps, eps)
        loss   = 0.5 * max((V - R)^2, (V_clip - R)^2)

    (value_eps_clip=None: loss = 0.5 * (V - R)^2). Gradient flows through
    `values` only.

    Returns:
        (scalar loss, stats): clip_frac (tokens where the clipped term is the
        larger one), value_mean, returns_mean, n_tokens.
    """
    old_values = old_values.detach().float()
    returns = returns.detach().float()
    values = values.float()
    valid = loss_mask.bool()
    loss_unclipped = (values - returns).square()
    if value_eps_clip is not None:
        values_clipped = old_values + (values - old_values).clamp(-value_eps_clip, value_eps_clip)
        loss_clipped = (values_clipped - returns).square()
        per_token_loss = 0.5 * torch.maximum(loss_unclipped, loss_clipped)
        clipped = loss_clipped > loss_unclipped
    else:
        per_token_loss = 0.5 * loss_unclipped
        clipped = torch.zeros_like(valid)
    loss = aggregate_loss(per_token_loss, valid, aggregation, normalizer)

    with torch.no_grad():
        n_tokens = valid.sum()
        stats_tensor = torch.stack(
            [
                (clipped & valid).sum() / n_tokens.clamp(min=1),
                masked_mean(values, valid),
                masked_mean(returns, valid),
                n_tokens.float(),
            ]
        ).tolist()
    stats = dict(zip(["clip_frac", "value_mean", "returns_mean", "n_tokens"], stats_tensor))
    return loss, stats
