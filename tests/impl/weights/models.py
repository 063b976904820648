"""The tiny real models of the weight transport tests: a Qwen2 with tied
embeddings (one tensor under two names) and a Llama with its own head."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config


def tiny_model(kind: str, seed: int, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    common = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    if kind == "tied":
        config = Qwen2Config(**common, tie_word_embeddings=True)
    elif kind == "untied":
        config = LlamaConfig(**common, tie_word_embeddings=False)
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


@torch.no_grad()
def train_a_little(model: torch.nn.Module, seed: int) -> None:
    """Every parameter changes (as a train step changes them)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.add_(torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype) * 1e-2)
