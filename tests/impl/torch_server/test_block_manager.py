"""The block allocator's invariants under any sequence of operations (property-tested)."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from realrl.impl.generation.torch_server.block_manager import BlockAllocator, OutOfBlocks


def check_invariants(alloc: BlockAllocator, live: list[tuple[list[int], int]]) -> None:
    """Each block's count is the number of live tables holding it; the free
    list is exactly the unreferenced blocks, each once; a partial last block
    (the next write goes there) belongs to one table only."""
    held = Counter(b for t, _ in live for b in t)
    assert alloc.refcount == [held[b] for b in range(alloc.num_blocks)]
    assert sorted(alloc._free) == [b for b in range(alloc.num_blocks) if held[b] == 0]
    for table, n in live:
        if n % alloc.block_size:
            assert alloc.refcount[table[-1]] == 1


operation = st.one_of(
    st.tuples(st.just("allocate"), st.integers(0, 40)),
    st.tuples(st.just("grow"), st.integers(0, 50), st.integers(1, 9)),
    st.tuples(st.just("fork"), st.integers(0, 50), st.integers(1, 16)),
    st.tuples(st.just("free"), st.integers(0, 50)),
)


@settings(max_examples=300, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 5), ops=st.lists(operation, max_size=60))
def test_no_block_leaks_and_counts_stay_consistent(num_blocks, block_size, ops):
    alloc = BlockAllocator(num_blocks, block_size)
    live: list[tuple[list[int], int]] = []  # (table, tokens it holds)
    for op in ops:
        before = (list(alloc.refcount), sorted(alloc._free))
        try:
            if op[0] == "allocate":
                live.append((alloc.allocate(op[1]), op[1]))
            elif live and op[0] == "grow":
                table, n = live[op[1] % len(live)]
                alloc.grow(table, n + op[2])
                live[op[1] % len(live)] = (table, n + op[2])
            elif live and op[0] == "fork":
                table, n = live[op[1] % len(live)]
                tables, copies = alloc.fork(table, n, op[2])
                partial = n % block_size != 0
                assert len(copies) == (op[2] if partial else 0)
                assert all(src == table[-1] for src, _ in copies)
                live += [(t, n) for t in tables]
            elif live and op[0] == "free":
                table, _ = live.pop(op[1] % len(live))
                alloc.free(table)
                assert table == []
        except OutOfBlocks:
            assert (list(alloc.refcount), sorted(alloc._free)) == before  # nothing changed
        for table, n in live:
            assert len(table) == alloc.blocks_for(n)
        check_invariants(alloc, live)
    for table, _ in live:
        alloc.free(table)
    assert alloc.num_free == num_blocks and not any(alloc.refcount)


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    alloc = BlockAllocator(num_blocks=20, block_size=4)
    prompt = alloc.allocate(10)  # 2 full blocks + 2 tokens
    tables, copies = alloc.fork(prompt, 10, 15)  # 16 answers in all
    assert all(t[:2] == prompt[:2] for t in tables)
    assert [alloc.refcount[b] for b in prompt[:2]] == [16, 16]
    # 16 answers hold 2 + 16 blocks, not 16 * 3.
    assert alloc.num_free == 20 - 3 - 15 and len(copies) == 15
    aligned = alloc.allocate(0)
    assert alloc.fork(aligned, 0, 3) == ([[], [], []], [])


def test_fork_that_does_not_fit_changes_nothing():
    alloc = BlockAllocator(num_blocks=4, block_size=4)
    prompt = alloc.allocate(6)
    with pytest.raises(OutOfBlocks):
        alloc.fork(prompt, 6, 3)
    assert alloc.refcount == [1, 1, 0, 0] and alloc.num_free == 2


def test_double_free_is_refused():
    alloc = BlockAllocator(num_blocks=2, block_size=2)
    table = alloc.allocate(3)
    copy = list(table)
    alloc.free(table)
    with pytest.raises(AssertionError):
        alloc.free(copy)
