"""Token log-probabilities and entropies from logits, in bounded memory.

The trainer's forward pass ends here: `gather_logprobs` turns [B, T, V]
logits into the [B, T] log-probabilities of the sampled tokens that every
loss in `realrl.impl.ppo.functional` starts from. Both functions work in fp32
chunk by chunk, so no full-vocabulary fp32 copy of the logits ever exists;
logprobs are log_softmax(logits / temperature), the scaling the generation
servers use, so behaviour, proximal and current logprobs are comparable.
"""

from __future__ import annotations

import torch

# Logits turned into fp32 at a time: bounds each temporary fp32 buffer to
# about 64 MiB however large the vocabulary or the micro-batch is.
_CHUNK_ELEMENTS = 1 << 24


def _rows_per_chunk(vocab_size: int) -> int:
    return max(1, _CHUNK_ELEMENTS // max(1, vocab_size))


def _effective_temperature(temperature: float | None) -> float:
    # Greedy decoding (temperature 0) is scored with the untempered
    # distribution; the same convention as the generation servers.
    if temperature is None or temperature == 0:
        return 1.0
    return float(temperature)


class _GatherLogprobs(torch.autograd.Function):
    """logp[n] = x[n, label[n]] - logsumexp_j x[n, j], with x = logits / T.

    Computed in fp32 chunk by chunk. Only the original logits and one fp32
    log-sum-exp per row are kept for backward; the gradient
    d logp[n] / d logits[n, j] = (1[j == label[n]] - softmax(x[n])_j) / T
    is recomputed chunk by chunk, so no full-vocabulary fp32 tensor ever
    exists (the naive log_softmax keeps one alive for backward).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
        """`temperature`: one for all rows, or an [n_rows] tensor of one per row."""
        n_rows, vocab_size = logits.shape
        chunk = _rows_per_chunk(vocab_size)
        logprobs = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        logsumexp = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
        for start in range(0, n_rows, chunk):
            end = min(start + chunk, n_rows)
            x = logits[start:end].to(torch.float32, copy=True).div_(_rows(temperature, start, end))
            lse = torch.logsumexp(x, dim=-1)
            picked = x.gather(-1, labels[start:end, None]).squeeze(-1)
            logprobs[start:end] = picked - lse
            logsumexp[start:end] = lse
        ctx.save_for_backward(logits, labels, logsumexp)
        ctx.temperature = temperature
        return logprobs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logprobs: torch.Tensor):
        logits, labels, logsumexp = ctx.saved_tensors
        temperature = ctx.temperature
        n_rows, vocab_size = logits.shape
        chunk = _rows_per_chunk(vocab_size)
        grad_logits = torch.empty_like(logits)
        grad_logprobs = grad_logprobs.float()
        for start in range(0, n_rows, chunk):
            end = min(start + chunk, n_rows)
            g_out = grad_logprobs[start:end, None]
            # one fp32 buffer, updated in place: x -> softmax(x) -> gradient
            t = _rows(temperature, start, end)
            g = logits[start:end].to(torch.float32, copy=True).div_(t)
            g.sub_(logsumexp[start:end, None]).exp_()
            g.mul_(-g_out).scatter_add_(-1, labels[start:end, None], g_out).div_(t)
            grad_logits[start:end].copy_(g)
        return grad_logits, None, None


def _rows(temperature: float | torch.Tensor, start: int, end: int) -> float | torch.Tensor:
    """The temperature of rows start..end, shaped to divide their [rows, V] logits."""
    return temperature[start:end, None] if isinstance(temperature, torch.Tensor) else temperature


def gather_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float | torch.Tensor | None = 1.0
) -> torch.Tensor:
    """Log-probability of each label under softmax(logits / temperature).

        logp[b, t] = log_softmax(logits[b, t] / temperature)[labels[b, t]]

    Args:
        logits: [B, T, V] (any float dtype; computed in fp32).
        labels: [B, T] token ids. Negative ids (e.g. -100 at padding) give 0.0
            and no gradient.
        temperature: the sampling temperature the tokens were drawn with;
            0 or None is treated as 1. A [B] float32 tensor gives each
            sequence its own (positive) temperature.

    Returns:
        [B, T] fp32 log-probabilities; differentiable w.r.t. `logits`.

    Memory: fp32 work happens in chunks of ~64 MiB and backward recomputes the
    softmax, so beyond the logits and their gradient only O(B*T) extra memory
    is kept (measured on [2, 1024, 32000] bf16 logits, forward+backward: peak
    +227 MiB, of which 125 MiB is the gradient, versus +756 MiB for
    log_softmax(logits.float()).gather).
    """
    *batch_shape, vocab_size = logits.shape
    if isinstance(temperature, torch.Tensor):  # one per sequence -> one per flattened row
        temperature = temperature.to(torch.float32)[:, None].expand(batch_shape).reshape(-1)
    else:
        temperature = _effective_temperature(temperature)
    flat_logits = logits.reshape(-1, vocab_size)
    flat_labels = labels.reshape(-1).long()
    valid = flat_labels >= 0
    safe_labels = flat_labels.clamp(min=0)
    logprobs = _GatherLogprobs.apply(flat_logits, safe_labels, temperature)
    logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    return logprobs.view(*batch_shape)


def entropy_from_logits(logits: torch.Tensor, temperature: float | torch.Tensor | None = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position, in fp32.

        H[b, t] = logsumexp(x) - sum_j softmax(x)_j * x_j,   x = logits[b, t] / T

    Chunked over rows; meant for statistics (wrap the call in torch.no_grad()),
    though it is differentiable.

    Args:
        logits: [B, T, V].
    Returns:
        [B, T] entropies in nats.
    """
    *batch_shape, vocab_size = logits.shape
    if isinstance(temperature, torch.Tensor):  # one per sequence -> one per flattened row
        temperature = temperature.to(torch.float32)[:, None].expand(batch_shape).reshape(-1, 1)
    else:
        temperature = _effective_temperature(temperature)
    flat_logits = logits.reshape(-1, vocab_size)
    chunk = _rows_per_chunk(vocab_size)
    pieces = []
    for start in range(0, flat_logits.shape[0], chunk):
        t = temperature[start : start + chunk] if isinstance(temperature, torch.Tensor) else temperature
        x = flat_logits[start : start + chunk].float() / t
        lse = torch.logsumexp(x, dim=-1)
        probs = torch.exp(x - lse[:, None])
        pieces.append(lse - (probs * x).sum(-1))
    if not pieces:
        return flat_logits.new_zeros(batch_shape, dtype=torch.float32)
    return torch.cat(pieces).view(*batch_shape)
