"""The built-in torch generation server: SGLang's native HTTP API on an HF causal LM.

    python -m realrl.impl.generation.torch_server --model-path DIR --port N \
        [--host 127.0.0.1] [--device cpu|cuda] [--dtype float32|bfloat16|float16] \
        [--max-running-requests 64] [--seed 1] [--weight-version 0] [--num-threads K] \
        [--length-before-eos] [--emulate-sglang VERSION [--emulate-sglang-dp N]] \
        [--engine auto|paged|dense] [--kv-cache-tokens N]

It speaks the subset of SGLang's native API that realrl uses (docs/design.md
§6), with the request and response bodies of `realrl.api.sglang_api`, so the
same `GenerationClient` drives it and a real SGLang server. One module per
layer, each usable alone:

- `protocol`: what a `/generate` body may hold (sampling parameters, limits,
  what is refused and why) and the `Request` each prompt becomes;
- `sampling`: one token per row of a batch, and its logprob
  (`log_softmax(logits / T)`, before filtering);
- `batch`: the running batch and its left-padded, preallocated KV buffers;
- `lean_decode`: a Llama decode step's forward without transformers' module
  dispatch (HF's ops exactly, its logits bit for bit);
- `weights`: reading a safetensors directory, checking names and shapes,
  copying it into the model in place; LoRA adapters read and merged into
  the weights (docs/design.md §8);
- `model`: loading the model, its eos ids, which models are supported
  (full-attention decoders only);
- `engine`: the thread that owns the model and runs the continuous-batching
  loop, fault isolation, weight swaps between decode steps (the dense engine:
  left-padded KV buffers);
- the paged engine, in small rooms: `sequence` (a request's tokens and block
  table), `block_manager` (the block allocator: reference counts, forks;
  pure Python), `scheduler` (packed prefill or decode steps, preemption;
  pure Python), `paged_attention` (attention over the block pool through
  transformers' attention interface: reference, Triton decode kernel, varlen
  prefill), `model_runner` (the pool tensors, one forward per step, CUDA
  graphs) and `paged_engine` (the engine's loop over them; `create_engine`
  picks paged or dense, `--engine`);
- `http`: the aiohttp routes, body checks and rejection counters;
- `sglang_compat`: SGLang's behaviours where they differ, by release, which
  the server copies for tests (`--emulate-sglang`);
- `__main__`: the command line.
"""

from realrl.impl.generation.torch_server.engine import EngineError, GenerationEngine
from realrl.impl.generation.torch_server.http import TorchGenerationServer, serve
from realrl.impl.generation.torch_server.model import eos_token_ids_of, load_model
from realrl.impl.generation.torch_server.protocol import GenerateLimits, Request, parse_generate_body
from realrl.impl.generation.torch_server.sampling import sample_tokens
from realrl.impl.generation.torch_server.weights import WeightLoadError, read_weights_dir

__all__ = [
    "EngineError",
    "GenerateLimits",
    "GenerationEngine",
    "Request",
    "TorchGenerationServer",
    "WeightLoadError",
    "eos_token_ids_of",
    "load_model",
    "parse_generate_body",
    "read_weights_dir",
    "sample_tokens",
    "serve",
]
