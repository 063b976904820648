"""The models realrl loads on the CPU (the generation server's, the trainer's)
live in memory of the process's own, not in the mapped checkpoint file, whose
pages the first write (a weight update, an optimizer step) would copy out one
fault at a time."""

from __future__ import annotations

import pytest
import torch

from tests.impl.weights.models import tiny_model


def _file_mappings(path) -> list[tuple[int, int]]:
    """The address ranges of this process mapping the file at `path`."""
    name = str(path.resolve())
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[5] == name:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                ranges.append((start, end))
    return ranges


def _server(path):
    from realrl.impl.generation.torch_server.model import load_model

    return load_model(str(path), "cpu", "float32")


def _trainer(path):
    from realrl.impl.ppo.models import load_policy

    return load_policy(str(path), torch.float32, fp32_master=False, lora=False, device=torch.device("cpu"))


@pytest.mark.parametrize("load", [_server, _trainer], ids=["server", "trainer"])
def test_a_loaded_model_is_in_memory_of_its_own_not_the_mapped_file(tmp_path, load):
    from transformers import AutoModelForCausalLM

    tiny_model("tied", seed=3).save_pretrained(tmp_path)
    plain = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    model = load(tmp_path)

    def in_file(model) -> list[str]:
        mapped = _file_mappings(tmp_path / "model.safetensors")
        return [n for n, p in model.named_parameters() if any(a <= p.data_ptr() < b for a, b in mapped)]

    assert in_file(plain), "transformers no longer maps the file: this copy may be moot"
    assert in_file(model) == []
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    for (name, p), q in zip(model.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(p, q), name


def test_the_trainers_critic_is_in_memory_of_its_own_too(tmp_path):
    from transformers import AutoModel

    from realrl.impl.ppo.models import CriticModel

    tiny_model("tied", seed=3).save_pretrained(tmp_path)
    plain = AutoModel.from_pretrained(tmp_path, dtype=torch.float32)
    critic = CriticModel.from_pretrained(str(tmp_path), torch.float32)
    mapped = _file_mappings(tmp_path / "model.safetensors")
    assert [n for n, p in plain.named_parameters() if any(a <= p.data_ptr() < b for a, b in mapped)]
    assert [n for n, p in critic.named_parameters() if any(a <= p.data_ptr() < b for a, b in mapped)] == []
    for (name, p), q in zip(critic.backbone.state_dict().items(), plain.state_dict().values(), strict=True):
        assert torch.equal(p, q), name
