"""Reading new weights from disk and copying them into the served model.

`read_weights_dir` reads the safetensors of an HF directory (single file or
sharded with an index) into CPU tensors; `WeightTargets.check` compares their
names and shapes with the model's (tied embeddings: either name of an aliased
pair will do), and `WeightTargets.copy_in` copies them into the existing
parameters in place. Reading and checking touch no model state, so they run
on a helper thread while the engine goes on generating; a bad path or a
mismatch raises `WeightLoadError` and the old weights keep serving.
"""

from __future__ import annotations

import json
import os

import torch


class WeightLoadError(RuntimeError):
    """The weights at a path cannot be loaded into this model."""


def read_weights_dir(path: str) -> dict[str, torch.Tensor]:
    """All tensors of an HF safetensors directory (single file or sharded + index), on CPU."""
    from safetensors.torch import load_file

    if not os.path.isdir(path):
        raise WeightLoadError(f"{path!r} is not a directory")
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(single):
        files = [single]
    elif os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise WeightLoadError(f"cannot read {index}: {e}") from e
        files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    else:
        files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise WeightLoadError(f"no safetensors files in {path!r}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(load_file(file, device="cpu"))
        except Exception as e:  # missing shard, truncated file, bad header
            raise WeightLoadError(f"cannot read {file}: {e}") from e
    return tensors


class WeightTargets:
    """The model's state-dict tensors (sharing storage with its parameters) and
    which names are aliases of one another (tied embeddings)."""

    def __init__(self, model: torch.nn.Module):
        self.tensors = dict(model.state_dict())
        groups: dict[tuple[int, tuple[int, ...]], list[str]] = {}
        for name, t in self.tensors.items():
            groups.setdefault((t.data_ptr(), tuple(t.shape)), []).append(name)
        self.groups = list(groups.values())

    def check(self, loaded: dict[str, torch.Tensor]) -> None:
        loaded = {k: v for k, v in loaded.items() if not k.endswith("rotary_emb.inv_freq")}
        unexpected = sorted(set(loaded) - set(self.tensors))
        if unexpected:
            raise WeightLoadError(f"unexpected tensors {unexpected[:5]} (model has no such parameters)")
        for name, t in loaded.items():
            if tuple(t.shape) != tuple(self.tensors[name].shape):
                raise WeightLoadError(
                    f"shape of {name}: file {tuple(t.shape)} vs model {tuple(self.tensors[name].shape)}"
                )
        missing = [group[0] for group in self.groups if not any(name in loaded for name in group)]
        if missing:
            raise WeightLoadError(f"missing tensors {missing[:5]}")

    @torch.no_grad()
    def copy_in(self, loaded: dict[str, torch.Tensor]) -> None:
        for name, t in loaded.items():
            if name in self.tensors:
                self.tensors[name].copy_(t)
