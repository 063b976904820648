"""The running batch: its requests and their left-padded KV cache.

**Batching.** The engine keeps one running batch whose KV cache is
left-padded: row i holds its tokens right-aligned in columns [start, end) of a
preallocated buffer per layer, with a boolean attention mask and an explicit
position id per row. A decode step writes the new keys/values in place at
column `end` (no re-allocation per step). Newly prefilled rows are written into
free rows of the buffers, right-aligned at `end` (the window widens to the
left if they are longer), before the next step. Finished rows leave at once:
the last rows move into their slots with one indexed copy per layer, and
leading columns that became padding in every row drop out of the window.
Buffers are re-allocated only when rows or columns run out. Decode steps pass
a ready 4D boolean mask, so HF builds no mask per step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from realrl.impl.generation.torch_server.protocol import Request
from realrl.impl.generation.torch_server.sampling import RowParams

# KV columns reserved past the current length when a cache buffer is (re)allocated:
# enough for the longest remaining request, but at most this many (then it grows).
MAX_HEADROOM = 1024


class Window:
    """The live part of a running batch's buffers: rows [0, rows), columns
    [start, end). Shared by every layer."""

    __slots__ = ("rows", "start", "end")

    def __init__(self, rows: int, start: int, end: int):
        self.rows, self.start, self.end = rows, start, end


class KVBuffer(DynamicLayer):
    """One layer's keys/values in a preallocated [rows, kv_heads, columns, head_dim] buffer.

    `update` writes the new keys/values in place right after the live window and
    returns views; the running batch reserves room before each forward and
    advances the shared window after it.
    """

    def __init__(self, keys_buf: torch.Tensor, values_buf: torch.Tensor, window: Window):
        super().__init__()
        self.keys_buf, self.values_buf, self.window = keys_buf, values_buf, window
        self.dtype, self.device = keys_buf.dtype, keys_buf.device
        self.is_initialized = True
        w = window
        self.keys = keys_buf[: w.rows, :, w.start : w.end]
        self.values = values_buf[: w.rows, :, w.start : w.end]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        w = self.window
        new_end = w.end + key_states.shape[-2]
        self.keys_buf[: w.rows, :, w.end : new_end].copy_(key_states)
        self.values_buf[: w.rows, :, w.end : new_end].copy_(value_states)
        self.keys = self.keys_buf[: w.rows, :, w.start : new_end]
        self.values = self.values_buf[: w.rows, :, w.start : new_end]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.window.end - self.window.start


class Rows(NamedTuple):
    """Keys/values of some rows, columns right-aligned: per layer (keys, values) and the rows' mask. `source`
    None: row i of the tensors is row i; else row i is the tensors' row `source[i]` (a prefill's distinct
    prompts, each the source of its answers' rows), copied straight into the batch's buffers by one indexed
    copy per tensor, with no copy of the rows in between."""

    kv: list[tuple[torch.Tensor, torch.Tensor]]
    mask: torch.Tensor
    source: torch.Tensor | None = None


def _put(dst: torch.Tensor, src: torch.Tensor, source: torch.Tensor | None) -> None:
    """`dst` (a view of a buffer) = `src`, or `src`'s rows `source`."""
    if source is None:
        dst.copy_(src)
    else:
        torch.index_select(src, 0, source, out=dst)


class RunningBatch:
    """The requests being decoded, their left-padded KV cache and per-row state.

    Buffers are allocated with spare rows and columns and reused: a finished row
    is replaced by the last row (one indexed copy per layer), a joining group is
    written into free rows right-aligned at `end`, a decode step writes one
    column in place. Only when rows or columns run out are the buffers
    re-allocated (zero-filled, so stale padding is always finite) and the live
    window copied over.
    """

    def __init__(self, requests: list[Request], rows: Rows, config, max_rows: int, spare: RunningBatch | None = None):
        """`spare`: a batch that ended normally (emptied, or its requests sent back at a weight
        update), whose buffers are taken over when they are large enough, instead of new ones."""
        self.config = config
        self.max_rows = max_rows
        self.requests: list[Request] = []
        n_rows, length = rows.mask.shape
        self._allocate([rows], n_rows=n_rows, length=length, extra_requests=requests, spare=spare)
        self.requests = list(requests)
        self._refresh_rows()

    # ---- views and sizes

    @property
    def size(self) -> int:
        return self.window.rows

    @property
    def length(self) -> int:
        return self.window.end - self.window.start

    def live(self) -> Rows:
        w = self.window
        kv = [
            (layer.keys_buf[: w.rows, :, w.start : w.end], layer.values_buf[: w.rows, :, w.start : w.end])
            for layer in self.cache.layers
        ]
        return Rows(kv, self.mask[: w.rows, w.start : w.end])

    def decode_mask(self) -> torch.Tensor:
        """The 4D boolean mask [rows, 1, 1, length + 1] for the next decode step
        (HF passes a 4D mask through untouched)."""
        w = self.window
        self.mask[: w.rows, w.end] = True
        return self.mask[: w.rows, None, None, w.start : w.end + 1]

    @staticmethod
    def headroom(requests: list[Request]) -> int:
        remaining = max(r.max_new_tokens - len(r.output_ids) for r in requests)
        return max(1, min(remaining, MAX_HEADROOM))

    # ---- (re)allocation

    def _allocate(
        self,
        parts: list[Rows],
        n_rows: int,
        length: int,
        extra_requests: list[Request],
        spare: RunningBatch | None = None,
    ) -> None:
        """Buffers holding `parts` stacked by rows, right-aligned at `length`: fresh zeroed
        ones, or `spare`'s when they hold enough rows and columns. Those are not zeroed: every
        value in them was computed by a batch that ended normally (a row that went non-finite
        is cleared when it fails), so their stale padding is finite too; the mask is reset."""
        requests = self.requests + extra_requests
        row_capacity = min(max(self.max_rows, n_rows), max(2 * n_rows, 8))
        col_capacity = length + self.headroom(requests)
        self.window = Window(n_rows, 0, length)
        if spare is not None and spare._fits(parts[0].kv, row_capacity, col_capacity):
            self.mask = spare.mask
            self.mask.zero_()
            layers = [KVBuffer(old.keys_buf, old.values_buf, self.window) for old in spare.cache.layers]
            spare.cache.layers = []  # the buffers are this batch's now
        else:
            self.mask = torch.zeros((row_capacity, col_capacity), dtype=torch.bool, device=parts[0].mask.device)
            layers = []
            for k0, v0 in parts[0].kv:
                keys = k0.new_zeros((row_capacity, k0.shape[1], col_capacity, k0.shape[3]))
                values = v0.new_zeros((row_capacity, v0.shape[1], col_capacity, v0.shape[3]))
                layers.append(KVBuffer(keys, values, self.window))
        row = 0
        for kv, part_mask, source in parts:
            n, cols = part_mask.shape
            offset = length - cols
            self.mask[row : row + n, offset:length] = part_mask
            for layer, (k, v) in zip(layers, kv):
                _put(layer.keys_buf[row : row + n, :, offset:length], k, source)
                _put(layer.values_buf[row : row + n, :, offset:length], v, source)
            row += n
        self.cache = DynamicCache(config=self.config)
        self.cache.layers = layers

    def _fits(self, kv: list[tuple[torch.Tensor, torch.Tensor]], rows: int, cols: int) -> bool:
        """Whether this batch's buffers can hold `rows` x `cols` of keys/values shaped like `kv`'s."""
        have_rows, have_cols = self.mask.shape
        layers = self.cache.layers
        if have_rows < rows or have_cols < cols or len(layers) != len(kv):
            return False
        return all(
            buf.dtype == new.dtype
            and buf.device == new.device
            and buf.shape[1] == new.shape[1]
            and buf.shape[3] == new.shape[3]
            for layer, (k, v) in zip(layers, kv)
            for buf, new in ((layer.keys_buf, k), (layer.values_buf, v))
        )

    def _refresh_rows(self, kept: list[int] | None = None) -> None:
        """Rebuild the per-row tensors from the requests (after rows changed); `kept`: the rows are
        some of the previous ones (row i was row kept[i]), whose tensors are taken instead."""
        device = self.mask.device
        if kept is not None:
            index = torch.tensor(kept, dtype=torch.long, device=device)
            self.last_tokens = self.last_tokens.index_select(0, index)
            self.positions = self.positions.index_select(0, index)
            self.params = self.params.select(index, self.requests)
        else:
            self.last_tokens = torch.tensor([r.output_ids[-1] for r in self.requests], dtype=torch.long, device=device)
            self.positions = torch.tensor(
                [len(r.input_ids) + len(r.output_ids) - 1 for r in self.requests], dtype=torch.long, device=device
            )
            self.params = RowParams.from_requests(self.requests, device)
        for layer in self.cache.layers:  # views over the new row count
            w = self.window
            layer.keys = layer.keys_buf[: w.rows, :, w.start : w.end]
            layer.values = layer.values_buf[: w.rows, :, w.start : w.end]

    def reserve(self, n: int) -> None:
        """Make room for n more columns (re-allocating, rarely, with fresh headroom)."""
        if self.window.end + n <= self.mask.shape[1]:
            return
        self._allocate([self.live()], n_rows=self.size, length=self.length, extra_requests=[])
        self._refresh_rows()

    # ---- membership

    def clear(self, rows: list[int]) -> None:
        """Zero every column of these rows (ones a fault may have filled with
        NaN): a later occupant of the slot sees them as masked padding, and a
        masked NaN value still turns attention into NaN."""
        index = torch.tensor(rows, dtype=torch.long, device=self.mask.device)
        for layer in self.cache.layers:
            layer.keys_buf.index_fill_(0, index, 0)
            layer.values_buf.index_fill_(0, index, 0)

    def remove(self, drop: list[int]) -> bool:
        """Drop rows (by index); returns False if the batch became empty."""
        w = self.window
        n_left = w.rows - len(drop)
        if n_left == 0:
            return False
        dropped = set(drop)
        # Kept rows beyond the new end move into the dropped slots below it.
        holes = [i for i in sorted(dropped) if i < n_left]
        movers = [i for i in range(n_left, w.rows) if i not in dropped]
        kept = list(range(n_left))  # where each row left comes from
        if holes:
            device = self.mask.device
            dst = torch.tensor(holes, dtype=torch.long, device=device)
            src = torch.tensor(movers, dtype=torch.long, device=device)
            for layer in self.cache.layers:
                for buf in (layer.keys_buf, layer.values_buf):
                    live = buf[:, :, w.start : w.end]
                    live.index_copy_(0, dst, live.index_select(0, src))
            live_mask = self.mask[:, w.start : w.end]
            live_mask.index_copy_(0, dst, live_mask.index_select(0, src))
            for h, m in zip(holes, movers):
                self.requests[h] = self.requests[m]
                kept[h] = m
        del self.requests[n_left:]
        w.rows = n_left
        # Columns that are now padding in every row are dropped from the window.
        first = int(self.mask[:n_left, w.start : w.end].any(dim=0).int().argmax())
        w.start += first
        self._refresh_rows(kept)
        return True

    def add(self, requests: list[Request], rows: Rows) -> None:
        """Join freshly prefilled rows (keys/values/mask right-aligned)."""
        kv, mask, source = rows
        n, cols = mask.shape
        w = self.window
        row_capacity, col_capacity = self.mask.shape
        if w.rows + n > row_capacity or cols > w.end or w.end >= col_capacity:
            length = max(self.length, cols)
            self._allocate([self.live(), rows], n_rows=w.rows + n, length=length, extra_requests=requests)
        else:
            c0 = w.end - cols
            if c0 < w.start:  # the window widens to the left for the longer newcomers
                self.mask[: w.rows, c0 : w.start] = False
                w.start = c0
            r0, r1 = w.rows, w.rows + n
            self.mask[r0:r1, w.start : w.end] = False
            self.mask[r0:r1, c0 : w.end] = mask
            for layer, (k, v) in zip(self.cache.layers, kv):
                _put(layer.keys_buf[r0:r1, :, c0 : w.end], k, source)
                _put(layer.values_buf[r0:r1, :, c0 : w.end], v, source)
            w.rows = r1
        self.requests.extend(requests)
        self._refresh_rows()
