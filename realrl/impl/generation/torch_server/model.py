"""The served model: loading it, its eos ids, and which models the engine can run.

The engine's KV buffers (`batch`) hold every position of every layer, and a
decode step passes its attention mask ready-made. That serves full-attention
models and sliding-window ones exactly: a sliding layer's mask is the full
mask with the columns older than the window switched off, the window HF's
own masks use (a key is attended while `q - k < sliding_window`). Models
whose layers mix both kinds (Gemma 3, Qwen2 with `max_window_layers`) get one
mask per layer type, the mapping their HF forward accepts in place of a mask.
`attention_layout` says which case a model is, and refuses (ValueError naming
the architecture) any other attention (chunked, linear, ...) before the
server starts: never a silent mismatch with what the trainer computes.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from realrl.impl.generation.eos import token_ids
from realrl.impl.weights.in_memory import in_own_memory

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> str:
    """`auto` is bfloat16 on CUDA (what SGLang and vLLM serve in) and float32 on
    CPU, where bfloat16 matmuls are slow and the trainer's logprobs are float32."""
    if dtype != "auto":
        return dtype
    return "bfloat16" if torch.device(device).type == "cuda" else "float32"


FULL, SLIDING = "full_attention", "sliding_attention"


@dataclasses.dataclass(frozen=True)
class AttentionLayout:
    """How the layers attend: `window` None = every layer sees every earlier
    token; else the sliding layers see the last `window` tokens, and `mixed`
    says that some layers are full (masks then go per layer type)."""

    window: int | None = None
    mixed: bool = False

    def decode_masks(self, mask: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
        """The attention mask(s) of one decode step from its full boolean 4D
        mask [rows, 1, 1, columns] (the new token is the last column)."""
        if self.window is None or mask.shape[-1] <= self.window:
            return mask
        windowed = mask.clone()
        windowed[..., : mask.shape[-1] - self.window] = False
        return {FULL: mask, SLIDING: windowed} if self.mixed else windowed


def attention_layout(config) -> AttentionLayout:
    """The layout of an HF model config; ValueError naming the architecture
    for attention the engine cannot serve exactly."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    architecture = ",".join(getattr(config, "architectures", None) or [type(config).__name__])
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        unknown = sorted(set(layer_types) - {FULL, SLIDING})
        if unknown:
            raise ValueError(
                f"{architecture}: the torch server serves full and sliding-window attention only, "
                f"this model has {', '.join(unknown)} layers (use the sglang backend)"
            )
        if SLIDING not in layer_types:
            return AttentionLayout()
        if not window:
            raise ValueError(f"{architecture}: sliding_attention layers but no sliding_window in its config")
        return AttentionLayout(window=int(window), mixed=FULL in layer_types)
    if getattr(config, "attention_chunk_size", None):
        raise ValueError(f"{architecture}: chunked attention is not served by the torch server (use sglang)")
    # No layer_types (Mistral, Phi-3): one mask for every layer, windowed when set.
    if window and getattr(config, "use_sliding_window", True):
        return AttentionLayout(window=int(window))
    return AttentionLayout()


def load_model(model_path: str, device: str, dtype: str) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=DTYPES[dtype], attn_implementation="sdpa")
    if torch.device(device).type == "cpu":
        in_own_memory(model)
    return model.to(device).eval()


def eos_token_ids_of(model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        ids |= token_ids(getattr(source, "eos_token_id", None))
    return frozenset(ids)
