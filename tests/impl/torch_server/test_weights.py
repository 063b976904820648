"""Reading a checkpoint directory and copying it into a model, without an
engine: the layouts HF writes, the ways a directory can be broken, and the
in-place copy (tied tensors included)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from realrl.impl.generation.torch_server.weights import WeightLoadError, WeightTargets, read_weights_dir


class Tied(torch.nn.Module):
    """An embedding and an output layer sharing one tensor, as with tie_word_embeddings."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight
        self.norm = torch.nn.LayerNorm(4)


def tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(8, 4, generator=g),
        "norm.weight": torch.randn(4, generator=g),
        "norm.bias": torch.zeros(4),
    }


def test_sharded_and_loose_layouts(tmp_path):
    new = tensors(1)
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"embed.weight": new["embed.weight"]}, sharded / "model-00001-of-00002.safetensors")
    save_file({k: new[k] for k in ("norm.weight", "norm.bias")}, sharded / "model-00002-of-00002.safetensors")
    weight_map = {"embed.weight": "model-00001-of-00002.safetensors"}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in ("norm.weight", "norm.bias")}
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    loose = tmp_path / "loose"  # no index: every .safetensors file
    loose.mkdir()
    save_file({"embed.weight": new["embed.weight"]}, loose / "a.safetensors")
    save_file({k: new[k] for k in ("norm.weight", "norm.bias")}, loose / "b.safetensors")
    for path in (sharded, loose):
        loaded = read_weights_dir(str(path))
        assert loaded.keys() == new.keys() and all(torch.equal(loaded[k], new[k]) for k in new)


def test_broken_directories_are_refused(tmp_path):
    with pytest.raises(WeightLoadError, match="is not a directory"):
        read_weights_dir(str(tmp_path / "nowhere"))
    bad_index = tmp_path / "bad_index"
    bad_index.mkdir()
    (bad_index / "model.safetensors.index.json").write_text("{not json")
    with pytest.raises(WeightLoadError, match="cannot read .*index"):
        read_weights_dir(str(bad_index))
    missing_shard = tmp_path / "missing_shard"
    missing_shard.mkdir()
    index = {"weight_map": {"embed.weight": "model-00001-of-00001.safetensors"}}
    (missing_shard / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(WeightLoadError, match="cannot read .*model-00001-of-00001"):
        read_weights_dir(str(missing_shard))
    truncated = tmp_path / "truncated"
    truncated.mkdir()
    save_file(tensors(1), truncated / "model.safetensors")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(WeightLoadError, match="cannot read"):
        read_weights_dir(str(truncated))


def test_tied_tensors_need_one_name_and_are_copied_in_place():
    model = Tied()
    targets = WeightTargets(model)
    storage = model.embed.weight.data_ptr()
    new = tensors(2)
    new["rotary_emb.inv_freq"] = torch.ones(2)  # computed, not loaded: ignored, as HF does
    targets.check(new)  # no head.weight: the embedding stands for it
    targets.copy_in(new)
    assert model.embed.weight.data_ptr() == storage  # the parameters the engine holds, updated in place
    assert torch.equal(model.head.weight, new["embed.weight"]) and torch.equal(model.norm.weight, new["norm.weight"])
    del new["norm.bias"]
    with pytest.raises(WeightLoadError, match=r"missing tensors \['norm.bias'\]"):
        targets.check(new)
    with pytest.raises(WeightLoadError, match="shape of norm.weight"):
        targets.check(dict(tensors(3), **{"norm.weight": torch.ones(5)}))
