"""Attention over the paged KV cache, through transformers' attention interface.

The HF model classes stay: `register()` adds `realrl_paged` to transformers'
`AttentionInterface`, the paged engine sets it as the model's attention, and
each forward passes the step's layout (`PagedKV`) as the keyword `paged_kv`,
which HF hands on to every attention call. Transformers builds no mask for an
implementation it has no mask function for, so a step spends nothing on masks.

Per layer the function first writes the step's new keys/values into the pool
at their slots (`slot_mapping`), then attends:

- **prefill** (packed: the step's sequences one after the other in a single
  row, nothing cached before them) attends causally within each sequence:
  `torch.nn.attention.varlen.varlen_attn` on CUDA in half precision, else SDPA
  per sequence;
- **decode** (one query per sequence) attends over the sequence's blocks: the
  Triton kernel below on CUDA (`triton_paged_decode`), else the reference:
  gather the blocks of each row into a dense [rows, max_len] view and run
  SDPA with a length mask. The tests compare the reference with the dense
  engine and a teacher-forced HF forward.

Called without `paged_kv` (e.g. a teacher-forced forward of the same model),
the function is plain SDPA. Models with sliding-window or soft-capped
attention do not use it (`paged_supported`): the engine keeps them dense.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

NAME = "realrl_paged"

try:  # Triton ships with CUDA builds of torch only.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU builds
    triton = None


@dataclass
class PagedKV:
    """One step's view of the pool, shared by every layer."""

    k_cache: torch.Tensor  # [layers, slots, kv_heads, head_dim]; slot = block * block_size + offset
    v_cache: torch.Tensor
    block_size: int
    slot_mapping: torch.Tensor  # [tokens] long: where each new token's keys/values go
    prefill: bool
    # prefill: the sequences' boundaries in the packed row (host ints; and on the device for varlen)
    cu_seqlens: list[int] | None = None
    cu_seqlens_dev: torch.Tensor | None = None
    # decode: each row's blocks and its length including the new token
    block_tables: torch.Tensor | None = None  # [rows, max_blocks] int32
    context_lens: torch.Tensor | None = None  # [rows] int32
    use_triton: bool = False
    gather_slots: torch.Tensor | None = None  # the reference's gather (`gather_layout`), set by its first layer
    gather_mask: torch.Tensor | None = None


def paged_supported(config) -> str | None:
    """Why a model cannot use paged attention (None if it can)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(config, "attn_logit_softcapping", None):
        return "soft-capped attention logits"
    if any(t != "full_attention" for t in (getattr(config, "layer_types", None) or [])):
        return "sliding-window or hybrid layers"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return "sliding-window attention"
    return None


def register() -> None:
    AttentionInterface.register(NAME, paged_attention_forward)


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,  # [batch, heads, q_len, head_dim]
    key: torch.Tensor,  # [batch, kv_heads, q_len, head_dim]
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    paged_kv: PagedKV | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    if paged_kv is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    layer = module.layer_idx
    kv_heads, head_dim = key.shape[1], key.shape[3]
    # [batch, kv_heads, q_len, d] -> [tokens, kv_heads, d], tokens in row-major order
    new_k = key.transpose(1, 2).reshape(-1, kv_heads, head_dim)
    new_v = value.transpose(1, 2).reshape(-1, kv_heads, head_dim)
    k_cache, v_cache = paged_kv.k_cache[layer], paged_kv.v_cache[layer]
    k_cache.index_copy_(0, paged_kv.slot_mapping, new_k.to(k_cache.dtype))
    v_cache.index_copy_(0, paged_kv.slot_mapping, new_v.to(v_cache.dtype))
    if paged_kv.prefill:
        out = _prefill_attention(query, key, value, paged_kv, scaling)
    elif paged_kv.use_triton:
        out = triton_paged_decode(query[:, :, 0], k_cache, v_cache, paged_kv, scaling)[:, None]
    else:
        out = reference_paged_decode(query, k_cache, v_cache, paged_kv, scaling)
    return out, None  # [batch, q_len, heads, head_dim]


def _prefill_attention(query, key, value, paged_kv: PagedKV, scaling) -> torch.Tensor:
    """Causal attention within each packed sequence; query [1, H, T, d] -> [1, T, H, d]."""
    bounds = paged_kv.cu_seqlens
    gqa = query.shape[1] != key.shape[1]
    if query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and _varlen_causal() is not None:
        longest = max(b - a for a, b in zip(bounds, bounds[1:]))
        q, k, v = (t[0].transpose(0, 1).contiguous() for t in (query, key, value))  # [T, heads, d]
        if gqa and not _VARLEN_GQA:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return _varlen_causal()(q, k, v, paged_kv.cu_seqlens_dev, longest, scaling, gqa)[None]
    out = torch.empty_like(query.transpose(1, 2))
    for a, b in zip(bounds, bounds[1:]):
        out[0, a:b] = F.scaled_dot_product_attention(
            query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], is_causal=True, scale=scaling, enable_gqa=gqa
        )[0].transpose(0, 1)
    return out


_VARLEN: list = []  # [callable or None], resolved once
_VARLEN_GQA = False


def _varlen_causal():
    """torch's varlen flash attention as f(q, k, v, cu_seqlens, longest,
    scale, gqa) -> [T, heads, d], causal; None where this torch has none.
    Its keywords changed between releases (`is_causal` in 2.10/2.11,
    `window_size` and `enable_gqa` later): read from its signature."""
    global _VARLEN_GQA
    if _VARLEN:
        return _VARLEN[0]
    try:
        import inspect

        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
    except (ImportError, ValueError, TypeError):
        _VARLEN.append(None)
        return None
    if "window_size" in params:
        _VARLEN_GQA = "enable_gqa" in params

        def call(q, k, v, cu, longest, scale, gqa):
            extra = {"enable_gqa": gqa} if _VARLEN_GQA else {}
            return varlen_attn(q, k, v, cu, cu, longest, longest, scale=scale, window_size=(-1, 0), **extra)

    elif "is_causal" in params:

        def call(q, k, v, cu, longest, scale, gqa):
            if scale is not None and "scale" not in params:
                q = q * (scale * q.shape[-1] ** 0.5)  # its default scale is 1 / sqrt(d)
                scale = None
            extra = {"scale": scale} if "scale" in params else {}
            return varlen_attn(q, k, v, cu, cu, longest, longest, is_causal=True, **extra)

    else:
        call = None
    _VARLEN.append(call)
    return call


def reference_paged_decode(query, k_cache, v_cache, paged_kv: PagedKV, scaling) -> torch.Tensor:
    """Gather each row's blocks into a dense view and attend with SDPA under a
    length mask; query [B, H, 1, d] -> [B, 1, H, d]. Slots past a row's
    length are zero or the row's own finite keys/values (`ModelRunner`
    clears every block it hands out: a masked NaN would still turn the
    attention NaN), so the mask makes them count 0."""
    if paged_kv.gather_slots is None:
        paged_kv.gather_slots, paged_kv.gather_mask = gather_layout(paged_kv)
    slots, mask = paged_kv.gather_slots, paged_kv.gather_mask
    rows, length = mask.shape
    keys = k_cache.index_select(0, slots).view(rows, length, *k_cache.shape[1:]).transpose(1, 2)  # [B, kv_heads, L, d]
    values = v_cache.index_select(0, slots).view(rows, length, *v_cache.shape[1:]).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        query,
        keys.to(query.dtype),
        values.to(query.dtype),
        attn_mask=mask[:, None, None, :],
        scale=scaling,
        enable_gqa=query.shape[1] != keys.shape[1],
    )
    return out.transpose(1, 2)


def gather_layout(paged_kv: PagedKV) -> tuple[torch.Tensor, torch.Tensor]:
    """The slots of every row's blocks, flattened [B * max_blocks * block_size],
    and which of them hold the row's tokens [B, max_blocks * block_size] (the
    same for every layer: computed once per step)."""
    bs = paged_kv.block_size
    tables = paged_kv.block_tables.long()
    slots = (tables[:, :, None] * bs + torch.arange(bs, device=tables.device)).reshape(-1)
    length = tables.shape[1] * bs
    mask = torch.arange(length, device=tables.device)[None, :] < paged_kv.context_lens[:, None]
    return slots, mask


def triton_paged_decode(query, k_cache, v_cache, paged_kv: PagedKV, scaling) -> torch.Tensor:
    """One query per row over its blocks (online softmax); query [B, H, d] -> [B, H, d]."""
    rows, heads, head_dim = query.shape
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(query)
    scale = scaling if scaling is not None else head_dim**-0.5
    _paged_decode_kernel[(rows, heads)](
        query,
        k_cache,
        v_cache,
        paged_kv.block_tables,
        paged_kv.context_lens,
        out,
        scale,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        paged_kv.block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        GROUP=heads // kv_heads,
        BLOCK_SIZE=paged_kv.block_size,
        HEAD_DIM=head_dim,
    )
    return out


def triton_usable(device: torch.device, block_size: int, head_dim: int) -> bool:
    """The kernel needs CUDA, Triton and power-of-two block and head sizes."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    return device.type == "cuda" and triton is not None and pow2(block_size) and pow2(head_dim) and block_size >= 16


if triton is not None:

    @triton.jit
    def _paged_decode_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        tables_ptr,
        lens_ptr,
        out_ptr,
        scale,
        q_stride_row,
        q_stride_head,
        kv_stride_slot,
        kv_stride_head,
        tables_stride_row,
        out_stride_row,
        out_stride_head,
        GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        dims = tl.arange(0, HEAD_DIM)
        offsets = tl.arange(0, BLOCK_SIZE)
        q = tl.load(q_ptr + row * q_stride_row + head * q_stride_head + dims).to(tl.float32)
        length = tl.load(lens_ptr + row)
        running_max = tl.full((), float("-inf"), tl.float32)
        running_sum = tl.full((), 0.0, tl.float32)
        acc = tl.zeros((HEAD_DIM,), tl.float32)
        for start in range(0, length, BLOCK_SIZE):
            block = tl.load(tables_ptr + row * tables_stride_row + start // BLOCK_SIZE).to(tl.int64)
            slots = block * BLOCK_SIZE + offsets
            valid = start + offsets < length
            kv_offsets = slots[:, None] * kv_stride_slot + kv_head * kv_stride_head + dims[None, :]
            k = tl.load(k_ptr + kv_offsets, mask=valid[:, None], other=0.0).to(tl.float32)
            scores = tl.sum(k * q[None, :], axis=1) * scale
            scores = tl.where(valid, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            correction = tl.exp(running_max - new_max)
            p = tl.exp(scores - new_max)
            v = tl.load(v_ptr + kv_offsets, mask=valid[:, None], other=0.0).to(tl.float32)
            acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
            running_sum = running_sum * correction + tl.sum(p, axis=0)
            running_max = new_max
        out = acc / running_sum
        tl.store(out_ptr + row * out_stride_row + head * out_stride_head + dims, out.to(out_ptr.dtype.element_ty))
