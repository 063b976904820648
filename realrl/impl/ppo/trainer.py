"""PPO and GRPO over Hugging Face causal LMs: the algorithm composed over the models.

The ModelWorker owns processes, sockets and weights; this module owns the
maths of one train step on one data-parallel rank's share of the batch:

    batch = SequenceBatch.from_trajectories(trajectories)
    trainer.inference(batch)        # proximal / reference logprobs, values
    stats = trainer.train_step(batch)

Sequences are trained in padded micro-batches (`realrl.impl.ppo.batch`):
rows that share a prompt where a FLOP estimate says it pays, packed by
token budget (`realrl.impl.ppo.packing`), through the models of
`realrl.impl.ppo.models`; the losses and advantages are the functions of
`realrl.impl.ppo.functional`.

Data parallelism: every forward/backward pass is a collective under FSDP
(per-layer all-gather / reduce-scatter), and every optimizer step all-reduces
its normaliser and gradients. Ranks hold different data, so every phase first
agrees on the largest micro-batch count over the ranks (one all-reduce MAX)
and ranks with fewer pad with empty micro-batches: a 2-token dummy whose loss
mask is all zero, so it runs the collectives and changes nothing. Stats are
reduced over the ranks, so every rank returns the same global numbers.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from realrl.api.cli_args import OptimizerConfig, PPOConfig
from realrl.base.datapack import partition_balanced
from realrl.impl.ppo import functional as F
from realrl.impl.ppo.batch import MicroBatch, SequenceBatch, make_micro_batch
from realrl.impl.ppo.models import (
    forward_logprobs,
    forward_logprobs_and_entropy,
    forward_values,
    shared_prompt_mask_kind,
    shared_rows_match,
    text_config,
    train_forward_is_deterministic,
)
from realrl.impl.ppo.packing import plan_micro_batches

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]
# The estimators whose baseline is the other samples of a group.
GROUP_ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


@dataclasses.dataclass
class Optimized:
    """A model with its optimizer and LR schedule."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def make_optimized(
    model: nn.Module,
    lr: float,
    weight_decay: float,
    betas: tuple[float, float],
    eps: float,
    schedule: str,
    warmup_steps: int,
    total_steps: int,
    min_lr_ratio: float = 0.0,
) -> Optimized:
    # Only what trains holds optimizer state (a LoRA model: its adapters).
    params = [p for p in model.parameters() if p.requires_grad]
    # torch's fused kernel: one pass over each tensor instead of a dozen ops per tensor (its default
    # on CPU is a Python loop of them: 2.5 -> 0.6 ms a step on the tiny kit's model, one thread).
    fused = all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params) or None
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, fused=fused)

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            decay = 1.0 - progress
        elif schedule == "cosine":
            decay = 0.5 * (1.0 + math.cos(math.pi * progress))
        else:
            return 1.0
        # decays from lr to min_lr_ratio * lr (verl's min_lr_ratio, OpenRLHF's cosine_with_min_lr)
        return min_lr_ratio + (1.0 - min_lr_ratio) * decay

    return Optimized(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor))


def optimized_as_configured(model: nn.Module, o: OptimizerConfig, total_train_steps: int) -> Optimized:
    """`make_optimized` with the trial's `optimizer.*`; the schedule advances once per train
    step (a step may run fewer minibatches than ppo_n_minibatches), so it is sized in train steps."""
    return make_optimized(
        model,
        o.lr,
        o.weight_decay,
        (o.beta1, o.beta2),
        o.eps,
        o.lr_scheduler,
        o.warmup_steps,
        total_train_steps,
        o.min_lr_ratio,
    )


# A train step's statistics are accumulated in one dict of floats, then
# reduced over ranks with one all-reduce per op. Summed: losses (each rank's
# share of a loss normalised by the global count), counts, and token-weighted
# sums (divided by their weight at the end).
_ACTOR_MEANS = F.ACTOR_MEAN_STATS
_SUM_KEYS = (
    "actor_loss",
    "actor_tokens",
    *_ACTOR_MEANS,
    "critic_loss",
    "critic_tokens",
    "critic_clip_frac",
    "reward_sum",
    "adv_sum",
    "adv_count",
    "n_seqs",
    "n_completion_tokens",
    "truncated_masked_seqs",
    "groups_of_one",
)
# Maxed: extremes (the minimum as the max of its negation) and the grad norms,
# which are of the summed gradients and so already the same on every rank.
_MAX_KEYS = ("behav_imp_weight_max", "neg_behav_imp_weight_min", "actor_grad_norm", "critic_grad_norm")
_MAX_INIT = {"behav_imp_weight_max": -math.inf, "neg_behav_imp_weight_min": -math.inf}


def _counts_per_sequence(flat_masks: torch.Tensor, lengths: list[int]) -> list[int]:
    """The True entries of each sequence's stretch of `flat_masks` (its masks concatenated), at
    once: a sum per sequence is a torch call each, 128 of them a default step."""
    prefix = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(flat_masks.long(), 0)])
    ends = torch.cumsum(torch.tensor(lengths, dtype=torch.long), 0)
    return (prefix[ends] - prefix[ends - torch.tensor(lengths, dtype=torch.long)]).tolist()


class PPOTrainer:
    """One rank's PPO/GRPO logic. Data parallelism enters through
    `process_group` (None: one rank, and then no collective is ever called)
    and two hooks: `all_reduce_sum` (sum a tensor over ranks; by default an
    all-reduce over `process_group`) and `sync_grads` (make every rank's
    gradients the sum over ranks; FSDP does this itself)."""

    def __init__(
        self,
        actor: Optimized,
        cfg: PPOConfig,
        temperature: float,
        device: torch.device,
        gradient_clipping: float = 1.0,
        critic: Optimized | None = None,
        ref: nn.Module | None = None,
        all_reduce_sum: AllReduceSum | None = None,
        sync_grads: Callable[[nn.Module], None] = lambda m: None,
        process_group=None,
        loss_scale: float = 1.0,
        max_new_tokens: int = 0,
    ):
        self.actor, self.critic, self.ref = actor, critic, ref
        self.cfg = cfg
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = device
        self.gradient_clipping = gradient_clipping
        self.process_group = process_group
        if all_reduce_sum is None:
            all_reduce_sum = _identity if process_group is None else self._all_reduce_sum
        self.all_reduce_sum = all_reduce_sum
        self.sync_grads = sync_grads
        self.loss_scale = loss_scale  # multiplies every loss before backward (see ModelWorker for FSDP)
        # The generation budget: Dr. GRPO's constant length and the overlong buffer's end.
        self.max_new_tokens = max_new_tokens
        self.overlong_buffer_len = cfg.overlong_buffer_len or round(cfg.overlong_buffer_frac * max_new_tokens)
        if cfg.overlong_penalty_factor > 0 and not (0 < self.overlong_buffer_len <= max_new_tokens):
            raise ValueError("the overlong penalty needs 0 < buffer <= max_new_tokens")
        # Whether the actor's train-mode forward is the same function as its eval-mode one: decided once,
        # on a probe every rank runs (under FSDP a forward is a collective), alike on every rank.
        config = getattr(actor.model, "config", None)
        deterministic = train_forward_is_deterministic(actor.model, self._probe_logprobs, device)
        self._deterministic_train_forward = self._max_over_ranks([0 if deterministic else 1])[0] == 0
        if cfg.adv_estimator == "gae" and critic is None:
            raise ValueError("ppo.adv_estimator=gae needs a critic")
        # Shared-prompt rows (`share_prompt_rows`) when every model's attention takes their mask.
        # Checked on a probe as well (every rank runs it: under FSDP a forward is a collective).
        models = [
            (m, fn)
            for m, fn in (
                (actor.model, self._probe_logprobs),
                (ref, self._probe_logprobs),
                (critic and critic.model, forward_values),
            )
            if m is not None
        ]
        kinds = {shared_prompt_mask_kind(m) for m, _ in models}
        self._additive_mask = "additive" in kinds
        hidden = getattr(text_config(config), "hidden_size", None)
        share = cfg.share_prompts and hidden is not None and None not in kinds
        if share:
            share = all(shared_rows_match(m, fn, device, self._additive_mask) for m, fn in models)
            share = self._max_over_ranks([0 if share else 1])[0] == 0  # every rank decides alike
        self._share_hidden = hidden if share else None

    def _probe_logprobs(self, model: nn.Module, mb: MicroBatch) -> torch.Tensor:
        return forward_logprobs(model, mb, 1.0)

    # ---- agreement between data-parallel ranks ------------------------------------------
    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=self.process_group)
        return x

    def _max_over_ranks(self, values: list[float], dtype=torch.int64) -> list:
        """Element-wise max over ranks in one all-reduce (as is on one rank)."""
        if self.process_group is None or not values:
            return values
        t = torch.tensor(values, dtype=dtype, device=self.device)  # on the device: NCCL needs it there
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.process_group)
        return t.tolist()

    def _padded_plans(self, batch: SequenceBatch, parts: list[list[int]]) -> list[list[list[int]]]:
        """Micro-batch plans of each part, each padded with empty micro-batches
        to the largest count any rank has for that part (one all-reduce)."""
        plans = [
            plan_micro_batches(batch, indices, self.cfg.max_tokens_per_mb, self._share_hidden) for indices in parts
        ]
        counts = self._max_over_ranks([len(plan) for plan in plans])
        return [plan + [[] for _ in range(n - len(plan))] for plan, n in zip(plans, counts)]

    # ---- inference ----------------------------------------------------------------
    def _micro_batch(self, batch: SequenceBatch, rows: list[list[int]]) -> MicroBatch:
        return make_micro_batch(batch, rows, self.device, additive_mask=self._additive_mask)

    @torch.no_grad()
    def _per_seq(self, model: nn.Module, batch: SequenceBatch, plan: list[list[list[int]]], fn) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * batch.n_seqs
        was_training = model.training
        model.eval()
        for rows in plan:
            mb = self._micro_batch(batch, rows)
            for i, value in zip(mb.indices, fn(model, mb)):
                out[i] = value
        model.train(was_training)
        return out  # type: ignore[return-value]

    def compute_logprobs(self, model: nn.Module, batch: SequenceBatch, plan=None) -> list[torch.Tensor]:
        """Logprobs of every completion; `plan`: an agreed micro-batch plan (None: agree on one here)."""
        plan = self._padded_plans(batch, [list(range(batch.n_seqs))])[0] if plan is None else plan
        return self._per_seq(
            model, batch, plan, lambda m, mb: mb.gather(forward_logprobs(m, mb, self._temperature(mb)))
        )

    def _temperature(self, mb: MicroBatch) -> float | torch.Tensor:
        """The temperature the logprobs of `mb`'s sequences are taken at: each
        sequence's own where it recorded one (`Trajectory.sampling`), else the
        run's. One float when they all agree (the same arithmetic as a run
        whose sequences record none), else one per sequence."""
        recorded = mb.batch.temperatures
        if recorded is None or not mb.indices:
            return self.temperature
        per_seq = [self.temperature if recorded[i] is None else recorded[i] for i in mb.indices]
        if all(t == per_seq[0] for t in per_seq):
            return per_seq[0]
        return torch.tensor(per_seq, dtype=torch.float32, device=self.device)

    def inference(self, batch: SequenceBatch, decoupled: bool) -> None:
        """Fills proximal logprobs (decoupled loss), reference logprobs (KL)
        and values (PPO) with the current weights."""
        use_ref = self.ref is not None and (self.cfg.kl_ctl > 0 or self.cfg.use_kl_loss)
        if decoupled and self._prox_in_train_forward(use_ref):
            batch.prox_from_train_forward = True
            decoupled = False
        if not (decoupled or use_ref or self.critic is not None):
            return
        # One plan, agreed once, serves all three models.
        plan = self._padded_plans(batch, [list(range(batch.n_seqs))])[0]
        if decoupled:
            batch.prox_logprobs = self.compute_logprobs(self.actor.model, batch, plan)
        if use_ref:
            batch.ref_logprobs = self.compute_logprobs(self.ref, batch, plan)
        if self.critic is not None:
            batch.values = self._per_seq(self.critic.model, batch, plan, lambda m, mb: mb.gather(forward_values(m, mb)))

    def inference_computes(self, decoupled: bool) -> bool:
        """Whether `inference(batch, decoupled)` runs a model (else it only marks the batch, and a
        caller may run it just before `train_step` instead of as a stage of its own)."""
        use_ref = self.ref is not None and (self.cfg.kl_ctl > 0 or self.cfg.use_kl_loss)
        if decoupled and self._prox_in_train_forward(use_ref):
            decoupled = False
        return decoupled or use_ref or self.critic is not None

    def _prox_in_train_forward(self, use_ref: bool) -> bool:
        """Whether the proximal logprobs can come from the train step's own
        forward: with one minibatch that forward runs at exactly the weights a
        separate pass would use (before the step's only optimizer update), so
        its detached logprobs are the proximal ones and the pass is saved. Not
        when they are needed earlier (KL rewards use them in the advantages)
        or when the forward is random (dropout in train mode)."""
        return self.cfg.ppo_n_minibatches == 1 and not use_ref and self._deterministic_train_forward

    # ---- advantages ------------------------------------------------------------------
    def _kl_token_rewards(self, batch: SequenceBatch, i: int) -> torch.Tensor:
        """-kl_ctl * KL per completion token; 0 on context tokens (the policy sampled none of them)."""
        n = len(batch.input_ids[i]) - batch.prompt_lens[i]
        if batch.ref_logprobs is None or self.cfg.kl_ctl <= 0:
            return torch.zeros(n)
        sampled = batch.prox_logprobs[i] if batch.prox_logprobs is not None else batch.behav_logprobs[i]
        kl = -self.cfg.kl_ctl * F.kl_penalty(sampled, batch.ref_logprobs[i], self.cfg.kl_estimator)
        return torch.where(batch.trained_mask(i), kl, torch.zeros_like(kl))

    def trained_masks(self, batch: SequenceBatch) -> list[torch.Tensor]:
        """Per sequence, bool [C_i]: the completion tokens the loss trains:
        the batch's loss mask, less every token of a truncated answer with
        `ppo.mask_truncated` (DAPO's overlong filtering)."""
        masks = []
        for i in range(batch.n_seqs):
            mask = batch.trained_mask(i)
            if self.cfg.mask_truncated and batch.no_eos[i]:
                mask = torch.zeros_like(mask)
            masks.append(mask)
        return masks

    def overlong_penalties(self, batch: SequenceBatch) -> torch.Tensor:
        """[N] DAPO's soft overlong punishment (times its factor; 0 when off). The budget is per
        generation call: a sequence's length is its longest sampled span (a chain of chat turns holds
        tool results and user turns between its calls' answers, which no budget counted)."""
        if self.cfg.overlong_penalty_factor <= 0:
            return torch.zeros(batch.n_seqs)
        lengths = torch.tensor([max(batch.sampled_spans(i), default=0) for i in range(batch.n_seqs)])
        penalty = F.overlong_penalty(lengths, self.max_new_tokens, self.overlong_buffer_len)
        return self.cfg.overlong_penalty_factor * penalty

    def shaped_rewards(self, batch: SequenceBatch) -> torch.Tensor:
        """[N] the sequences' rewards plus DAPO's soft overlong punishment."""
        return batch.rewards + self.overlong_penalties(batch)

    def chain_rewards(
        self, batch: SequenceBatch, chains: list[list[int]], penalties: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[len(chains)] what a group estimator compares: each chain's reward, its first sequence's
        (the episode's return from its start: a multi-turn agent's turn-level discount gives later
        turns more), plus its worst call's overlong penalty (`penalties`: `overlong_penalties`)."""
        penalties = self.overlong_penalties(batch) if penalties is None else penalties
        firsts = torch.tensor([chain[0] for chain in chains])
        if all(len(chain) == 1 for chain in chains):  # one sequence each: one indexing, not one per chain
            return batch.rewards[firsts] + penalties[firsts]
        return batch.rewards[firsts] + torch.stack([penalties[chain].min() for chain in chains])

    def advantages(
        self, batch: SequenceBatch, masks: list[torch.Tensor] | None = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sequence completion advantages (and GAE's returns), by
        `ppo.adv_estimator`. An empty completion gets empty ones: it trains no
        token, though its reward still counts in its group's baseline.
        Tokens outside `masks` (default: `trained_masks`) get advantage 0."""
        cfg = self.cfg
        masks = self.trained_masks(batch) if masks is None else masks
        rewards = self.shaped_rewards(batch)
        advs: list[torch.Tensor] = [torch.zeros(0)] * batch.n_seqs
        if cfg.adv_estimator in GROUP_ESTIMATORS:
            # Each chain (a sampled episode: one sequence, or a multi-turn agent's turns) is one sample
            # of its group; its sequences share its advantage.
            penalties = self.overlong_penalties(batch)
            kl_rewards = batch.ref_logprobs is not None and cfg.kl_ctl > 0
            for chains in batch.group_chains():
                chain_adv = torch.zeros(len(chains))
                if len(chains) >= 2:  # a group of one has no baseline: no signal (counted: groups_of_one)
                    chain_rewards = self.chain_rewards(batch, chains, penalties)
                    if cfg.adv_estimator == "rloo":
                        chain_adv = F.rloo_advantages(chain_rewards, len(chains))
                    else:
                        std_norm = cfg.adv_estimator == "grpo"
                        chain_adv = F.group_normalized_advantages(chain_rewards, len(chains), std_normalize=std_norm)
                for a, chain in zip(chain_adv.tolist(), chains):
                    for i in chain:
                        if not kl_rewards:  # the chain's advantage on every trained token (one op, not seven)
                            advs[i] = masks[i] * a
                            continue
                        kl = self._kl_token_rewards(batch, i) * masks[i]
                        # advantage_t = A_chain + sum_{t' >= t} (-kl_ctl * KL_t')
                        advs[i] = (a + torch.flip(torch.cumsum(torch.flip(kl, [0]), 0), [0])) * masks[i]
            return advs, None
        returns: list[torch.Tensor] = [torch.zeros(0)] * batch.n_seqs
        for i in range(batch.n_seqs):
            G = batch.completion_len(i)
            sampled = batch.trained_mask(i)
            if G == 0 or not sampled.any():  # no sampled token to put the reward on
                advs[i], returns[i] = torch.zeros(G), torch.zeros(G)
                continue
            if not masks[i].any():  # trains no token (e.g. a truncated answer with ppo.mask_truncated)
                advs[i] = returns[i] = torch.zeros(G)
                continue
            mask = masks[i].float()[None]
            # the reward on the last trained token, the KL penalty on every trained one
            token_rewards = F.reward_to_token_rewards(rewards[i : i + 1], mask)
            token_rewards = (token_rewards + self._kl_token_rewards(batch, i)[None]) * mask
            if cfg.adv_estimator == "reinforce_plus_plus":
                advs[i] = F.discounted_returns(token_rewards, mask, cfg.discount)[0]
                continue
            # The scored answer is terminal, truncated or not (as verl and OpenRLHF): the value after its
            # last token is never trained (the critic's loss covers the predicted tokens only), so no bootstrap.
            values = batch.values[i]  # at tokens P-1 .. L-1
            adv, ret = F.gae_advantages(token_rewards, values[None, :-1], mask, cfg.discount, cfg.gae_lambda)
            advs[i], returns[i] = adv[0], ret[0]
        if cfg.adv_norm or cfg.adv_estimator == "reinforce_plus_plus":
            # Whitened over the trained tokens of every rank (two all-reduces), also on a rank without sequences.
            flat = torch.cat(advs)[None] if advs else torch.zeros(1, 0)
            flat_mask = torch.cat([m.float() for m in masks])[None] if advs else torch.zeros(1, 0)
            white = F.masked_whiten(flat, flat_mask, process_group=self.process_group)[0]
            advs = list(torch.split(white, [len(a) for a in advs])) if advs else []
        return advs, (returns if cfg.adv_estimator == "gae" else None)

    # ---- training ---------------------------------------------------------------------
    def train_step(self, batch: SequenceBatch) -> dict[str, float]:
        """One PPO/GRPO update; returns stats over the whole (all-rank) batch,
        the same on every rank."""
        cfg = self.cfg
        masks = self.trained_masks(batch)
        flat_masks = torch.cat(masks) if masks else torch.zeros(0, dtype=torch.bool)
        trained_counts = _counts_per_sequence(flat_masks, [len(m) for m in masks])
        advs, returns = self.advantages(batch, masks)
        decoupled = batch.prox_from_train_forward or batch.prox_logprobs is not None
        if batch.prox_from_train_forward:
            prox = None  # taken from the forward itself (_optimize_actor)
        else:
            prox = batch.prox_logprobs if decoupled else batch.behav_logprobs
        # The behaviour policy of the decoupled weight pi_prox / mu is the distribution the tokens were
        # drawn from (after top-k/top-p/min-p); without decoupling, the old policy is the unfiltered
        # behaviour one and the weight is 1 (docs/design.md §9).
        behav = batch.sampling_logprobs if decoupled and batch.sampling_logprobs is not None else batch.behav_logprobs
        # Every rank steps n_mbs times (each step all-reduces), so n_mbs comes
        # from the largest group count; a rank with fewer groups gets empty
        # minibatches and adds zero gradients. Minibatches keep each
        # trajectory whole and balance tokens.
        n_mbs = min(cfg.ppo_n_minibatches, self._max_over_ranks([len(batch.groups)])[0])
        group_tokens = [batch.n_completion_tokens(g) for g in batch.groups]
        group_parts = partition_balanced(group_tokens, n_mbs) if n_mbs else []  # n_mbs = 0: no rank has data
        parts = [[i for g in part for i in batch.groups[g]] for part in group_parts]
        plans = self._padded_plans(batch, parts)
        normalizers = self._normalizers(masks, parts, trained_counts)

        acc = {**dict.fromkeys(_SUM_KEYS + _MAX_KEYS, 0.0), **_MAX_INIT}
        old_values = None
        if self.critic is not None:
            old_values = [v[:-1] for v in batch.values]
        for plan, normalizer in zip(plans, normalizers):
            self._optimize_actor(batch, plan, normalizer, prox, behav, advs, masks, acc)
            if self.critic is not None:
                self._optimize_critic(batch, plan, normalizer, old_values, returns, masks, acc)
        if n_mbs:  # the LR schedule advances per train step, however many minibatches the step took
            for optimized in (self.actor, self.critic):
                if optimized is not None:
                    optimized.scheduler.step()

        acc.update(
            reward_sum=float(batch.rewards.sum()),
            n_seqs=float(batch.n_seqs),
            n_completion_tokens=float(batch.n_completion_tokens()),
            adv_sum=float(torch.cat(advs)[flat_masks].double().sum()) if advs else 0.0,
            adv_count=float(sum(trained_counts)),
            truncated_masked_seqs=float(sum(bool(cfg.mask_truncated and x) for x in batch.no_eos.tolist())),
            groups_of_one=float(
                sum(len(chains) < 2 for chains in batch.group_chains()) if cfg.adv_estimator in GROUP_ESTIMATORS else 0
            ),
        )
        return self._global_stats(acc, n_mbs)

    def _normalizers(
        self, masks: list[torch.Tensor], parts: list[list[int]], trained_counts: list[int] | None = None
    ) -> list[torch.Tensor]:
        """Each minibatch's loss denominator over all ranks (one all-reduce):
        its trained tokens (token-mean), or its sequences with a trained
        token (`F.aggregate_loss`); `trained_counts`: each sequence's trained tokens, if counted."""
        if not parts:
            return []
        if trained_counts is None:
            trained_counts = _counts_per_sequence(torch.cat(masks), [len(m) for m in masks])
        if self.cfg.loss_agg_mode == "token-mean":
            local = [float(sum(trained_counts[i] for i in indices)) for indices in parts]
        else:
            local = [float(sum(trained_counts[i] > 0 for i in indices)) for indices in parts]
        return list(self.all_reduce_sum(torch.tensor(local, device=self.device)).clamp(min=1.0))

    def _global_stats(self, acc: dict[str, float], n_mbs: int) -> dict[str, float]:
        """The step's stats over all ranks (one all-reduce SUM, one MAX), the
        same on every rank; losses and grad norms are means over minibatches."""
        sums = torch.tensor([acc[k] for k in _SUM_KEYS], dtype=torch.float64, device=self.device)
        sums = dict(zip(_SUM_KEYS, self.all_reduce_sum(sums).tolist()))
        maxes = dict(zip(_MAX_KEYS, self._max_over_ranks([acc[k] for k in _MAX_KEYS], dtype=torch.float64)))
        per_step = max(n_mbs, 1)
        stats = {"actor_loss": sums["actor_loss"] / per_step, "actor_grad_norm": maxes["actor_grad_norm"] / per_step}
        for key in _ACTOR_MEANS:
            stats[key] = sums[key] / max(sums["actor_tokens"], 1.0)
        # ESS = (sum w)^2 / (n sum w^2) over every trained token of the step (F.effective_sample_size)
        mean_sq = stats.pop("behav_imp_weight_sq_mean")
        stats["behav_ess"] = stats["behav_imp_weight_mean"] ** 2 / mean_sq if mean_sq > 0 else 0.0
        if math.isfinite(maxes["behav_imp_weight_max"]):  # some rank trained a token
            stats["behav_imp_weight_max"] = maxes["behav_imp_weight_max"]
            stats["behav_imp_weight_min"] = -maxes["neg_behav_imp_weight_min"]
        if self.critic is not None:
            stats.update(
                critic_loss=sums["critic_loss"] / per_step,
                critic_clip_frac=sums["critic_clip_frac"] / max(sums["critic_tokens"], 1.0),
                critic_grad_norm=maxes["critic_grad_norm"] / per_step,
            )
        stats.update(
            reward_mean=sums["reward_sum"] / max(sums["n_seqs"], 1.0),
            adv_mean=sums["adv_sum"] / max(sums["adv_count"], 1.0),
            n_seqs=sums["n_seqs"],
            n_completion_tokens=sums["n_completion_tokens"],
            truncated_masked_frac=sums["truncated_masked_seqs"] / max(sums["n_seqs"], 1.0),
            groups_of_one=sums["groups_of_one"],
            lr=float(self.actor.scheduler.get_last_lr()[0]),
        )
        return stats

    def _optimize_actor(self, batch, plan, normalizer, prox, behav, advs, masks, acc) -> None:
        """One optimizer step over the micro-batches of `plan`; adds this
        rank's share of the stats to `acc`. `prox` None: the proximal
        logprobs are this forward's own (`SequenceBatch.prox_from_train_forward`);
        `behav`: the behaviour policy's logprobs of the importance weight."""
        cfg, actor = self.cfg, self.actor
        actor.model.train()
        actor.optimizer.zero_grad(set_to_none=False)
        for rows in plan:
            mb = self._micro_batch(batch, rows)
            logp, entropy = forward_logprobs_and_entropy(
                actor.model, mb, self._temperature(mb), entropy_grad=cfg.entropy_coef > 0
            )
            loss, st = F.decoupled_ppo_actor_loss(
                logp,
                logp.detach() if prox is None else mb.scatter(prox),
                mb.scatter(behav),
                mb.scatter(advs),
                mb.loss_mask * mb.scatter(masks),
                eps_clip=cfg.eps_clip,
                behav_imp_weight_cap=cfg.behav_imp_weight_cap,
                c_clip=cfg.c_clip,
                loss_agg_mode=cfg.loss_agg_mode,
                normalizer=normalizer,
                policy_loss=cfg.policy_loss,
                eps_clip_high=cfg.eps_clip_high,
                behav_imp_weight_mode=cfg.behav_imp_weight_mode,
                behav_imp_weight_level=cfg.behav_imp_weight_level,
                max_len=float(max(self.max_new_tokens, 1)),
                ref_logprobs=mb.scatter(batch.ref_logprobs) if cfg.use_kl_loss else None,
                kl_loss_coef=cfg.kl_loss_coef,
                kl_estimator=cfg.kl_loss_estimator,
                entropy=entropy,
                entropy_coef=cfg.entropy_coef,
            )
            # A padding micro-batch has an all-zero loss mask: loss and gradients are exactly 0.
            (loss * self.loss_scale).backward()
            n = st["n_tokens"]
            acc["actor_loss"] += float(loss.detach())
            acc["actor_tokens"] += n
            for key in _ACTOR_MEANS:
                acc[key] += st[key] * n
            if n:
                acc["behav_imp_weight_max"] = max(acc["behav_imp_weight_max"], st["behav_imp_weight_max"])
                acc["neg_behav_imp_weight_min"] = max(acc["neg_behav_imp_weight_min"], -st["behav_imp_weight_min"])
        self.sync_grads(actor.model)
        acc["actor_grad_norm"] += self._clip(actor.model)
        actor.optimizer.step()

    def _optimize_critic(self, batch, plan, normalizer, old_values, returns, masks, acc) -> None:
        cfg, critic = self.cfg, self.critic
        critic.model.train()
        critic.optimizer.zero_grad(set_to_none=False)
        for rows in plan:
            mb = self._micro_batch(batch, rows)
            values = forward_values(critic.model, mb)[:, :-1]
            loss, st = F.critic_loss(
                values,
                mb.scatter(old_values),
                mb.scatter(returns),
                mb.loss_mask * mb.scatter(masks),
                cfg.value_eps_clip,
                cfg.loss_agg_mode,
                normalizer,
                float(max(self.max_new_tokens, 1)),
            )
            (loss * self.loss_scale).backward()
            acc["critic_loss"] += float(loss.detach())
            acc["critic_tokens"] += st["n_tokens"]
            acc["critic_clip_frac"] += st["clip_frac"] * st["n_tokens"]
        self.sync_grads(critic.model)
        acc["critic_grad_norm"] += self._clip(critic.model)
        critic.optimizer.step()

    def _clip(self, model: nn.Module) -> float:
        """Clips and returns the global gradient norm (under FSDP a collective
        over the shards, which every rank reaches once per step)."""
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.gradient_clipping if self.gradient_clipping > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
