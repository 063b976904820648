"""Which sequences go through the model together: shared-prompt rows,
chosen by a FLOP estimate, packed into micro-batches by token budget."""

from __future__ import annotations

import heapq
import itertools

from realrl.base.datapack import split_by_token_budget
from realrl.impl.ppo.batch import SequenceBatch


def _row_width(batch: SequenceBatch, row: list[int]) -> int:
    """Tokens of a row: the shared prompt once, then every completion."""
    lens = batch.completion_lens
    return batch.prompt_lens[row[0]] + sum(lens[i] for i in row)


def share_prompt_rows(
    batch: SequenceBatch, indices: list[int], hidden_size: int | None, max_tokens: int
) -> list[list[int]]:
    """Rows for these sequences: those with the same prompt go into rows of k
    completions after one copy of it, k chosen per prompt to minimise a FLOP
    estimate of the forward pass; `hidden_size` None: one sequence per row.

    A row of width W costs about W * (6h + W): the linear layers scale with
    its tokens (~24h^2 each per layer), the masked attention with W^2 (4h each
    per layer, computed densely). A shared prompt saves (k-1) * P tokens, and
    costs attention across the row: it pays for short answers after long
    prompts (small k or none for long answers)."""
    if hidden_size is None:
        return [[i] for i in indices]
    by_prompt: dict[bytes, list[int]] = {}
    for i in indices:
        P = batch.prompt_lens[i]
        key = P.to_bytes(4, "little") + batch.input_ids[i].numpy()[:P].tobytes()
        by_prompt.setdefault(key, []).append(i)
    rows: list[list[int]] = []
    lens = batch.completion_lens
    for same in by_prompt.values():
        P = batch.prompt_lens[same[0]]
        ends = list(itertools.accumulate((lens[i] for i in same), initial=0))  # completions' tokens before each
        n = len(same)
        best: tuple[float, int] | None = None
        for k in range(1, n + 1):
            widths = [P + ends[min(s + k, n)] - ends[s] for s in range(0, n, k)]  # `_row_width` of each chunk
            if k > 1 and max(widths) > max_tokens:
                continue
            cost = sum(w * (6 * hidden_size + w) for w in widths)
            if best is None or cost < best[0]:
                best = (cost, k)
        k = best[1]
        rows += [same[s : s + k] for s in range(0, n, k)]
    return rows


def pack_rows(widths: list[int], hidden_size: int, max_tokens: int) -> list[list[int]]:
    """Rows side by side in fewer, wider rows (each of these a list of indices
    into `widths`), where that lowers the FLOP estimate of
    `share_prompt_rows` for the padded micro-batch: k rows padded to width W
    cost about k * W * (6h + W). A micro-batch's rows are padded to its
    widest, so rows of uneven widths waste the difference; narrow rows side
    by side (each keeps its own prompt, positions and mask) fill it. Tried:
    the rows as they are, and for k from a quarter of them up, their
    longest-first spread over k rows, each into the narrowest so far (every
    k up to 64 rows, 16 of them beyond), at most `max_tokens` padded."""
    n = len(widths)
    if n < 2:
        return [[j] for j in range(n)]
    widest = max(widths)
    best = (n * widest * (6 * hidden_size + widest), [[j] for j in range(n)])
    order = sorted(range(n), key=lambda j: (-widths[j], j))
    low = -(-n // 4)
    ks = range(low, n) if n <= 64 else sorted({low + (n - 1 - low) * i // 15 for i in range(16)})
    for k in ks:
        heap = [(0, b) for b in range(k)]  # (width so far, row): the narrowest first
        bins: list[list[int]] = [[] for _ in range(k)]
        for j in order:
            width, b = heapq.heappop(heap)
            bins[b].append(j)
            heapq.heappush(heap, (width + widths[j], b))
        W = max(width for width, _ in heap)
        cost = k * W * (6 * hidden_size + W)
        if k * W <= max_tokens and cost < best[0]:
            best = (cost, [sorted(b) for b in bins])
    return best[1]


def plan_micro_batches(
    batch: SequenceBatch, indices: list[int], max_tokens: int, hidden_size: int | None = None
) -> list[list[list[int]]]:
    """The rows of each micro-batch (`share_prompt_rows`), packed by padded
    token budget (FFD); with shared rows, rows of uneven width may then go
    side by side in one (`pack_rows`: such a row is a list of its rows)."""
    rows = share_prompt_rows(batch, indices, hidden_size, max_tokens)
    widths = [_row_width(batch, row) for row in rows]
    plan = [[rows[j] for j in b] for b in split_by_token_budget(widths, max_tokens, padded=True)]
    if hidden_size is None:  # one sequence per row: the model takes no 4-D mask
        return plan
    packed = []
    for mb in plan:
        bins = pack_rows([_row_width(batch, row) for row in mb], hidden_size, max_tokens)
        packed.append([mb[b[0]] if len(b) == 1 else [mb[j] for j in b] for b in bins])
    return packed
