"""The paged engine against the dense engine and a teacher-forced HF forward
(float32, max |Δ logprob| <= 1e-4): mixed lengths, forks of n = 1..16, abort
mid-sequence, preemption under a small pool, a weight update mid-run (also the dense engine)."""

from __future__ import annotations

import random
import threading

import pytest
import torch

from realrl.impl.generation import torch_server
from realrl.impl.generation.torch_server.paged_engine import PagedGenerationEngine
from tests.impl.conftest import load_reference, save_perturbed

TOL = 1e-4
CPU = torch.device("cpu")


def teacher_forced(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = model(ids).logits[0].float()
    logprobs = torch.log_softmax(logits / (temperature if temperature > 0 else 1.0), dim=-1)[len(prompt) - 1 : -1]
    return logprobs.gather(1, torch.tensor(output)[:, None]).squeeze(1)


def max_delta(model, prompt, result, temperature=1.0) -> float:
    got = torch.tensor([lp for lp, _, _ in result.meta_info.output_token_logprobs])
    return float((got - teacher_forced(model, prompt, result.output_ids, temperature)).abs().max())


class Driver:
    """Submits straight to an engine (no HTTP) and collects the replies."""

    def __init__(self, engine):
        self.engine, self.results, self.events = engine, {}, {}
        self.on_reply: dict = {}  # name -> callback run in the loop thread on that reply

    def submit(self, name, prompt, **params) -> threading.Event:
        (req,), _ = torch_server.parse_generate_body(
            {"input_ids": prompt, "sampling_params": params, "return_logprob": True}, self.engine.limits
        )
        req.rid = str(name)
        done = self.events[name] = threading.Event()

        def reply(result):
            self.results[name] = result
            if name in self.on_reply:
                self.on_reply[name](result)
            done.set()

        req.reply = reply
        self.engine.submit(req)
        return done

    def together(self):
        """Submissions inside `with driver.together():` reach one prefill
        step (as one batched /generate body does): the engine is paused in
        place meanwhile."""
        driver = self

        class Together:
            def __enter__(self):
                driver.engine.command("pause", {"mode": "in_place"}, lambda _: None)

            def __exit__(self, *exc):
                driver.engine.command("continue", {}, lambda _: None)

        return Together()

    def wait(self, timeout=120):
        assert all(e.wait(timeout) for e in self.events.values())
        return self.results


@pytest.fixture(scope="module")
def paged_model(tiny_llama_dir):
    return load_reference(tiny_llama_dir)  # its own copy: the paged engine switches its attention


def start_paged(model, **kwargs) -> PagedGenerationEngine:
    kwargs.setdefault("kv_cache_tokens", 4096)
    kwargs.setdefault("eos_token_ids", torch_server.eos_token_ids_of(model))
    engine = PagedGenerationEngine(model, device=CPU, cuda_graphs=False, **kwargs)
    engine.start()
    return engine


def prompts_of_mixed_lengths(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[0] + [rng.randrange(2, 64) for _ in range(rng.randint(0, 45))] for _ in range(n)]


def test_paged_equals_dense_and_teacher_forcing_over_mixed_lengths(paged_model, reference_model):
    prompts = prompts_of_mixed_lengths(12)
    params = [
        dict(temperature=t, max_new_tokens=n, ignore_eos=True) for t, n in zip([0, 1.0, 0.7] * 4, range(5, 41, 3))
    ]
    dense = torch_server.GenerationEngine(reference_model, device=CPU, max_running_requests=8)
    paged = start_paged(paged_model, max_running_requests=8, max_prefill_tokens=96, block_size=4)
    dense.start()
    try:
        by_engine = []
        for engine in (dense, paged):
            driver = Driver(engine)
            for i, (p, kw) in enumerate(zip(prompts, params)):
                driver.submit(i, p, **kw)
            by_engine.append(driver.wait())
    finally:
        dense.stop(), paged.stop()
    dense_results, paged_results = by_engine
    for i, (p, kw) in enumerate(zip(prompts, params)):
        got = paged_results[i]
        assert len(got.output_ids) == kw["max_new_tokens"]
        assert max_delta(reference_model, p, got, kw["temperature"]) <= TOL
        if kw["temperature"] == 0:  # greedy: the same tokens as the dense engine
            assert got.output_ids == dense_results[i].output_ids
    assert paged.stats["prefill_batches"] > 1  # the budget split the prompts over several packed steps
    assert paged.allocator.num_free == paged.allocator.num_blocks  # every block came back


def test_forks_of_n_answers_share_the_prompt_blocks(paged_model, reference_model):
    prompt = prompts_of_mixed_lengths(1, seed=3)[0] + list(range(2, 30))  # several blocks and a partial one
    paged = start_paged(paged_model, max_running_requests=64, block_size=8)
    used = {}
    try:
        for n in (1, 2, 5, 16):
            driver = Driver(paged)
            free_before = paged.allocator.num_free

            def measure(_result, n=n):  # in the loop, as the first answer finishes: every row still holds blocks
                used.setdefault(n, free_before - paged.allocator.num_free)

            driver.on_reply[f"{n}-0"] = measure
            with driver.together():
                for k in range(n):
                    driver.submit(f"{n}-{k}", prompt, temperature=1.0, max_new_tokens=1 + k, ignore_eos=True)
            results = driver.wait()
            for k in range(n):
                assert max_delta(reference_model, prompt, results[f"{n}-{k}"]) <= TOL
            assert len({tuple(r.output_ids) for r in results.values()}) > n // 2  # sampled independently
    finally:
        paged.stop()
    # A prompt of len(prompt) tokens in 8-token blocks: its full blocks once, a last block per answer.
    full, extra = divmod(len(prompt), 8)
    assert extra and all(used[n] == full + n for n in (1, 2, 5, 16))
    assert used[16] * 3 < 16 * (full + 1)  # vs 16 private copies of the prompt's blocks
    assert paged.stats["prompt_tokens_shared"] == len(prompt) * (1 + 4 + 15)


def test_abort_mid_sequence_returns_the_partial_answer_and_frees_its_blocks(paged_model, reference_model):
    paged = start_paged(paged_model, block_size=4)
    driver = Driver(paged)
    prompt = prompts_of_mixed_lengths(1, seed=5)[0]
    aborted = threading.Event()
    # When the short request finishes, the long one is mid-sequence: abort it from the loop.
    driver.on_reply["short"] = lambda _r: paged.command("abort", {"rid": "long"}, lambda _a: aborted.set())
    try:
        driver.submit("long", prompt, temperature=1.0, max_new_tokens=500, ignore_eos=True)
        driver.submit("short", [0, 4], temperature=1.0, max_new_tokens=6, ignore_eos=True)
        results = driver.wait()
        assert aborted.wait(30)
    finally:
        paged.stop()
    long = results["long"]
    assert long.meta_info.finish_reason.type == "abort" and 6 <= len(long.output_ids) < 500
    assert max_delta(reference_model, prompt, long) <= TOL
    assert paged.allocator.num_free == paged.allocator.num_blocks


def test_preemption_under_a_small_pool_recomputes_exactly(paged_model, reference_model):
    prompts = prompts_of_mixed_lengths(8, seed=7)
    # 12 blocks of 4 = 48 tokens: one request fits, eight running at once do not.
    paged = start_paged(paged_model, kv_cache_tokens=48, block_size=4, max_running_requests=8)
    driver = Driver(paged)
    try:
        for i, p in enumerate(prompts):
            driver.submit(i, p[:12], temperature=0, max_new_tokens=30, ignore_eos=True)
        results = driver.wait()
        too_long = Driver(paged)
        too_long.submit("x", [0] * 20, temperature=0, max_new_tokens=40)
        refused = too_long.wait()["x"]
    finally:
        paged.stop()
    assert paged.stats["preemptions"] > 0
    for i, p in enumerate(prompts):
        assert len(results[i].output_ids) == 30
        assert max_delta(reference_model, p[:12], results[i]) <= TOL
    assert refused.reason == "kv_cache_too_small"
    assert paged.allocator.num_free == paged.allocator.num_blocks


@pytest.mark.parametrize("kind", ["dense", "paged"])
def test_weight_update_mid_run_goes_on_under_the_new_weights(paged_model, tiny_llama_dir, tmp_path, kind):
    """A weight update (`abort_all_requests`) while a request runs: nothing runs on under the old
    weights, and nothing it made is thrown away. The request is prefilled again from its prompt and
    outputs under the new weights and goes on to its budget; its answer names each output span's
    version, and each token has the logprob of the weights its span names (teacher-forced, the whole
    prefix). On the old engine the request ended with `abort` at the update."""
    new_dir = str(tmp_path / "new")
    save_perturbed(tiny_llama_dir, new_dir, seed=11)
    new_model = load_reference(new_dir)
    old_model = load_reference(tiny_llama_dir)
    eos = torch_server.eos_token_ids_of(old_model)
    if kind == "paged":
        model, engine = paged_model, start_paged(paged_model, block_size=4)
    else:
        model = load_reference(tiny_llama_dir)
        engine = torch_server.GenerationEngine(model, device=CPU, eos_token_ids=eos)
        engine.start()
    tensors = engine.read_weights(new_dir)
    answers = []
    driver = Driver(engine)
    update = {"tensors": tensors, "weight_version": "1", "abort_all_requests": True, "model_path": new_dir}
    # Mid-run: when the short request finishes (in the loop), the long one is running.
    driver.on_reply["short"] = lambda _r: engine.command("update", update, answers.append)
    prompt = [0, 9, 8, 7, 6]
    longs = ["long", "long1", "long2"]  # a group's answers: after the update, one prompt under three outputs
    try:
        with driver.together():
            for name in longs:
                driver.submit(name, prompt, temperature=1.0, max_new_tokens=120, ignore_eos=True)
            driver.submit("short", [0, 3], temperature=1.0, max_new_tokens=4, ignore_eos=True)
        driver.wait()
        after = Driver(engine)
        after.submit("after", prompt, temperature=1.0, max_new_tokens=20, ignore_eos=True)
        result_after = after.wait()["after"]
        stats = dict(engine.stats)
    finally:
        engine.stop()
        model.load_state_dict(old_model.state_dict())  # the module's other tests use the old weights
    assert [(a.success, a.num_paused_requests) for a in answers] == [(True, 3)]
    assert stats["requests_resumed"] == 3 and stats["finish_abort"] == 0
    if kind == "dense":  # the resumed answers' prompt computed once: `_prefill_resumed`
        assert stats["prompt_tokens_shared"] >= 2 * 2 * len(prompt)  # (at the first prefill, and after the update)
    for name in longs:
        long = driver.results[name]
        meta = long.meta_info
        assert meta.finish_reason.type == "length" and len(long.output_ids) == 120 and meta.weight_version == "1"
        (v0, v1) = meta.weight_versions
        assert (v0.version, v0.start, v1.version, v1.end) == ("0", 0, "1", 120) and 0 < v0.end == v1.start < 120
        got = torch.tensor([lp for lp, _, _ in meta.output_token_logprobs])
        switch = v0.end
        old = teacher_forced(old_model, prompt, long.output_ids)
        new = teacher_forced(new_model, prompt, long.output_ids)
        assert float((got[:switch] - old[:switch]).abs().max()) <= TOL, name
        assert float((got[switch:] - new[switch:]).abs().max()) <= TOL, name
        assert float((old[switch:] - new[switch:]).abs().max()) > 1e-2  # the versions are distinguishable
    assert len({tuple(driver.results[name].output_ids) for name in longs}) == 3  # three different answers
    assert result_after.meta_info.weight_version == "1" and result_after.meta_info.weight_versions is None
    assert max_delta(new_model, prompt, result_after) <= TOL


def test_stale_slots_never_reach_attention(paged_model, reference_model):
    """Blocks come back holding whatever their last owner wrote (a failed
    request's NaN too): a pool full of NaN must not change any answer."""
    paged = PagedGenerationEngine(
        paged_model, device=CPU, kv_cache_tokens=1024, block_size=8, cuda_graphs=False, max_running_requests=4
    )
    pool = slice(0, paged.allocator.num_blocks * paged.allocator.block_size)  # not the runner's scratch block
    paged.runner.k_cache[:, pool].fill_(float("nan"))
    paged.runner.v_cache[:, pool].fill_(float("nan"))
    paged.start()
    driver = Driver(paged)
    prompts = prompts_of_mixed_lengths(6, seed=9)
    try:
        with driver.together():
            for i, p in enumerate(prompts):
                driver.submit(i, p, temperature=1.0, max_new_tokens=13, ignore_eos=True)
            driver.submit("group-0", prompts[0], temperature=1.0, max_new_tokens=9, ignore_eos=True)
            driver.submit("group-1", prompts[0], temperature=1.0, max_new_tokens=9, ignore_eos=True)
        results = driver.wait()
    finally:
        paged.stop()
    for i, p in enumerate(prompts):
        assert max_delta(reference_model, p, results[i]) <= TOL
    for name in ("group-0", "group-1"):
        assert max_delta(reference_model, prompts[0], results[name]) <= TOL


def test_engine_choice(tiny_llama_dir):
    from transformers import MistralConfig, MistralForCausalLM

    from realrl.impl.generation.torch_server.paged_engine import create_engine, engine_kind

    model = load_reference(tiny_llama_dir)
    assert type(create_engine("auto", model, device=CPU)) is torch_server.GenerationEngine  # dense on CPU
    assert type(create_engine("paged", model, device=CPU, kv_cache_tokens=64)) is PagedGenerationEngine
    windowed = MistralForCausalLM(
        MistralConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1, sliding_window=8)
    ).eval()
    with pytest.raises(ValueError, match="sliding-window"):
        create_engine("paged", windowed, device=CPU)
    cuda = torch.device("cuda")
    assert engine_kind("auto", model.config, cuda) == "paged" and engine_kind("auto", windowed.config, cuda) == "dense"
