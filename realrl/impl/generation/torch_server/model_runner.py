"""The paged engine's torch side: the KV pool, one forward per step, sampling, CUDA graphs.

The pool is two tensors, keys and values, [layers, slots, kv_heads,
head_dim], with `slots = (num_blocks + 1) * block_size`: the blocks the
allocator hands out, and one scratch block that padded rows of a captured
decode graph write to. A step is one HF forward with `paged_kv` (see
`paged_attention`):

- **prefill**: the step's sequences packed into one row (no padding), their
  positions restarting at 0 each, logits only at each sequence's last token
  (`logits_to_keep`); forks sample from their source's row, then the partial
  last blocks are copied to the forks (`copy_blocks`);
- **decode**: one token per sequence. On CUDA, with the Triton kernel, the
  forward is a CUDA graph captured once per bucket of batch sizes
  (1, 2, 4, 8, 16, 32, then steps of 16 up to `max_seqs`, at most 256): the
  step's inputs are copied into the graph's static tensors, padded rows point
  at the scratch block, and the graph is replayed. Weight updates and LoRA
  merges copy into the parameters in place, so the graphs stay valid.

Each step ends with one device-to-host copy: tokens, logprobs and sampling
logprobs in one tensor (`sample_tokens(check_finite=False)`: a non-finite
row comes back as NaN and is refused here, without a sync of its own).
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from realrl.base.logging import getLogger
from realrl.impl.generation.torch_server import paged_attention
from realrl.impl.generation.torch_server.paged_attention import PagedKV
from realrl.impl.generation.torch_server.sampling import RowParams, sample_tokens
from realrl.impl.generation.torch_server.sequence import Sequence

logger = getLogger(__name__)

StepResult = tuple[list[int], list[float], list[float]]  # tokens, logprobs, sampling logprobs


def graph_buckets(max_seqs: int) -> list[int]:
    """Batch sizes a decode graph is captured for (a step pads up to the next)."""
    top = min(max_seqs, 256)
    sizes = [b for b in (1, 2, 4, 8, 16) if b < top] + list(range(32, top, 16)) + [top]
    return sorted(set(sizes))


def kv_shape(model: PreTrainedModel) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a model."""
    config = model.config.get_text_config(decoder=True)
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, getattr(config, "num_key_value_heads", None) or heads, head_dim


def blocks_for_memory(model: PreTrainedModel, block_size: int, kv_cache_bytes: int) -> int:
    layers, kv_heads, head_dim = kv_shape(model)
    per_block = 2 * layers * block_size * kv_heads * head_dim * model.dtype.itemsize
    return max(1, kv_cache_bytes // per_block)


class ModelRunner:
    def __init__(
        self,
        model: PreTrainedModel,
        *,
        device: torch.device,
        num_blocks: int,
        block_size: int,
        max_seqs: int,
        generator: torch.Generator,
        cuda_graphs: bool = True,
    ):
        paged_attention.register()
        model.set_attn_implementation(paged_attention.NAME)
        self.model, self.device, self.generator = model, device, generator
        self.block_size, self.num_blocks, self.max_seqs = block_size, num_blocks, max_seqs
        layers, kv_heads, head_dim = kv_shape(model)
        slots = (num_blocks + 1) * block_size
        shape = (layers, slots, kv_heads, head_dim)
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=device)
        self.scratch_block = num_blocks  # never handed out
        self.use_triton = paged_attention.triton_usable(device, block_size, head_dim)
        self.cuda_graphs = cuda_graphs and self.use_triton
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._graph_io: dict[str, torch.Tensor] | None = None
        self._graph_pool = None

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    # ---- steps

    def prefill(
        self, seqs: list[Sequence], rows: list[Sequence], source: list[int], banned
    ) -> tuple[torch.Tensor, StepResult]:
        """One packed forward over `seqs`; samples a token for each of `rows`
        from the last logits of `seqs[source[i]]`."""
        ids, positions, slots, bounds = [], [], [], [0]
        for seq in seqs:
            tokens = seq.token_ids()
            ids += tokens
            positions += range(len(tokens))
            slots += [seq.slot(p, self.block_size) for p in range(len(tokens))]
            bounds.append(bounds[-1] + len(tokens))
        dev = self.device
        long = dict(dtype=torch.long, device=dev)
        paged_kv = PagedKV(
            self.k_cache,
            self.v_cache,
            self.block_size,
            slot_mapping=torch.tensor(slots, **long),
            prefill=True,
            cu_seqlens=bounds,
            cu_seqlens_dev=torch.tensor(bounds, dtype=torch.int32, device=dev),
        )
        last = torch.tensor(bounds[1:], **long) - 1
        out = self.model(
            input_ids=torch.tensor([ids], **long),
            position_ids=torch.tensor([positions], **long),
            paged_kv=paged_kv,
            use_cache=False,
            logits_to_keep=last,
        )
        logits = out.logits[0].index_select(0, torch.tensor(source, **long))
        return self._sample(logits, [r.request for r in rows], banned)

    def decode(self, seqs: list[Sequence], banned) -> tuple[torch.Tensor, StepResult]:
        """One token for each sequence (its last token goes in)."""
        n = len(seqs)
        bs = self.block_size
        positions = [s.num_tokens - 1 for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [self.scratch_block] * (width - len(s.block_table)) for s in seqs]
        inputs = {
            "input_ids": torch.tensor([s.last_token for s in seqs], dtype=torch.long),
            "positions": torch.tensor(positions, dtype=torch.long),
            "slot_mapping": torch.tensor([s.slot(p, bs) for s, p in zip(seqs, positions)], dtype=torch.long),
            "block_tables": torch.tensor(tables, dtype=torch.int32),
            "context_lens": torch.tensor([p + 1 for p in positions], dtype=torch.int32),
        }
        if self.cuda_graphs and n <= self.max_seqs:
            logits = self._replay(n, inputs)
        else:
            inputs = {k: v.to(self.device, non_blocking=True) for k, v in inputs.items()}
            logits = self._decode_forward(inputs)[:n]
        return self._sample(logits, [s.request for s in seqs], banned)

    def _decode_forward(self, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        paged_kv = PagedKV(
            self.k_cache,
            self.v_cache,
            self.block_size,
            slot_mapping=inputs["slot_mapping"],
            prefill=False,
            block_tables=inputs["block_tables"],
            context_lens=inputs["context_lens"],
            use_triton=self.use_triton,
        )
        out = self.model(
            input_ids=inputs["input_ids"][:, None],
            position_ids=inputs["positions"][:, None],
            paged_kv=paged_kv,
            use_cache=False,
        )
        return out.logits[:, -1, :]

    def _sample(self, logits: torch.Tensor, requests, banned) -> tuple[torch.Tensor, StepResult]:
        params = RowParams.from_requests(requests, self.device)
        tokens, logprobs, sampling = sample_tokens(logits, params, self.generator, banned, check_finite=False)
        # The step's one device-to-host copy.
        host = torch.stack([tokens.double(), logprobs.double(), sampling.double()]).cpu().tolist()
        if any(lp != lp for lp in host[1]):  # NaN: the logits of that row were not finite
            raise FloatingPointError("the model produced non-finite logits (NaN or inf)")
        return tokens, ([int(t) for t in host[0]], host[1], host[2])

    def clear_blocks(self, blocks: list[int]) -> None:
        """Zero blocks before their new owner uses them, where attention reads
        a block's unwritten slots (the gather reference; the Triton kernel
        and prefill never do): they may hold a failed request's NaN."""
        if not blocks or self.use_triton:
            return
        bs = self.block_size
        offsets = torch.arange(bs, device=self.device)
        slots = (torch.tensor(blocks, device=self.device)[:, None] * bs + offsets).reshape(-1)
        for cache in (self.k_cache, self.v_cache):
            cache.index_fill_(1, slots, 0)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks (source, destination) in every layer: a fork's partial last block."""
        if not copies:
            return
        bs = self.block_size
        offsets = torch.arange(bs, device=self.device)
        src = (torch.tensor([s for s, _ in copies], device=self.device)[:, None] * bs + offsets).reshape(-1)
        dst = (torch.tensor([d for _, d in copies], device=self.device)[:, None] * bs + offsets).reshape(-1)
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(1, dst, cache.index_select(1, src))

    # ---- CUDA graphs (decode)

    def capture_graphs(self, max_blocks_per_seq: int) -> None:
        """Capture one decode graph per bucket (CUDA with the Triton kernel only)."""
        if not self.cuda_graphs:
            return
        top = graph_buckets(self.max_seqs)[-1]
        dev = self.device
        io = {
            "input_ids": torch.zeros(top, dtype=torch.long, device=dev),
            "positions": torch.zeros(top, dtype=torch.long, device=dev),
            "slot_mapping": torch.full((top,), self.scratch_block * self.block_size, dtype=torch.long, device=dev),
            "block_tables": torch.full((top, max_blocks_per_seq), self.scratch_block, dtype=torch.int32, device=dev),
            "context_lens": torch.ones(top, dtype=torch.int32, device=dev),
        }
        self._graph_io = io
        with torch.inference_mode():
            for size in reversed(graph_buckets(self.max_seqs)):  # largest first: the pool's memory is reused
                view = {k: v[:size] for k, v in io.items()}
                self._decode_forward(view)  # warm up (Triton compiles, HF caches)
                torch.cuda.synchronize(dev)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._graph_pool):
                    io[f"logits{size}"] = self._decode_forward(view)
                self._graph_pool = graph.pool()
                self._graphs[size] = graph
        torch.cuda.synchronize(dev)
        logger.info("captured %d decode graphs (batch sizes up to %d)", len(self._graphs), top)

    def _replay(self, n: int, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
        size = next(b for b in sorted(self._graphs) if b >= n)
        io = self._graph_io
        width = inputs["block_tables"].shape[1]
        if width > io["block_tables"].shape[1]:
            raise RuntimeError(f"a sequence holds {width} blocks, the decode graphs were captured for fewer")
        # Padded rows: one token at the scratch block, attending to itself.
        io["slot_mapping"][n:size].fill_(self.scratch_block * self.block_size)
        io["block_tables"][:size].fill_(self.scratch_block)
        io["context_lens"][n:size].fill_(1)
        for name in ("input_ids", "positions", "slot_mapping", "context_lens"):
            io[name][:n].copy_(inputs[name], non_blocking=True)
        io["block_tables"][:n, :width].copy_(inputs["block_tables"], non_blocking=True)
        self._graphs[size].replay()
        return io[f"logits{size}"][:n]
