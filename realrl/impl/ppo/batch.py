"""The sequences of one train step, and their layout for one forward pass.

`SequenceBatch` holds one rank's sequences of a step (flattened
trajectories) and what the trainer computes for them. `make_micro_batch`
lays a few of them out for the model: each row holds a prompt once, followed
by the completions of the sequences that share it (a 4-D mask keeps each
completion to the prompt and itself), or one sequence (which rows share is
`realrl.impl.ppo.packing`'s choice). Per-token tensors are in completion
layout: [n, C], row k a sequence, column j its completion token j.

The loss mask is decided here, once (docs/design.md §5): a completion token
is trained when the policy sampled it. A multi-turn sequence (a chain of chat
turns) holds context between its sampled spans (tool results, user turns,
template tokens); those have loss mask 0 in every micro-batch, so every loss,
normaliser, statistic and advantage built on the micro-batch's `loss_mask`
leaves them out, and `n_completion_tokens` counts sampled tokens only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch.nn.utils.rnn import pad_sequence

from realrl.api.trajectory import Trajectory


@dataclasses.dataclass
class SequenceBatch:
    """The sequences one rank trains on in one step (flattened trajectories)."""

    input_ids: list[torch.Tensor]  # int64 [L_i]: prompt + completion
    prompt_lens: list[int]
    # float32 [L_i - P_i], from the generation servers: log_softmax(logits / T), unfiltered (the
    # PPO ratio's old policy when the loss is not decoupled)
    behav_logprobs: list[torch.Tensor]
    rewards: torch.Tensor  # float32 [N], already shaped by the agent
    no_eos: torch.Tensor  # bool [N]
    groups: list[list[int]]  # the sequence indices of each trajectory
    # Per group, its chains: the sequence indices of each sampled episode (a multi-turn agent's turns,
    # `metadata["chain"]`, docs/design.md §5); None: every sequence is a chain of its own
    chains: list[list[list[int]]] | None = None
    prox_logprobs: list[torch.Tensor] | None = None  # [L_i - P_i]
    # Decoupled loss with one minibatch: the proximal logprobs are the train
    # forward's own (detached) logprobs, taken at the same weights (no pass of their own).
    prox_from_train_forward: bool = False
    ref_logprobs: list[torch.Tensor] | None = None  # [L_i - P_i]
    values: list[torch.Tensor] | None = None  # [L_i - P_i + 1]: state values at tokens P_i-1 .. L_i-1
    # bool [L_i - P_i]: True where the policy sampled the token; None (or a
    # None entry) means every completion token was sampled
    loss_masks: list[torch.Tensor | None] | None = None
    # [L_i - P_i]: under the distribution each token was drawn from (after top-k/top-p/min-p),
    # the behaviour policy of the decoupled loss's weight (docs/design.md §9); None: behav_logprobs
    sampling_logprobs: list[torch.Tensor] | None = None
    # Per sequence, the temperature its logprobs are taken at (None: the run's, `rollout.gconfig`)
    temperatures: list[float | None] | None = None

    @staticmethod
    def from_trajectories(trajectories: list[Trajectory]) -> SequenceBatch:
        input_ids, prompt_lens, behav, rewards, no_eos, groups, masks = [], [], [], [], [], [], []
        sampling, temperatures, chains = [], [], []
        for traj in trajectories:
            group = []
            chain_of = traj.metadata.get("chain") or range(traj.group_size)
            by_chain: dict[int, list[int]] = {}
            for i in range(traj.group_size):
                by_chain.setdefault(int(chain_of[i]), []).append(len(input_ids))
                group.append(len(input_ids))
                input_ids.append(torch.from_numpy(traj.input_ids[i].astype("int64")))
                prompt_lens.append(int(traj.prompt_len[i]))
                behav.append(torch.from_numpy(traj.logprobs[i].copy()))
                sampling.append(torch.from_numpy(traj.sampling_logprobs[i].copy()) if traj.sampling_logprobs else None)
                temperatures.append(traj.sampling[i].logprob_temperature if traj.sampling else None)
                rewards.append(float(traj.reward[i]))
                no_eos.append(bool(traj.no_eos[i]))
                masks.append(None if not traj.loss_mask else torch.from_numpy(traj.loss_mask[i].astype(bool)))
            groups.append(group)
            chains.append(list(by_chain.values()))
        return SequenceBatch(
            input_ids,
            prompt_lens,
            behav,
            torch.tensor(rewards, dtype=torch.float32),
            torch.tensor(no_eos, dtype=torch.bool),
            groups,
            chains=chains,
            loss_masks=masks if any(m is not None for m in masks) else None,
            # a sequence that records none: its tokens were drawn from the unfiltered distribution
            sampling_logprobs=[b if s is None else s for s, b in zip(sampling, behav)]
            if any(s is not None for s in sampling)
            else None,
            temperatures=temperatures if any(t is not None for t in temperatures) else None,
        )

    @property
    def n_seqs(self) -> int:
        return len(self.input_ids)

    @property
    def seq_lens(self) -> list[int]:
        return [len(x) for x in self.input_ids]

    @property
    def completion_lens(self) -> list[int]:
        """Every sequence's completion length (computed once: the trainer asks per sequence many times a step)."""
        lens = self.__dict__.get("_completion_lens")
        if lens is None or len(lens) != len(self.input_ids):
            lens = self.__dict__["_completion_lens"] = [len(x) - p for x, p in zip(self.input_ids, self.prompt_lens)]
        return lens

    def completion_len(self, i: int) -> int:
        return self.completion_lens[i]

    def trained_mask(self, i: int) -> torch.Tensor:
        """bool [C_i]: which completion tokens of sequence i the policy sampled:
        the ones the losses, advantages and their normalisers cover (a
        trajectory's `loss_mask`, docs/design.md §5; all when it has none)."""
        mask = None if self.loss_masks is None else self.loss_masks[i]
        return torch.ones(self.completion_len(i), dtype=torch.bool) if mask is None else mask.bool()

    def group_chains(self) -> list[list[list[int]]]:
        """Per group, the sequence indices of each of its chains (sampled episodes), in order."""
        return self.chains if self.chains is not None else [[[i] for i in group] for group in self.groups]

    def sampled_spans(self, i: int) -> list[int]:
        """The lengths of sequence i's sampled spans: each one generation call's answer (a chain of chat
        turns holds context between them); one span, the whole completion, without a loss mask."""
        mask = self.trained_mask(i).tolist()
        spans, run = [], 0
        for sampled in mask + [False]:
            if sampled:
                run += 1
            elif run:
                spans.append(run)
                run = 0
        return spans

    def n_sampled(self, i: int) -> int:
        mask = None if self.loss_masks is None else self.loss_masks[i]
        return self.completion_len(i) if mask is None else int(mask.sum())

    def n_completion_tokens(self, indices: list[int] | None = None) -> int:
        """Trained (sampled) completion tokens of these sequences (all: None)."""
        if self.loss_masks is None:  # every completion token was sampled
            lens = self.completion_lens
            return sum(lens) if indices is None else sum(lens[i] for i in indices)
        indices = range(self.n_seqs) if indices is None else indices
        return sum(map(self.n_sampled, indices))


@dataclasses.dataclass
class MicroBatch:
    """Sequences laid out for one forward pass.

    The model sees `rows`: each holds a prompt once, then the completions of
    the sequences that share it (one sequence per row when sharing is off or
    does not pay), or several such blocks side by side, right-padded to
    [R, W]. With shared rows a completion's
    tokens attend to its prompt and to themselves only (a 4-D mask) and
    carry their own positions (P, P+1, ...), so each gets exactly the
    logits it would get alone; gradients through the shared prompt are the
    sum of its completions' (as with separate rows).

    Per-token tensors are in completion layout [n, C]: row k is sequence
    `indices[k]`, column j its completion token j, predicted from the token
    at (src_rows[k, j], src_cols[k, j]); column C_k of src_* is its last token.
    """

    indices: list[int]
    input_ids: torch.Tensor  # [R, W]
    attention_mask: torch.Tensor  # [R, W] with one sequence per row; else [R, 1, W, W] (bool, or additive)
    position_ids: torch.Tensor | None  # [R, W] with shared rows
    src_rows: torch.Tensor  # [n, C+1]
    src_cols: torch.Tensor  # [n, C+1]
    targets: torch.Tensor  # [n, C]: the completion tokens
    loss_mask: torch.Tensor  # [n, C], 1.0 on the completion tokens the policy sampled
    batch: SequenceBatch

    def scatter(self, per_seq: list[torch.Tensor], fill: float = 0.0) -> torch.Tensor:
        """Per-sequence completion values as [n, C]."""
        if not self.indices:  # the padding micro-batch
            return torch.full(self.loss_mask.shape, fill, dtype=torch.float32, device=self.loss_mask.device)
        out = pad_sequence([per_seq[i].float().cpu() for i in self.indices], batch_first=True, padding_value=fill)
        return out.to(self.loss_mask.device)  # [n, C]: C is the longest completion

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of `scatter`: per-sequence slices of [n, C(+1)]; an
        [n, C+1] tensor (values at src positions) keeps the last token's."""
        extra = tensor.shape[1] - self.loss_mask.shape[1]
        tensor = tensor.float().cpu()
        return [tensor[k, : self.batch.completion_len(i) + extra] for k, i in enumerate(self.indices)]

    def at_sources(self, per_position: torch.Tensor) -> torch.Tensor:
        """[R, W, ...] model outputs at each completion token's source: [n, C+1, ...]."""
        return per_position[self.src_rows, self.src_cols]


def make_micro_batch(
    batch: SequenceBatch, rows: list, device: torch.device, pad_id: int = 0, additive_mask: bool = False
) -> MicroBatch:
    """A micro-batch of these rows (see `plan_micro_batches`): a row is a
    list of sequences with the same prompt, or a list of such lists (blocks
    side by side in one row, each with its own prompt and positions). No rows
    gives the padding micro-batch (one 2-token dummy with an all-zero loss
    mask) that a rank with fewer micro-batches than the others runs to join
    their collectives. Shared rows get a boolean mask (SDPA), or an additive
    one (`additive_mask`: eager attention adds it to the scores)."""
    rows = [row if row and isinstance(row[0], list) else [row] for row in rows]  # each row: its blocks
    indices = [i for row in rows for block in row for i in block]
    # Built as Python lists, one tensor each at the end (a few small tensor
    # writes per sequence cost more than the forward of a tiny model).
    # segment: 0 a prompt, s + 1 the row's completion s, -1 padding; block: the position's block (-1 padding)
    ids_rows, seg_rows, blk_rows, pos_rows = [], [], [], []
    src_rows, src_cols, targets, masks = [], [], [], []
    for r, row in enumerate(rows):
        ids, seg, blk, pos, s = [], [], [], [], 0
        for b, block in enumerate(row):
            P, start = batch.prompt_lens[block[0]], len(ids)
            ids += batch.input_ids[block[0]][:P].tolist()
            seg += [0] * P
            pos += range(P)
            for i in block:
                s += 1
                completion = batch.input_ids[i][P:].tolist()
                G, col = len(completion), len(ids)
                # token j is predicted from the one before it: the prompt's last, then this completion's own
                src_cols.append([start + P - 1, *range(col, col + G)])
                src_rows.append(r)
                targets.append(completion)
                mask = None if batch.loss_masks is None else batch.loss_masks[i]
                masks.append([1] * G if mask is None else mask.long().tolist())
                ids += completion
                seg += [s] * G
                pos += range(P, P + G)
            blk += [b] * (len(ids) - start)
        ids_rows.append(ids)
        seg_rows.append(seg)
        blk_rows.append(blk)
        pos_rows.append(pos)
    if not rows:  # the padding micro-batch
        ids_rows, seg_rows, blk_rows, pos_rows = [[pad_id] * 2], [[0, 0]], [[0, 0]], [[0, 1]]
        src_rows, src_cols, targets, masks = [0], [[0]], [[]], [[]]
    W = max(map(len, ids_rows))
    C = max(max(map(len, targets)), 0 if rows else 1)

    def padded(lists: list[list[int]], width: int, fill: int) -> torch.Tensor:
        return torch.tensor([x + [fill] * (width - len(x)) for x in lists], dtype=torch.long)

    input_ids, segment, position_ids = padded(ids_rows, W, pad_id), padded(seg_rows, W, -1), padded(pos_rows, W, 0)
    # Past a completion's end its source repeats its last token (any valid index: masked out).
    src_cols_t = torch.tensor([c + [c[-1]] * (C + 1 - len(c)) for c in src_cols], dtype=torch.long)
    src_rows_t = torch.tensor(src_rows, dtype=torch.long)[:, None].expand(-1, C + 1).contiguous()
    # The one place the trainer decides which tokens train: context tokens
    # inside a completion (and padding) get 0.
    loss_mask = padded(masks, C, 0).float()
    targets_t = padded(targets, C, 0)
    if all(len(row) == 1 and len(row[0]) == 1 for row in rows):  # separate rows: the 2-D padding mask says it all
        attention_mask, position_ids = (segment >= 0).long(), None
    else:
        blocks = padded(blk_rows, W, -1) if any(len(row) > 1 for row in rows) else None
        attention_mask = _shared_prompt_mask(segment, additive_mask, blocks)
    return MicroBatch(
        indices,
        input_ids.to(device),
        attention_mask.to(device),
        None if position_ids is None else position_ids.to(device),
        src_rows_t.to(device),
        src_cols_t.to(device),
        targets_t.to(device),
        loss_mask.to(device),
        batch,
    )


def _shared_prompt_mask(segment: torch.Tensor, additive: bool, blocks: torch.Tensor | None = None) -> torch.Tensor:
    """[R, 1, W, W]: causal, and a completion sees its prompt and itself
    only (`blocks`, when a row holds several: within its own block); a padding
    position sees itself (no empty softmax). True = attend, or additive: 0 /
    the float32 minimum."""
    W = segment.shape[1]
    q, kv = segment[:, :, None], segment[:, None, :]
    causal = torch.ones(W, W, dtype=torch.bool).tril()
    allowed = causal & (q >= 0) & ((kv == 0) | (kv == q))
    if blocks is not None:
        allowed &= blocks[:, :, None] == blocks[:, None, :]
    allowed |= torch.eye(W, dtype=torch.bool)
    if not additive:
        return allowed[:, None]
    return torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)[:, None]
