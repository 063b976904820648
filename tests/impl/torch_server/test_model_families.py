"""The torch server's engine on each model family (realrl/impl/random_models.py):
sliding-window and hybrid attention included, its logprobs equal a fresh full
forward of the model (what the trainer computes), for prompts longer than the
window and answers that cross it, in one running batch."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3TextConfig, Llama4TextConfig, MistralConfig

from realrl.impl.generation import torch_server
from realrl.impl.generation.torch_server.model import AttentionLayout, attention_layout, resolve_dtype
from realrl.impl.random_models import FAMILIES, SLIDING_WINDOW, build_random_model
from tests.impl.test_torch_server import forward_logprobs


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: build_random_model(name, str(root / name)) for name in FAMILIES}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_engine_serves_each_family_as_a_full_forward_computes_it(family, family_dirs):
    model = AutoModelForCausalLM.from_pretrained(family_dirs[family], dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    assert type(model).__name__ == FAMILIES[family].architecture
    engine = torch_server.GenerationEngine(model, device=torch.device("cpu"), max_running_requests=8)
    vocab = model.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    # Short and long prompts (up to ~10 windows), answers crossing the window, all in one batch.
    prompts = [torch.randint(5, vocab, (n,), generator=g).tolist() for n in (3, 9, 40, 170)]
    results: dict[int, object] = {}
    events = [threading.Event() for _ in prompts]
    engine.start()
    try:
        for i, prompt in enumerate(prompts):
            sampling = {"temperature": 1.0, "max_new_tokens": 2 * SLIDING_WINDOW + 5, "ignore_eos": True}
            body = {"input_ids": prompt, "sampling_params": sampling, "return_logprob": True}
            (req,), _ = torch_server.parse_generate_body(body, engine.limits)
            req.reply = lambda result, i=i: (results.__setitem__(i, result), events[i].set())
            engine.submit(req)
        assert all(e.wait(120) for e in events)
    finally:
        engine.stop()
    worst = 0.0
    for i, prompt in enumerate(prompts):
        logprobs, ids, _ = zip(*results[i].meta_info.output_token_logprobs)
        assert len(ids) == 2 * SLIDING_WINDOW + 5
        expected = forward_logprobs(model, prompt, list(ids), 1.0)
        worst = max(worst, (torch.tensor(logprobs) - expected).abs().max().item())
    assert worst <= 1e-4, f"{family}: max |server - forward| logprob {worst:.2e}"


def test_attention_layouts():
    assert attention_layout(MistralConfig(sliding_window=16)) == AttentionLayout(window=16)
    assert attention_layout(MistralConfig(sliding_window=None)) == AttentionLayout()
    hybrid = Gemma3TextConfig(
        sliding_window=8, layer_types=["sliding_attention", "full_attention"], num_hidden_layers=2
    )
    assert attention_layout(hybrid) == AttentionLayout(window=8, mixed=True)
    mask = torch.ones(2, 1, 1, 11, dtype=torch.bool)
    masks = attention_layout(hybrid).decode_masks(mask)
    # The new token (last column, position q) attends keys with q - k < 8: the last 8 columns.
    assert (
        masks["full_attention"].sum().item() == 22
        and masks["sliding_attention"][0, 0, 0].tolist() == [False] * 3 + [True] * 8
    )


def test_attention_it_cannot_serve_is_refused_naming_the_architecture():
    config = Llama4TextConfig(attention_chunk_size=64)
    config.architectures = ["Llama4ForCausalLM"]
    with pytest.raises(ValueError, match="Llama4ForCausalLM: .*chunked"):
        attention_layout(config)
    odd = Gemma3TextConfig(num_hidden_layers=2)
    odd.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(ValueError, match="linear_attention"):
        attention_layout(odd)


def test_a_moe_checkpoint_loads_into_the_served_model_through_transformers_conversion(family_dirs, tmp_path):
    """transformers 5 fuses MoE experts in memory but saves them one by one: the
    trainer's published versions still load, with the trained values."""
    path = family_dirs["qwen3-moe"]
    served = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for p in trained.parameters():
            p.add_(0.01)
    trained.save_pretrained(tmp_path / "v1")
    engine = torch_server.GenerationEngine(served, device=torch.device("cpu"))  # thread not started
    tensors = engine.read_weights(str(tmp_path / "v1"))
    engine._targets.copy_in(tensors)
    for name, value in trained.state_dict().items():
        assert torch.equal(served.state_dict()[name], value), name


def test_the_servers_default_dtype_is_bfloat16_on_cuda_and_float32_on_cpu():
    # A GPU user gets what SGLang and vLLM serve in without a flag; CPU keeps the
    # float32 that the logprob parity tests compare against.
    assert resolve_dtype("auto", "cuda") == resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert resolve_dtype("auto", "cpu") == "float32"
    assert resolve_dtype("float16", "cuda") == "float16"
