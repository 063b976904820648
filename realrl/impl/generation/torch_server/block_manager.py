"""The paged KV cache's bookkeeping: fixed-size blocks and their reference counts.

Pure Python (no torch): the model runner owns the tensors, this class only
says which block of the pool holds which tokens. A sequence's keys/values
live in its *block table*, a list of block ids; token t is at slot
`table[t // block_size] * block_size + t % block_size` of every layer's pool.

A block is shared by several tables only while it is full: `fork` gives the
n answers of a prompt the prompt's full blocks (their reference counts go up)
and each answer its own copy of the partial last block (the runner copies
it). Writes go only to a sequence's last block, so a shared block is never
written: copy-on-write, done eagerly at the fork. A block returns to the free
list when its last table is freed; every operation either succeeds whole or
raises `OutOfBlocks` having changed nothing.
"""

from __future__ import annotations

from collections import deque


class OutOfBlocks(RuntimeError):
    """The pool has fewer free blocks than an operation needs (nothing changed)."""


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.refcount = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._handed_out: list[int] = []  # blocks taken from the free list since `take_handed_out`

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks a table needs to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def _take(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"{n} blocks needed, {len(self._free)} free of {self.num_blocks}")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.refcount[b] = 1
        self._handed_out += blocks
        return blocks

    def take_handed_out(self) -> list[int]:
        """The blocks handed out since the last call (the runner clears them:
        a block may hold anything its last owner wrote)."""
        blocks, self._handed_out = self._handed_out, []
        return blocks

    def allocate(self, num_tokens: int) -> list[int]:
        """A fresh table for `num_tokens` tokens."""
        return self._take(self.blocks_for(num_tokens))

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place so that it holds `num_tokens` tokens."""
        table.extend(self._take(max(0, self.blocks_for(num_tokens) - len(table))))

    def fork(self, table: list[int], num_tokens: int, n: int) -> tuple[list[list[int]], list[tuple[int, int]]]:
        """`n` more tables holding the same `num_tokens` tokens as `table`: they
        share its full blocks; a partial last block is copied into a fresh
        block each. Returns the tables and the (source, destination) block
        copies the runner must make once the source is written."""
        full = num_tokens // self.block_size
        partial = len(table) > full
        fresh = self._take(n if partial else 0)
        for b in table[:full]:
            self.refcount[b] += n
        tables = [table[:full] + ([fresh[i]] if partial else []) for i in range(n)]
        copies = [(table[full], b) for b in fresh]
        return tables, copies

    def free(self, table: list[int]) -> None:
        """Drop one reference to each block of `table` (and empty it)."""
        for b in table:
            if self.refcount[b] <= 0:
                raise AssertionError(f"block {b} freed more often than it was referenced")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._free.append(b)
        table.clear()
