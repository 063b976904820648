"""Packing sequences into micro-batches and data-parallel shards by token count.

Pure Python on lists of lengths; returns lists of sequence indices. Nothing
here imports torch or any other part of realrl.

- `ffd_allocate`: first-fit-decreasing bin packing. Each bin (micro-batch)
  holds at most `capacity` tokens, so a token budget bounds activation memory
  while the number of micro-batches stays small.
- `split_by_token_budget`: the same, named for the trainer's use.
- `partition_balanced`: exactly k groups with near-equal token sums (greedy
  longest-processing-time), for splitting a batch across data-parallel ranks.

Every result is deterministic: ties are broken by the original index, and the
indices inside a bin are listed in ascending order (so e.g. the answers of one
GRPO group stay in their original order).

To keep groups of sequences together (GRPO's `group_size` answers), pass one
length per group and expand the chosen group indices afterwards, e.g.
`flat2d([[g * size + i for i in range(size)] for g in bin])`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def flat2d(nested: Iterable[Iterable[T]]) -> list[T]:
    """[[a, b], [c]] -> [a, b, c]."""
    return [item for inner in nested for item in inner]


def _check_lengths(lengths: list[int]) -> None:
    for i, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"lengths[{i}] = {length} is negative")


def _descending_order(lengths: list[int]) -> list[int]:
    """Indices sorted by length, longest first; equal lengths keep index order."""
    return sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))


def _bin_cost(bin_lengths: list[int], padded: bool) -> int:
    """Tokens a bin costs: the plain sum, or n * max_len when it is padded to 2-D."""
    if not bin_lengths:
        return 0
    if padded:
        return len(bin_lengths) * max(bin_lengths)
    return sum(bin_lengths)


def _first_fit_decreasing(lengths: list[int], capacity: int, padded: bool) -> list[list[int]]:
    bins: list[list[int]] = []
    bin_lengths: list[list[int]] = []
    for index in _descending_order(lengths):
        length = lengths[index]
        for members, members_lengths in zip(bins, bin_lengths):
            if _bin_cost(members_lengths + [length], padded) <= capacity:
                members.append(index)
                members_lengths.append(length)
                break
        else:
            # no open bin has room (or the item alone exceeds capacity): new bin
            bins.append([index])
            bin_lengths.append([length])
    return bins


def _lightest_first(lengths: list[int], n_bins: int, capacity: int | None, padded: bool) -> list[list[int]]:
    """Longest first, each item into the currently lightest bin that has room.

    Starts with `n_bins` bins; opens another only if no bin has room.
    """
    bins: list[list[int]] = [[] for _ in range(n_bins)]
    bin_lengths: list[list[int]] = [[] for _ in range(n_bins)]
    for index in _descending_order(lengths):
        length = lengths[index]
        # an empty bin takes anything (an oversize sequence gets its own bin)
        has_room = [
            b
            for b in range(len(bins))
            if not bins[b] or capacity is None or _bin_cost(bin_lengths[b] + [length], padded) <= capacity
        ]
        # lightest bin; fewer sequences, then lower index, break ties (so
        # zero-length sequences still fill the empty bins first)
        best = min(
            has_room,
            key=lambda b: (_bin_cost(bin_lengths[b], padded), len(bins[b]), b),
            default=None,
        )
        if best is None:
            bins.append([])
            bin_lengths.append([])
            best = len(bins) - 1
        bins[best].append(index)
        bin_lengths[best].append(length)
    return bins


def ffd_allocate(lengths: list[int], capacity: int, min_groups: int = 1, padded: bool = False) -> list[list[int]]:
    """First-fit-decreasing packing of sequence indices into bins of <= capacity tokens.

    Sequences are taken longest first; each goes into the first bin where it
    still fits, or opens a new bin. A sequence longer than `capacity` gets a
    bin of its own (the only bin that may exceed capacity).

    If first fit needs fewer than `min_groups` bins, the sequences are instead
    spread over min(min_groups, len(lengths)) bins, longest first into the
    lightest bin with room (balanced and still capacity-bounded); no bin is
    ever empty, so with fewer sequences than min_groups there are only
    len(lengths) bins.

    Args:
        lengths: token count of each sequence.
        capacity: token budget per bin.
        min_groups: the least number of bins wanted (e.g. one per DP rank).
        padded: count a bin as n_seqs * max_len tokens (the cost of a padded
            [B, T] micro-batch) instead of the sum of lengths.

    Returns:
        Bins of indices into `lengths`, each bin sorted ascending; bins in the
        order they were opened (the first holds the longest sequence).
    """
    if capacity <= 0:
        raise ValueError(f"capacity must be positive, got {capacity}")
    if min_groups < 1:
        raise ValueError(f"min_groups must be >= 1, got {min_groups}")
    _check_lengths(lengths)
    if not lengths:
        return []
    bins = _first_fit_decreasing(lengths, capacity, padded)
    n_wanted = min(min_groups, len(lengths))
    if len(bins) < n_wanted:
        bins = _lightest_first(lengths, n_wanted, capacity, padded)
    return [sorted(b) for b in bins]


def split_by_token_budget(
    lengths: list[int], max_tokens_per_mb: int, n_mbs_min: int = 1, padded: bool = False
) -> list[list[int]]:
    """Micro-batches (lists of sequence indices) of at most `max_tokens_per_mb` tokens.

    At least `n_mbs_min` micro-batches when there are that many sequences. See
    `ffd_allocate`; `padded=True` budgets the padded [B, T] size instead.
    """
    return ffd_allocate(lengths, max_tokens_per_mb, min_groups=n_mbs_min, padded=padded)


def partition_balanced(lengths: list[int], k: int) -> list[list[int]]:
    """Split indices into exactly k groups with near-equal token sums.

    Greedy longest-processing-time: longest first, each into the group with
    the smallest sum so far (ties: fewer sequences, then lower index). The spread
    max(sum) - min(sum) is at most max(lengths). Groups may be empty when
    there are fewer than k sequences.

    Returns:
        k lists of indices, each sorted ascending.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    _check_lengths(lengths)
    groups: list[list[int]] = [[] for _ in range(k)]
    sums = [0] * k
    for index in _descending_order(lengths):
        lightest = min(range(k), key=lambda g: (sums[g], len(groups[g]), g))
        groups[lightest].append(index)
        sums[lightest] += lengths[index]
    return [sorted(g) for g in groups]
