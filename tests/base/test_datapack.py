"""Tests for realrl.base.datapack: FFD micro-batching and balanced DP partitions."""

import random

import pytest

from realrl.base.datapack import ffd_allocate, flat2d, partition_balanced, split_by_token_budget


def _assert_is_partition(bins, n):
    assert sorted(flat2d(bins)) == list(range(n))


def test_ffd_classic_example():
    # Items 2,5,4,7,1,3,8 into bins of 10. Longest first:
    #   8 -> new bin A; 7 -> new bin B; 5 -> new bin C; 4 -> C (9);
    #   3 -> B (10); 2 -> A (10); 1 -> C (10).   Three full bins.
    lengths = [2, 5, 4, 7, 1, 3, 8]
    bins = ffd_allocate(lengths, capacity=10)
    assert bins == [[0, 6], [3, 5], [1, 2, 4]]
    assert [sum(lengths[i] for i in b) for b in bins] == [10, 10, 10]


def test_ffd_capacity_invariant_random():
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 40)
        capacity = rng.randint(5, 200)
        lengths = [rng.randint(0, 120) for _ in range(n)]
        min_groups = rng.randint(1, 6)
        bins = ffd_allocate(lengths, capacity, min_groups=min_groups)
        _assert_is_partition(bins, n)
        assert all(b for b in bins), "no empty bins"
        assert len(bins) >= min(min_groups, n)
        for b in bins:
            total = sum(lengths[i] for i in b)
            # only a lone oversize sequence may exceed the budget
            assert total <= capacity or (len(b) == 1 and lengths[b[0]] > capacity)
            assert b == sorted(b)
        assert ffd_allocate(lengths, capacity, min_groups=min_groups) == bins  # deterministic


def test_ffd_oversize_item_gets_own_bin():
    # 15 > 10 alone; then 4 opens a bin (15+4 > 10) and 3 joins it.
    assert ffd_allocate([15, 3, 4], capacity=10) == [[0], [1, 2]]


def test_ffd_min_groups_spreads_when_first_fit_needs_fewer_bins():
    # Everything fits one bin of 100, but 2 are wanted: spread lightest-first.
    assert ffd_allocate([3, 3, 3, 3], capacity=100) == [[0, 1, 2, 3]]
    assert ffd_allocate([3, 3, 3, 3], capacity=100, min_groups=2) == [[0, 2], [1, 3]]
    # The DP-style use: huge capacity, one group per rank, balanced sums.
    lengths = [9, 1, 8, 2, 7, 3]
    bins = ffd_allocate(lengths, capacity=10**12, min_groups=3)
    assert len(bins) == 3
    assert sorted(sum(lengths[i] for i in b) for b in bins) == [10, 10, 10]
    # Fewer sequences than wanted groups: one bin each, none empty.
    assert ffd_allocate([5, 6], capacity=100, min_groups=4) == [[1], [0]]
    # Zero-length sequences still land in distinct bins.
    assert len(ffd_allocate([0, 0, 0], capacity=10, min_groups=3)) == 3


def test_ffd_min_groups_already_satisfied_keeps_first_fit():
    # 6,6,6 need three bins of 10 anyway; the 1 joins the first.
    assert ffd_allocate([6, 6, 6, 1], capacity=10, min_groups=2) == [[0, 3], [1], [2]]


def test_ffd_padded_cost():
    lengths = [10, 2, 2, 2]
    # by sum, 10 + 2 fits a budget of 12
    assert ffd_allocate(lengths, capacity=12) == [[0, 1], [2, 3]]
    # padded to 2-D, [10, 2] costs 2 * 10 = 20 > 12; three 2s cost 3 * 2 = 6
    assert ffd_allocate(lengths, capacity=12, padded=True) == [[0], [1, 2, 3]]
    rng = random.Random(1)
    for _ in range(100):
        lengths = [rng.randint(1, 50) for _ in range(rng.randint(1, 30))]
        bins = split_by_token_budget(lengths, 100, n_mbs_min=rng.randint(1, 4), padded=True)
        _assert_is_partition(bins, len(lengths))
        for b in bins:
            assert len(b) * max(lengths[i] for i in b) <= 100


def test_split_by_token_budget_matches_ffd():
    lengths = [2, 5, 4, 7, 1, 3, 8]
    assert split_by_token_budget(lengths, 10) == ffd_allocate(lengths, 10)
    assert len(split_by_token_budget(lengths, 1000, n_mbs_min=4)) == 4


def test_ffd_edge_cases():
    assert ffd_allocate([], capacity=10) == []
    with pytest.raises(ValueError):
        ffd_allocate([1, 2], capacity=0)
    with pytest.raises(ValueError):
        ffd_allocate([1, -2], capacity=10)


def test_partition_balanced_hand_example():
    # Greedy into the lightest group: 10->g0, 9->g1, 8->g2, 7->g2 (15),
    # 6->g1 (15), 5->g0 (15), 4->g0 (19; all tied at 15, lowest index).
    lengths = [10, 9, 8, 7, 6, 5, 4]
    groups = partition_balanced(lengths, 3)
    assert groups == [[0, 5, 6], [1, 4], [2, 3]]
    assert [sum(lengths[i] for i in g) for g in groups] == [19, 15, 15]


def test_partition_balanced_random_sums():
    rng = random.Random(2)
    for _ in range(200):
        n = rng.randint(0, 50)
        k = rng.randint(1, 8)
        lengths = [rng.randint(0, 500) for _ in range(n)]
        groups = partition_balanced(lengths, k)
        assert len(groups) == k
        _assert_is_partition(groups, n)
        sums = [sum(lengths[i] for i in g) for g in groups]
        if n:
            assert max(sums) - min(sums) <= max(lengths)
        if n >= k:
            assert all(groups)


def test_flat2d():
    assert flat2d([[1, 2], [], [3]]) == [1, 2, 3]
