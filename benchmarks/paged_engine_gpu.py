"""The paged engine on a GPU: parity, graph replay, throughput and GPU-busy time.

    python benchmarks/paged_engine_gpu.py [--json PATH] [--sizes 64,256] [--quick] [--cpu-dry-run]

Runs in one process, in about 5 minutes on an H200 (`scripts/gpu_check.py`'s
`paged_engine` step). Without CUDA it writes `{"skipped": true, "reason":
...}` and exits 0. With CUDA, on a random-weight model of Qwen2.5-0.5B's
configuration built in memory (no download):

- `kernels`: bf16 on random tensors with Qwen2.5-0.5B's heads: varlen
  prefill vs SDPA per sequence, the Triton decode kernel vs gather + SDPA;
- `parity`: float32, no TF32: the paged engine (Triton decode kernel, CUDA
  graphs) and the dense engine against a teacher-forced forward of the same
  weights, max |Δ logprob| over mixed-length requests (sampled and greedy);
- `graphs`: bf16, the same greedy requests with decode graphs replayed and
  eagerly: tokens equal, max |Δ logprob|;
- `throughput`: bf16, N concurrent requests of mixed lengths (prompts 16..512
  tokens, 32..256 new tokens, temperature 1, eos ignored) through the paged
  engine in process vs `model.generate` on the same prompts as one
  left-padded batch run to the longest; tokens/s counts the tokens asked for;
- `gpu_busy`: the fraction of wall time some kernel runs on the device over
  a decode-dominated run (64 requests of 16 prompt tokens, 256 new tokens),
  from the profiler's kernel intervals.

`--cpu-dry-run` runs every step on the CPU with a tiny model of the same
family and 8 requests (no graphs, no kernel profile): the script's own code
paths, checked where there is no GPU.

Targets on an H200 (the issue): throughput >= 3x `model.generate` at 64 and
256 requests; decode GPU-busy >= 80%. The script reports; it fails (exit 1)
only when parity or graph replay is off.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from realrl.impl.generation import torch_server  # noqa: E402
from realrl.impl.generation.torch_server.paged_engine import PagedGenerationEngine  # noqa: E402

PARITY_TOL = 2e-3  # float32 on a GPU, no TF32: kernels differ in summation order only
DEVICE = "cuda"
TINY = False  # --cpu-dry-run: a tiny model of the same family


def qwen25_05b_config():
    from transformers import Qwen2Config

    if TINY:
        return Qwen2Config(
            vocab_size=1024,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
            use_sliding_window=False,
        )
    return Qwen2Config(
        vocab_size=151936,
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        use_sliding_window=False,
    )


def build_model(dtype: torch.dtype):
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = Qwen2ForCausalLM._from_config(qwen25_05b_config(), dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def workload(n: int, seed: int, prompt_range=(16, 512), new_range=(32, 256)):
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(10, 1000 if TINY else 150000) for _ in range(rng.randint(*prompt_range))] for _ in range(n)
    ]
    return prompts, [rng.randint(*new_range) for _ in range(n)]


def run_engine(engine, prompts, lengths, temperature=1.0) -> tuple[list, float]:
    """Submit everything at once; (responses, seconds to the last answer)."""
    results: list = [None] * len(prompts)
    left = [len(prompts)]
    done = threading.Event()
    lock = threading.Lock()
    t0 = time.perf_counter()
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        body = {
            "input_ids": p,
            "sampling_params": {"temperature": temperature, "max_new_tokens": n, "ignore_eos": True},
            "return_logprob": True,
        }
        (req,), _ = torch_server.parse_generate_body(body, engine.limits)

        def reply(result, i=i):
            results[i] = result
            with lock:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        req.reply = reply
        engine.submit(req)
    if not done.wait(600):
        raise TimeoutError("the engine did not answer in 600 s")
    elapsed = time.perf_counter() - t0
    for r in results:
        if not hasattr(r, "output_ids"):
            raise RuntimeError(f"a request failed: {r!r}")
    return results, elapsed


def logprobs_of(result) -> torch.Tensor:
    return torch.tensor([lp for lp, _, _ in result.meta_info.output_token_logprobs], dtype=torch.float64)


def teacher_forced(model, prompt, output, temperature=1.0) -> torch.Tensor:
    ids = torch.tensor([prompt + output], device=DEVICE)
    with torch.inference_mode():
        logits = model(ids).logits[0].float()
    t = temperature if temperature > 0 else 1.0
    lp = torch.log_softmax(logits / t, dim=-1)[len(prompt) - 1 : -1]
    return lp.gather(1, torch.tensor(output, device=DEVICE)[:, None]).squeeze(1).double().cpu()


def paged(model, **kwargs) -> PagedGenerationEngine:
    kwargs.setdefault("kv_cache_tokens", 256 * 1024)
    engine = PagedGenerationEngine(model, device=torch.device(DEVICE), **kwargs)
    engine.start()
    return engine


def check_parity() -> dict:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    reference = build_model(torch.float32)
    prompts, lengths = workload(4 if TINY else 12, seed=1, prompt_range=(3, 300), new_range=(8, 48))
    out = {}
    for name in ("paged", "dense"):
        model = build_model(torch.float32)
        engine = (
            paged(model, max_running_requests=16)
            if name == "paged"
            else torch_server.GenerationEngine(model, device=torch.device(DEVICE), max_running_requests=16)
        )
        if name == "dense":
            engine.start()
        try:
            sampled, _ = run_engine(engine, prompts, lengths, temperature=1.0)
            greedy, _ = run_engine(engine, prompts, lengths, temperature=0.0)
        finally:
            engine.stop()
        delta = max(
            float((logprobs_of(r) - teacher_forced(reference, p, r.output_ids, t)).abs().max())
            for rs, t in ((sampled, 1.0), (greedy, 0.0))
            for r, p in zip(rs, prompts)
        )
        out[name] = {"max_abs_delta_logprob": delta, "greedy": [r.output_ids for r in greedy]}
        if name == "paged":
            out[name]["triton"] = engine.runner.use_triton
            out[name]["cuda_graphs"] = len(engine.runner._graphs)
        del model, engine
        torch.cuda.empty_cache()
    out["greedy_tokens_equal"] = out["paged"].pop("greedy") == out["dense"].pop("greedy")
    out["ok"] = out["paged"]["max_abs_delta_logprob"] <= PARITY_TOL
    torch.backends.cuda.matmul.allow_tf32 = True
    return out


def check_kernels() -> dict:
    """The CUDA kernels against the reference on random tensors, in bf16:
    varlen prefill vs SDPA per sequence, the Triton decode kernel vs gather +
    SDPA (Qwen2.5-0.5B's heads: 14 query, 2 kv, 64 dims; a stale NaN block
    in the pool must not leak)."""
    from realrl.impl.generation.torch_server import paged_attention as pa

    torch.manual_seed(0)
    dev, dtype, heads, kv_heads, d, bs = DEVICE, torch.bfloat16, 14, 2, 64, 16
    out: dict = {"varlen": pa._varlen_causal() is not None, "triton": pa.triton_usable(torch.device(dev), bs, d)}
    lens = [1, 7, 16, 33, 250]
    bounds = [0]
    for n in lens:
        bounds.append(bounds[-1] + n)
    q = torch.randn(1, heads, bounds[-1], d, device=dev, dtype=dtype)
    k = torch.randn(1, kv_heads, bounds[-1], d, device=dev, dtype=dtype)
    v = torch.randn(1, kv_heads, bounds[-1], d, device=dev, dtype=dtype)
    kv = pa.PagedKV(None, None, bs, None, True, cu_seqlens=bounds)
    kv.cu_seqlens_dev = torch.tensor(bounds, dtype=torch.int32, device=dev)
    fast = pa._prefill_attention(q, k, v, kv, d**-0.5)
    reference = pa._prefill_attention(q.float().cpu(), k.float().cpu(), v.float().cpu(), kv, d**-0.5)
    out["prefill_max_abs_diff"] = float((fast.float().cpu() - reference).abs().max())
    blocks = 64
    pool_k = torch.randn(blocks * bs, kv_heads, d, device=dev, dtype=dtype)
    pool_v = torch.randn(blocks * bs, kv_heads, d, device=dev, dtype=dtype)
    pool_k[-bs:] = float("nan")  # the padding block: must be masked out
    pool_v[-bs:] = float("nan")
    widths = [-(-n // bs) for n in lens]
    order = torch.randperm(blocks - 1).tolist()
    tables, i = [], 0
    for w in widths:
        tables.append(order[i : i + w] + [blocks - 1] * (max(widths) - w))
        i += w
    kv = pa.PagedKV(None, None, bs, None, False)
    kv.block_tables = torch.tensor(tables, dtype=torch.int32, device=dev)
    kv.context_lens = torch.tensor(lens, dtype=torch.int32, device=dev)
    query = torch.randn(len(lens), heads, 1, d, device=dev, dtype=dtype)
    clean = lambda t: t.masked_fill(t.isnan(), 0)  # noqa: E731  (the reference expects cleared blocks)
    reference = pa.reference_paged_decode(query.float(), clean(pool_k).float(), clean(pool_v).float(), kv, d**-0.5)
    if out["triton"]:
        fast = pa.triton_paged_decode(query[:, :, 0], pool_k, pool_v, kv, d**-0.5)
        out["decode_max_abs_diff"] = float((fast.float() - reference[:, 0]).abs().max())
    out["ok"] = out["prefill_max_abs_diff"] <= 3e-2 and out.get("decode_max_abs_diff", 0.0) <= 3e-2
    return out


def check_graphs(model) -> dict:
    prompts, lengths = workload(4 if TINY else 24, seed=2, prompt_range=(3, 200), new_range=(8, 64))
    runs = {}
    for graphs in (True, False):
        engine = paged(model, max_running_requests=32, cuda_graphs=graphs)
        try:
            runs[graphs], _ = run_engine(engine, prompts, lengths, temperature=0.0)
            captured = len(engine.runner._graphs)
        finally:
            engine.stop()
        if graphs:
            n_graphs = captured
    tokens_equal = all(a.output_ids == b.output_ids for a, b in zip(runs[True], runs[False]))
    delta = max(float((logprobs_of(a) - logprobs_of(b)).abs().max()) for a, b in zip(runs[True], runs[False]))
    return {
        "graphs_captured": n_graphs,
        "tokens_equal": tokens_equal,
        "max_abs_delta_logprob": delta,
        "ok": (n_graphs > 0 or DEVICE == "cpu") and tokens_equal and delta <= 1e-2,  # no graphs on a CPU
    }


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def hf_generate_seconds(model, prompts, lengths) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(DEVICE), mask.to(DEVICE)
    synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max(lengths),
            min_new_tokens=max(lengths),
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=0,
        )
    synchronize()
    return time.perf_counter() - t0


def check_throughput(model, hf_model, sizes: list[int]) -> dict:
    out = {}
    for n in sizes:
        prompts, lengths = workload(n, seed=3, prompt_range=(4, 64), new_range=(4, 16)) if TINY else workload(n, seed=3)
        engine = paged(model, max_running_requests=n)
        try:
            run_engine(engine, *workload(min(n, 8), seed=9, new_range=(4, 8)))  # warm-up
            _, engine_s = run_engine(engine, prompts, lengths)
        finally:
            engine.stop()
        hf_generate_seconds(hf_model, *workload(4, seed=9, new_range=(4, 4)))  # warm-up
        generate_s = hf_generate_seconds(hf_model, prompts, lengths)
        tokens = sum(lengths)
        out[str(n)] = {
            "tokens": tokens,
            "engine_tok_s": tokens / engine_s,
            "generate_tok_s": tokens / generate_s,
            "ratio": generate_s / engine_s,
        }
        print(f"paged_engine_gpu: {n} requests: {out[str(n)]}", flush=True)
    return out


def busy_fraction(kernels: list[tuple[float, float]]) -> float:
    """Union of [start, end) intervals over the span from the first start to the last end."""
    if not kernels:
        return 0.0
    kernels.sort()
    busy, cur_start, cur_end = 0.0, *kernels[0]
    for start, end in kernels[1:]:
        if start > cur_end:
            busy += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    return busy / (max(e for _, e in kernels) - kernels[0][0])


def check_gpu_busy(model) -> dict:
    from torch.profiler import ProfilerActivity, profile

    n, new = (8, 16) if TINY else (64, 256)
    prompts, lengths = workload(n, seed=4, prompt_range=(16, 16), new_range=(new, new))
    engine = paged(model, max_running_requests=n)
    try:
        run_engine(engine, *workload(8, seed=9, new_range=(4, 8)))  # warm-up
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            _, seconds = run_engine(engine, prompts, lengths)
    finally:
        engine.stop()
    kernels = [
        (e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    return {"fraction": busy_fraction(kernels), "kernels": len(kernels), "seconds": seconds}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--sizes", default="64,256")
    parser.add_argument("--quick", action="store_true", help="64 requests only")
    parser.add_argument("--cpu-dry-run", action="store_true", help="every step on the CPU, tiny model, 8 requests")
    args = parser.parse_args()
    global DEVICE, TINY
    if args.cpu_dry_run:
        DEVICE, TINY = "cpu", True
        args.sizes = "8"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        result = {"skipped": True, "reason": f"no CUDA device visible to torch {torch.__version__}"}
        print(f"paged_engine_gpu: skipped: {result['reason']}")
    else:
        sizes = [64] if args.quick else [int(s) for s in args.sizes.split(",")]
        t0 = time.monotonic()
        result = {"skipped": False, "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (dry run)"}
        result["kernels"] = check_kernels()
        print(f"paged_engine_gpu: kernels {result['kernels']}", flush=True)
        result["parity"] = check_parity()
        print(f"paged_engine_gpu: parity {result['parity']}", flush=True)
        model, hf_model = build_model(torch.bfloat16), build_model(torch.bfloat16)
        result["graphs"] = check_graphs(model)
        print(f"paged_engine_gpu: graphs {result['graphs']}", flush=True)
        result["throughput"] = check_throughput(model, hf_model, sizes)
        result["gpu_busy"] = check_gpu_busy(model)
        print(f"paged_engine_gpu: gpu_busy {result['gpu_busy']}", flush=True)
        result["ok"] = result["kernels"]["ok"] and result["parity"]["ok"] and result["graphs"]["ok"]
        result["wall_s"] = round(time.monotonic() - t0, 1)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result.get("ok", True) else 1


if __name__ == "__main__":
    sys.exit(main())
