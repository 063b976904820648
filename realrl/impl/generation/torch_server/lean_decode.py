"""A decode step's forward for Llama models without transformers' module dispatch.

A decode step of the default run's tiny model is ~290 small torch ops; around them HF's forward spends as
much again in Python: ~60 module calls with their hook checks, the output-capturing and config-merging
wrappers, the mask helper, the attention-interface lookup and config attribute reads per layer.
`lean_decoder(model)` returns a forward that runs the *same torch ops, on the same tensors, in the same
order* as `LlamaForCausalLM.forward` does for one new token per row with a ready 4D mask (the engine's
decode step, `batch.RunningBatch`), calling the rotary embedding and the activation modules themselves, so
its logits are HF's bit for bit (tests/impl/torch_server/test_lean_decode.py checks them against the model's
own forward). Any other model, or one whose submodules carry hooks, gets None and the engine calls the
model. Forward hooks on the model itself (`cpu_threads.FollowIdleCores.per_forward`) are called around it,
as a module call would (without arguments: those hooks read none).

Measured (quiet, one thread, the tiny kit model): a forward of 128 / 32 / 8 rows 7.17 / 2.70 / 1.52 ms with
HF's, 6.69 / 2.12 / 1.15 ms lean; the default run's server workload replayed on the engine (16 prompts x 8
answers a step) 26.6-26.9 -> 24.8-25.2 ms of decode a step, the same tokens and logprobs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama import modeling_llama as llama

LeanForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], torch.Tensor]


def _has_hooks(module: nn.Module) -> bool:
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or getattr(module, "_forward_hooks_with_kwargs", None)
        or getattr(module, "_forward_pre_hooks_with_kwargs", None)
    )


def lean_decoder(model: nn.Module) -> LeanForward | None:
    """The lean decode forward of `model` (module docstring), or None where it would not be HF's exactly."""
    if type(model) is not llama.LlamaForCausalLM or type(model.model) is not llama.LlamaModel:
        return None
    if model.training or model.config._attn_implementation != "sdpa":
        return None
    inner = model.model
    for layer in inner.layers:
        parts = (type(layer), type(layer.self_attn), type(layer.mlp))
        norms = (type(layer.input_layernorm), type(layer.post_attention_layernorm))
        if parts != (llama.LlamaDecoderLayer, llama.LlamaAttention, llama.LlamaMLP):
            return None
        if norms != (llama.LlamaRMSNorm, llama.LlamaRMSNorm):
            return None
    if type(inner.norm) is not llama.LlamaRMSNorm or type(inner.embed_tokens) is not nn.Embedding:
        return None
    if any(_has_hooks(m) for m in model.modules() if m is not model):
        return None
    if len(inner.layers) != model.config.num_hidden_layers:
        return None
    layers = list(inner.layers)

    def forward(input_ids: torch.Tensor, mask: torch.Tensor, position_ids: torch.Tensor, cache) -> torch.Tensor:
        """Logits [rows, vocab] of one new token per row (`input_ids`, `position_ids`: [rows, 1]; `mask`:
        the 4D boolean mask; `cache`: the running batch's, its layers written in place)."""
        if model._forward_pre_hooks:
            for hook in list(model._forward_pre_hooks.values()):
                hook(model, ())
        logits = _forward(input_ids, mask, position_ids, cache)
        if model._forward_hooks:
            for hook in list(model._forward_hooks.values()):
                hook(model, (), logits)
        return logits

    def _forward(input_ids, mask, position_ids, cache) -> torch.Tensor:
        embed = inner.embed_tokens
        hidden = F.embedding(
            input_ids, embed.weight, embed.padding_idx, embed.max_norm, embed.norm_type, embed.scale_grad_by_freq
        )
        cos, sin = inner.rotary_emb(hidden, position_ids=position_ids)
        # apply_rotary_pos_emb's unsqueeze, once for every layer (the same views)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        input_shape = hidden.shape[:-1]
        for layer in layers:
            attn = layer.self_attn
            residual = hidden
            hidden = _rms_norm(layer.input_layernorm, hidden)
            hidden_shape = (*input_shape, -1, attn.head_dim)
            q = F.linear(hidden, attn.q_proj.weight, attn.q_proj.bias).view(hidden_shape).transpose(1, 2)
            k = F.linear(hidden, attn.k_proj.weight, attn.k_proj.bias).view(hidden_shape).transpose(1, 2)
            v = F.linear(hidden, attn.v_proj.weight, attn.v_proj.bias).view(hidden_shape).transpose(1, 2)
            q = (q * cos) + (_rotate_half(q) * sin)
            k = (k * cos) + (_rotate_half(k) * sin)
            k, v = cache.layers[attn.layer_idx].update(k, v)
            groups = attn.num_key_value_groups
            if groups > 1:  # sdpa_attention_forward's pack_gqa for one query token
                q = q.reshape(q.shape[0], q.shape[1] // groups, groups, q.shape[-1])
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=0.0, scale=attn.scaling, is_causal=False
            )
            out = out.reshape(out.shape[0], -1, 1, v.shape[-1]).transpose(1, 2).contiguous()
            out = out.reshape(*input_shape, -1).contiguous()
            hidden = residual + F.linear(out, attn.o_proj.weight, attn.o_proj.bias)
            residual = hidden
            hidden = _rms_norm(layer.post_attention_layernorm, hidden)
            mlp = layer.mlp
            gate = mlp.act_fn(F.linear(hidden, mlp.gate_proj.weight, mlp.gate_proj.bias))
            up = F.linear(hidden, mlp.up_proj.weight, mlp.up_proj.bias)
            hidden = residual + F.linear(gate * up, mlp.down_proj.weight, mlp.down_proj.bias)
        hidden = _rms_norm(inner.norm, hidden)
        head = model.lm_head
        return F.linear(hidden, head.weight, head.bias)[:, -1, :]

    return forward


def _rms_norm(norm: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """LlamaRMSNorm.forward, op for op."""
    input_dtype = hidden.dtype
    hidden = hidden.to(torch.float32)
    variance = hidden.pow(2).mean(-1, keepdim=True)
    hidden = hidden * torch.rsqrt(variance + norm.variance_epsilon)
    return norm.weight * hidden.to(input_dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """modeling_llama.rotate_half."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
