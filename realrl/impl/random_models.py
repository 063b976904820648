"""Small random-weight models of real architectures, built locally.

Nothing can be downloaded where realrl's tests run, yet a user's first real run
is a Hugging Face chat model: a byte-level BPE tokenizer, a chat template,
several EOS ids, maybe no pad token, sliding-window or hybrid attention, maybe
MoE. `build_random_model(family, out_dir)` writes such a model directory from
scratch: the family's config class at a tiny size (random weights, seeded), a
byte-level BPE tokenizer trained here with `tokenizers` on a small corpus, the
family's special tokens and a chat template in the family's format, and a
`generation_config.json` listing every EOS id. The directory loads with
`AutoModelForCausalLM` / `AutoTokenizer` like a downloaded one.

The tokenizer config names `PreTrainedTokenizerFast`: under transformers 5 a
family's own tokenizer class (e.g. `Qwen2Tokenizer`) would rebuild a locally
trained tokenizer from its vocabulary with the family's own pre-tokenizer and
specials, which is not the tokenizer trained here.

CLI: `python -m realrl.impl.random_models FAMILY OUT_DIR [--hidden-size H
--layers L --intermediate-size I --vocab-size V]`; `qwen2.5 DIR --hidden-size
768 --layers 12 --intermediate-size 3072` is a ~100M Qwen2.5 for
benchmarks/vs_inprocess.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

from realrl.impl.math_data import MathDataRecipe, generate_math_records


@dataclasses.dataclass(frozen=True)
class Family:
    """One model family: its architecture, special tokens and chat template."""

    name: str
    architecture: str  # the HF class, also checked by tests
    attention: str  # what the family's attention looks like here (docs table)
    bos: str | None  # None: the family has no BOS token
    eos: tuple[str, ...]  # every EOS token, first = tokenizer.eos_token
    pad: str | None  # None: no pad token, as Llama 3 ships
    extra_specials: tuple[str, ...]
    chat_template: str
    add_bos: bool  # whether encode() of plain text adds BOS (templates write their own)


# Chat templates in each family's real format, shortened to what realrl renders
# (system/user/assistant turns and a generation prompt).
_CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
_MISTRAL = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}[/INST]"
    "{% elif m['role'] == 'system' %}[SYSTEM_PROMPT]{{ m['content'] }}[/SYSTEM_PROMPT]"
    "{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
_GEMMA3 = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m['role'] == 'assistant' else 'user' }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
_PHI3 = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% else %}{{ eos_token }}{% endif %}"
)

_QWEN_SPECIALS = dict(
    bos=None, eos=("<|im_end|>", "<|endoftext|>"), pad="<|endoftext|>", extra_specials=("<|im_start|>",)
)

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family(
            "llama3",
            "LlamaForCausalLM",
            "full (llama3 rope scaling)",
            bos="<|begin_of_text|>",
            eos=("<|eot_id|>", "<|end_of_text|>"),
            pad=None,
            extra_specials=("<|start_header_id|>", "<|end_header_id|>"),
            chat_template=_LLAMA3,
            add_bos=True,
        ),
        Family(
            "qwen2.5",
            "Qwen2ForCausalLM",
            "full (qkv bias, tied)",
            **_QWEN_SPECIALS,
            chat_template=_CHATML,
            add_bos=False,
        ),
        Family("qwen3", "Qwen3ForCausalLM", "full (q/k norms)", **_QWEN_SPECIALS, chat_template=_CHATML, add_bos=False),
        Family(
            "qwen3-moe",
            "Qwen3MoeForCausalLM",
            "full, 4 experts top 2",
            **_QWEN_SPECIALS,
            chat_template=_CHATML,
            add_bos=False,
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            "sliding window 16",
            bos="<s>",
            eos=("</s>",),
            pad=None,
            extra_specials=("[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
            chat_template=_MISTRAL,
            add_bos=False,
        ),
        Family(
            "gemma3",
            "Gemma3ForCausalLM",
            "sliding window 16 + full (hybrid)",
            bos="<bos>",
            eos=("<eos>", "<end_of_turn>"),
            pad="<pad>",
            extra_specials=("<start_of_turn>",),
            chat_template=_GEMMA3,
            add_bos=False,
        ),
        Family(
            "phi3",
            "Phi3ForCausalLM",
            "sliding window 16 (fused qkv)",
            bos=None,
            eos=("<|end|>", "<|endoftext|>"),
            pad="<|endoftext|>",
            extra_specials=("<|system|>", "<|user|>", "<|assistant|>"),
            chat_template=_PHI3,
            add_bos=False,
        ),
    )
}

SLIDING_WINDOW = 16  # small, so test prompts and answers cross it


def _model_config(family: str, vocab_size: int, hidden: int, layers: int, intermediate: int, token_ids: dict):
    from transformers import (
        Gemma3TextConfig,
        LlamaConfig,
        MistralConfig,
        Phi3Config,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    heads = max(2, hidden // 32)
    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=4096,
        attention_dropout=0.0,
        **token_ids,
    )
    if family == "llama3":
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 1024}
        return LlamaConfig(**common, rope_parameters=rope)
    if family == "qwen2.5":
        return Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**common, head_dim=hidden // heads)
    if family == "qwen3-moe":
        return Qwen3MoeConfig(
            **common,
            head_dim=hidden // heads,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=(intermediate or 2 * hidden) // 2,
        )
    if family == "mistral":
        return MistralConfig(**common, sliding_window=SLIDING_WINDOW)
    if family == "gemma3":
        pattern = ["sliding_attention", "full_attention"] * layers
        return Gemma3TextConfig(
            **common, head_dim=hidden // heads, sliding_window=SLIDING_WINDOW, layer_types=pattern[:layers]
        )
    if family == "phi3":
        return Phi3Config(**common, sliding_window=SLIDING_WINDOW)
    raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")


def _corpus(seed: int) -> list[str]:
    """Text the tokenizer is trained on: arithmetic like the default task's,
    chat-like English, digits."""
    train, _ = generate_math_records(MathDataRecipe(seed=seed, n_train=400, n_test=10))
    words = "the answer is what how many you can a an and of to in solve step final question please reply"
    return [f"{r['prompt']} {r['answer']}" for r in train] + [words] * 20 + [" ".join(map(str, range(200)))]


def train_tokenizer(family: Family, vocab_size: int = 512, seed: int = 1) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer (GPT-2 / Llama 3 / Qwen style) with the
    family's special tokens and chat template."""
    specials = [t for t in (family.bos, *family.eos, family.pad, *family.extra_specials) if t]
    specials = list(dict.fromkeys(specials))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(_corpus(seed), trainer=trainer)
    if family.add_bos:
        bos_id = backend.token_to_id(family.bos)
        backend.post_processor = processors.TemplateProcessing(
            single=f"{family.bos} $A", pair=f"{family.bos} $A {family.bos} $B", special_tokens=[(family.bos, bos_id)]
        )
    else:
        backend.post_processor = processors.ByteLevel(trim_offsets=False)
    extra = [t for t in family.extra_specials if t not in (family.bos, family.pad, *family.eos)]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=family.bos,
        eos_token=family.eos[0],
        pad_token=family.pad,
        additional_special_tokens=extra + list(family.eos[1:]),
        chat_template=family.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )


def build_random_model(
    family: str,
    out_dir: str,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    intermediate_size: int = 0,
    vocab_size: int = 512,
    seed: int = 1,
) -> str:
    """Write a random-weight `family` model with its tokenizer into `out_dir`."""
    spec = FAMILIES[family] if family in FAMILIES else None
    if spec is None:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(FAMILIES)}")
    tokenizer = train_tokenizer(spec, vocab_size, seed)
    ids = tokenizer.convert_tokens_to_ids
    token_ids = dict(
        bos_token_id=ids(spec.bos) if spec.bos else None,
        eos_token_id=ids(spec.eos[0]),
        pad_token_id=ids(spec.pad) if spec.pad else None,
    )
    config = _model_config(family, len(tokenizer), hidden_size, layers, intermediate_size, token_ids)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if type(model).__name__ != spec.architecture:
        raise AssertionError(f"{family}: built {type(model).__name__}, expected {spec.architecture}")
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=[ids(t) for t in spec.eos],
        pad_token_id=config.pad_token_id,
    )
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # transformers 5 would otherwise load the family's own tokenizer class (module docstring).
    path = os.path.join(out_dir, "tokenizer_config.json")
    with open(path) as f:
        tokenizer_config = json.load(f)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(path, "w") as f:
        json.dump(tokenizer_config, f, indent=2)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("family", choices=sorted(FAMILIES))
    parser.add_argument("out_dir")
    parser.add_argument("--hidden-size", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--intermediate-size", type=int, default=0, help="MLP width (0 = 2 x hidden size)")
    parser.add_argument("--vocab-size", type=int, default=512, help="BPE merges stop here or when the corpus runs out")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    build_random_model(
        args.family,
        args.out_dir,
        hidden_size=args.hidden_size,
        layers=args.layers,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        seed=args.seed,
    )
    print(args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
