"""The lean decode forward (lean_decode.py): HF's logits bit for bit, the same answers from the engine, and
HF's own forward wherever it could differ (other models, hooks on submodules)."""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import LlamaForCausalLM, MistralConfig, MistralForCausalLM

from realrl.impl.generation import torch_server
from realrl.impl.generation.torch_server.batch import RunningBatch
from realrl.impl.generation.torch_server.lean_decode import lean_decoder
from tests.impl.conftest import tiny_llama_config


def tiny_llama(seed: int, **overrides) -> LlamaForCausalLM:
    config = tiny_llama_config()
    for k, v in overrides.items():
        setattr(config, k, v)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


VARIANTS = {
    "gqa": {},
    "mha": {"num_key_value_heads": 4},
    "biases": {"attention_bias": True, "mlp_bias": True, "num_key_value_heads": 1},
}


def serve(engine: torch_server.GenerationEngine, prompts: list[list[int]], sampling: dict) -> list:
    """Every prompt as one request, all submitted together; their answers in order."""
    results: dict[int, object] = {}
    done = threading.Event()
    engine.start()
    try:
        for i, prompt in enumerate(prompts):
            body = {"input_ids": prompt, "sampling_params": dict(sampling), "return_logprob": True, "rid": str(i)}
            (req,), _ = torch_server.parse_generate_body(body, engine.limits)
            req.reply = lambda result, i=i: (
                results.__setitem__(i, result),
                len(results) == len(prompts) and done.set(),
            )
            engine.submit(req)
        assert done.wait(120)
    finally:
        engine.stop()
    return [results[i] for i in range(len(prompts))]


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_engine_answers_the_same_with_the_lean_forward_as_with_hfs(variant):
    """Same seed, same requests (prompts of different lengths, rows leaving at eos or their own limits,
    sampled and greedy, top-k): the same tokens and the same logprobs, to the last bit."""
    model = tiny_llama(0, **VARIANTS[variant])
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 64, (n,), generator=g).tolist() for n in (3, 7, 7, 12, 20, 1, 9, 30)]
    answers = {}
    for lean in (True, False):
        runs = []
        for sampling in (
            {"temperature": 1.0, "max_new_tokens": 24},
            {"temperature": 0.0, "max_new_tokens": 17},
            {"temperature": 0.8, "top_k": 5, "max_new_tokens": 9},
        ):
            engine = torch_server.GenerationEngine(
                model, device=torch.device("cpu"), seed=5, eos_token_ids=frozenset({1})
            )
            assert engine._lean is not None
            if not lean:
                engine._lean = None  # HF's forward
            runs += [
                (r.output_ids, r.meta_info.output_token_logprobs, r.meta_info.output_token_sampling_logprobs)
                for r in serve(engine, prompts, sampling)
            ]
        answers[lean] = runs
    assert answers[True] == answers[False]
    assert sum(len(ids) for ids, _, _ in answers[True]) > 100


def test_logits_equal_the_models_own_forward_bit_for_bit():
    model = tiny_llama(3)
    engine = torch_server.GenerationEngine(model, device=torch.device("cpu"), eos_token_ids=frozenset())
    lean = engine._lean
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append("pre"))
    model.register_forward_hook(lambda *a: calls.append("post"))
    requests = []
    for i, n in enumerate((4, 11, 6)):
        body = {"input_ids": list(range(2, 2 + n)), "sampling_params": {"max_new_tokens": 8}, "rid": str(i)}
        (req,), _ = torch_server.parse_generate_body(body, engine.limits)
        requests.append(req)
    with torch.inference_mode():
        (reqs, rows) = engine._prefill(requests)
        batch = RunningBatch(reqs, rows, model.config, max_rows=8)
        for _ in range(5):
            batch.reserve(1)
            args = (batch.last_tokens[:, None], batch.decode_mask(), batch.positions[:, None], batch.cache)
            calls.clear()
            ours = lean(*args)
            assert calls == ["pre", "post"]  # the model's own hooks (FollowIdleCores) still run around it
            hf = model(
                input_ids=args[0], attention_mask=args[1], position_ids=args[2], past_key_values=batch.cache
            ).logits[:, -1, :]
            assert torch.equal(ours, hf)
            batch.window.end += 1
            batch.last_tokens = ours.argmax(dim=-1)
            batch.positions += 1


def test_hf_forward_where_the_lean_one_could_differ():
    config = MistralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2
    )
    config._attn_implementation = "sdpa"
    assert lean_decoder(MistralForCausalLM(config).eval()) is None  # not a Llama
    model = tiny_llama(0)
    assert lean_decoder(model) is not None
    model.model.layers[1].mlp.register_forward_hook(lambda *a: None)
    assert lean_decoder(model) is None  # a hook inside the model would be skipped
    eager = tiny_llama(0)
    eager.config._attn_implementation = "eager"
    assert lean_decoder(eager) is None
