"""The tiny-model kit: everything realrl's default run needs, built locally.

The default run must train on a laptop CPU with no GPU and no download, so this
module builds, from nothing:

- a character-level tokenizer (`build_char_tokenizer`): every character is one
  token, decoding concatenates with no spaces, so `decode(encode(s)) == s` for
  any text over its alphabet; it adds no special tokens on its own;
- a chat template (`KIT_CHAT_TEMPLATE`) and Hermes' tool-call tokens
  (`build_kit_tokenizer`), so agents over the OpenAI chat API run on the kit;
  a plain prompt (one user message) renders exactly as the raw prompt text;
- a tiny Llama causal LM (`build_tiny_model`, ~0.8M parameters, fp32, seeded);
- synthetic arithmetic train/test JSONL (`realrl.impl.math_data`);
- a short supervised warm start so the policy already solves part of the test
  split (`realrl.impl.warm_start`).

`build_tiny_kit(cache_root, recipe)` does all four and caches the result under
`<cache_root>/tiny_kit/<recipe_hash>/`: a normal HF directory in `model/`
(loadable with `AutoModelForCausalLM` / `AutoTokenizer`), `train.jsonl`,
`test.jsonl` and `kit.json` (recipe + warm-start stats). The kit is built in a
temp directory and renamed into place, so a crash or two racing builders never
leave a half-written kit visible; the directory exists only when complete.

CLI: `python -m realrl.impl.tiny_model --cache-root DIR` builds (or finds) the
default kit and prints its stats as JSON.

Llama, not Qwen2: with transformers 5 a Qwen2 directory loads `Qwen2Tokenizer`,
which would rewrite a custom tokenizer; the saved tokenizer config here names
the generic fast tokenizer class so AutoTokenizer loads it unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import socket
import string
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

from realrl.base.logging import getLogger
from realrl.base.process import pid_alive
from realrl.impl.math_data import MathDataRecipe, load_math_jsonl, write_math_dataset
from realrl.impl.warm_start import WarmStartConfig, greedy_accuracy, pass_at_k, warm_start

logger = getLogger("realrl.impl.tiny_model")  # not __main__ under `python -m`

# Bump when the kit's layout or build procedure changes: old caches then miss.
KIT_FORMAT_VERSION = 4  # 2: hedged warm-start demonstrations; 3: chat template and tool-call tokens;
# 4: the tool tokens appended after the warm start (which then runs on the characters alone)

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
# Arithmetic first, then letters for prompts and feedback text, then the rest of
# printable ASCII. Order fixes the ids; append only (or bump the version).
ALPHABET = (
    string.digits
    + "+-*/=()?.,:!"
    + " \n"
    + string.ascii_lowercase
    + string.ascii_uppercase
    + "'\"%<>_;#&[]{}^|~$@`\\\t"
)


# ---------------------------------------------------------------- tokenizer


def build_char_tokenizer(alphabet: str = ALPHABET) -> PreTrainedTokenizerFast:
    """A fast tokenizer with one token per character (ids: specials, then `alphabet`)."""
    chars = list(dict.fromkeys(alphabet))  # dedupe, keep order
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK_TOKEN))
    # Split("") isolates every character, whitespace included.
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()  # concatenate, no spaces between tokens
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=256,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


# Hermes' tool format (Qwen2.5, Qwen3): added after the characters' ids, so
# every id of the character tokenizer stays what it was.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
# The kit's own turn boundaries: a user (or system) message is its text as
# is, an assistant turn is its text, its tool calls and EOS, a tool result is
# wrapped in <tool_response>; no generation prompt. So one user message renders
# exactly as the default task's raw prompt ("Q: 12+30=?\nA:"), and a later
# turn continues after the EOS that ended the previous answer. The tool list
# is not rendered: the kit's model is far too small to read one.
KIT_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{%- if m.role == 'assistant' -%}"
    "{{- m.content if m.content is string else '' -}}"
    "{%- for tc in (m.tool_calls or []) -%}{%- set f = tc.function -%}"
    '{{- \'<tool_call>{"name": "\' + f.name + \'", "arguments": \' -}}'
    "{{- f.arguments if f.arguments is string else (f.arguments | tojson) -}}"
    "{{- '}</tool_call>' -}}{%- endfor -%}"
    "{{- eos_token -}}"
    "{%- elif m.role == 'tool' -%}{{- '<tool_response>' + m.content + '</tool_response>' -}}"
    "{%- else -%}{{- m.content -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
)


def build_kit_tokenizer() -> PreTrainedTokenizerFast:
    """The kit's tokenizer: the character tokenizer, plus `TOOL_TOKENS` and
    `KIT_CHAT_TEMPLATE`; text without those tokens encodes as before."""
    tokenizer = build_char_tokenizer()
    tokenizer.add_tokens(list(TOOL_TOKENS))
    tokenizer.chat_template = KIT_CHAT_TEMPLATE
    return tokenizer


# ---------------------------------------------------------------- model


@dataclass(frozen=True)
class TinyModelConfig:
    """Llama shape. The default (~0.8M parameters) is sized for the CPU time
    budget: on this task a 256-wide model learns no faster per step than a
    128-wide one but costs ~2.7x more per step, so reaching the warm-start
    accuracy band would take ~90 s instead of ~35 s on 2 CPU cores."""

    hidden_size: int = 128
    num_layers: int = 4
    num_heads: int = 4
    intermediate_size: int = 344
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0


def build_tiny_model(
    tokenizer: PreTrainedTokenizerFast, config: TinyModelConfig = TinyModelConfig(), seed: int = 1
) -> LlamaForCausalLM:
    """A freshly initialised fp32 Llama causal LM sized for `tokenizer`; same seed, same weights."""
    llama_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Untied: plain safetensors files round-trip without tied-weight care.
        tie_word_embeddings=False,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return model


def append_tool_tokens(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Grow `model` (sized for the character tokenizer) to the kit tokenizer's
    vocabulary. Each new row is the mean of the old rows (transformers' mean
    resizing, Hewitt 2021): a new token's logit is then the mean of the old
    logits, so its probability is at most about 1/(old vocabulary) and, on a trained
    model, far below that of any answer character."""
    model.resize_token_embeddings(len(tokenizer), mean_resizing=True)


def count_parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


# ---------------------------------------------------------------- kit


@dataclass(frozen=True)
class TinyKitRecipe:
    """Everything that determines a kit; hashed (all fields) into its cache key.

    `seed` fixes the model's initial weights, the warm start's batch order and
    the pass@k sampling; `data.seed` fixes which problems are drawn.
    """

    seed: int = 1
    model: TinyModelConfig = field(default_factory=TinyModelConfig)
    data: MathDataRecipe = field(default_factory=MathDataRecipe)
    warm_start: WarmStartConfig = field(default_factory=WarmStartConfig)
    eval_k: int = 8
    eval_temperature: float = 1.0
    eval_max_new_tokens: int = 8
    format_version: int = KIT_FORMAT_VERSION
    # Set by `dataset_recipe`: warm start on a user's JSONL (identified by the
    # SHA-256 of its train and test files) instead of the synthetic arithmetic.
    dataset_sha256: str = ""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TinyKitRecipe:
        """Inverse of `to_dict` (missing keys take their defaults)."""
        d = dict(d)
        if "model" in d:
            d["model"] = TinyModelConfig(**d["model"])
        if "data" in d:
            d["data"] = MathDataRecipe(**d["data"])
        if "warm_start" in d:
            d["warm_start"] = WarmStartConfig(**d["warm_start"])
        return cls(**d)

    def hash(self) -> str:
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class WarmStartStats:
    accuracy: float  # greedy accuracy on the test split
    pass_at_k: float  # pass@k at the recipe's eval temperature on the test split
    k: int
    seconds: float  # warm-start training wall time
    final_loss: float


@dataclass(frozen=True)
class TinyKit:
    root: str
    model_path: str
    train_path: str
    test_path: str
    warm_start_stats: WarmStartStats
    num_parameters: int
    recipe_hash: str


_KIT_MANIFEST = "kit.json"


def _kit_from_dir(root: str) -> TinyKit:
    with open(os.path.join(root, _KIT_MANIFEST), encoding="utf-8") as f:
        manifest = json.load(f)
    return TinyKit(
        root=root,
        model_path=os.path.join(root, "model"),
        train_path=os.path.join(root, "train.jsonl"),
        test_path=os.path.join(root, "test.jsonl"),
        warm_start_stats=WarmStartStats(**manifest["warm_start_stats"]),
        num_parameters=manifest["num_parameters"],
        recipe_hash=manifest["recipe_hash"],
    )


def _file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def dataset_recipe(train_path: str, test_path: str, seed: int = 1) -> TinyKitRecipe:
    """The recipe of a kit warm-started on a user's dataset (math JSONL format):
    the tiny model learns that task's answers instead of arithmetic. No hedged
    demonstrations: those belong to the synthetic task."""
    base = TinyKitRecipe(seed=seed)
    return dataclasses.replace(
        base,
        warm_start=dataclasses.replace(base.warm_start, hedge_fraction_large=0.0, hedge_fraction_small=0.0),
        dataset_sha256=_file_sha256(train_path)[:32] + _file_sha256(test_path)[:32],
    )


def _build_into(build_dir: str, recipe: TinyKitRecipe, dataset: tuple[str, str] | None = None) -> None:
    """Build every kit file into `build_dir` (not yet visible to readers)."""
    if dataset is None:
        train_path, test_path = write_math_dataset(build_dir, recipe.data)
    else:  # the kit keeps its own copy, so it stays valid if the user's files change
        train_path, test_path = os.path.join(build_dir, "train.jsonl"), os.path.join(build_dir, "test.jsonl")
        shutil.copyfile(dataset[0], train_path)
        shutil.copyfile(dataset[1], test_path)
    train_records, test_records = load_math_jsonl(train_path), load_math_jsonl(test_path)

    # The warm start runs on the characters alone, then the tool tokens' rows
    # are appended: rows present during the warm start (never a target, only in
    # the softmax) change every one of its updates, so a kit that carried them
    # from the start was a different warm-started model, one that RL improved
    # far less (docs/benchmarks.md, "The default run"). Appended after, the
    # kit's arithmetic is exactly that of the character model.
    char_tokenizer, tokenizer = build_char_tokenizer(), build_kit_tokenizer()
    model = build_tiny_model(char_tokenizer, recipe.model, seed=recipe.seed)
    train_stats = warm_start(model, char_tokenizer, train_records, recipe.warm_start, seed=recipe.seed)
    append_tool_tokens(model, tokenizer)
    n_params = count_parameters(model)
    logger.info("tiny Llama: %.2fM parameters, vocab %d", n_params / 1e6, len(tokenizer))

    accuracy = greedy_accuracy(model, tokenizer, test_records, recipe.eval_max_new_tokens)
    pass_k = pass_at_k(
        model,
        tokenizer,
        test_records,
        k=recipe.eval_k,
        temperature=recipe.eval_temperature,
        max_new_tokens=recipe.eval_max_new_tokens,
        seed=recipe.seed,
    )
    stats = WarmStartStats(
        accuracy=accuracy,
        pass_at_k=pass_k,
        k=recipe.eval_k,
        seconds=round(train_stats["seconds"], 2),
        final_loss=round(train_stats["loss"], 4),
    )
    # (answers checked as numbers: for a dataset of another kind, the run's
    # step-0 evaluation is the figure that counts)
    logger.info(
        "warm start: greedy acc %.3f, pass@%d %.3f (numeric answers), %.1fs",
        accuracy,
        recipe.eval_k,
        pass_k,
        stats.seconds,
    )

    model_dir = os.path.join(build_dir, "model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    manifest = {
        "recipe": recipe.to_dict(),
        "recipe_hash": recipe.hash(),
        "num_parameters": n_params,
        "warm_start_stats": dataclasses.asdict(stats),
    }
    with open(os.path.join(build_dir, _KIT_MANIFEST), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2)


_BUILD_PREFIX = ".building-"


def _sweep_dead_builds(kit_parent: str) -> None:
    """Remove temp build dirs left by builders on this host that died mid-build.

    Temp dirs are named `.building-<host>-<pid>-<random>`; dirs of other hosts
    (shared filesystem) are left alone since their pid means nothing here.
    """
    host = socket.gethostname()
    for name in os.listdir(kit_parent):
        if not name.startswith(f"{_BUILD_PREFIX}{host}-"):
            continue
        pid_text = name[len(f"{_BUILD_PREFIX}{host}-") :].split("-", 1)[0]
        if pid_text.isdigit() and not pid_alive(int(pid_text)):
            logger.info("removing %s (its builder, pid %s, is gone)", name, pid_text)
            shutil.rmtree(os.path.join(kit_parent, name), ignore_errors=True)


def build_tiny_kit(
    cache_root: str, recipe: TinyKitRecipe = TinyKitRecipe(), dataset: tuple[str, str] | None = None
) -> TinyKit:
    """Build (or find cached) tokenizer + warm-started model + arithmetic data.

    With `dataset=(train_path, test_path)` (and `recipe=dataset_recipe(...)`)
    the model is warm-started on that dataset instead.

    The kit lives in `<cache_root>/tiny_kit/<recipe.hash()>/`. If that directory
    exists it is complete (it only ever appears by an atomic rename) and is
    returned as is. Otherwise the kit is built in a sibling temp directory and
    renamed into place; if another process won the race, its kit is used and
    ours is discarded.
    """
    if (dataset is None) != (not recipe.dataset_sha256):
        raise ValueError("a dataset kit needs both `dataset` and a recipe from dataset_recipe(), or neither")
    kit_parent = os.path.join(os.path.abspath(cache_root), "tiny_kit")
    final_dir = os.path.join(kit_parent, recipe.hash())
    if os.path.isfile(os.path.join(final_dir, _KIT_MANIFEST)):
        logger.info("tiny kit cache hit: %s", final_dir)
        return _kit_from_dir(final_dir)

    os.makedirs(kit_parent, exist_ok=True)
    _sweep_dead_builds(kit_parent)
    build_dir = tempfile.mkdtemp(prefix=f"{_BUILD_PREFIX}{socket.gethostname()}-{os.getpid()}-", dir=kit_parent)
    try:
        logger.info("building tiny kit in %s", final_dir)
        _build_into(build_dir, recipe, dataset)
        os.chmod(build_dir, 0o755)  # mkdtemp makes it private; the kit is for everyone
        try:
            os.rename(build_dir, final_dir)  # atomic; fails if final_dir exists
        except OSError:
            if not os.path.isfile(os.path.join(final_dir, _KIT_MANIFEST)):
                raise
            logger.info("another process built %s first; using its kit", final_dir)
    finally:
        shutil.rmtree(build_dir, ignore_errors=True)
    return _kit_from_dir(final_dir)


def load_tiny_kit_model(kit: TinyKit) -> tuple[torch.nn.Module, PreTrainedTokenizerFast]:
    """The kit's warm-started model (eval mode) and tokenizer, loaded with the Auto classes."""
    model = AutoModelForCausalLM.from_pretrained(kit.model_path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(kit.model_path)
    model.eval()
    return model, tokenizer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Build (or find) the tiny-model kit and print its stats.")
    parser.add_argument("--cache-root", required=True, help="directory holding tiny_kit/<recipe_hash>/")
    parser.add_argument("--seed", type=int, default=None, help="override the recipe's seeds (model and data)")
    args = parser.parse_args(argv)
    recipe = TinyKitRecipe()
    if args.seed is not None:
        recipe = dataclasses.replace(recipe, seed=args.seed, data=dataclasses.replace(recipe.data, seed=args.seed))
    start = time.perf_counter()
    kit = build_tiny_kit(args.cache_root, recipe)
    out = {
        "root": kit.root,
        "model_path": kit.model_path,
        "train_path": kit.train_path,
        "test_path": kit.test_path,
        "num_parameters": kit.num_parameters,
        "recipe_hash": kit.recipe_hash,
        "warm_start_stats": dataclasses.asdict(kit.warm_start_stats),
        "elapsed_seconds": round(time.perf_counter() - start, 2),
    }
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
