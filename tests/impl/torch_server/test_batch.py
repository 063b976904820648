"""The running batch's KV bookkeeping, without a model: rows join (in place,
widening the window to the left, or re-allocating), decode steps write one
column, rows leave (the last rows move into their slots, all-padding columns
drop out), columns run out (re-allocation). After every operation each row
must still hold exactly its own keys/values, right-aligned, under its mask."""

from __future__ import annotations

import random

import torch

from realrl.impl.generation.torch_server import batch as batch_module
from realrl.impl.generation.torch_server.batch import Rows, RunningBatch
from realrl.impl.generation.torch_server.protocol import Request
from realrl.impl.generation.torch_server.sampling import RowParams
from tests.impl.conftest import tiny_llama_config

CONFIG = tiny_llama_config()
LAYERS = CONFIG.num_hidden_layers


def kv_len(req: Request) -> int:
    """Positions with keys/values: the prompt and every output token but the last."""
    return len(req.input_ids) + len(req.output_ids) - 1


def key(req: Request, position: int, layer: int) -> float:
    """A value that says whose key it is, where, and in which layer."""
    return int(req.rid) * 10_000 + position * 10 + layer + 1


def prefilled(group: list[Request], rng: random.Random | None = None) -> Rows:
    """What a prefill hands over: per layer (keys, values) [n, 1, length, 1]
    and the mask, each row right-aligned. With `rng`, half the time as a prefill of
    distinct prompts does: the tensors hold the rows shuffled among rows no request
    takes (NaN), and `source` says which row is whose."""
    length = max(kv_len(r) for r in group)
    mask = torch.zeros((len(group), length), dtype=torch.bool)
    source = None
    at = list(range(len(group)))
    n_rows = len(group)
    if rng is not None and rng.random() < 0.5:
        n_rows = len(group) + rng.randint(0, 2)
        at = rng.sample(range(n_rows), len(group))
        source = torch.tensor(at, dtype=torch.long)
    kv = []
    for layer in range(LAYERS):
        keys = torch.full((n_rows, 1, length, 1), float("nan"))
        for i, r in enumerate(group):
            n = kv_len(r)
            mask[i, length - n :] = True
            keys[at[i], 0, : length - n, 0] = 0.0
            keys[at[i], 0, length - n :, 0] = torch.tensor([key(r, j, layer) for j in range(n)])
        kv.append((keys, -keys))
    return Rows(kv, mask, source)


def decode_step(batch: RunningBatch, token: int) -> None:
    """What the engine does around one forward: reserve a column, hand HF the
    mask, let each layer write its new keys/values, advance."""
    batch.reserve(1)
    mask = batch.decode_mask()
    assert mask.shape == (batch.size, 1, 1, batch.length + 1)
    for layer_index, layer in enumerate(batch.cache.layers):
        new = torch.tensor([key(r, kv_len(r), layer_index) for r in batch.requests]).view(-1, 1, 1, 1)
        keys, values = layer.update(new, -new)
        assert keys.shape[2] == values.shape[2] == batch.length + 1
    batch.window.end += 1
    for r in batch.requests:
        r.output_ids.append(token)
    batch.last_tokens = torch.full((batch.size,), token)
    batch.positions += 1


def check(batch: RunningBatch) -> None:
    kv, mask, source = batch.live()
    assert source is None
    width = batch.length
    assert len(batch.requests) == batch.size == mask.shape[0]
    assert bool(mask[:, 0].any()), "a leading column that is padding in every row stayed in the window"
    for i, r in enumerate(batch.requests):
        n = kv_len(r)
        assert mask[i].tolist() == [False] * (width - n) + [True] * n, r.rid
        for layer, (keys, values) in enumerate(kv):
            assert bool(keys[i].isfinite().all() and values[i].isfinite().all()), (r.rid, layer)  # padding too
            expected = torch.tensor([key(r, j, layer) for j in range(n)])
            assert torch.equal(keys[i, 0, width - n :, 0], expected), (r.rid, layer)
            assert torch.equal(values[i, 0, width - n :, 0], -expected), (r.rid, layer)
    assert batch.positions.tolist() == [kv_len(r) for r in batch.requests]
    assert batch.last_tokens.tolist() == [r.output_ids[-1] for r in batch.requests]
    expected_params = RowParams.from_requests(batch.requests, torch.device("cpu"))
    for name, value in vars(batch.params).items():  # taken from the rows kept, or rebuilt: the same
        want = getattr(expected_params, name)
        assert torch.equal(value, want) if isinstance(value, torch.Tensor) else value == want, name
    for layer, (keys, values) in zip(batch.cache.layers, kv):  # what the model attends to
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
        assert layer.get_seq_length() == width


def test_rows_keep_their_keys_and_values_through_joins_steps_and_departures(monkeypatch):
    monkeypatch.setattr(batch_module, "MAX_HEADROOM", 3)  # columns run out every few steps
    rng = random.Random(0)
    seen = {"join_in_place": 0, "join_widening": 0, "join_reallocating": 0, "step_reallocating": 0, "trim": 0}
    batch: RunningBatch | None = None
    n_requests = 0
    for _ in range(1000):
        op = rng.random()
        if batch is None or (op < 0.3 and batch.size < 10):
            group = []
            for _ in range(rng.randint(1, 3)):
                prompt = [0] * rng.randint(1, 24)
                temperature, top_p = rng.choice([(1.0, 1.0), (0.0, 1.0), (0.7, 0.9)])  # sampled, greedy, filtered
                group.append(
                    Request(str(n_requests), prompt, 10**6, 0, temperature, top_p, -1, 0.0, frozenset(), False)
                )
                group[-1].output_ids.append(rng.randrange(64))  # the token sampled at prefill
                n_requests += 1
            if batch is None:
                batch = RunningBatch(group, prefilled(group, rng), CONFIG, max_rows=4)
            else:
                buffer, start = batch.mask.data_ptr(), batch.window.start
                batch.add(group, prefilled(group, rng))
                if batch.mask.data_ptr() != buffer:
                    seen["join_reallocating"] += 1
                else:
                    seen["join_widening" if batch.window.start < start else "join_in_place"] += 1
        elif op < 0.5:
            drop = rng.sample(range(batch.size), rng.randint(1, batch.size))
            if rng.random() < 0.5:  # as after a failed step: the rows are zeroed first
                batch.clear(drop)
                for layer in batch.cache.layers:
                    assert not layer.keys_buf[drop].any() and not layer.values_buf[drop].any()
            start = batch.window.start
            if not batch.remove(drop):
                batch = None
                continue
            seen["trim"] += batch.window.start > start
        else:
            buffer = batch.mask.data_ptr()
            decode_step(batch, rng.randrange(64))
            seen["step_reallocating"] += batch.mask.data_ptr() != buffer
        check(batch)
    assert all(seen.values()), seen  # every path was taken
