"""PPO and GRPO over Hugging Face causal LMs: the algorithm composed over the models.

The ModelWorker owns processes, sockets and weights; this module owns the
maths of one train step on one data-parallel rank's share of the batch:

    batch = SequenceBatch.from_trajectories(trajectories)
    trainer.inference(batch)        # proximal / reference logprobs, values
    stats = trainer.train_step(batch)

Sequences are trained as padded [B, T] micro-batches (right padding), packed
by token budget with first-fit-decreasing. Per-token tensors are aligned with
the predicted positions: column j holds the token at j+1, predicted from the
logits at j, so sequence i's completion occupies columns prompt_len-1 ..
len-2. Logprobs are log_softmax(logits / temperature), the same scaling the
generation servers use, so behaviour, proximal and current logprobs are
comparable.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch
import torch.nn as nn

from realrl.api.cli_args import PPOConfig
from realrl.api.trajectory import Trajectory
from realrl.base.datapack import partition_balanced, split_by_token_budget
from realrl.impl import ppo_functional as F

AllReduceSum = Callable[[torch.Tensor], torch.Tensor]


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


# ---- data --------------------------------------------------------------------


@dataclasses.dataclass
class SequenceBatch:
    """The sequences one rank trains on in one step (flattened trajectories)."""

    input_ids: list[torch.Tensor]  # int64 [L_i]: prompt + completion
    prompt_lens: list[int]
    behav_logprobs: list[torch.Tensor]  # float32 [L_i - P_i], from the generation servers
    rewards: torch.Tensor  # float32 [N], already shaped by the agent
    no_eos: torch.Tensor  # bool [N]
    groups: list[list[int]]  # the sequence indices of each trajectory
    prox_logprobs: list[torch.Tensor] | None = None  # [L_i - P_i]
    ref_logprobs: list[torch.Tensor] | None = None  # [L_i - P_i]
    values: list[torch.Tensor] | None = None  # [L_i]: state value at every position

    @staticmethod
    def from_trajectories(trajectories: list[Trajectory]) -> "SequenceBatch":
        input_ids, prompt_lens, behav, rewards, no_eos, groups = [], [], [], [], [], []
        for traj in trajectories:
            group = []
            for i in range(traj.group_size):
                group.append(len(input_ids))
                input_ids.append(torch.from_numpy(traj.input_ids[i].astype("int64")))
                prompt_lens.append(int(traj.prompt_len[i]))
                behav.append(torch.from_numpy(traj.logprobs[i].copy()))
                rewards.append(float(traj.reward[i]))
                no_eos.append(bool(traj.no_eos[i]))
            groups.append(group)
        return SequenceBatch(input_ids, prompt_lens, behav, torch.tensor(rewards, dtype=torch.float32),
                             torch.tensor(no_eos, dtype=torch.bool), groups)  # fmt: skip

    @property
    def n_seqs(self) -> int:
        return len(self.input_ids)

    @property
    def seq_lens(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    def n_completion_tokens(self, indices: list[int] | None = None) -> int:
        indices = range(self.n_seqs) if indices is None else indices
        return sum(len(self.input_ids[i]) - self.prompt_lens[i] for i in indices)


@dataclasses.dataclass
class MicroBatch:
    indices: list[int]
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    loss_mask: torch.Tensor  # [B, T-1], 1.0 on completion tokens
    batch: SequenceBatch

    def scatter(self, per_seq: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """Places per-sequence completion values into [B, T-1] columns P-1..L-2."""
        out = torch.full(self.loss_mask.shape, fill, dtype=torch.float32, device=self.loss_mask.device)
        for row, i in enumerate(self.indices):
            start = self.batch.prompt_lens[i] - 1
            values = per_seq[i]
            out[row, start : start + len(values)] = values.to(out.device, torch.float32)
        return out

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of `scatter`: per-sequence completion slices of [B, T-1]."""
        out = []
        for row, i in enumerate(self.indices):
            start = self.batch.prompt_lens[i] - 1
            out.append(tensor[row, start : start + len(self.batch.input_ids[i]) - self.batch.prompt_lens[i]].float().cpu())
        return out


def make_micro_batch(batch: SequenceBatch, indices: list[int], device: torch.device, pad_id: int = 0) -> MicroBatch:
    lengths = [len(batch.input_ids[i]) for i in indices]
    T = max(lengths)
    input_ids = torch.full((len(indices), T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(indices), T), dtype=torch.long)
    loss_mask = torch.zeros((len(indices), T - 1), dtype=torch.float32)
    for row, (i, L) in enumerate(zip(indices, lengths)):
        input_ids[row, :L] = batch.input_ids[i]
        attention_mask[row, :L] = 1
        loss_mask[row, batch.prompt_lens[i] - 1 : L - 1] = 1.0
    return MicroBatch(indices, input_ids.to(device), attention_mask.to(device), loss_mask.to(device), batch)


def micro_batches(batch: SequenceBatch, indices: list[int], max_tokens: int, device: torch.device) -> list[MicroBatch]:
    lengths = [len(batch.input_ids[i]) for i in indices]
    bins = split_by_token_budget(lengths, max_tokens, padded=True)
    return [make_micro_batch(batch, [indices[j] for j in b], device) for b in bins]


# ---- models ------------------------------------------------------------------


class CriticModel(nn.Module):
    """A value model: the policy's transformer body plus a scalar head."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype) -> "CriticModel":
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=dtype)
        return cls(backbone, backbone.config.hidden_size).to(dtype)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()  # [B, T]


def forward_logprobs(model: nn.Module, mb: MicroBatch, temperature: float) -> torch.Tensor:
    """[B, T-1] logprobs of each next token (grad flows when enabled)."""
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    return F.gather_logprobs(logits[:, :-1], mb.input_ids[:, 1:], temperature)


# ---- the trainer --------------------------------------------------------------


@dataclasses.dataclass
class Optimized:
    """A model with its optimizer and LR schedule."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler


def make_optimized(model: nn.Module, lr: float, weight_decay: float, betas: tuple[float, float], eps: float,
                   schedule: str, warmup_steps: int, total_steps: int) -> Optimized:  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        if schedule == "linear":
            return 1.0 - progress
        if schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * progress))
        return 1.0

    return Optimized(model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor))


class PPOTrainer:
    """One rank's PPO/GRPO logic. Data parallelism enters through two hooks:
    `all_reduce_sum` (sum a tensor over ranks) and `sync_grads` (make every
    rank's gradients the sum over ranks); both are identities on one rank."""

    def __init__(
        self,
        actor: Optimized,
        cfg: PPOConfig,
        temperature: float,
        device: torch.device,
        gradient_clipping: float = 1.0,
        critic: Optimized | None = None,
        ref: nn.Module | None = None,
        all_reduce_sum: AllReduceSum = _identity,
        sync_grads: Callable[[nn.Module], None] = lambda m: None,
        process_group=None,
        loss_scale: float = 1.0,
    ):
        self.actor, self.critic, self.ref = actor, critic, ref
        self.cfg = cfg
        self.temperature = temperature if temperature > 0 else 1.0
        self.device = device
        self.gradient_clipping = gradient_clipping
        self.all_reduce_sum = all_reduce_sum
        self.sync_grads = sync_grads
        self.process_group = process_group
        self.loss_scale = loss_scale  # multiplies every loss before backward (see ModelWorker for FSDP)
        if cfg.algorithm == "ppo" and critic is None:
            raise ValueError("ppo.algorithm=ppo needs a critic")

    # ---- inference ----------------------------------------------------------------
    @torch.no_grad()
    def _per_seq(self, model: nn.Module, batch: SequenceBatch, fn) -> list[torch.Tensor]:
        out: list[torch.Tensor | None] = [None] * batch.n_seqs
        was_training = model.training
        model.eval()
        for mb in micro_batches(batch, list(range(batch.n_seqs)), self.cfg.max_tokens_per_mb, self.device):
            for i, value in zip(mb.indices, fn(model, mb)):
                out[i] = value
        model.train(was_training)
        return out  # type: ignore[return-value]

    def compute_logprobs(self, model: nn.Module, batch: SequenceBatch) -> list[torch.Tensor]:
        return self._per_seq(model, batch, lambda m, mb: mb.gather(forward_logprobs(m, mb, self.temperature)))

    def inference(self, batch: SequenceBatch, decoupled: bool) -> None:
        """Fills proximal logprobs (decoupled loss), reference logprobs (KL)
        and values (PPO) with the current weights."""
        if decoupled:
            batch.prox_logprobs = self.compute_logprobs(self.actor.model, batch)
        if self.ref is not None and self.cfg.kl_ctl > 0:
            batch.ref_logprobs = self.compute_logprobs(self.ref, batch)
        if self.critic is not None:

            def values(model, mb):
                v = model(mb.input_ids, mb.attention_mask)
                return [v[row, : len(batch.input_ids[i])].cpu() for row, i in enumerate(mb.indices)]

            batch.values = self._per_seq(self.critic.model, batch, values)

    # ---- advantages ------------------------------------------------------------------
    def _kl_token_rewards(self, batch: SequenceBatch, i: int) -> torch.Tensor:
        n = len(batch.input_ids[i]) - batch.prompt_lens[i]
        if batch.ref_logprobs is None or self.cfg.kl_ctl <= 0:
            return torch.zeros(n)
        sampled = batch.prox_logprobs[i] if batch.prox_logprobs is not None else batch.behav_logprobs[i]
        return -self.cfg.kl_ctl * F.kl_penalty(sampled, batch.ref_logprobs[i], self.cfg.kl_estimator)

    def advantages(self, batch: SequenceBatch) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per-sequence completion advantages (and PPO returns)."""
        cfg = self.cfg
        advs: list[torch.Tensor] = [torch.zeros(0)] * batch.n_seqs
        if cfg.algorithm == "grpo":
            for group in batch.groups:
                seq_adv = F.group_normalized_advantages(batch.rewards[group], len(group), std_normalize=cfg.group_std_norm)
                for a, i in zip(seq_adv.tolist(), group):
                    kl = self._kl_token_rewards(batch, i)
                    # advantage_t = A_seq + sum_{t' >= t} (-kl_ctl * KL_t')
                    advs[i] = a + torch.flip(torch.cumsum(torch.flip(kl, [0]), 0), [0])
            return advs, None
        returns: list[torch.Tensor] = [torch.zeros(0)] * batch.n_seqs
        for i in range(batch.n_seqs):
            P, L = batch.prompt_lens[i], len(batch.input_ids[i])
            token_rewards = self._kl_token_rewards(batch, i)
            token_rewards[-1] += batch.rewards[i]
            values = batch.values[i]
            bootstrap = values[L - 1 : L] if batch.no_eos[i] else torch.zeros(1)
            mask = torch.ones(1, L - P)
            adv, ret = F.gae_advantages(token_rewards[None], values[None, P - 1 : L - 1], mask,
                                        cfg.discount, cfg.gae_lambda, bootstrap)  # fmt: skip
            advs[i], returns[i] = adv[0], ret[0]
        if cfg.adv_norm:
            flat = torch.cat(advs)[None]
            white = F.masked_whiten(flat, torch.ones_like(flat), process_group=self.process_group)[0]
            advs = list(torch.split(white, [len(a) for a in advs]))
        return advs, returns

    # ---- training ---------------------------------------------------------------------
    def train_step(self, batch: SequenceBatch) -> dict[str, float]:
        cfg = self.cfg
        advs, returns = self.advantages(batch)
        prox = batch.prox_logprobs if batch.prox_logprobs is not None else batch.behav_logprobs
        # Minibatches keep each trajectory whole and balance tokens.
        group_tokens = [batch.n_completion_tokens(g) for g in batch.groups]
        stats: dict[str, float] = {}
        n_mbs = min(cfg.ppo_n_minibatches, len(batch.groups))
        for part in partition_balanced(group_tokens, n_mbs):
            indices = [i for g in part for i in batch.groups[g]]
            # Every rank steps n_mbs times; an empty part still joins the collectives.
            step_stats = self._optimize_actor(batch, indices, prox, advs)
            if self.critic is not None:
                step_stats.update(self._optimize_critic(batch, indices, returns))
            for k, v in step_stats.items():
                stats[k] = stats.get(k, 0.0) + v / n_mbs
        rewards = batch.rewards
        stats.update(
            reward_mean=float(rewards.mean()) if len(rewards) else 0.0,
            adv_mean=float(torch.cat(advs).mean()) if advs else 0.0,
            n_seqs=float(batch.n_seqs),
            n_completion_tokens=float(batch.n_completion_tokens()),
            lr=float(self.actor.scheduler.get_last_lr()[0]),
        )
        return stats

    def _normalizer(self, batch: SequenceBatch, indices: list[int]) -> torch.Tensor:
        if self.cfg.loss_aggregation == "token":
            local = float(batch.n_completion_tokens(indices))
        else:
            local = float(sum(1 for i in indices if len(batch.input_ids[i]) > batch.prompt_lens[i]))
        return self.all_reduce_sum(torch.tensor(local, device=self.device)).clamp(min=1.0)

    def _optimize_actor(self, batch, indices, prox, advs) -> dict[str, float]:
        cfg, actor = self.cfg, self.actor
        actor.model.train()
        actor.optimizer.zero_grad(set_to_none=False)
        normalizer = self._normalizer(batch, indices)
        totals: dict[str, float] = {}
        weight_sum = 0.0
        for mb in micro_batches(batch, indices, cfg.max_tokens_per_mb, self.device):
            logp = forward_logprobs(actor.model, mb, self.temperature)
            loss, st = F.decoupled_ppo_actor_loss(
                logp,
                mb.scatter(prox),
                mb.scatter(batch.behav_logprobs),
                mb.scatter(advs),
                mb.loss_mask,
                eps_clip=cfg.eps_clip,
                behav_imp_weight_cap=cfg.behav_imp_weight_cap,
                c_clip=cfg.c_clip,
                aggregation=cfg.loss_aggregation,
                normalizer=normalizer,
            )
            (loss * self.loss_scale).backward()
            n = float(mb.loss_mask.sum())
            weight_sum += n
            totals["actor_loss"] = totals.get("actor_loss", 0.0) + float(loss.detach())
            for key in ("clip_frac", "dual_clip_frac", "behav_imp_weight_mean", "behav_capped_frac", "approx_kl"):
                totals[key] = totals.get(key, 0.0) + st.get(key, 0.0) * n
            for key, reduce in (("behav_imp_weight_max", max), ("behav_imp_weight_min", min)):
                if key in st and n:
                    totals[key] = reduce(totals.get(key, st[key]), st[key])
        self.sync_grads(actor.model)
        grad_norm = self._clip(actor.model)
        actor.optimizer.step()
        actor.scheduler.step()
        out = {"actor_loss": totals.get("actor_loss", 0.0), "actor_grad_norm": grad_norm}
        for key in ("clip_frac", "dual_clip_frac", "behav_imp_weight_mean", "behav_capped_frac", "approx_kl"):
            out[key] = totals.get(key, 0.0) / max(weight_sum, 1.0)
        for key in ("behav_imp_weight_max", "behav_imp_weight_min"):
            if key in totals:
                out[key] = totals[key]
        return out

    def _optimize_critic(self, batch, indices, returns) -> dict[str, float]:
        cfg, critic = self.cfg, self.critic
        critic.model.train()
        critic.optimizer.zero_grad(set_to_none=False)
        normalizer = self._normalizer(batch, indices)
        old_values = [v[batch.prompt_lens[i] - 1 : len(batch.input_ids[i]) - 1] for i, v in enumerate(batch.values)]
        total_loss, clip_weighted, weight = 0.0, 0.0, 0.0
        for mb in micro_batches(batch, indices, cfg.max_tokens_per_mb, self.device):
            values = critic.model(mb.input_ids, mb.attention_mask)[:, :-1]
            loss, st = F.critic_loss(values, mb.scatter(old_values), mb.scatter(returns), mb.loss_mask,
                                     cfg.value_eps_clip, cfg.loss_aggregation, normalizer)  # fmt: skip
            (loss * self.loss_scale).backward()
            n = float(mb.loss_mask.sum())
            total_loss += float(loss.detach())
            clip_weighted += st.get("clip_frac", 0.0) * n
            weight += n
        self.sync_grads(critic.model)
        grad_norm = self._clip(critic.model)
        critic.optimizer.step()
        critic.scheduler.step()
        return {"critic_loss": total_loss, "critic_clip_frac": clip_weighted / max(weight, 1.0), "critic_grad_norm": grad_norm}

    def _clip(self, model: nn.Module) -> float:
        params = [p for p in model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.gradient_clipping if self.gradient_clipping > 0 else float("inf")
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
