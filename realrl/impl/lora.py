"""LoRA adapters on the policy, through peft: which layers, the wrapping, the files.

With `model.lora.rank` > 0 the trainer wraps its actor with `wrap(model,
config)`: every targeted linear layer becomes peft's `lora.Linear` (the frozen
layer plus A: r x in and B: out x r, output `W x + (alpha / r) B A x`; B
starts at zero, so version 0 is the base model), every other parameter is
frozen, and only the adapters get gradients and optimizer state. A published
version, a checkpoint's model state and the final model's `adapter/` hold the
adapter alone (a version and `adapter/` with the model directory's tokenizer
files beside it), in peft's format (docs/design.md §8): `adapter_model.safetensors`
with keys `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` and
`adapter_config.json`; the torch server reads it with
`realrl.impl.generation.torch_server.weights.read_adapter`, SGLang with its
LoRA API. `save_merged` writes the final model as a plain HF directory too.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn as nn

from realrl.api.cli_args import ALL_LINEAR, LoraConfig

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def _linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The layers peft can adapt: torch Linear and transformers' Conv1D (GPT-2)."""
    from transformers.pytorch_utils import Conv1D

    return {name: m for name, m in model.named_modules() if isinstance(m, (nn.Linear, Conv1D))}


def target_modules(model: nn.Module, requested: list[str]) -> list[str]:
    """The module names (last components, as peft and SGLang match them) of
    the layers `requested` adapts in `model`: [all-linear] is every linear
    layer but the output head. ValueError names what is not there."""
    linear = _linear_modules(model)
    if list(requested) == [ALL_LINEAR]:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        names = {name.rsplit(".", 1)[-1] for name, m in linear.items() if m is not head}
        if not names:
            raise ValueError(f"{type(model).__name__} has no linear layer besides its output head")
        return sorted(names)
    missing = [t for t in requested if not any(n == t or n.endswith("." + t) for n in linear)]
    if missing:
        available = sorted({n.rsplit(".", 1)[-1] for n in linear})
        raise ValueError(f"{type(model).__name__} has no linear layer named {missing}; its linear layers: {available}")
    return sorted(requested)


def model_target_modules(model_path: str, requested: list[str]) -> list[str]:
    """`target_modules` of the model in `model_path`, read from its config
    alone (built on the meta device: no weights are read or allocated)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return target_modules(model, requested)


@contextlib.contextmanager
def _quiet():
    # peft 0.21 asks transformers 5 for a deprecated attribute: one FutureWarning per wrap.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def wrap(model: nn.Module, config: LoraConfig) -> nn.Module:
    """`model` (changed in place) as a peft model whose only trainable
    parameters are the adapters of `config.target_modules`."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    peft_config = PeftLoraConfig(
        r=config.rank,
        lora_alpha=config.alpha,
        lora_dropout=config.dropout,
        # Short names keep adapter_config.json portable (SGLang matches them by suffix).
        target_modules=target_modules(model, list(config.target_modules)),
        task_type="CAUSAL_LM",
    )
    with _quiet():
        return get_peft_model(model, peft_config)


def is_lora(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model")


def base_model(model: nn.Module) -> nn.Module:
    """The HF model under a peft wrapper (its layers, with the adapters inside); `model` itself otherwise."""
    return model.get_base_model() if is_lora(model) else model


def trainable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters (a LoRA model's adapters) under their state-dict names."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def save_adapter(model: nn.Module, path: str, state_dict: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter of a LoRA model (or `state_dict`, its trainable
    parameters, e.g. gathered under FSDP) in peft's format, as
    `save_pretrained` writes it but without the model card (its template
    costs more than the adapter)."""
    import os

    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    tensors = get_peft_model_state_dict(model, state_dict=trainable_state(model) if state_dict is None else state_dict)
    os.makedirs(path, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, ADAPTER_WEIGHTS), {"format": "pt"})
    config = model.peft_config["default"]
    inference_mode, config.inference_mode = config.inference_mode, True  # as save_pretrained writes it
    try:
        config.save_pretrained(path)
    finally:
        config.inference_mode = inference_mode


def save_merged(adapter_dir: str, base_path: str, out_dir: str, dtype: torch.dtype) -> None:
    """The base model at `base_path` with the adapter in `adapter_dir` merged
    into its weights (W + (alpha / r) B A), saved as a plain HF model that
    loads without peft."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    with _quiet():
        merged = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merged.save_pretrained(out_dir)
