"""Start one torch generation server (see the package docstring).

    python -m realrl.impl.generation.torch_server --model-path DIR --port N \
        [--host 127.0.0.1] [--device cpu|cuda] [--dtype float32|bfloat16|float16] \
        [--max-running-requests 64] [--max-prefill-tokens 8192] [--seed 1] \
        [--weight-version 0] [--num-threads K] [--max-threads K] [--length-before-eos] [--log-level LEVEL] \
        [--emulate-sglang VERSION [--emulate-sglang-dp N] | --emulate-vllm VERSION] [--weight-load-gate FILE] \
        [--frozen] [--engine auto|paged|dense] [--kv-cache-tokens N] [--kv-block-size 16] [--no-cuda-graphs] \
        [--secret-file FILE] [--weights-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio

import torch
import transformers

from realrl.base import trial_secret
from realrl.base.cpu_threads import FollowIdleCores, IdleCores
from realrl.base.logging import configure, getLogger
from realrl.base.malloc import hold_malloc
from realrl.base.process import exit_process
from realrl.impl.generation.eos import eos_token_ids_in_dir
from realrl.impl.generation.torch_server.http import TorchGenerationServer, serve
from realrl.impl.generation.torch_server.model import DTYPES, eos_token_ids_of, load_model, resolve_dtype
from realrl.impl.generation.torch_server.paged_engine import DEFAULT_BLOCK_SIZE, create_engine
from realrl.impl.generation.torch_server.sglang_compat import SGLangCompat
from realrl.impl.generation.torch_server.vllm_compat import VLLMCompat
from realrl.impl.generation.torch_server.weights_group import GroupMembership

logger = getLogger("realrl.impl.generation.torch_server")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m realrl.impl.generation.torch_server",
        description="The built-in torch generation server: SGLang's native HTTP API on an HF causal LM.",
    )
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", *sorted(DTYPES)], help="auto: bfloat16 on CUDA, float32 on CPU"
    )
    parser.add_argument("--max-running-requests", type=int, default=64)
    parser.add_argument("--max-prefill-tokens", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--weight-version", default="0")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--max-threads",
        type=int,
        default=0,
        help="CPU: up to this many torch threads while the rest of the machine leaves cores idle "
        "(checked before each forward; never fewer than --num-threads)",
    )
    parser.add_argument(
        "--length-before-eos", action="store_true", help="check the length limit before stop tokens, as SGLang does"
    )
    parser.add_argument("--log-level", default=None)
    parser.add_argument(
        "--emulate-sglang",
        default="",
        metavar="VERSION",
        help="behave as this SGLang release does where it differs (tests; see sglang_compat); "
        "reads SGLANG_HEALTH_CHECK_TIMEOUT and SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION as SGLang does",
    )
    parser.add_argument("--emulate-sglang-dp", type=int, default=1, help="data-parallel ranks SGLang would report")
    parser.add_argument(
        "--emulate-vllm",
        default="",
        metavar="VERSION",
        help="answer vLLM's routes and bodies as this vLLM release does, instead of SGLang's (tests; see vllm_compat)",
    )
    parser.add_argument(
        "--weight-load-gate", default=None, metavar="FILE", help="test hook: weight updates wait until FILE exists"
    )
    parser.add_argument(
        "--frozen", action="store_true", help="refuse every weight change with 400 (a judge model's server)"
    )
    parser.add_argument(
        "--engine",
        default="auto",
        choices=["auto", "paged", "dense"],
        help="KV cache layout: paged (block pool, shared prompts, CUDA graphs) or dense (left-padded buffers); "
        "auto: paged on CUDA, dense on CPU and for sliding-window/hybrid models",
    )
    parser.add_argument(
        "--kv-cache-tokens",
        type=int,
        default=None,
        help="paged engine: tokens the KV pool holds (default: max-running-requests x 2048, on CUDA at most half "
        "the free memory; lower it when a trainer shares the GPU)",
    )
    parser.add_argument("--kv-block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="paged engine: tokens per block")
    parser.add_argument("--no-cuda-graphs", action="store_true", help="paged engine: decode eagerly on CUDA")
    parser.add_argument(
        "--secret-file",
        default="",
        metavar="FILE",
        help="the trial's secret: every route but /health then needs its HTTP key (docs/design.md §14)",
    )
    parser.add_argument(
        "--weights-dir", default="", metavar="DIR", help="load weights only from under DIR (or --model-path)"
    )
    args = parser.parse_args(argv)
    try:
        compat = SGLangCompat.from_env(args.emulate_sglang, args.emulate_sglang_dp) if args.emulate_sglang else None
    except ValueError as e:
        parser.error(f"--emulate-sglang: {e}")
    try:
        vllm = VLLMCompat.of(args.emulate_vllm) if args.emulate_vllm else None
    except ValueError as e:
        parser.error(f"--emulate-vllm: {e}")
    if vllm is not None and compat is not None:
        parser.error("--emulate-vllm and --emulate-sglang exclude each other")
    if vllm is not None and args.frozen:  # (a judge's server speaks SGLang's routes, whose loads it refuses)
        parser.error("--emulate-vllm and --frozen exclude each other")

    configure(f"torch_server:{args.port}", args.log_level)
    keys = trial_secret.install(args.secret_file)  # a bad secret file stops it before the model loads
    transformers.logging.disable_progress_bar()  # a "Loading weights" bar per weight update
    hold_malloc()  # the decode steps' temporaries come from the heap, not a fresh mmap each (realrl/base/malloc.py)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    device = torch.device(args.device)
    args.dtype = resolve_dtype(args.dtype, args.device)
    model = load_model(args.model_path, args.device, args.dtype)
    engine = create_engine(
        args.engine,
        model,
        kv_cache_tokens=args.kv_cache_tokens,
        block_size=args.kv_block_size,
        cuda_graphs=not args.no_cuda_graphs,
        device=device,
        seed=args.seed,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        weight_version=args.weight_version,
        # Stops at every eos id of generation_config.json, config.json and the tokenizer.
        eos_token_ids=eos_token_ids_of(model) | eos_token_ids_in_dir(args.model_path),
        length_before_eos=args.length_before_eos,
        compat=compat,
    )
    if args.device == "cpu" and args.max_threads > (args.num_threads or 1):
        # A server generating while the trainer waits for its rollouts uses the trainer's cores too.
        FollowIdleCores.per_forward(model, args.num_threads or 1, args.max_threads, IdleCores().start())
        logger.info("torch threads: %d, up to %d while cores are idle", args.num_threads or 1, args.max_threads)
    engine.start()
    logger.info(
        "loaded %s on %s (%s, %s engine), weight version %s, stop ids %s%s",
        args.model_path,
        args.device,
        args.dtype,
        type(engine).__name__,
        engine.weight_version,
        sorted(engine.limits.eos_token_ids),
        f", emulating SGLang {args.emulate_sglang}: {compat}" if compat else "",
    )
    server = TorchGenerationServer(
        engine,
        args.model_path,
        args.device,
        args.dtype,
        args.weight_load_gate,
        args.frozen,
        vllm=vllm,
        api_key=keys.http_api_key if keys is not None else None,
        weights_dir=args.weights_dir,
        # Versions over the wire: its group's store sealed with the trial's key (docs/design.md §8).
        weights_group=None
        if args.frozen
        else GroupMembership(engine, keys.weights_group_key if keys is not None else b"", args.host),
        bind_host=args.host,
    )
    asyncio.run(serve(server, args.host, args.port))


if __name__ == "__main__":
    main()
    # Stopped: every request answered, the engine's loop ended. The worker and the trial wait for
    # this process to go, not for the interpreter to tear torch down.
    exit_process(0)
