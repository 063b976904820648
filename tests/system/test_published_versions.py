"""A published weight version `<weights_dir>/<v>/` is an ordinary HF
directory (docs/design.md §8): the weights, config, the user's tokenizer with
its chat template and generation config, so `AutoModelForCausalLM` +
`AutoTokenizer` load it and generate; a LoRA version is the adapter with the
same tokenizer files. Small random models of real architectures
(realrl/impl/random_models.py)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from realrl.api.cli_args import LoraConfig
from realrl.impl import lora
from realrl.impl.random_models import FAMILIES, build_random_model
from realrl.system.model_worker import VersionWriter, publish_weights

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def source_dirs(tmp_path_factory):
    """Each family's model directory as a user's download has it: also an
    `added_tokens.json` (Qwen2.5 ships one) and another framework's weights."""
    root = tmp_path_factory.mktemp("sources")
    dirs = {}
    for family in ("qwen2.5", "llama3"):
        path = build_random_model(family, str(root / family))
        tokenizer = AutoTokenizer.from_pretrained(path)
        specials = [FAMILIES[family].bos, *FAMILIES[family].eos, FAMILIES[family].pad]
        with open(os.path.join(path, "added_tokens.json"), "w") as f:
            json.dump({t: tokenizer.convert_tokens_to_ids(t) for t in specials if t}, f)
        with open(os.path.join(path, "flax_model.msgpack"), "wb") as f:
            f.write(b"\0" * 1024)
        dirs[family] = path
    return dirs


def trained(path: str) -> torch.nn.Module:
    """The source model with every weight moved (as training would)."""
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def prompt_ids(tokenizer) -> torch.Tensor:
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def assert_same_tokenizer(version: str, source: str) -> AutoTokenizer:
    """The version's tokenizer renders the chat as the user's does."""
    tokenizer, original = AutoTokenizer.from_pretrained(version), AutoTokenizer.from_pretrained(source)
    assert tokenizer.chat_template == original.chat_template and tokenizer.chat_template
    assert tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False) == (
        original.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    )
    assert torch.equal(prompt_ids(tokenizer), prompt_ids(original))
    return tokenizer


@pytest.mark.parametrize("family", ["qwen2.5", "llama3"])
def test_a_published_version_loads_with_auto_classes_and_generates(family, source_dirs, tmp_path):
    source = source_dirs[family]
    model = trained(source)
    version = publish_weights(model, str(tmp_path / "weights"), 3, tokenizer_source=source)
    assert version == str(tmp_path / "weights" / "3")
    assert os.listdir(tmp_path / "weights") == ["3"]  # nothing left beside it
    files = set(os.listdir(version))
    assert {"config.json", "model.safetensors", "generation_config.json", "chat_template.jinja"} <= files
    assert {"tokenizer.json", "tokenizer_config.json", "added_tokens.json"} <= files
    assert "flax_model.msgpack" not in files  # other frameworks' weights stay behind
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        with open(os.path.join(version, name), "rb") as a, open(os.path.join(source, name), "rb") as b:
            assert a.read() == b.read(), f"{name} is not the user's file unchanged"

    loaded = AutoModelForCausalLM.from_pretrained(version, dtype=torch.float32).eval()
    assert type(loaded).__name__ == FAMILIES[family].architecture
    published = loaded.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(published[name], value), name
    # Every EOS id of the family (generation_config.json), as the user's model stops.
    eos = loaded.generation_config.eos_token_id
    with open(os.path.join(source, "generation_config.json")) as f:
        assert eos == json.load(f)["eos_token_id"] and isinstance(eos, list) and len(eos) >= 2
    tokenizer = assert_same_tokenizer(version, source)
    ids = prompt_ids(tokenizer)
    out = loaded.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    expected = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert out.shape[1] > ids.shape[1] and torch.equal(out, expected)
    assert isinstance(tokenizer.decode(out[0, ids.shape[1] :]), str)


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft 0.21 on transformers 5
def test_a_published_lora_version_is_the_adapter_with_the_tokenizer(source_dirs, tmp_path):
    """A LoRA version is not a full model: peft's adapter files, and the
    user's tokenizer files but `added_tokens.json` (SGLang would read its
    tokens as ones the adapter adds); with the base model it generates."""
    from peft import PeftModel

    # Llama 3: an adapter directory has no config.json, and for a qwen2
    # config transformers 5 loads Qwen2Tokenizer in place of the random
    # model's declared generic class, so with and without config.json the
    # random Qwen2.5 tokenizes differently (a real Qwen2.5 declares Qwen2Tokenizer).
    source = source_dirs["llama3"]
    torch.manual_seed(0)
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), LoraConfig(rank=4, alpha=8))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # as trained: B starts at zero
    version = publish_weights(model.eval(), str(tmp_path / "weights"), 2, tokenizer_source=source)
    files = set(os.listdir(version))
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= files
    assert {"chat_template.jinja", "generation_config.json"} <= files
    assert not files & {"added_tokens.json", "config.json", "model.safetensors", "flax_model.msgpack"}
    with open(os.path.join(version, "adapter_config.json")) as f:
        assert json.load(f)["r"] == 4  # the adapter's own config, not overwritten

    tokenizer = assert_same_tokenizer(version, source)
    base = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, version).eval()
    ids = prompt_ids(tokenizer)
    out = loaded.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    expected = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False)
    assert out.shape[1] > ids.shape[1] and torch.equal(out, expected)


def test_a_mixed_precision_version_is_published_in_the_runs_dtype(source_dirs, tmp_path):
    """A bf16 run trains a float32 master (model.fp32_master): its versions
    are bf16, config.json included, so the server and the user load what the
    run's dtype says; the tied embedding stays tied."""
    source = source_dirs["qwen2.5"]  # tie_word_embeddings
    model = trained(source)
    version = publish_weights(model, str(tmp_path / "weights"), 3, tokenizer_source=source, dtype=torch.bfloat16)
    with open(os.path.join(version, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(version)
    assert loaded.dtype == torch.bfloat16
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    master = dict(model.named_parameters())
    for name, p in loaded.named_parameters():
        assert torch.equal(p, master[name].to(torch.bfloat16)), name
    assert model.dtype == torch.float32  # the master is left as it was


@pytest.mark.parametrize("family,dtype", [("llama3", None), ("qwen2.5", torch.bfloat16)])
def test_a_trainers_later_versions_are_the_directory_save_pretrained_writes(family, dtype, source_dirs, tmp_path):
    """A trainer's `VersionWriter` writes its first version with save_pretrained and
    the later ones directly (the first one's safetensors header, each tensor's bytes
    after it, and the first one's other files): each later version holds the same
    files as save_pretrained's directory of the same weights, byte for byte, the
    weights file too (Qwen2.5: the tied embedding written once; in a
    mixed-precision run's dtype)."""
    from safetensors import safe_open

    source = source_dirs[family]
    model = trained(source)
    writer = VersionWriter(source, dtype)
    writer.publish(model, str(tmp_path / "weights"), 1)
    for version in (2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.01)  # the step between versions
        direct = writer.publish(model, str(tmp_path / "weights"), version)
        reference = publish_weights(model, str(tmp_path / "reference"), version, tokenizer_source=source, dtype=dtype)
        assert sorted(os.listdir(direct)) == sorted(os.listdir(reference))
        for name in os.listdir(reference):
            with open(os.path.join(direct, name), "rb") as a, open(os.path.join(reference, name), "rb") as b:
                assert a.read() == b.read(), name
        with (
            safe_open(os.path.join(direct, "model.safetensors"), "pt") as a,
            safe_open(os.path.join(reference, "model.safetensors"), "pt") as b,
        ):
            assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
            for name in b.keys():
                assert torch.equal(a.get_tensor(name), b.get_tensor(name)), name
        loaded = AutoModelForCausalLM.from_pretrained(direct)
        master = dict(model.named_parameters())
        for name, p in loaded.named_parameters():
            assert torch.equal(p, master[name].to(dtype or p.dtype)), name
    assert writer.n_direct == 2  # (save_pretrained each time: 0)
    assert writer._layout.entries is not None  # written from the tensors' own bytes, not through save_file
    assert sorted(os.listdir(tmp_path / "weights")) == ["1", "2", "3"]


@pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing:FutureWarning")  # peft 0.21 on transformers 5
def test_a_lora_trainers_versions_all_go_through_save_model(source_dirs, tmp_path):
    """A LoRA model's versions are its adapter (peft's files): never written directly."""
    source = source_dirs["llama3"]
    model = lora.wrap(AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32), LoraConfig(rank=4, alpha=8))
    writer = VersionWriter(source)
    for version in (1, 2):
        path = writer.publish(model, str(tmp_path / "weights"), version)
        assert "adapter_model.safetensors" in os.listdir(path) and "model.safetensors" not in os.listdir(path)
    assert writer.n_direct == 0
