"""The paged scheduler: packed prefill, forks of a group, decode with
preempt-and-recompute, and no block leaked whatever happens (property-tested)."""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from realrl.impl.generation.torch_server.block_manager import BlockAllocator
from realrl.impl.generation.torch_server.scheduler import PrefillStep, Scheduler


@dataclass
class Req:  # the fields of protocol.Request the scheduler reads
    input_ids: list[int]
    max_new_tokens: int
    output_ids: list[int] = field(default_factory=list)


def check(s: Scheduler) -> None:
    held = Counter(b for seq in s.running for b in seq.block_table)
    alloc = s.allocator
    assert alloc.refcount == [held[b] for b in range(alloc.num_blocks)]
    assert alloc.num_free == sum(1 for b in range(alloc.num_blocks) if held[b] == 0)
    for seq in s.running:  # room for every cached token, and the partial block is its own
        assert len(seq.block_table) * alloc.block_size >= seq.num_cached
        if seq.num_cached % alloc.block_size:
            assert alloc.refcount[seq.block_table[seq.num_cached // alloc.block_size]] == 1
    in_running = {id(q.request) for q in s.running}
    assert not in_running & {id(r) for r in s.waiting}


def record(s: Scheduler, seqs, token: int) -> None:
    """A step's sampled token for each row; finished rows leave."""
    done = []
    for seq in seqs:
        seq.request.output_ids.append(token)
        if len(seq.request.output_ids) >= seq.request.max_new_tokens:
            done.append(seq)
    s.release(done)


def test_a_group_is_one_prefill_and_shares_its_full_blocks():
    waiting = deque(Req([1] * 10, 5) for _ in range(16))
    s = Scheduler(BlockAllocator(num_blocks=40, block_size=4), max_seqs=64, max_prefill_tokens=64, waiting=waiting)
    step = s.schedule_prefill()
    assert len(step.seqs) == 1 and len(step.rows) == 16 and step.source == [0] * 16
    assert step.num_tokens == 10  # computed once
    assert len(step.copies) == 15  # the partial third block, once per other answer
    assert s.allocator.num_free == 40 - 2 - 16  # 2 shared full blocks + 16 last blocks
    check(s)


def test_prefill_packs_under_the_token_budget_and_the_first_always_goes():
    waiting = deque([Req(list(range(30)), 2), Req([1, 2], 2), Req([3] * 5, 2)])
    s = Scheduler(BlockAllocator(num_blocks=40, block_size=4), max_seqs=8, max_prefill_tokens=20, waiting=waiting)
    assert [q.num_tokens for q in s.schedule_prefill().seqs] == [30]
    assert [q.num_tokens for q in s.schedule_prefill().seqs] == [2, 5]
    assert s.schedule_prefill() is None


def test_decode_preempts_the_newest_and_it_recomputes_with_its_outputs():
    waiting = deque([Req([1, 2, 3], 6), Req([4, 5, 6], 6)])
    s = Scheduler(BlockAllocator(num_blocks=4, block_size=2), max_seqs=8, max_prefill_tokens=64, waiting=waiting)
    step = s.schedule_prefill()
    assert len(step.seqs) == 2 and s.allocator.num_free == 0
    first, second = step.rows
    record(s, step.rows, 7)
    record(s, s.schedule_decode().seqs, 8)  # 4 tokens each: the 2 blocks hold them
    decode = s.schedule_decode()  # 5 tokens need a third block each: the newest goes
    assert decode.seqs == [first] and decode.preempted == [second.request]
    assert list(waiting) == [second.request] and second.request.output_ids == [7, 8]
    check(s)
    record(s, decode.seqs, 9)
    assert s.schedule_prefill() is None  # 5 tokens: 3 blocks, 1 free
    while s.running:
        record(s, s.schedule_decode().seqs, 9)
    step = s.schedule_prefill()  # recomputed from all its tokens
    assert step.seqs[0].request is second.request and step.num_tokens == 5
    check(s)


def test_requests_that_cannot_fit_or_want_nothing_are_returned():
    waiting = deque([Req([1] * 5, 0), Req([1] * 5, 20), Req([2], 3)])
    s = Scheduler(BlockAllocator(num_blocks=4, block_size=4), max_seqs=8, max_prefill_tokens=64, waiting=waiting)
    step = s.schedule_prefill()
    assert isinstance(step, PrefillStep) and len(step.no_tokens) == 1 and len(step.too_long) == 1
    assert [q.num_tokens for q in step.seqs] == [1]


events = st.lists(
    st.one_of(
        st.tuples(st.just("arrive"), st.integers(1, 12), st.integers(1, 4), st.integers(0, 9)),
        st.tuples(st.just("step"), st.booleans()),
        st.tuples(st.just("abort"), st.integers(0, 30)),
    ),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(num_blocks=st.integers(6, 30), block_size=st.integers(1, 4), max_seqs=st.integers(1, 8), events=events)
def test_no_block_leaks_under_arrivals_steps_aborts_and_preemption(num_blocks, block_size, max_seqs, events):
    waiting: deque = deque()
    s = Scheduler(BlockAllocator(num_blocks, block_size), max_seqs, max_prefill_tokens=24, waiting=waiting)
    answered: list[Req] = []
    every: list[Req] = []
    for event in events:
        if event[0] == "arrive":  # a group of n answers to one prompt
            _, length, n, max_new = event
            reqs = [Req([length % 7] * length, max_new) for _ in range(n)]
            waiting.extend(reqs)
            every += reqs
        elif event[0] == "step":
            step = s.schedule_prefill() if event[1] else None
            if step is not None:
                answered += step.no_tokens + step.too_long
                record(s, step.rows, 1)
            elif s.running:
                step = s.schedule_decode()
                record(s, step.seqs, 2)
        elif s.running:
            s.remove([event[1] % s.size])
        check(s)
        for seq in s.running:
            assert seq.num_cached <= seq.num_tokens
    # Drain: everything left finishes; the pool ends empty.
    for _ in range(10_000):
        if not (waiting or s.running):
            break
        step = s.schedule_prefill()
        if step is not None:
            answered += step.no_tokens + step.too_long
            record(s, step.rows, 1)
        if s.running:
            record(s, s.schedule_decode().seqs, 2)
        check(s)
    assert not waiting and not s.running
    assert s.allocator.num_free == num_blocks and not any(s.allocator.refcount)
