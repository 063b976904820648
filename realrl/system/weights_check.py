"""Do the data-parallel ranks hold the same weights? (docs/design.md §8)

Without FSDP every rank holds a full replica: their checksums must agree.
Under FSDP every rank holds a different shard of the one copy of the
weights, so ranks cannot compare checksums with each other. What can be
compared: each rank's shard now against that shard cut from the full
weights rank 0 gathered (and published) at the last train step or load. A
rank whose shard changed since is caught. The ranks' checksums come from
their `spec` reply (realrl/system/model_worker.py); the master compares
them (`dp_weights_identical`, torch-free: the master runs without torch).
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def _hash_tensor(h, name: str, t: torch.Tensor) -> None:
    h.update(name.encode())
    h.update(t.detach().float().cpu().contiguous().numpy().tobytes())


def state_checksum(state: dict[str, torch.Tensor]) -> str:
    """A hash of every tensor's bytes in `state` (a state dict), by name."""
    h = hashlib.sha256()
    for name, t in sorted(state.items()):
        _hash_tensor(h, name, t)
    return h.hexdigest()[:16]


def weights_checksum(model: torch.nn.Module) -> str:
    """A hash of every parameter's bytes: data-parallel ranks must agree."""
    return state_checksum(model.state_dict())


def checked_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters a shard checksum covers, by name: all of them; of a
    LoRA model its trainable adapters (the full state dict holds no more)."""
    from realrl.impl import lora

    partial = lora.is_lora(model)
    return sorted(((n, p) for n, p in model.named_parameters() if p.requires_grad or not partial), key=lambda x: x[0])


def local_shard_checksum(model: torch.nn.Module) -> str:
    """A hash of this rank's own shard of every checked parameter (no collective)."""
    from torch.distributed.tensor import DTensor

    h = hashlib.sha256()
    for name, p in checked_parameters(model):
        _hash_tensor(h, name, p.to_local() if isinstance(p, DTensor) else p)
    return h.hexdigest()[:16]


def expected_shard_checksums(model: torch.nn.Module, full_state: dict[str, torch.Tensor], world: int) -> list[str]:
    """Each rank's `local_shard_checksum` as it must be, cut from the full
    (unsharded) weights: FSDP2 shards every parameter on dim 0 into
    `torch.chunk` pieces, rank r holding piece r (empty past the last)."""
    import torch

    sums = []
    for rank in range(world):
        h = hashlib.sha256()
        for name, _ in checked_parameters(model):
            pieces = torch.chunk(full_state[name], world, dim=0)
            _hash_tensor(h, name, pieces[rank] if rank < len(pieces) else full_state[name][:0])
        sums.append(h.hexdigest()[:16])
    return sums


def nudge_local_weights(model: torch.nn.Module) -> None:
    """Adds 1e-3 to one number of this rank's shard of the checked
    parameters: what the fault point `model_worker.weights_drift` does, so a
    test sees the check catch a rank whose weights drifted."""
    import torch
    from torch.distributed.tensor import DTensor

    shards = [p.to_local() if isinstance(p, DTensor) else p for _, p in checked_parameters(model)]
    with torch.no_grad():
        next(t for t in shards if t.numel()).view(-1)[0] += 1e-3


def dp_weights_identical(specs: list[dict]) -> bool:
    """Whether the ranks' `spec` checksums say they hold the same weights:
    without FSDP all ranks' checksums are equal; under FSDP every rank's
    shard checksum is the one rank 0 expects of it."""
    rank0 = next(s for s in specs if s["dp_rank"] == 0)
    expected = rank0.get("expected_shard_checksums")
    if expected is not None:
        return all(s["checksum"] == expected[s["dp_rank"]] for s in specs)
    return len({s["checksum"] for s in specs}) <= 1
