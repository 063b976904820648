"""Picking one token for every row of a batch at once.

Sampling is vectorised over the batch with per-row temperature / top-p /
top-k / min-p tensors (`RowParams`) and the engine's `torch.Generator`, seeded
from `--seed`.

**Logprobs.** Two per generated token, both in float32 (docs/design.md §6):

- the logprob, `log_softmax(logits / T)[token]`, where T is the request's
  temperature (T = 0, greedy, uses T = 1, i.e. plain `log_softmax(logits)`). It
  is taken *before* top-p / top-k / min-p filtering and before the
  `min_new_tokens` stop-token mask, so the trainer reproduces it exactly from a
  forward pass of the same weights with the same temperature scaling;
- the sampling logprob: the token's logprob under the distribution it was
  actually drawn from, i.e. after the filters and the stop-token mask,
  renormalised (0.0 for a greedy row: a point mass). A row that nothing
  filters or masks gets the logprob itself, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from realrl.impl.generation.torch_server.protocol import Request


@dataclass
class RowParams:
    """The sampling parameters of a batch's rows, as tensors."""

    temperature: torch.Tensor  # [B] float32; 0 = greedy
    top_p: torch.Tensor
    top_k: torch.Tensor  # [B] long; <= 0 = off
    min_p: torch.Tensor
    all_greedy: bool
    any_greedy: bool
    any_filter: bool
    filtered: torch.Tensor  # [B] bool: a sampled row that top-p / top-k / min-p may cut

    @classmethod
    def from_requests(cls, requests: Sequence[Request], device: torch.device) -> RowParams:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            temperature=torch.tensor([r.temperature for r in requests], **f32),
            top_p=torch.tensor([r.top_p for r in requests], **f32),
            top_k=torch.tensor([r.top_k for r in requests], dtype=torch.long, device=device),
            min_p=torch.tensor([r.min_p for r in requests], **f32),
            all_greedy=all(r.is_greedy for r in requests),
            any_greedy=any(r.is_greedy for r in requests),
            any_filter=any(r.needs_filter for r in requests),
            filtered=torch.tensor([r.needs_filter for r in requests], dtype=torch.bool, device=device),
        )

    def select(self, index: torch.Tensor, requests: Sequence[Request]) -> RowParams:
        """These rows' parameters (`index`), whose requests are `requests`, in that order."""
        return RowParams(
            temperature=self.temperature.index_select(0, index),
            top_p=self.top_p.index_select(0, index),
            top_k=self.top_k.index_select(0, index),
            min_p=self.min_p.index_select(0, index),
            # What holds for all rows holds for some; what holds for none holds for none of some.
            all_greedy=self.all_greedy or (self.any_greedy and all(r.is_greedy for r in requests)),
            any_greedy=self.any_greedy and any(r.is_greedy for r in requests),
            any_filter=self.any_filter and any(r.needs_filter for r in requests),
            filtered=self.filtered.index_select(0, index),
        )


def sample_tokens(
    logits: torch.Tensor,
    params: RowParams,
    generator: torch.Generator,
    banned: list[tuple[int, list[int]]] | None = None,
    check_finite: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pick one token per row; return (tokens, logprobs, sampling_logprobs):
    logprob = log_softmax(logits / T)[token] (T = 1 for greedy rows), before
    any filtering; sampling logprob = the token's logprob under the filtered,
    renormalised distribution it was drawn from (module docstring).

    `banned`: (row, token ids) that must not be picked (min_new_tokens).
    `check_finite=False` skips the host sync of the non-finite check: such a
    row samples from a uniform stand-in and reports NaN logprobs, which the
    caller turns into the same FloatingPointError after its one copy."""
    logits = logits.float()
    temperature = params.temperature
    scale = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    scaled = logits / scale[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    # NaN / +inf logits (or all -inf) make every logprob of the row NaN. Refuse
    # them here: torch.multinomial would raise on CPU but hit a device-side
    # assert on CUDA (which ends the process), and greedy rows would return NaN.
    if check_finite:
        if not bool(torch.isfinite(logprobs.amax(dim=-1)).all()):
            raise FloatingPointError("the model produced non-finite logits (NaN or inf)")
    else:
        scaled = scaled.masked_fill(~torch.isfinite(logprobs.amax(dim=-1, keepdim=True)), 0.0)

    pick_from = scaled
    masked = torch.zeros_like(params.filtered)  # rows whose stop tokens are banned
    if banned:
        pick_from = scaled.clone()
        for row, ids in banned:
            pick_from[row, ids] = float("-inf")
            masked[row] = True

    filtered_logprobs = None  # rows with a filter: the logprob under the kept tokens, renormalised
    if params.all_greedy:
        tokens = pick_from.argmax(dim=-1)
    else:
        if params.any_filter:
            sorted_logits, sorted_idx = pick_from.sort(dim=-1, descending=True)
            sorted_probs = torch.softmax(sorted_logits, dim=-1)
            ranks = torch.arange(sorted_logits.shape[-1], device=logits.device)
            top_k = params.top_k[:, None]
            drop = (top_k > 0) & (ranks[None, :] >= top_k)
            # top-p: drop a token if the tokens ranked above it already cover top_p
            drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) > params.top_p[:, None]
            drop |= sorted_probs < params.min_p[:, None] * sorted_probs[:, :1]
            drop[:, 0] = False  # the most likely token always survives
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            choice = torch.multinomial(torch.softmax(sorted_logits, dim=-1), 1, generator=generator)
            sampled = sorted_idx.gather(1, choice).squeeze(1)
            filtered_logprobs = torch.log_softmax(sorted_logits, dim=-1).gather(1, choice).squeeze(1)
        else:
            sampled = torch.multinomial(torch.softmax(pick_from, dim=-1), 1, generator=generator).squeeze(1)
        if params.any_greedy:
            sampled = torch.where(temperature > 0, sampled, pick_from.argmax(dim=-1))
        tokens = sampled
    token_logprobs = logprobs.gather(1, tokens[:, None]).squeeze(1)
    if params.all_greedy:  # a point mass
        return tokens, token_logprobs, torch.zeros_like(token_logprobs)
    # The sampling logprob: the plain one (the same tensor: bit for bit) where
    # nothing changed the distribution; the masked softmax's where only the
    # ban did; the filtered one where a filter did (after the ban too); 0 for
    # a greedy row.
    sampling_logprobs = token_logprobs
    if banned:  # some row is masked (no device sync to find out)
        banned_only = torch.log_softmax(pick_from, dim=-1).gather(1, tokens[:, None]).squeeze(1)
        sampling_logprobs = torch.where(masked, banned_only, sampling_logprobs)
    if filtered_logprobs is not None:
        sampling_logprobs = torch.where(params.filtered, filtered_logprobs, sampling_logprobs)
    if params.any_greedy:
        sampling_logprobs = torch.where(temperature > 0, sampling_logprobs, torch.zeros_like(sampling_logprobs))
    return tokens, token_logprobs, sampling_logprobs
