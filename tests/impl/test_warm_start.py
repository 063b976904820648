"""Warm start and evaluation: answer checking, batched decoding, the default kit's accuracy band.

The module fixture builds the default kit once (the real recipe the default run
uses: the default tiny Llama and the full warm start) into a temp cache.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

from realrl.impl.math_data import load_math_jsonl
from realrl.impl.tiny_model import (
    TinyKitRecipe,
    TinyModelConfig,
    build_char_tokenizer,
    build_tiny_kit,
    build_tiny_model,
    load_tiny_kit_model,
)
from realrl.impl.warm_start import (
    WarmStartConfig,
    _collate,
    _encode_examples,
    generate_batch,
    greedy_accuracy,
    is_correct,
    parse_number,
    pass_at_k,
    reference_number,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def default_kit(kit_cache):
    # The session-wide cache: the end-to-end tests use the same default kit.
    return kit_cache, build_tiny_kit(kit_cache, TinyKitRecipe())


@pytest.fixture(scope="module")
def warm_model(default_kit):
    _, kit = default_kit
    return load_tiny_kit_model(kit)


# ---------------------------------------------------------------- answer checking


def test_parse_number_is_strict():
    assert parse_number("81") == 81.0
    assert parse_number("  -7 ") == -7.0
    assert parse_number("1,024") == 1024.0
    assert parse_number("2.50") == 2.5
    for bad in ("", "8 1", "81a", "x", "1+1", "--3"):
        assert parse_number(bad) is None, bad


def test_reference_number_and_is_correct():
    assert reference_number("81") == 81.0
    assert reference_number("so 3+4 = 7 apples.\n#### 7") == 7.0
    assert reference_number("no number") is None
    record = {"answer": "81", "solutions": ["81"]}
    assert is_correct("81", record) and is_correct(" 81.0", record)
    assert not is_correct("18", record) and not is_correct("81 and more", record)
    gsm = {"answer": "work... #### 1,200", "solutions": ["work... #### 1,200"]}
    assert is_correct("1200", gsm)
    assert is_correct("5", {"answer": "4"}) is False


# ---------------------------------------------------------------- training data


def test_loss_mask_covers_answer_and_eos_only():
    tokenizer = build_char_tokenizer()
    records = [{"prompt": "Q: 1+2=?\nA:", "answer": "3"}, {"prompt": "Q: 10+20=?\nA:", "answer": "30"}]
    plain = WarmStartConfig(hedge_fraction_large=0.0, hedge_fraction_small=0.0)
    input_ids, attention_mask, labels = _collate(_encode_examples(tokenizer, records, plain), tokenizer.pad_token_id)
    for row, record in enumerate(records):
        prompt_len = len(record["prompt"])
        n_real = prompt_len + len(record["answer"]) + 1
        assert (labels[row, :prompt_len] == -100).all()
        assert tokenizer.decode(labels[row, prompt_len:n_real].tolist()) == record["answer"] + "<eos>"
        assert (labels[row, n_real:] == -100).all()
        assert attention_mask[row].sum() == n_real
        assert (input_ids[row, n_real:] == tokenizer.pad_token_id).all()


def test_hedged_demonstrations_follow_difficulty():
    """Problems whose first operand has two digits get the hedge suffix far more often;
    the hedge goes after the digits, before eos, and the digits stay correct."""
    tokenizer = build_char_tokenizer()
    large = [{"prompt": f"Q: {20 + i}+{i % 10}=?\nA:", "answer": str(20 + i + i % 10)} for i in range(60)]
    small = [{"prompt": f"Q: {i % 10}+{20 + i}=?\nA:", "answer": str(20 + i + i % 10)} for i in range(60)]
    config = WarmStartConfig(hedge_fraction_large=0.8, hedge_fraction_small=0.1)

    def hedged(records):
        out = []
        for (ids, plen), r in zip(_encode_examples(tokenizer, records, config), records):
            text = tokenizer.decode(ids[plen:-1])
            assert text in (r["answer"], r["answer"] + "?") and ids[-1] == tokenizer.eos_token_id
            out.append(text.endswith("?"))
        return sum(out) / len(out)

    assert hedged(large) > 0.6 and hedged(small) < 0.25


# ---------------------------------------------------------------- decoding


def test_batched_left_padded_decode_matches_one_by_one(warm_model):
    model, tokenizer = warm_model
    prompts = ["Q: 7+8=?\nA:", "Q: 23+58=?\nA:", "Q: 5-3=?\nA:", "Q: 91-45=?\nA:"]
    ids = [tokenizer.encode(p) for p in prompts]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    batched = generate_batch(model, ids, 6, eos, pad)
    alone = [generate_batch(model, [p], 6, eos, pad)[0] for p in ids]
    assert batched == alone
    # Also equal to a plain full-recompute greedy loop (no cache, no padding).
    for prompt_ids, completion in zip(ids, batched):
        seq = list(prompt_ids)
        expected = []
        with torch.no_grad():
            for _ in range(6):
                nxt = int(model(torch.tensor([seq])).logits[0, -1].argmax())
                expected.append(nxt)
                seq.append(nxt)
                if nxt == eos:
                    break
        assert completion == expected


def test_sampling_is_seeded(warm_model):
    model, tokenizer = warm_model
    ids = [tokenizer.encode("Q: 47+38=?\nA:")] * 16
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    run = lambda seed: generate_batch(  # noqa: E731
        model, ids, 6, eos, pad, temperature=1.0, generator=torch.Generator().manual_seed(seed)
    )
    assert run(3) == run(3)
    assert len({tuple(c) for c in run(3)}) > 1  # T=1 actually samples


def test_fresh_model_solves_nothing():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(
        tokenizer, TinyModelConfig(hidden_size=64, num_layers=1, num_heads=2, intermediate_size=128)
    )
    records = [{"prompt": f"Q: {a}+1=?\nA:", "answer": str(a + 1)} for a in range(20)]
    assert greedy_accuracy(model, tokenizer, records, max_new_tokens=4) == 0.0


# ---------------------------------------------------------------- the default kit


def test_default_kit_lands_in_accuracy_band(default_kit):
    _, kit = default_kit
    stats = kit.warm_start_stats
    print(f"\ndefault kit: {kit.num_parameters} params, {dataclasses.asdict(stats)}")
    assert 0.10 <= stats.accuracy <= 0.40
    # Sampling at T=1 finds answers greedy misses: room for RL to grow.
    assert stats.k == 8 and stats.pass_at_k >= stats.accuracy + 0.10


def test_reloaded_model_reproduces_recorded_stats(default_kit, warm_model):
    _, kit = default_kit
    model, tokenizer = warm_model
    recipe = TinyKitRecipe()
    test_records = load_math_jsonl(kit.test_path)
    # Saved weights reproduce the recorded accuracy. Odd-sized batches change
    # the left padding, which may flip a near-tie argmax, hence the tolerance.
    accuracy = greedy_accuracy(model, tokenizer, test_records, recipe.eval_max_new_tokens, batch_size=37)
    assert accuracy == pytest.approx(kit.warm_start_stats.accuracy, abs=0.01)
    pass_k = pass_at_k(
        model,
        tokenizer,
        test_records,
        k=recipe.eval_k,
        temperature=recipe.eval_temperature,
        max_new_tokens=recipe.eval_max_new_tokens,
        seed=recipe.seed,
    )
    assert pass_k == pytest.approx(kit.warm_start_stats.pass_at_k, abs=0.03)


def test_cli_on_cached_kit_prints_stats_json(default_kit):
    cache_root, kit = default_kit
    marker = os.path.join(kit.root, "cli-marker")
    open(marker, "w").close()
    out = subprocess.run(
        [sys.executable, "-m", "realrl.impl.tiny_model", "--cache-root", cache_root],
        cwd=REPO_ROOT,
        env=dict(os.environ, PYTHONPATH=REPO_ROOT),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    printed = json.loads(out.stdout)
    assert printed["root"] == kit.root and printed["model_path"] == kit.model_path
    assert printed["warm_start_stats"] == dataclasses.asdict(kit.warm_start_stats)
    assert printed["num_parameters"] == kit.num_parameters
    assert os.path.exists(marker)  # cache hit: nothing was rebuilt
