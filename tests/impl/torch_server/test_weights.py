"""Reading a checkpoint directory and copying it into a model, without an
engine: the layouts HF writes, the ways a directory can be broken, and the
in-place copy (tied tensors included); LoRA adapters read and merged."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from realrl.impl.generation.torch_server.weights import (
    AdapterTargets,
    WeightLoadError,
    WeightTargets,
    read_adapter,
    read_weights_dir,
)


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


def test_a_version_swapped_in_by_pointer_becomes_the_models_storage_tied_ones_together():
    model = Tied()
    targets = WeightTargets(model)
    new = tensors(4)
    assert targets.swappable(new)
    assert not targets.swappable(dict(new, **{"head.weight": new["embed.weight"]}))  # an alias twice
    assert not targets.swappable({k: v.double() for k, v in new.items()})  # another dtype: copied instead
    targets.swap_in(new)
    for name, param in (("embed.weight", model.embed.weight), ("norm.weight", model.norm.weight)):
        assert param.data_ptr() == new[name].data_ptr()  # no copy
    assert model.head.weight is model.embed.weight  # still tied
    again = tensors(5)
    targets.copy_in(again)  # a later copy (from disk) lands in the storage the model has now
    assert torch.equal(model.head.weight, again["embed.weight"]) and torch.equal(
        new["norm.weight"], again["norm.weight"]
    )


# ---- LoRA adapters


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 6, bias=False)
        self.down = torch.nn.Linear(6, 4, bias=False)


def write_adapter(path, modules: dict[str, tuple[torch.Tensor, torch.Tensor]], **config) -> None:
    """A peft-format adapter directory (the keys and config fields peft writes)."""
    path.mkdir(parents=True)
    rank = next(iter(modules.values()))[0].shape[0]
    save_file(
        {f"base_model.model.{name}.lora_{part}.weight": t for name, ab in modules.items() for part, t in zip("AB", ab)},
        path / "adapter_model.safetensors",
    )
    (path / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "use_dora": False, **config})
    )


def ab(seed: int, out_features: int, in_features: int, rank: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rank, in_features, generator=g), torch.randn(out_features, rank, generator=g)


def test_adapters_merge_from_the_base_weights_every_time(tmp_path):
    """Each version is W0 + scaling * B @ A from the same W0: nothing
    accumulates across versions, and a layer the new adapter leaves out
    gets its base weight back."""
    model = TwoLayers()
    base_up, base_down = model.up.weight.detach().clone(), model.down.weight.detach().clone()
    targets = AdapterTargets(model)
    write_adapter(tmp_path / "v1", {"up": ab(1, 6, 4), "down": ab(2, 4, 6)})
    write_adapter(tmp_path / "v2", {"up": ab(3, 6, 4)}, use_rslora=True)
    v1, v2 = read_adapter(str(tmp_path / "v1")), read_adapter(str(tmp_path / "v2"))
    assert v1.scaling == 2.0 and v2.scaling == pytest.approx(4 / 2**0.5)  # alpha / r; rsLoRA: alpha / sqrt(r)
    for adapter in (v1, v2, v1):
        targets.check(adapter)
        targets.apply(adapter)
    a, b = v1.modules["up"]
    torch.testing.assert_close(model.up.weight, base_up + 2.0 * b @ a, rtol=0, atol=1e-6)
    targets.apply(v2)
    a, b = v2.modules["up"]
    torch.testing.assert_close(model.up.weight, base_up + v2.scaling * b @ a, rtol=0, atol=1e-6)
    assert torch.equal(model.down.weight, base_down)  # not in v2: the base again
    targets.apply(None)
    assert torch.equal(model.up.weight, base_up)


def test_a_transposed_layer_gets_the_transposed_delta(tmp_path):
    """GPT-2's Conv1D stores W as in x out (peft: fan_in_fan_out)."""
    from transformers.pytorch_utils import Conv1D

    model = torch.nn.Module()
    model.proj = Conv1D(6, 4)  # 4 in, 6 out; weight 4 x 6
    base = model.proj.weight.detach().clone()
    write_adapter(tmp_path / "v1", {"proj": ab(1, 6, 4)}, fan_in_fan_out=True)
    adapter = read_adapter(str(tmp_path / "v1"))
    targets = AdapterTargets(model)
    targets.check(adapter)
    targets.apply(adapter)
    a, b = adapter.modules["proj"]
    torch.testing.assert_close(model.proj.weight, base + 2.0 * (b @ a).T, rtol=0, atol=1e-6)


def test_adapters_that_do_not_fit_are_refused(tmp_path):
    targets = AdapterTargets(TwoLayers())
    with pytest.raises(WeightLoadError, match="not a LoRA adapter directory"):
        read_adapter(str(tmp_path / "nowhere"))
    write_adapter(tmp_path / "dora", {"up": ab(1, 6, 4)}, use_dora=True)
    with pytest.raises(WeightLoadError, match=r"only plain LoRA .*\['use_dora'\]"):
        read_adapter(str(tmp_path / "dora"))
    write_adapter(tmp_path / "extra", {"up": ab(1, 6, 4)}, modules_to_save=["lm_head"])
    with pytest.raises(WeightLoadError, match="modules_to_save"):
        read_adapter(str(tmp_path / "extra"))
    write_adapter(tmp_path / "elsewhere", {"mlp.up": ab(1, 6, 4)})
    with pytest.raises(WeightLoadError, match="adapts 'mlp.up', which this model does not have"):
        targets.check(read_adapter(str(tmp_path / "elsewhere")))
    write_adapter(tmp_path / "shape", {"up": ab(1, 4, 6)})
    with pytest.raises(WeightLoadError, match="up: adapter is 4 x 6, the layer 6 x 4"):
        targets.check(read_adapter(str(tmp_path / "shape")))
    tied = Tied()
    write_adapter(tmp_path / "tied", {"head": ab(1, 8, 4)})
    with pytest.raises(WeightLoadError, match="tied"):
        AdapterTargets(tied).check(read_adapter(str(tmp_path / "tied")))
