"""Which sequences go through the model together: shared-prompt rows,
chosen by a FLOP estimate, packed into micro-batches by token budget."""

from __future__ import annotations

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
        key = P.to_bytes(4, "little") + batch.input_ids[i][:P].numpy().tobytes()
        by_prompt.setdefault(key, []).append(i)
    rows: list[list[int]] = []
    for same in by_prompt.values():
        best: tuple[float, list[list[int]]] | None = None
        for k in range(1, len(same) + 1):
            chunks = [same[s : s + k] for s in range(0, len(same), k)]
            widths = [_row_width(batch, c) for c in chunks]
            if k > 1 and max(widths) > max_tokens:
                continue
            cost = sum(w * (6 * hidden_size + w) for w in widths)
            if best is None or cost < best[0]:
                best = (cost, chunks)
        rows += best[1]
    return rows


def plan_micro_batches(
    batch: SequenceBatch, indices: list[int], max_tokens: int, hidden_size: int | None = None
) -> list[list[list[int]]]:
    """The rows of each micro-batch (`share_prompt_rows`), packed by padded
    token budget (FFD)."""
    rows = share_prompt_rows(batch, indices, hidden_size, max_tokens)
    widths = [_row_width(batch, row) for row in rows]
    return [[rows[j] for j in b] for b in split_by_token_budget(widths, max_tokens, padded=True)]
