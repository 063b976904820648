"""Generation throughput: the torch server vs `model.generate` on the same batch.

    python benchmarks/generation_throughput.py [--quick] [--json PATH] [--threads N] [--device cuda] \
        [--engine auto|paged|dense]

A small random Llama (hidden 256, 4 layers, vocab 100; about 3M parameters) is
built and saved to a temp directory. The torch generation server runs it in a
subprocess; every prompt is one request through the shared `GenerationClient`,
all submitted at once. `model.generate` runs the same prompts as one
left-padded batch in this process with the same sampling settings
(temperature 1.0, no top-k / top-p, eos ignored) and the same number of torch
threads, on the same device (`--device`, default cpu). Two workloads:

- equal: every prompt asks for the same number of new tokens;
- mixed: max_new_tokens drawn from 8..128 per prompt; `generate` must run the
  whole batch to the longest one, the server retires each request when done.

Throughput counts only the tokens the prompts asked for (sum of max_new_tokens)
over the wall time of the whole batch, best of `--repeats` interleaved runs. Prints a table
and with --json writes {"equal": {...}, "mixed": {...}, "ratio": <mixed ratio>,
"group_kv": {...}}.

`group_kv`: the KV memory one GRPO group of 16 answers to a 500-token prompt
holds once prefilled, in the paged engine (blocks in use, measured in
process as the first answer finishes) and in the dense engine (16 rows of the
prompt), in tokens' worth of keys/values.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from realrl.impl.generation.client import GenerationClient  # noqa: E402

VOCAB = 100


def build_model(path: str) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        bos_token_id=0,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(path)
    return model


def make_workload(n: int, mode: str, equal_len: int, mixed_range: tuple[int, int], seed: int):
    rng = random.Random(seed)
    prompts = [[0] + [rng.randrange(2, VOCAB) for _ in range(rng.randint(8, 32))] for _ in range(n)]
    if mode == "equal":
        lengths = [equal_len] * n
    else:
        lengths = [rng.randint(*mixed_range) for _ in range(n)]
    return prompts, lengths


def run_generate(model, prompts: list[list[int]], lengths: list[int]) -> float:
    """Seconds for one `model.generate` call on the whole left-padded batch."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(model.device), mask.to(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(lengths),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
        )
    if out.is_cuda:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert out.shape[1] == width + max(lengths)
    return elapsed


async def run_server(client: GenerationClient, url: str, prompts, lengths) -> float:
    """Seconds from submitting every request at once to the last answer."""
    start = time.perf_counter()
    results = await asyncio.gather(
        *[
            client.generate(url, p, {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True})
            for p, n in zip(prompts, lengths)
        ]
    )
    elapsed = time.perf_counter() - start
    for res, n in zip(results, lengths):
        assert len(res.output_ids) == n and res.finish_reason == "length", res
    return elapsed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller batch and outputs, one run each (< 60 s)")
    parser.add_argument("--json", default=None, help="write results here")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides")
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu | cuda, for both sides")
    parser.add_argument("--engine", default="auto", help="the server's --engine (auto | paged | dense)")
    args = parser.parse_args()

    batch = args.batch or (32 if args.quick else 64)
    repeats = args.repeats or (1 if args.quick else 3)
    equal_len = 64 if args.quick else 128
    mixed_range = (8, 128)
    torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as model_dir:
        model = build_model(model_dir).to(args.device)
        n_params = sum(p.numel() for p in model.parameters())
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "realrl.impl.generation.torch_server",
                "--model-path",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num-threads",
                str(args.threads),
                "--device",
                args.device,
                "--max-running-requests",
                str(batch),
                "--log-level",
                "WARNING",
                "--engine",
                args.engine,
            ],
            start_new_session=True,
        )
        try:
            results = asyncio.run(_measure(model, url, batch, repeats, equal_len, mixed_range))
        finally:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()

    print(
        f"\nmodel: Llama {n_params / 1e6:.1f}M params on {args.device}, batch {batch}, threads {args.threads}, "
        f"best of {repeats}"
    )
    print(f"{'mode':<8}{'tokens':>8}{'server tok/s':>15}{'generate tok/s':>17}{'ratio':>8}")
    for mode in ("equal", "mixed"):
        r = results[mode]
        print(f"{mode:<8}{r['tokens']:>8}{r['server_tok_s']:>15.1f}{r['generate_tok_s']:>17.1f}{r['ratio']:>8.2f}")
    group = group_kv_tokens(model.cpu(), prompt_len=500, answers=16)
    print(
        f"group of {group['answers']} answers to a {group['prompt_tokens']}-token prompt: paged KV "
        f"{group['paged_tokens']} tokens, dense {group['dense_tokens']} ({group['ratio']:.3f} of dense)"
    )
    if args.json:
        out = {"equal": results["equal"], "mixed": results["mixed"], "ratio": results["mixed"]["ratio"]}
        out["group_kv"] = group
        out["config"] = {
            "batch": batch,
            "repeats": repeats,
            "threads": args.threads,
            "params": n_params,
            "device": args.device,
            "engine": args.engine,
        }
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


def group_kv_tokens(model, prompt_len: int, answers: int) -> dict:
    """KV held by a group of `answers` answers to one prompt right after its
    prefill: paged (blocks in use when the first answer, asking for 1 token,
    finishes) vs dense (a row of the whole prompt per answer)."""
    import copy
    import threading

    from realrl.impl.generation.torch_server import parse_generate_body
    from realrl.impl.generation.torch_server.paged_engine import PagedGenerationEngine

    engine = PagedGenerationEngine(
        copy.deepcopy(model), device=torch.device("cpu"), kv_cache_tokens=64 * 1024, cuda_graphs=False
    )
    engine.start()
    prompt = [0] + [random.Random(5).randrange(2, VOCAB) for _ in range(prompt_len - 1)]
    used, done = [], threading.Event()
    left = [answers]

    def reply(_result):
        if not used:
            used.append(engine.allocator.num_blocks - engine.allocator.num_free)
        left[0] -= 1
        if left[0] == 0:
            done.set()

    engine.command("pause", {"mode": "in_place"}, lambda _: None)  # the group reaches one prefill step
    for k in range(answers):
        body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 1 + k, "ignore_eos": True}}
        (req,), _ = parse_generate_body(body, engine.limits)
        req.reply = reply
        engine.submit(req)
    engine.command("continue", {}, lambda _: None)
    try:
        assert done.wait(300)
    finally:
        engine.stop()
    paged = used[0] * engine.allocator.block_size
    return {
        "answers": answers,
        "prompt_tokens": prompt_len,
        "block_size": engine.allocator.block_size,
        "paged_tokens": paged,
        "dense_tokens": answers * prompt_len,
        "ratio": paged / (answers * prompt_len),
    }


async def _measure(model, url, batch, repeats, equal_len, mixed_range) -> dict:
    async with GenerationClient(timeout_s=600) as client:
        # Warm-up both sides (first-call allocations, thread pools); generate's
        # while the server is still starting.
        warm_prompts, warm_lengths = make_workload(min(batch, 8), "equal", 8, mixed_range, seed=99)
        run_generate(model, warm_prompts, warm_lengths)
        await client.wait_healthy(url, timeout_s=120)
        await run_server(client, url, warm_prompts, warm_lengths)
        results = {}
        for mode in ("equal", "mixed"):
            prompts, lengths = make_workload(batch, mode, equal_len, mixed_range, seed=1)
            # Interleaved, best of `repeats`: both sides see the same machine load.
            server_runs, generate_runs = [], []
            for _ in range(repeats):
                server_runs.append(await run_server(client, url, prompts, lengths))
                generate_runs.append(run_generate(model, prompts, lengths))
            server_s, generate_s = min(server_runs), min(generate_runs)
            tokens = sum(lengths)
            results[mode] = {
                "tokens": tokens,
                "server_s": server_s,
                "generate_s": generate_s,
                "server_tok_s": tokens / server_s,
                "generate_tok_s": tokens / generate_s,
                "ratio": generate_s / server_s,
            }
        return results


if __name__ == "__main__":
    main()
