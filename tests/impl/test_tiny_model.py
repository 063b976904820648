"""Tiny-model kit: char tokenizer, tiny Llama, save/reload with Auto classes, the cache.

Uses a deliberately small recipe (a few warm-start steps) so the kit builds in
seconds; the accuracy band of the default recipe is tested in test_warm_start.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import string
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from realrl.impl.math_data import MathDataRecipe, load_math_jsonl
from realrl.impl.tiny_model import (
    KIT_CHAT_TEMPLATE,
    TOOL_TOKENS,
    TinyKitRecipe,
    TinyModelConfig,
    build_char_tokenizer,
    build_kit_tokenizer,
    build_tiny_kit,
    build_tiny_model,
    count_parameters,
    load_tiny_kit_model,
)
from realrl.impl.warm_start import WarmStartConfig, warm_start

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ARITHMETIC_TEXTS = [
    "Q: 12+7=?\nA:",
    "Q: 23+58=?\nA:81",
    "Q: 90-45=?\nA: 45",
    "(3*4)/2 = 6, 7.5; x: 1!",
    "Wrong. Try again.",
    "  leading and trailing spaces  \n\n",
    "",
]

# Small everything: builds in seconds, still a real model trained for real steps.
MINI_RECIPE = TinyKitRecipe(
    model=TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128),
    data=MathDataRecipe(n_train=200, n_test=16),
    warm_start=WarmStartConfig(steps=3, batch_size=16, warmup_steps=1),
    eval_k=2,
)


@pytest.fixture(scope="module")
def mini_kit(tmp_path_factory):
    torch.set_num_threads(1)
    cache_root = tmp_path_factory.mktemp("kit_cache")
    return str(cache_root), build_tiny_kit(str(cache_root), MINI_RECIPE)


# ---------------------------------------------------------------- tokenizer


@pytest.mark.parametrize("text", ARITHMETIC_TEXTS)
def test_tokenizer_roundtrips_one_token_per_char(text):
    tokenizer = build_char_tokenizer()
    ids = tokenizer.encode(text)  # no special tokens are added by default
    assert len(ids) == len(text)
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_covers_printable_ascii():
    tokenizer = build_char_tokenizer()
    text = string.printable.replace("\r", "").replace("\x0b", "").replace("\x0c", "")
    ids = tokenizer.encode(text)
    assert len(set(ids)) == len(text) and tokenizer.unk_token_id not in ids
    assert tokenizer.decode(ids) == text


def test_tokenizer_special_tokens():
    tokenizer = build_char_tokenizer()
    assert tokenizer.bos_token == "<bos>" and tokenizer.eos_token == "<eos>" and tokenizer.pad_token == "<pad>"
    ids = {tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id}
    assert len(ids) == 4 and None not in ids
    # Special tokens written out in text are recognised as single tokens.
    ids = tokenizer.encode("<bos>1+1<eos>")
    assert ids == [tokenizer.bos_token_id, *tokenizer.encode("1+1"), tokenizer.eos_token_id]
    assert tokenizer.decode(ids, skip_special_tokens=True) == "1+1"
    # A character outside the alphabet becomes unk instead of failing.
    assert tokenizer.encode("é") == [tokenizer.unk_token_id]


# ---------------------------------------------------------------- model


def test_model_init_is_deterministic_by_seed():
    tokenizer = build_char_tokenizer()
    config = TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)
    a = build_tiny_model(tokenizer, config, seed=5).state_dict()
    b = build_tiny_model(tokenizer, config, seed=5).state_dict()
    c = build_tiny_model(tokenizer, config, seed=6).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_default_model_size_and_ids():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer)
    # Small enough for a ~40 s CPU warm start, big enough to learn arithmetic.
    assert 500_000 <= count_parameters(model) <= 10_000_000
    assert model.config.model_type == "llama"
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.bos_token_id == tokenizer.bos_token_id
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert model.config.pad_token_id == tokenizer.pad_token_id
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_kit_chat_template_renders_the_default_task_as_today_and_continues_tool_turns():
    from realrl.impl.openai_compat.rendering import ChatRenderer
    from realrl.impl.openai_compat.tool_calls import TOOL_PARSERS

    chars, tokenizer = build_char_tokenizer(), build_kit_tokenizer()
    prompt = "Q: 12+30=?\nA:"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert rendered == chars.encode(prompt, add_special_tokens=False)
    assert all(tokenizer.encode(t) == chars.encode(t) for t in ARITHMETIC_TEXTS)  # old ids unchanged
    # A sampled tool call decodes to Hermes' block; the tool's answer follows the EOS that ended it.
    call = tokenizer.encode('<tool_call>{"name": "calc", "arguments": {"expression": "12+30"}}</tool_call>')
    assert call[0] == tokenizer.convert_tokens_to_ids("<tool_call>") and len(call) == 2 + 54
    (parsed,) = TOOL_PARSERS.get("hermes")(tokenizer.decode(call, skip_special_tokens=True)).tool_calls
    assert parsed.name == "calc" and parsed.arguments == '{"expression": "12+30"}'
    bridge = ChatRenderer(tokenizer, {tokenizer.eos_token_id}).bridge(
        [{"role": "tool", "tool_call_id": "c1", "content": "42"}], None, None
    )
    assert bridge.turn_end == tokenizer.eos_token_id
    assert tokenizer.decode(bridge.ids) == "<tool_response>42</tool_response>"


# ---------------------------------------------------------------- kit


def test_kit_reloads_with_auto_classes(mini_kit):
    _, kit = mini_kit
    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert os.path.isfile(os.path.join(kit.model_path, name)), name

    built_tokenizer = build_kit_tokenizer()
    tokenizer = AutoTokenizer.from_pretrained(kit.model_path)
    assert tokenizer.chat_template == KIT_CHAT_TEMPLATE
    assert type(tokenizer).__name__ in ("PreTrainedTokenizerFast", "TokenizersBackend")
    assert len(tokenizer) == len(built_tokenizer)
    for text in ARITHMETIC_TEXTS:
        assert tokenizer.encode(text) == built_tokenizer.encode(text)
        assert tokenizer.decode(tokenizer.encode(text)) == text
    assert tokenizer.eos_token_id == built_tokenizer.eos_token_id
    assert tokenizer.pad_token_id == built_tokenizer.pad_token_id

    model = AutoModelForCausalLM.from_pretrained(kit.model_path)
    assert model.config.vocab_size == len(tokenizer)
    assert model.config.eos_token_id == tokenizer.eos_token_id
    assert count_parameters(model) == kit.num_parameters

    # The saved weights are the warm-started ones: same logits as a second load.
    model2, _ = load_tiny_kit_model(kit)
    ids = torch.tensor([tokenizer.encode("Q: 12+7=?\nA:")])
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model2(ids).logits)


def test_kit_warm_start_is_the_characters_alone_with_tool_rows_appended(mini_kit):
    """The tool tokens take no part in the warm start: the kit's model is, bit for
    bit, the character model warm-started on the kit's data, with one row per
    tool token appended to the embedding and the head (kit format 3 carried the
    rows through the warm start, which made it another model: RL then reached
    0.47 greedy accuracy where this one reaches 0.8)."""
    _, kit = mini_kit
    chars = build_char_tokenizer()
    reference = build_tiny_model(chars, MINI_RECIPE.model, seed=MINI_RECIPE.seed)
    warm_start(reference, chars, load_math_jsonl(kit.train_path), MINI_RECIPE.warm_start, seed=MINI_RECIPE.seed)
    model, tokenizer = load_tiny_kit_model(kit)
    assert len(tokenizer) == len(chars) + len(TOOL_TOKENS) == model.config.vocab_size
    got = model.state_dict()
    for name, want in reference.state_dict().items():
        rows = got[name]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            assert rows.shape[0] == len(tokenizer)
            rows = rows[: len(chars)]
        assert torch.equal(rows, want), name
    # Each appended head row is the mean of the others: a tool token's logit is the
    # mean logit, so (Jensen) its probability is at most about 1/len(chars).
    prompt = torch.tensor([tokenizer.encode(load_math_jsonl(kit.test_path)[0]["prompt"])])
    with torch.no_grad():
        probs = torch.softmax(model(input_ids=prompt).logits[0, -1], -1)
    tool_ids = tokenizer.convert_tokens_to_ids(list(TOOL_TOKENS))
    assert float(probs[tool_ids].max()) <= 1.001 / len(chars)


def test_kit_files_and_stats(mini_kit):
    _, kit = mini_kit
    train, test = load_math_jsonl(kit.train_path), load_math_jsonl(kit.test_path)
    assert len(train) == 200 and len(test) == 16
    stats = kit.warm_start_stats
    assert 0.0 <= stats.accuracy <= 1.0 and 0.0 <= stats.pass_at_k <= 1.0
    assert stats.k == 2 and stats.seconds > 0
    with open(os.path.join(kit.root, "kit.json")) as f:
        manifest = json.load(f)
    assert manifest["recipe"] == MINI_RECIPE.to_dict()
    assert os.path.basename(kit.root) == MINI_RECIPE.hash() == kit.recipe_hash


def test_cache_hit_returns_existing_kit_without_rebuilding(mini_kit):
    cache_root, kit = mini_kit
    marker = os.path.join(kit.root, "marker-from-test")
    with open(marker, "w") as f:
        f.write("still here")
    weights = os.path.join(kit.model_path, "model.safetensors")
    weights_stat = os.stat(weights)

    again = build_tiny_kit(cache_root, MINI_RECIPE)
    assert again == kit
    assert os.path.exists(marker)  # a rebuild would have replaced the directory
    assert os.stat(weights).st_ino == weights_stat.st_ino
    assert os.stat(weights).st_mtime_ns == weights_stat.st_mtime_ns
    assert os.listdir(os.path.join(cache_root, "tiny_kit")) == [MINI_RECIPE.hash()]


def test_recipe_hash_covers_every_field():
    base = MINI_RECIPE.hash()
    variants = [
        dataclasses.replace(MINI_RECIPE, seed=2),
        dataclasses.replace(MINI_RECIPE, format_version=MINI_RECIPE.format_version + 1),
        dataclasses.replace(MINI_RECIPE, eval_k=3),
        dataclasses.replace(MINI_RECIPE, data=dataclasses.replace(MINI_RECIPE.data, seed=9)),
        dataclasses.replace(MINI_RECIPE, data=dataclasses.replace(MINI_RECIPE.data, operators="+")),
        dataclasses.replace(MINI_RECIPE, warm_start=dataclasses.replace(MINI_RECIPE.warm_start, lr=1e-4)),
        dataclasses.replace(MINI_RECIPE, model=dataclasses.replace(MINI_RECIPE.model, num_layers=1)),
    ]
    hashes = [v.hash() for v in variants]
    assert base not in hashes and len(set(hashes)) == len(hashes)
    assert TinyKitRecipe().hash() == TinyKitRecipe().hash()
    for recipe in (MINI_RECIPE, *variants):
        assert TinyKitRecipe.from_dict(json.loads(json.dumps(recipe.to_dict()))) == recipe


def test_recipe_change_builds_a_new_directory(mini_kit):
    cache_root, kit = mini_kit
    other_recipe = dataclasses.replace(MINI_RECIPE, seed=MINI_RECIPE.seed + 1)
    other = build_tiny_kit(cache_root, other_recipe)
    assert other.root != kit.root
    assert os.path.basename(other.root) == other_recipe.hash()
    assert os.path.isdir(kit.root)  # the old kit is untouched
    # Different seed: different initial weights, so different trained weights.
    a, _ = load_tiny_kit_model(kit)
    b, _ = load_tiny_kit_model(other)
    assert not torch.equal(a.lm_head.weight, b.lm_head.weight)


def _build_in_subprocess(cache_root: str, recipe: TinyKitRecipe, slow: bool = False) -> subprocess.Popen:
    """`build_tiny_kit(cache_root, recipe)` in a fresh interpreter (own process group).

    With `slow`, the child prints "built" once every kit file is in its temp
    directory and then sleeps before the rename, so a test can kill it there.
    """
    env = dict(os.environ, PYTHONPATH=REPO_ROOT, OMP_NUM_THREADS="1")
    args = [sys.executable, "-c", _BUILD_SNIPPET, cache_root, json.dumps(recipe.to_dict()), "slow" if slow else "fast"]
    return subprocess.Popen(
        args, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


_BUILD_SNIPPET = """
import json, sys, time
import realrl.impl.tiny_model as tm
recipe = tm.TinyKitRecipe.from_dict(json.loads(sys.argv[2]))
if sys.argv[3] == "slow":
    real_build = tm._build_into
    def slow_build(build_dir, recipe, dataset=None):
        real_build(build_dir, recipe, dataset)
        print("built", flush=True)
        time.sleep(600)
    tm._build_into = slow_build
kit = tm.build_tiny_kit(sys.argv[1], recipe)
print(json.dumps({"root": kit.root}))
"""


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)  # reaps the child and closes its pipes


def test_racing_builders_agree_on_one_complete_kit(tmp_path):
    cache_root = str(tmp_path)
    recipe = dataclasses.replace(MINI_RECIPE, seed=11)
    procs = [_build_in_subprocess(cache_root, recipe) for _ in range(2)]
    try:
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            _kill(p)
    for p, (stdout, stderr) in zip(procs, outs):
        assert p.returncode == 0, stderr
    roots = {json.loads(stdout.strip().splitlines()[-1])["root"] for stdout, _ in outs}
    assert len(roots) == 1
    (root,) = roots
    assert os.path.basename(root) == recipe.hash()
    # Exactly one kit directory, complete, and no temp directories left behind.
    assert os.listdir(os.path.join(cache_root, "tiny_kit")) == [os.path.basename(root)]
    assert os.path.isfile(os.path.join(root, "kit.json"))
    assert os.path.isfile(os.path.join(root, "model", "model.safetensors"))


def test_crash_mid_build_leaves_no_visible_kit(tmp_path):
    cache_root = str(tmp_path)
    recipe = dataclasses.replace(MINI_RECIPE, seed=12)
    proc = _build_in_subprocess(cache_root, recipe, slow=True)
    try:
        # Wait until the whole kit is written to the temp dir, then crash hard.
        line = proc.stdout.readline()
        assert line.strip() == "built", proc.stderr.read() if proc.poll() is not None else line
        kit_parent = os.path.join(cache_root, "tiny_kit")
        leftovers = os.listdir(kit_parent)
        assert len(leftovers) == 1 and leftovers[0].startswith(".building-")
    finally:
        _kill(proc)
    final_dir = os.path.join(kit_parent, recipe.hash())
    assert not os.path.exists(final_dir)

    # The next build succeeds and sweeps the dead builder's temp directory.
    kit = build_tiny_kit(cache_root, recipe)
    assert kit.root == final_dir
    assert os.listdir(kit_parent) == [recipe.hash()]
