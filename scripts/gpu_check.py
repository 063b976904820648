"""realrl's CUDA paths on this machine, checked in one step; one JSON of figures.

    python scripts/gpu_check.py [--out FILE] [--budget-s 570]      (scripts/gpu_check.sh runs it)

Without CUDA (torch missing, built without CUDA, or no device visible) it
writes `{"skipped": true, "reason": ...}`, prints `gpu_check: skipped: <reason>`
and exits 0. Otherwise each check runs in a process of its own, in this order,
within the time budget (each gets at most what is left; one that would start
with less than a minute left is not run and says so):

- `torch_server`: the torch server on CUDA against a CPU forward pass (logprobs
  and greedy output, batched requests);
- `paged_engine`: `benchmarks/paged_engine_gpu.py` (about 5 minutes): the
  paged engine on a random-weight model of Qwen2.5-0.5B's configuration,
  parity with the dense engine and a teacher-forced forward, CUDA-graph
  replay vs eager, tokens/s at 64 and 256 requests vs `model.generate`, the
  GPU-busy fraction of decode;
- `trainer_fsdp`: model workers with FSDP2 on CUDA, GRPO in bf16 and PPO in
  float32 (NCCL between two ranks when two GPUs are visible): trained full
  weights published, the final model, checkpoints;
- `nccl_lockstep` (two GPUs or more): two FSDP2 ranks over NCCL with uneven
  data take the same steps as one big batch;
- `vllm_trial` (when vLLM is importable; else it says it skipped): a
  3-step trial on the vLLM backend (`allocation_mode=vllm.d1p1m1+d1p1m1`),
  the runtime driving a real vLLM server: launch, weight updates, generation;
- `generation_throughput`: `benchmarks/generation_throughput.py --quick
  --device cuda` (the torch server vs `model.generate`, on the GPU);
- `vs_inprocess`: `benchmarks/vs_inprocess.py --device cuda` (12 steps; the
  tiny kit is built first if there is none), realrl against a one-process loop;
- `weight_publish_nccl`: `benchmarks/weight_publish.py --transport
  disk,broadcast --servers 1,2 --models tiny,100m --device cuda --repeats 2`
  (the trainer's weights on the first GPU, the torch servers on the others,
  the broadcast over the backend realrl picks on CUDA: nccl), each against
  its floors. NCCL refuses two ranks of one group on one GPU: with one GPU
  visible it runs with `weights.backend=gloo` instead (everything on the one
  GPU, the broadcast through host memory; its figures say which backend).

The JSON: `{"skipped": false, "ok": <every check passed>, "device": {...},
"packages": {realrl's requirements: the versions found}, "checks": {name:
{"ok", "seconds", ...figures | "skipped": why | "error": the output's
tail}}, "wall_s"}`. Exit 1 if a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_START_S = 60.0  # a check does not start with less time left than this


def package_versions() -> dict[str, str | None]:
    """The version of each of realrl's pinned requirements this Python would
    import (None: missing), read from the distributions on sys.path in order,
    so wheels put ahead on PYTHONPATH show; nothing is imported."""
    import importlib.metadata
    import re

    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        requirements = tomllib.load(f)["project"]["dependencies"]
    versions: dict[str, str | None] = {}
    for requirement in requirements:
        name = re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def cuda_state() -> tuple[dict, str | None]:
    """What this Python sees, and why CUDA cannot be checked (None: it can)."""
    state: dict = {"python": sys.executable}
    try:
        import torch
    except ImportError as e:
        return state, f"torch is not installed for {sys.executable} ({e})"
    state["torch"] = torch.__version__
    state["torch_cuda"] = torch.version.cuda
    if torch.version.cuda is None:
        return state, f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)")
        return state, f"no CUDA device is visible to torch {torch.__version__} (CUDA_VISIBLE_DEVICES={visible})"
    state["count"] = torch.cuda.device_count()
    state["name"] = torch.cuda.get_device_name(0)
    state["capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    state["bf16"] = torch.cuda.is_bf16_supported()
    return state, None


def run_check(cmd: list[str], timeout_s: float, env: dict) -> tuple[bool, float, str]:
    """Runs one check from the repository root; (passed, seconds, output tail)."""
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
        ok, output = proc.returncode == 0, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        ok, output = False, (out.decode(errors="replace") if isinstance(out, bytes) else out)
        output += f"\n(timed out after {timeout_s:.0f}s)"
    return ok, time.monotonic() - t0, output[-3000:]


def vllm_importable() -> bool:
    """Whether this Python finds vLLM (not imported: that initialises CUDA)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def pytest(*node_ids: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *node_ids]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "gpu_check.json"))
    parser.add_argument("--budget-s", type=float, default=570.0, help="the whole check's time (seconds)")
    parser.add_argument("--extra", default=None, help="a JSON object merged into the output (gpu_check.sh's wheels)")
    args = parser.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    extra = json.loads(args.extra) if args.extra else {}

    device, why_not = cuda_state()
    packages = package_versions()
    if why_not is not None:
        result = {"skipped": True, "reason": why_not, "device": device, "packages": packages, **extra}
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"gpu_check: skipped: {why_not}; wrote {args.out}")
        return 0

    t0 = time.monotonic()
    work = tempfile.mkdtemp(prefix="realrl-gpu-check-")
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    checks: dict[str, dict] = {}
    figures = {
        name: os.path.join(work, f"{name}.json")
        for name in ("paged_engine", "generation_throughput", "vs_inprocess", "weight_publish_nccl")
    }
    plan: list[tuple[str, list[str] | None, str | None]] = [
        ("torch_server", pytest("tests/impl/test_torch_server.py::test_cuda_server_matches_the_cpu_reference"), None),
        (
            "paged_engine",
            [sys.executable, "benchmarks/paged_engine_gpu.py", "--json", figures["paged_engine"]],
            None,
        ),
        ("trainer_fsdp", pytest("tests/system/test_training_side.py::test_fsdp_model_workers_on_cuda"), None),
        (
            "nccl_lockstep",
            pytest("tests/impl/test_trainer_lockstep.py::test_fsdp_nccl_ranks_with_uneven_data_stay_in_lockstep"),
            None if device["count"] >= 2 else f"needs 2 GPUs, {device['count']} visible",
        ),
        (
            "generation_throughput",
            [sys.executable, "benchmarks/generation_throughput.py", "--quick", "--device", "cuda"]
            + ["--json", figures["generation_throughput"]],
            None,
        ),
        (
            "vllm_trial",
            [sys.executable, "training/main_async_ppo.py", "allocation_mode=vllm.d1p1m1+d1p1m1", "train.device=cuda"]
            + ["total_train_steps=3", "eval.every_n_steps=0", "server.vllm.gpu_memory_utilization=0.3"]
            + ["server.vllm.extra_args=[--enforce-eager]", f"fileroot={work}/vllm", f"tiny_kit.cache_dir={work}/kit"],
            None if vllm_importable() else "vLLM is not importable here (pip install 'vllm>=0.32' to check it)",
        ),
        (
            "vs_inprocess",
            [sys.executable, "benchmarks/vs_inprocess.py", "--device", "cuda", "--steps", "12", "--eval-every", "6"]
            + [f"--fileroot={work}/runs", f"tiny_kit.cache_dir={work}/kit", "--json", figures["vs_inprocess"]],
            None,
        ),
        (
            "weight_publish_nccl",
            [sys.executable, "benchmarks/weight_publish.py", "--transport", "disk,broadcast", "--servers", "1,2"]
            + ["--models", "tiny,100m", "--device", "cuda", "--repeats", "2", f"--fileroot={work}/runs"]
            + [f"tiny_kit.cache_dir={work}/kit", "--json", figures["weight_publish_nccl"]]
            + ([] if device["count"] >= 2 else ["weights.backend=gloo"]),  # (NCCL: one rank per GPU)
            None,
        ),
    ]
    for name, cmd, skip in plan:
        left = args.budget_s - (time.monotonic() - t0)
        if skip is None and left < MIN_START_S:
            skip = f"not run: {left:.0f}s of the {args.budget_s:.0f}s budget left"
        if skip is not None:
            checks[name] = {"ok": True, "skipped": skip}
            print(f"gpu_check: {name}: skipped ({skip})", flush=True)
            continue
        print(f"gpu_check: {name} ...", flush=True)
        ok, seconds, output = run_check(cmd, left, env)
        check: dict = {"ok": ok, "seconds": round(seconds, 1)}
        if name in figures and os.path.exists(figures[name]):
            with open(figures[name]) as f:
                check["figures"] = json.load(f)
        if not ok:
            check["error"] = output
        checks[name] = check
        print(f"gpu_check: {name}: {'ok' if ok else 'FAILED'} ({seconds:.0f}s)", flush=True)

    result = {
        "skipped": False,
        "ok": all(c["ok"] for c in checks.values()),
        "device": device,
        "packages": packages,
        "checks": checks,
        "wall_s": round(time.monotonic() - t0, 1),
        **extra,
    }
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    summary = summarize(checks)
    print(
        f"gpu_check: {'ok' if result['ok'] else 'FAILED'} in {result['wall_s']:.0f}s on {device['count']}x "
        f"{device['name']}{summary}; wrote {args.out}"
    )
    return 0 if result["ok"] else 1


def summarize(checks: dict) -> str:
    """The headline figures: generation tokens/s, the realrl / in-process ratio,
    and the broadcast (NCCL) / disk time to every server at 2 servers."""
    parts = []
    paged = checks.get("paged_engine", {}).get("figures")
    if paged and not paged.get("skipped"):
        ratios = ", ".join(f"x{r['ratio']:.2f} at {n}" for n, r in paged["throughput"].items())
        parts.append(f"paged engine {ratios} model.generate, decode GPU-busy {paged['gpu_busy']['fraction']:.0%}")
    gen = checks.get("generation_throughput", {}).get("figures")
    if gen:
        parts.append(f"server {gen['mixed']['server_tok_s']:.0f} tok/s (x{gen['ratio']:.2f} model.generate)")
    vs = checks.get("vs_inprocess", {}).get("figures")
    if vs:
        parts.append(f"realrl {vs['realrl']['steps_per_min']:.0f} steps/min (x{vs['ratio']:.2f} in-process)")
    weights = checks.get("weight_publish_nccl", {}).get("figures")
    if weights:
        models = {name: r for name, r in weights.items() if isinstance(r, dict) and "to_all_ratio_by_servers" in r}
        at2 = ", ".join(
            f"{name} x{r['to_all_ratio_by_servers']['2']:.2f}"
            for name, r in models.items()
            if "2" in r["to_all_ratio_by_servers"]
        )
        backend = next((r.get("backend") for r in models.values()), None) or "?"
        parts.append(f"weights broadcast ({backend}) / disk at 2 servers: {at2 or '-'}")
    return f": {', '.join(parts)}" if parts else ""


if __name__ == "__main__":
    sys.exit(main())
