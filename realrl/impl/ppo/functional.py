"""The RL algorithms of realrl as plain, stateless tensor functions
(docs/algorithms.md has the formulas and their papers).

Everything the trainer computes that is "math" rather than "model plumbing"
lives here, one function per idea with its formula in its docstring, so each
can be read and unit tested on hand-computed numbers. (Log-probabilities
from logits are in `realrl.impl.ppo.logprobs`.)

(Over 700 lines on purpose: the whole menu -- estimators, policy losses,
aggregations, corrections -- side by side, each a short function with its
paper's formula, so an algorithm reads as one screen of its kind.)

The file is laid out by kind; a new algorithm is one more short function
beside its kind, with the same arguments and results:

- masked statistics: `masked_sum/mean/var/whiten`;
- rewards: from a sequence's score to per-token rewards, DAPO's
  `overlong_penalty`;
- KL to the reference model: per-token estimators (k1, k2, k3, low-var, abs)
  and the reward penalty;
- advantage estimators: rewards (and values) -> advantages. Per-sequence
  estimators (`group_normalized_advantages` for grpo / dr_grpo,
  `rloo_advantages`) take [N] rewards in consecutive groups (`group_size`
  answers per prompt) and return [N]; per-token ones (`gae_advantages`,
  `discounted_returns` for reinforce_plus_plus) take [B, T] and return [B, T];
- loss aggregation: a [B, T] per-token loss -> a scalar (`aggregate_loss`,
  verl's four `loss_agg_mode`s, exact over micro-batches and ranks);
- policy losses (`ppo_clip_loss`, `gspo_loss`, `cispo_loss`): (logp,
  prox_logp, A) [B, T] -> (per-token loss, {mechanism: clipped tokens}),
  before behaviour correction and aggregation;
- behaviour correction: the importance weight of the proximal policy over
  the (stale) behaviour policy, truncated or masked per token or sequence,
  and its effective sample size;
- the value loss.

`decoupled_ppo_actor_loss` composes a policy loss, the behaviour correction,
the aggregation and the KL and entropy terms, and reports the step's
statistics.

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
    adv, returns = gae_advantages(token_rewards, values, loss_mask, gamma, lam)   # the answer is terminal
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

Micro-batches: losses take a `normalizer` (total trained tokens, or
sequences, of the whole batch: `loss_agg_count` summed), so summing the
micro-batch losses, and their gradients, gives exactly the whole-batch loss.
"""

from __future__ import annotations

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


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, eq. 13), per answer of
    |y| tokens, budget L_max = `max_len`, buffer L_cache = `buffer_len`:

        R(y) = 0                                   |y| <= L_max - L_cache
        R(y) = ((L_max - L_cache) - |y|) / L_cache  L_max - L_cache < |y| <= L_max
        R(y) = -1                                  |y| > L_max

    added to the reward (times `ppo.overlong_penalty_factor`). [N] -> [N].
    """
    start = max_len - buffer_len
    penalty = (start - lengths.float()) / buffer_len
    penalty = torch.where(lengths.float() <= start, torch.zeros_like(penalty), penalty)
    return torch.where(lengths.float() > max_len, torch.full_like(penalty, -1.0), penalty)


def last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """[B] index of the last position where mask[b] is nonzero (-1 if none)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.full_like(positions, -1)).max(dim=-1).values


def last_token_values(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] values[b, last valid t] (0 for a sequence with no valid token).

    A bootstrap for `gae_advantages` where an episode goes on after the sequence
    (the trainer's scored answers are terminal and take none).
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

KL_ESTIMATORS = ("k1", "k2", "k3", "low-var", "abs")


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1") -> torch.Tensor:
    """Per-token estimators of KL(pi || pi_ref) from tokens sampled from pi.

    With log_ratio = logp - ref_logp (Schulman, "Approximating KL divergence"):
        k1      = log_ratio                          unbiased, can be negative
        k2      = 0.5 * log_ratio^2                  biased, low variance, >= 0
        k3      = exp(-log_ratio) - 1 + log_ratio    unbiased, low variance, >= 0
        low-var = min(k3, 10), log_ratio clamped to [-20, 20]   (verl's low_var_kl)
        abs     = |log_ratio|

    Differentiable in `logprobs`: as a loss term (`ppo.use_kl_loss`) its
    gradient is the estimator's (k2's is that of the true KL's sampled form,
    E[log_ratio * grad logp]; k1's is grad logp, whose expectation is 0).
    """
    log_ratio = logprobs.float() - ref_logprobs.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio.square()
    if kind == "k3":
        return torch.expm1(-log_ratio) + log_ratio
    if kind == "low-var":
        log_ratio = log_ratio.clamp(-20.0, 20.0)
        return (torch.expm1(-log_ratio) + log_ratio).clamp(max=10.0)
    if kind == "abs":
        return log_ratio.abs()
    raise ValueError(f"unknown KL estimator {kind!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def apply_kl_to_rewards(
    token_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    mask: torch.Tensor,
    kl_ctl: float,
    kind: str = "k1",
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


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """RLOO (Kool et al. 2019; Ahmadian et al. 2024): each answer's baseline is
    the mean reward of the *other* answers to its prompt,

        A_i = r_i - (1 / (G - 1)) * sum_{j != i} r_j  =  G / (G - 1) * (r_i - mean_group)

    `rewards`: [N] in consecutive groups of `group_size` (>= 2). Returns [N].
    """
    if group_size < 2 or rewards.numel() % group_size != 0:
        raise ValueError(f"RLOO needs groups of >= 2 answers; {rewards.numel()} rewards, group_size {group_size}")
    grouped = rewards.to(torch.float32).view(-1, group_size)
    others_mean = (grouped.sum(dim=-1, keepdim=True) - grouped) / (group_size - 1)
    return (grouped - others_mean).view(-1)


def discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{t' >= t} gamma^(t' - t) r_t' over each sequence's trained tokens
    (`gae_advantages` with V = 0 and lambda = 1). [B, T] -> [B, T]."""
    advantages, _ = gae_advantages(
        token_rewards, torch.zeros_like(token_rewards, dtype=torch.float32), mask, gamma, 1.0
    )
    return advantages


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

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def loss_agg_count(loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """This micro-batch's share of `aggregate_loss`'s normaliser: its trained
    tokens (token-mean), else its sequences with at least one trained token.
    The trainer sums it over the micro-batches of a minibatch and over ranks."""
    valid = loss_mask.bool()
    if mode == "token-mean":
        return valid.sum()
    return (valid.sum(dim=-1) > 0).sum()


def aggregate_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_len: float = 1.0,
) -> torch.Tensor:
    """Reduce a [B, T] per-token loss to a scalar (verl's `loss_agg_mode`).

    With l_bt the loss of trained token t of sequence b, n_b its trained
    tokens, N_tok / N_seq the trained tokens / sequences of the whole batch:

        token-mean               sum_b sum_t l_bt / N_tok           (DAPO: long answers weigh more)
        seq-mean-token-mean      sum_b (sum_t l_bt / n_b) / N_seq   (GRPO's original form)
        seq-mean-token-sum       sum_b sum_t l_bt / N_seq
        seq-mean-token-sum-norm  sum_b sum_t l_bt / (N_seq * max_len)   (Dr. GRPO: a constant length)

    `max_len` is that constant (the generation budget, max_new_tokens).
    Pass `normalizer` = N_tok or N_seq of the *whole batch* (all micro-batches
    and ranks, `loss_agg_count` summed) when the batch is split: the sum of the
    parts' losses and gradients is then exactly the whole batch's.
    """
    valid = loss_mask.bool()
    seq_sums = masked_sum(per_token_loss, valid, dim=-1)
    if mode == "token-mean" or mode == "seq-mean-token-sum":
        total = seq_sums.sum()
    elif mode == "seq-mean-token-mean":
        total = (seq_sums / valid.sum(dim=-1).clamp(min=1)).sum()
    elif mode == "seq-mean-token-sum-norm":
        total = seq_sums.sum() / max_len
    else:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; expected one of {', '.join(LOSS_AGG_MODES)}")
    if normalizer is None:
        normalizer = loss_agg_count(valid, mode).clamp(min=1)
    return total / normalizer


# ---------------------------------------------------------------------------
# Policy losses
# ---------------------------------------------------------------------------
# Each takes [B, T] fp32 tensors: the current policy's log-probs (the only
# input with gradient), the proximal (old) policy's and the advantages, and
# returns (per-token loss, {mechanism: bool [B, T] tokens it clipped}) before
# the behaviour correction and the aggregation.


def ppo_clip_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    c_clip: float | None = None,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate (Schulman et al. 2017) with DAPO's clip-higher
    (Yu et al. 2025: a separate upper bound) and the dual clip (Ye et al. 2020)
    for negative advantages, per token:

        ratio  = exp(logp - prox_logp)
        L_clip = max(-A * ratio, -A * clip(ratio, 1 - eps, 1 + eps_high))   (eps_high None: eps)
        L      = min(L_clip, -c_clip * A)   where A < 0   (dual clip, if c_clip)

    Clipped tokens: clip_high (A > 0, ratio > 1 + eps_high), clip_low
    (A < 0, ratio < 1 - eps), dual_clip (the dual bound acted).
    """
    if c_clip is not None and c_clip <= 1.0:
        raise ValueError(f"c_clip must be > 1, got {c_clip}")
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logprobs - proximal_logprobs)
    loss_unclipped = -advantages * ratio
    loss_clipped = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    pg_loss = torch.maximum(loss_unclipped, loss_clipped)
    clipped = loss_clipped > loss_unclipped
    masks = {"clip_high": clipped & (advantages > 0), "clip_low": clipped & (advantages < 0)}
    if c_clip is None:
        masks["dual_clip"] = torch.zeros_like(clipped)
        return pg_loss, masks
    loss_dual = -advantages * c_clip
    masks["dual_clip"] = (advantages < 0) & (loss_dual < pg_loss)
    return torch.where(masks["dual_clip"], loss_dual, pg_loss), masks


def gspo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO (Zheng et al. 2025): a sequence-level, length-normalised ratio

        s_b = exp( (1/n_b) * sum_t (logp_bt - prox_logp_bt) )      over b's trained tokens
        L_b = max(-A_b * s_b, -A_b * clip(s_b, 1 - eps, 1 + eps_high))

    in its token form (GSPO-token): s_bt = sg(s_b) * pi(y_bt) / sg(pi(y_bt))
    has the value s_b and, summed over t with weight 1/n_b
    (`seq-mean-token-mean`), exactly the gradient of L_b. The paper's clip
    range is tiny (3e-4, 4e-4): the ratio is a geometric mean over tokens.
    """
    valid = loss_mask.bool()
    log_ratio = torch.where(valid, logprobs - proximal_logprobs, torch.zeros_like(logprobs))
    seq_log_ratio = masked_mean(log_ratio, valid, dim=-1)
    token_log_ratio = seq_log_ratio.detach()[:, None] + logprobs - logprobs.detach()
    return ppo_clip_loss(token_log_ratio, torch.zeros_like(token_log_ratio), advantages, eps_clip, None, eps_clip_high)


def cispo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    eps_clip: float,
    eps_clip_high: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO (MiniMax-M1, 2025): clip the importance weight, not the update,
    and keep every token's gradient:

        r_t = clip(exp(logp - prox_logp), 1 - eps, 1 + eps_high)
        L_t = -sg(r_t) * A_t * logp_t

    Clipped tokens: clip_high (ratio > 1 + eps_high), clip_low (ratio < 1 - eps).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(logprobs - proximal_logprobs).detach()
    weight = ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    masks = {
        "clip_high": ratio > 1.0 + eps_high,
        "clip_low": ratio < 1.0 - eps_clip,
        "dual_clip": torch.zeros_like(ratio, dtype=torch.bool),
    }
    return -weight * advantages * logprobs, masks


# ---------------------------------------------------------------------------
# Behaviour correction (rollout correction)
# ---------------------------------------------------------------------------


BEHAV_IMP_WEIGHT_LEVELS = ("token", "sequence", "geometric")


def behav_imp_weight(
    proximal_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    cap: float | None = None,
    mode: str = "mask",
    level: str = "token",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The importance weight of the proximal policy over the behaviour policy
    that sampled the tokens (AReaL's decoupled PPO), and what the cap does:

        token:     w_bt = exp(prox_logp_bt - behav_logp_bt)
        sequence:  w_bt = exp(sum_t' (prox_logp_bt' - behav_logp_bt'))   (the product over b's trained tokens)
        geometric: w_bt = exp(mean_t' (prox_logp_bt' - behav_logp_bt'))  (its geometric mean, as AReaL for
                   GSPO: the product vanishes or explodes on a long answer, the mean stays near 1)
        truncate:  w = min(w, cap)                      TIS (Yao et al. 2025)
        mask:      w = 0 where w > cap                  MIS: the token (sequence) is dropped

    `behav_logprobs` is mu, the distribution the tokens were drawn from.
    Returns (weight to apply, raw weight, capped: bool where the cap acted),
    [B, T] each, 0 / False outside `loss_mask`. cap None: no cap.
    """
    valid = loss_mask.bool()
    log_w = torch.where(valid, proximal_logprobs - behav_logprobs, torch.zeros_like(proximal_logprobs))
    if level == "sequence":
        log_w = masked_sum(log_w, valid, dim=-1)[:, None].expand_as(log_w)
    elif level == "geometric":
        log_w = masked_mean(log_w, valid, dim=-1)[:, None].expand_as(log_w)
    elif level != "token":
        raise ValueError(
            f"unknown behav_imp_weight_level {level!r}; expected one of {', '.join(BEHAV_IMP_WEIGHT_LEVELS)}"
        )
    raw = torch.where(valid, torch.exp(log_w.clamp(max=80.0)), torch.zeros_like(log_w))
    if cap is None:
        return raw, raw, torch.zeros_like(valid)
    capped = valid & (raw > cap)
    if mode == "truncate":
        return torch.where(capped, torch.full_like(raw, cap), raw), raw, capped
    if mode == "mask":
        return torch.where(capped, torch.zeros_like(raw), raw), raw, capped
    raise ValueError(f"unknown behav_imp_weight_mode {mode!r}; expected truncate or mask")


def effective_sample_size(weights: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The normalised effective sample size of importance weights (Kong 1992):

        ESS = (sum w)^2 / (n * sum w^2)      in (0, 1]; 1 = on-policy

    A falling ESS says a few stale tokens carry the update (off-policy collapse).
    """
    valid = mask.bool()
    w = torch.where(valid, weights.float(), torch.zeros_like(weights, dtype=torch.float32))
    n = valid.sum()
    return w.sum().square() / (n * w.square().sum()).clamp(min=1e-30)


# ---------------------------------------------------------------------------
# The actor loss
# ---------------------------------------------------------------------------

POLICY_LOSSES = ("ppo", "gspo", "cispo")

# The actor loss's stats: means over the micro-batch's trained tokens (the
# trainer weights them by n_tokens), then its extremes.
ACTOR_MEAN_STATS = (
    "clip_frac",
    "clip_high_frac",
    "clip_low_frac",
    "dual_clip_frac",
    "behav_imp_weight_mean",
    "behav_imp_weight_sq_mean",
    "behav_capped_frac",
    "approx_kl",
    "ratio_mean",
    "entropy",
    "kl_loss",
)


def decoupled_ppo_actor_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behav_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    eps_clip: float,
    behav_imp_weight_cap: float | None = None,
    c_clip: float | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    *,
    policy_loss: str = "ppo",
    eps_clip_high: float | None = None,
    behav_imp_weight_mode: str = "mask",
    behav_imp_weight_level: str = "token",
    max_len: float = 1.0,
    ref_logprobs: torch.Tensor | None = None,
    kl_loss_coef: float = 0.0,
    kl_estimator: str = "low-var",
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The actor's loss: a policy loss, corrected for the stale behaviour
    policy (AReaL's decoupled PPO), aggregated, plus the optional KL and
    entropy terms, per trained token:

        L_t  = policy_loss(logp, prox_logp, A)      ppo | gspo | cispo (gradient through logp only)
        w_t  = behav_imp_weight(prox_logp, behav_logp)   no gradient; capped by mode/level
        loss = agg(w * L) + kl_loss_coef * agg(KL_est(logp, ref_logp)) - entropy_coef * agg(H)

    The proximal policy (the weights at the start of this train step)
    anchors the trust region; the behaviour policy is corrected by importance
    weighting. Passing the behaviour log-probs as `proximal_logprobs` makes
    w == 1 exactly: standard PPO with ratio = exp(logp - behav_logp).
    Tokens the cap masks still count in the normaliser (they contribute 0),
    so the normaliser depends on loss_mask only and micro-batches add up.

    Args:
        logprobs: [B, T] log pi_theta(token), with gradient.
        proximal_logprobs, behav_logprobs, advantages: [B, T] (detached here).
        loss_mask: [B, T] 1 on trained tokens.
        ref_logprobs: [B, T] the reference model's, for the KL loss.
        entropy: [B, T] the policy's entropy per token (with gradient for
            the bonus; for stats only, without).
        loss_agg_mode, normalizer, max_len: see `aggregate_loss`.

    Returns:
        (scalar loss, stats): the means over this micro-batch's trained
        tokens of `ACTOR_MEAN_STATS`, behav_imp_weight_max/min, behav_ess and
        n_tokens.
    """
    proximal_logprobs = proximal_logprobs.detach().float()
    behav_logprobs = behav_logprobs.detach().float()
    advantages = advantages.detach().float()
    logprobs = logprobs.float()
    valid = loss_mask.bool()

    if policy_loss == "ppo":
        pg_loss, clipped = ppo_clip_loss(logprobs, proximal_logprobs, advantages, eps_clip, c_clip, eps_clip_high)
    elif policy_loss == "gspo":
        pg_loss, clipped = gspo_loss(logprobs, proximal_logprobs, advantages, valid, eps_clip, eps_clip_high)
    elif policy_loss == "cispo":
        pg_loss, clipped = cispo_loss(logprobs, proximal_logprobs, advantages, eps_clip, eps_clip_high)
    else:
        raise ValueError(f"unknown policy_loss {policy_loss!r}; expected one of {', '.join(POLICY_LOSSES)}")
    weight, raw_weight, capped = behav_imp_weight(
        proximal_logprobs, behav_logprobs, valid, behav_imp_weight_cap, behav_imp_weight_mode, behav_imp_weight_level
    )
    per_token_loss = torch.where(valid, pg_loss * weight, torch.zeros_like(pg_loss))
    loss = aggregate_loss(per_token_loss, valid, loss_agg_mode, normalizer, max_len)
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None and kl_loss_coef > 0:
        kl = kl_penalty(logprobs, ref_logprobs.detach(), kl_estimator)
        loss = loss + kl_loss_coef * aggregate_loss(kl, valid, loss_agg_mode, normalizer, max_len)
    if entropy is not None and entropy_coef > 0:
        loss = loss - entropy_coef * aggregate_loss(entropy.float(), valid, loss_agg_mode, normalizer, max_len)

    with torch.no_grad():
        log_ratio = logprobs.detach() - proximal_logprobs
        n_tokens = valid.sum()

        def mean(x: torch.Tensor) -> torch.Tensor:
            return masked_mean(x.float(), valid)

        values = {
            "clip_frac": mean(clipped["clip_high"] | clipped["clip_low"]),
            "clip_high_frac": mean(clipped["clip_high"]),
            "clip_low_frac": mean(clipped["clip_low"]),
            "dual_clip_frac": mean(clipped["dual_clip"]),
            "behav_imp_weight_mean": mean(raw_weight),
            "behav_imp_weight_sq_mean": mean(raw_weight.square()),
            "behav_capped_frac": mean(capped),
            "approx_kl": mean(torch.expm1(-log_ratio) + log_ratio),
            "ratio_mean": mean(torch.exp(log_ratio)),
            "entropy": mean(entropy.detach()) if entropy is not None else torch.zeros(()),
            "kl_loss": mean(kl.detach()),
            "behav_ess": effective_sample_size(raw_weight, valid),
            "n_tokens": n_tokens.float(),
        }
        if n_tokens > 0:
            values["behav_imp_weight_max"] = torch.where(valid, raw_weight, -torch.inf).max()
            values["behav_imp_weight_min"] = torch.where(valid, raw_weight, torch.inf).min()
        stats = dict(zip(values, torch.stack([v.float().reshape(()) for v in values.values()]).tolist()))
    stats.setdefault("behav_imp_weight_max", 0.0)
    stats.setdefault("behav_imp_weight_min", 0.0)
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
    loss_agg_mode: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
    max_len: float = 1.0,
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
    loss = aggregate_loss(per_token_loss, valid, loss_agg_mode, normalizer, max_len)

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
