"""Supervised warm start and arithmetic evaluation for the tiny model.

RL needs a policy that already earns some reward: a freshly initialised model
never emits a correct number, so every GRPO group would score zero and learn
nothing. `warm_start` runs a short supervised pass (plain PyTorch, AdamW, loss
only on the answer tokens and eos) so the tiny model solves part of the
arithmetic tasks — enough reward signal, with room left for RL to grow.

The demonstrations are deliberately imperfect, like the data real models are
pre-trained on: some of them end the answer with a hedge ("81?" instead of
"81"), most of those whose first operand has two digits and few of the
others, and the task's exact answer format rejects a hedged answer. The warm-started
policy thus starts with a habit that has nothing to do with the arithmetic of
any one problem; RL unlearns it within minutes and the gain carries over to
problems it never trained on, so greedy accuracy on the test split rises.
(Without it, RL on a model this small can only improve the arithmetic itself,
which takes far longer than a CPU demo has.)

Evaluation helpers (`greedy_accuracy`, `pass_at_k`) decode in batches with a KV
cache and check the answer by exact numeric match; later evaluation code reuses
them. The tokenizer is expected to add no special tokens on its own (the tiny
kit's character tokenizer does not), so a prompt's ids are exactly its
characters' ids.
"""

from __future__ import annotations

import math
import random
import re
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from realrl.base.logging import getLogger

logger = getLogger(__name__)

_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class WarmStartConfig:
    steps: int = 1000
    batch_size: int = 64
    lr: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # Fractions of demonstrations written as answer + hedge_suffix: of the
    # problems whose first operand is >= 10 (about 70%), and of the others.
    hedge_fraction_large: float = 0.75
    hedge_fraction_small: float = 0.1
    hedge_suffix: str = "?"


# ---------------------------------------------------------------- answers


def parse_number(text: str) -> float | None:
    """The number a completion states, or None if it is not exactly one number.

    Strict on purpose: the completion (already cut at eos) must be a single
    number, optionally surrounded by whitespace; thousands separators are allowed.
    """
    text = text.strip().replace(",", "")
    if not _NUMBER_RE.fullmatch(text):
        return None
    return float(text)


def reference_number(answer: str) -> float | None:
    """The number a reference answer means: the whole string if it is a number,
    else the last number in it (e.g. a GSM8K-style solution ending `#### 72`)."""
    value = parse_number(answer)
    if value is not None:
        return value
    found = _NUMBER_RE.findall(answer.replace(",", ""))
    return float(found[-1]) if found else None


def is_correct(completion: str, record: dict) -> bool:
    """Numeric answers: exactly one number, equal to a solution's. Other
    answers (e.g. a plugin task's strings): equal to a solution after strip."""
    solutions = record.get("solutions") or [record["answer"]]
    if all(reference_number(str(s)) is None for s in solutions):
        return any(completion.strip() == str(s).strip() for s in solutions)
    predicted = parse_number(completion)
    if predicted is None:
        return False
    for solution in solutions:
        reference = reference_number(str(solution))
        if reference is not None and math.isclose(predicted, reference, rel_tol=0.0, abs_tol=1e-6):
            return True
    return False


# ---------------------------------------------------------------- decoding


@torch.no_grad()
def generate_batch(
    model: PreTrainedModel,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos_token_id: int,
    pad_token_id: int,
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
) -> list[list[int]]:
    """Decode a batch of prompts with a KV cache; temperature 0 means greedy.

    Prompts are left-padded; position ids count only real tokens, so a padded
    prompt decodes exactly like the same prompt alone. Each returned completion
    ends at (and includes) its eos, or has `max_new_tokens` tokens.
    """
    device = next(model.parameters()).device
    batch = len(prompts)
    longest = max(len(p) for p in prompts)
    input_ids = torch.full((batch, longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, longest), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, longest - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, longest - len(p) :] = 1
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)

    cache = DynamicCache()
    logits = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        past_key_values=cache,
        use_cache=True,
    ).logits[:, -1, :]

    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    steps: list[torch.Tensor] = []
    for _ in range(max_new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits.float() / temperature, dim=-1)
            next_token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(device)
        else:
            next_token = logits.argmax(dim=-1)
        next_token = torch.where(finished, torch.full_like(next_token, pad_token_id), next_token)
        steps.append(next_token)
        finished |= next_token == eos_token_id
        if bool(finished.all()):
            break
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((batch, 1))], dim=-1)
        position_ids = position_ids[:, -1:] + 1
        logits = model(
            input_ids=next_token[:, None],
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
        ).logits[:, -1, :]

    tokens = torch.stack(steps, dim=1).tolist()
    completions = []
    for row in tokens:
        out = []
        for t in row:
            out.append(t)
            if t == eos_token_id:
                break
        completions.append(out)
    return completions


def _completion_text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    if ids and ids[-1] == tokenizer.eos_token_id:
        ids = ids[:-1]
    # Keep special tokens: a stray <pad>/<bos> inside a sample makes it wrong, not skipped.
    return tokenizer.decode(ids, skip_special_tokens=False)


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, records: list[dict]) -> list[list[int]]:
    return [tokenizer.encode(r["prompt"], add_special_tokens=False) for r in records]


def _was_training(model: PreTrainedModel) -> bool:
    training = model.training
    model.eval()
    return training


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict],
    max_new_tokens: int = 8,
    batch_size: int = 256,
) -> float:
    """Fraction of records whose greedy completion (cut at eos) equals the answer numerically."""
    if not records:
        return 0.0
    training = _was_training(model)
    correct = 0
    try:
        for start in range(0, len(records), batch_size):
            chunk = records[start : start + batch_size]
            outs = generate_batch(
                model, _prompt_ids(tokenizer, chunk), max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id
            )
            correct += sum(is_correct(_completion_text(tokenizer, o), r) for o, r in zip(outs, chunk))
    finally:
        model.train(training)
    return correct / len(records)


def pass_at_k(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict],
    k: int = 8,
    temperature: float = 1.0,
    max_new_tokens: int = 8,
    batch_size: int = 256,
    seed: int = 0,
) -> float:
    """Fraction of records for which at least one of `k` samples at `temperature` is correct."""
    if not records:
        return 0.0
    training = _was_training(model)
    generator = torch.Generator().manual_seed(seed)
    # Each record repeated k times, consecutively, then decoded in flat batches.
    flat = [r for r in records for _ in range(k)]
    hits: list[bool] = []
    try:
        for start in range(0, len(flat), batch_size):
            chunk = flat[start : start + batch_size]
            outs = generate_batch(
                model,
                _prompt_ids(tokenizer, chunk),
                max_new_tokens,
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
                temperature=temperature,
                generator=generator,
            )
            hits.extend(is_correct(_completion_text(tokenizer, o), r) for o, r in zip(outs, chunk))
    finally:
        model.train(training)
    solved = sum(any(hits[i * k : (i + 1) * k]) for i in range(len(records)))
    return solved / len(records)


# ---------------------------------------------------------------- training


_OPERANDS_RE = re.compile(r"(\d+)\s*[-+*/]\s*(\d+)")


def _has_large_operand(prompt: str) -> bool:
    m = _OPERANDS_RE.search(prompt)
    return m is not None and len(m.group(1)) >= 2


def _encode_examples(
    tokenizer: PreTrainedTokenizerBase,
    records: list[dict],
    config: WarmStartConfig | None = None,
    rng: random.Random | None = None,
) -> list[tuple[list[int], int]]:
    """(prompt + answer + eos ids, prompt length) per record; some answers get
    the hedge suffix (chosen once per record, by `rng`)."""
    config = config or WarmStartConfig()
    rng = rng or random.Random(0)
    examples = []
    for r in records:
        prompt = tokenizer.encode(r["prompt"], add_special_tokens=False)
        text = str(r["answer"])
        fraction = config.hedge_fraction_large if _has_large_operand(r["prompt"]) else config.hedge_fraction_small
        if fraction and rng.random() < fraction:
            text += config.hedge_suffix
        answer = tokenizer.encode(text, add_special_tokens=False)
        examples.append((prompt + answer + [tokenizer.eos_token_id], len(prompt)))
    return examples


def _collate(examples: list[tuple[list[int], int]], pad_token_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded input ids, attention mask, and labels that are -100 except on answer + eos."""
    longest = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    labels = torch.full_like(input_ids, -100)
    for i, (ids, prompt_len) in enumerate(examples):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
        labels[i, prompt_len : len(ids)] = input_ids[i, prompt_len : len(ids)]
    return input_ids, attention_mask, labels


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train_records: list[dict],
    config: WarmStartConfig = WarmStartConfig(),
    seed: int = 1,
) -> dict[str, float]:
    """Supervised pass over (prompt, answer) pairs; trains `model` in place.

    Batches are drawn by shuffling the train records each epoch (seeded). The
    learning rate warms up linearly, then decays with a cosine to 10%.
    Returns {"loss": final smoothed loss, "seconds": wall time}.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    examples = _encode_examples(tokenizer, train_records, config, random.Random(seed))
    device = next(model.parameters()).device

    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(0.9, 0.98), weight_decay=config.weight_decay)

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return config.lr * (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    order: list[int] = []
    smoothed_loss = float("nan")
    model.train()
    start = time.perf_counter()
    for step in range(config.steps):
        if len(order) < config.batch_size:
            epoch = list(range(len(examples)))
            rng.shuffle(epoch)
            order.extend(epoch)
        batch_idx, order = order[: config.batch_size], order[config.batch_size :]
        input_ids, attention_mask, labels = (
            t.to(device) for t in _collate([examples[i] for i in batch_idx], tokenizer.pad_token_id)
        )

        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        # Token t predicts token t+1; prompt and padding positions are ignored.
        loss = F.cross_entropy(
            logits[:, :-1].reshape(-1, logits.size(-1)).float(), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.grad_clip)
        optimizer.step()

        value = loss.item()
        smoothed_loss = value if math.isnan(smoothed_loss) else 0.9 * smoothed_loss + 0.1 * value
        if step % 50 == 0 or step == config.steps - 1:
            logger.info("warm start step %d/%d loss %.4f lr %.2e", step + 1, config.steps, smoothed_loss, lr_at(step))
    model.eval()
    return {"loss": smoothed_loss, "seconds": time.perf_counter() - start}
