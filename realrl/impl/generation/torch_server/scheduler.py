"""Which sequences the next step computes: packed all-prefill or all-decode.

Pure Python (no torch), over a `BlockAllocator`. `waiting` holds requests
(the engine's queue, shared: aborts and pauses act on it directly);
`running` holds the `Sequence`s whose keys/values are in the pool.

- **Prefill** takes requests from the head of `waiting` while the running set
  has room (`max_seqs`), their tokens fit the step's budget
  (`max_prefill_tokens`, counted unpadded; the first always goes) and the
  pool has their blocks. A request with the same prompt as one earlier in the
  step and no output yet (an answer of the same GRPO group) is not computed
  again: it is a fork of that one (`BlockAllocator.fork`), sampling its own
  first token from the same logits.
- **Decode** steps every running sequence by one token. When the pool cannot
  give a sequence the block its next token needs, the newest running
  sequence is preempted: its blocks are freed and its request goes back to
  the head of `waiting`, outputs kept, to be prefilled again from all its
  tokens (recompute).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from realrl.impl.generation.torch_server.block_manager import BlockAllocator
from realrl.impl.generation.torch_server.sequence import Sequence


@dataclass
class PrefillStep:
    seqs: list[Sequence]  # computed: all their tokens go through the model
    # Sampled rows: the computed ones, then the forks; `source[i]` is the
    # computed sequence whose last logits row i samples from.
    rows: list[Sequence] = field(default_factory=list)
    source: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # block copies after the forward
    no_tokens: list[Any] = field(default_factory=list)  # requests asking for 0 tokens: answered at once
    too_long: list[Any] = field(default_factory=list)  # requests no pool of this size can hold

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


@dataclass
class DecodeStep:
    seqs: list[Sequence]
    preempted: list[Any] = field(default_factory=list)  # their requests, back in `waiting`


class Scheduler:
    def __init__(self, allocator: BlockAllocator, max_seqs: int, max_prefill_tokens: int, waiting: deque):
        self.allocator = allocator
        self.max_seqs, self.max_prefill_tokens = max_seqs, max_prefill_tokens
        self.waiting = waiting
        self.running: list[Sequence] = []

    # ---- the running set, as the engine's batch (size, requests, remove)

    @property
    def size(self) -> int:
        return len(self.running)

    @property
    def requests(self) -> list[Any]:
        return [s.request for s in self.running]

    def remove(self, indices: list[int]) -> bool:
        """Free these running sequences (by index); False if none is left."""
        drop = set(indices)
        for i in sorted(drop):
            self.allocator.free(self.running[i].block_table)
        self.running = [s for i, s in enumerate(self.running) if i not in drop]
        return bool(self.running)

    def release(self, seqs: list[Sequence]) -> None:
        """Free these running sequences (by identity)."""
        ids = {id(s) for s in seqs}
        self.remove([i for i, s in enumerate(self.running) if id(s) in ids])

    def clear(self) -> None:
        self.remove(list(range(len(self.running))))

    # ---- steps

    def schedule_prefill(self, resumed_only: bool = False) -> PrefillStep | None:
        """`resumed_only`: take only preempted requests (they have outputs),
        e.g. while new requests wait for a weight update."""
        step = PrefillStep(seqs=[])
        parents: dict[tuple[int, ...], int] = {}  # prompt -> index in step.seqs
        forks: list[tuple[int, Sequence]] = []
        alloc = self.allocator
        while self.waiting and len(self.running) + len(step.seqs) + len(forks) < self.max_seqs:
            req = self.waiting[0]
            if resumed_only and not req.output_ids:
                break
            if req.max_new_tokens == 0:
                step.no_tokens.append(self.waiting.popleft())
                continue
            seq = Sequence(req)
            n = seq.num_tokens
            # The most keys/values it can ever hold (its last token is never fed back).
            if alloc.blocks_for(len(req.input_ids) + req.max_new_tokens - 1) > alloc.num_blocks:
                step.too_long.append(self.waiting.popleft())
                continue
            parent = parents.get(tuple(req.input_ids)) if not req.output_ids else None
            if parent is not None:
                source = step.seqs[parent]
                if alloc.num_free < (1 if n % alloc.block_size else 0):
                    break
                (seq.block_table,), copies = alloc.fork(source.block_table, n, 1)
                step.copies += copies
                forks.append((parent, seq))
            else:
                if step.seqs and step.num_tokens + n > self.max_prefill_tokens:
                    break
                if alloc.num_free < alloc.blocks_for(n):
                    break
                seq.block_table = alloc.allocate(n)
                if not req.output_ids:
                    parents.setdefault(tuple(req.input_ids), len(step.seqs))
                step.seqs.append(seq)
            self.waiting.popleft()
        if not step.seqs:
            return step if step.no_tokens or step.too_long else None
        step.rows = step.seqs + [s for _, s in forks]
        step.source = list(range(len(step.seqs))) + [p for p, _ in forks]
        for s in step.rows:
            s.num_cached = s.num_tokens
        self.running += step.rows
        return step

    def schedule_decode(self) -> DecodeStep:
        """Blocks for every running sequence's next token, preempting the
        newest sequences while the pool is short."""
        step = DecodeStep(seqs=[])
        alloc = self.allocator
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            while alloc.blocks_for(seq.num_tokens) - len(seq.block_table) > alloc.num_free:
                victim = self.running[-1]
                self._preempt(victim)
                step.preempted.append(victim.request)
                if victim is seq:
                    break
            else:
                alloc.grow(seq.block_table, seq.num_tokens)
                i += 1
        step.seqs = list(self.running)
        return step

    def preempt_all(self) -> int:
        """Every running sequence back to the head of `waiting`, in order (a weight update: their
        keys/values are the old weights'); how many."""
        n = len(self.running)
        for seq in reversed(list(self.running)):
            self._preempt(seq)
        return n

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.block_table)
        seq.num_cached = 0
        self.waiting.appendleft(seq.request)
