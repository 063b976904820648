"""The served model: loading it, its eos ids, and which models the engine can run.

Only full-attention decoder models (Llama, Qwen2, Mistral without sliding
window, ...) are supported: the engine's KV buffers (`batch`) hold every
position of every layer. `check_supported` refuses the others before the
server starts.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.cache_utils import DynamicCache, DynamicLayer

from realrl.impl.generation.eos import token_ids

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_model(model_path: str, device: str, dtype: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    return model.to(device).eval()


def eos_token_ids_of(model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        ids |= token_ids(getattr(source, "eos_token_id", None))
    return frozenset(ids)


def check_supported(model: PreTrainedModel) -> None:
    """Raise ValueError for a model the engine cannot serve."""
    layers = DynamicCache(config=model.config).layers
    if any(type(layer) is not DynamicLayer for layer in layers):
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise ValueError(f"the torch server supports full-attention models only (cache layers: {kinds})")
