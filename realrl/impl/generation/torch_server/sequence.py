"""One request as the paged engine sees it: its tokens and where their keys/values are.

The tokens are the request's own lists (`input_ids` + `output_ids`), read,
never copied; the sequence adds the block table (`block_manager`) and how
many of the tokens already have keys/values in the pool. A running sequence
has all but its last token cached: that one is the input of the next decode
step. A preempted sequence loses its blocks and is prefilled again from all
its tokens (recompute), with its outputs kept.
"""

from __future__ import annotations

from typing import Any


class Sequence:
    __slots__ = ("request", "block_table", "num_cached")

    def __init__(self, request: Any):
        self.request = request  # has input_ids and output_ids (protocol.Request)
        self.block_table: list[int] = []
        self.num_cached = 0

    @property
    def num_tokens(self) -> int:
        return len(self.request.input_ids) + len(self.request.output_ids)

    def token_ids(self) -> list[int]:
        return self.request.input_ids + self.request.output_ids

    @property
    def last_token(self) -> int:
        r = self.request
        return r.output_ids[-1] if r.output_ids else r.input_ids[-1]

    def slot(self, position: int, block_size: int) -> int:
        """The pool slot of the token at `position`."""
        return self.block_table[position // block_size] * block_size + position % block_size
