"""A loaded model's tensors in memory of the process's own, not a mapped
checkpoint file (the generation server's model and the trainer's, on the CPU)."""

from __future__ import annotations

import torch


@torch.no_grad()
def in_own_memory(model: torch.nn.Module) -> None:
    """Each CPU parameter and buffer copied out of what loading left it in,
    tied ones once (they stay tied). `from_pretrained` leaves a tensor stored
    as in the file as a view of the safetensors file, mapped private: the
    first write into it (a server's first weight update, a trainer's first
    optimizer step) then faults every page and copies it out of the file
    (406 MiB: 0.65 s for the first copy into it against 0.03 s after; an
    AdamW step 2.7 s against 0.7-1.1). Copied here, at load, once (~0.2 s)."""
    copies: dict[tuple, torch.Tensor] = {}
    for module in model.modules():
        for tensors in (module._parameters, module._buffers):
            for t in tensors.values():
                if t is None or t.device.type != "cpu":
                    continue
                key = (t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
                if key not in copies:
                    copies[key] = t.data.clone()
                t.data = copies[key]
