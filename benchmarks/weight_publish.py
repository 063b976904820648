"""Weight publication: trainer step end -> every generation server serves the new version.

    python benchmarks/weight_publish.py [--quick] [--json PATH] [--servers N] [--repeats R]
                                        [--dtype float32|bfloat16] [--inflight K] [--models tiny,100m,<N>mib]
                                        [--lora-rank R]
    python benchmarks/weight_publish.py --transport disk,broadcast --servers 1,2,4 [--bucket-mb M] ...
    python benchmarks/weight_publish.py --transport disk,broadcast --servers 1,2 --device cuda ...

`--transport` compares the two ways a version reaches the servers
(docs/design.md §8) instead (`broadcast`: realrl's routes, each member in a
group of two with the sender, what realrl does; `broadcast-one`: all in one
group, whose broadcast relays along a tree; `sglang-pairs`, `sglang-one`: broadcast over
SGLang's routes to torch servers emulating SGLang 0.5.23, driven by the
manager's `SGLangDriver`, each member in a group of two with the sender, what
realrl does, or all in one group, whose broadcast relays along a tree;
`sglang-pairs-nomarks`: pairs with every bucket asked for at once, not after
the sender's mark of the one before (what the marks cost; not safe with a
stalled member); "wire s" is the sender's time on the wire per version; a
broadcast kind writes no version to disk, as realrl does while every server
is a member (docs/design.md §8: only on demand), and with `-copy` appended,
e.g. `broadcast-copy`, writes each one after the wire as realrl did before
03a04ec): for each server count n and each transport, the
trainer's stall (disk: `publish_weights`; broadcast: the snapshot), the time
from step end to every server serving the version, (disk, `-copy`) until its
directory is on disk, the bytes moved, and the generation pause of `--inflight` requests per
server, against floors measured in the same run (one memory copy of the
weights; safetensors written once + read n times). "ratio": broadcast / disk
time to all servers at 2 servers (or the only count).

`--device cuda` (with `--transport`; default cpu) runs the same on GPUs: the
trainer's weights on the first visible GPU, the torch servers with `--device
cuda`, each on the next GPU (`CUDA_VISIBLE_DEVICES`, round robin over the
others; all on the one when only one is visible), the broadcast over the
backend realrl picks there (`weights.backend=auto` ->
`realrl.experiment.build.weights_backend`: nccl when the trainer and the
servers are on CUDA), the floors on the GPU (one device memory copy;
safetensors written from it once, read into it n times). NCCL refuses two
ranks of one group on one GPU, so a broadcast over nccl needs two GPUs (the
override `weights.backend=gloo` broadcasts through host memory, on one GPU
too); without CUDA, or with one GPU and a broadcast over nccl, it stops with
one line before anything starts.

Through the real components, for two models: the tiny kit's model (0.8M
parameters; found or built first, by default under /tmp/kit when that exists)
and a random ~100M-parameter Llama (hidden 640, 12 layers, vocab 32000,
untied head; built with transformers' LlamaConfig on CPU), both in
`--dtype` (float32 by default, what training uses):

- `--servers` torch generation servers (`python -m realrl.impl.generation.torch_server`,
  one thread each, as the default run starts them) serve the model;
- realrl: this process plays the trainer and the manager. A "step end" is
  followed by `publish_weights` (realrl/system/model_worker.py: HF
  safetensors into a temp directory, renamed to `<weights_dir>/<v>`), then
  `GenerationClient.update_weights_from_disk(url, <weights_dir>/<v>, v,
  abort_all_requests=True)` on every server at once (what the gserver
  manager sends), until every server answers that it serves v (checked
  afterwards with `/model_info`). Not included: the trainer setting the
  version in the name service and the manager noticing it (it polls every
  0.1 s; `benchmarks/step_cost.py` measures that lag in a real run);
- baseline: the same weights saved with `safetensors.torch.save_model` and
  loaded back into the model with `load_model`, in this process.

With `--lora-rank R` (default 8; 0 = off), each model also runs as a LoRA
actor (peft, rank R on every linear layer but the head) on fresh servers
started on the same base: a version is the adapter alone, loaded with
`/load_lora_adapter` + `/update_weight_version` (`GenerationClient.load_version`,
what the manager sends). The LoRA table shows, full vs LoRA, the trained
parameters, bytes per version, step end -> every server serves it, and the
trainer's peak memory in one GRPO step (a fresh process each; peak RSS on CPU,
peak CUDA allocation on a GPU). A last table compares the torch server's two
ways of serving an adapter: merged into the weights (what it does) and a LoRA
forward (peft's unmerged layers), each by the seconds to apply a version and
per decode step.

Each side runs `--repeats` times, interleaved, the weights changed a little
before each (as a train step would); the table shows medians. The realrl path
runs twice per repeat: with idle servers (this is the "ratio" = realrl /
baseline) and with `--inflight` requests per server generating all the time
(long outputs, ignore_eos). An update aborts the requests in flight; each
aborted request is resumed at once the way the rollout worker resumes one
(prompt + partial output sent again), and its pause is the time from the
abort reaching the client to the first token of the resumed request. `--json
PATH` writes everything with a top-level "ratio" (of the ~100M model; of the
tiny model when only that one runs).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

import torch  # noqa: E402

from realrl.base.process import with_parent_death_signal  # noqa: E402
from realrl.impl.generation.client import GenerationClient  # noqa: E402
from realrl.system.model_worker import publish_weights  # noqa: E402

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


# ---- models --------------------------------------------------------------------------------


def tiny_model(dtype: torch.dtype, fileroot: str, overrides: list[str]):
    from transformers import AutoModelForCausalLM

    from realrl.experiment.build import resolve_model_and_data
    from realrl.experiment.config import load_config

    cache = (
        []
        if any(o.startswith("tiny_kit.cache_dir=") for o in overrides) or not os.path.isdir("/tmp/kit")
        else ["tiny_kit.cache_dir=/tmp/kit"]
    )
    cfg = load_config([f"fileroot={fileroot}", *cache, *overrides])
    model_path, _, _ = resolve_model_and_data(cfg, os.path.abspath(cfg.fileroot))
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)


def llama_100m(dtype: torch.dtype):
    """A random ~100M Llama: 12 layers of hidden 640, vocab 32000, untied head."""
    return llama_of_hidden(640, dtype)


def llama_of_hidden(hidden: int, dtype: torch.dtype):
    """A random Llama of `llama_100m`'s shape (12 layers, vocab 32000, untied head,
    intermediate 2.7x hidden, heads of 64) at hidden size `hidden`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.7),
        num_hidden_layers=12,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config).to(dtype).eval()


def llama_of_mib(mib: int, dtype: torch.dtype):
    """A random Llama shaped as `llama_100m` (12 layers, vocab 32000, untied head,
    intermediate 2.7x hidden) but of the hidden size (a multiple of 64, heads of
    64) whose weights come closest to `mib` MiB in `dtype`."""

    per_param = torch.finfo(dtype).bits // 8

    def params(hidden: int) -> int:
        inter = int(hidden * 2.7)
        return 2 * 32000 * hidden + 12 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden) + hidden

    want = mib * (1 << 20) / per_param
    hidden = min(range(64, 8192 + 1, 64), key=lambda h: abs(params(h) - want))
    return llama_of_hidden(hidden, dtype)


def make_model(name: str, dtype: torch.dtype, fileroot: str, overrides: list[str]):
    """`tiny`, `100m`, or `<N>mib` (`llama_of_mib`); None for another name."""
    if name == "tiny":
        return tiny_model(dtype, fileroot, overrides)
    if name == "100m":
        return llama_100m(dtype)
    if name.endswith("mib") and name[:-3].isdigit() and int(name[:-3]) > 0:
        return llama_of_mib(int(name[:-3]), dtype)
    return None


# ---- servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_servers(
    model_dir: str, n: int, dtype: str, log_dir: str, emulate_sglang: bool = False, gpus: list[str] | None = None
) -> list[tuple[subprocess.Popen, str]]:
    """`gpus`: the servers on CUDA, server i on `gpus[i % len(gpus)]`
    (its CUDA_VISIBLE_DEVICES); None: on CPU."""
    servers = []
    for i in range(n):
        env = None
        if gpus:
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=gpus[i % len(gpus)])
        port = free_port()
        with open(os.path.join(log_dir, f"server-{i}.log"), "wb") as log:
            cmd = [
                sys.executable,
                "-m",
                "realrl.impl.generation.torch_server",
                "--model-path",
                model_dir,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--dtype",
                dtype,
                "--num-threads",
                "1",
                "--max-running-requests",
                "64",
                "--log-level",
                "WARNING",
            ] + (["--emulate-sglang", "0.5.23"] if emulate_sglang else [])
            if gpus:
                cmd += ["--device", "cuda"]
            proc = subprocess.Popen(
                with_parent_death_signal(cmd, os.getpid()),  # SIGKILLed with us, should we die
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                env=env,
            )
        servers.append((proc, f"http://127.0.0.1:{port}"))
    return servers


def stop_servers(servers: list[tuple[subprocess.Popen, str]]) -> None:
    for proc, _ in servers:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc, _ in servers:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# ---- in-flight load -------------------------------------------------------------------------


class InflightLoad:
    """`k` requests per server generating all the time. An aborted request
    (a weight update) is resumed at once with prompt + partial output, first
    for one token: its pause is abort received -> that token received."""

    def __init__(self, client: GenerationClient, urls: list[str], k: int, vocab: int, max_new: int):
        self.client, self.urls, self.k = client, urls, k
        self.vocab, self.max_new = vocab, max_new
        self.pauses: list[dict] = []
        self.tokens = 0
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self) -> None:
        self._stop.clear()
        self._tasks = [
            asyncio.create_task(self._loop(url, random.Random(i))) for url in self.urls for i in range(self.k)
        ]

    async def stop(self) -> None:
        self._stop.set()
        for t in self._tasks:
            t.cancel()
        results = await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        errors = [r for r in results if isinstance(r, Exception) and not isinstance(r, asyncio.CancelledError)]
        if errors:
            raise RuntimeError(f"in-flight requests failed: {errors[0]!r}")

    async def _loop(self, url: str, rng: random.Random) -> None:
        params = {"temperature": 1.0, "ignore_eos": True}
        while not self._stop.is_set():
            prompt = [1] + [rng.randrange(3, self.vocab) for _ in range(16)]
            res = await self.client.generate(
                url, prompt, {**params, "max_new_tokens": self.max_new}, return_logprob=False
            )
            self.tokens += len(res.output_ids)
            if not res.aborted or self._stop.is_set():
                continue
            t_abort = time.perf_counter()
            resumed = await self.client.generate(
                url, prompt + res.output_ids, {**params, "max_new_tokens": 1}, return_logprob=False
            )
            self.pauses.append(
                {
                    "pause_s": time.perf_counter() - t_abort,
                    "at": t_abort,
                    "version_before": res.weight_version,
                    "version_after": resumed.weight_version,
                }
            )


# ---- one model ------------------------------------------------------------------------------


@torch.no_grad()
def nudge(model: torch.nn.Module, step: int) -> None:
    """A stand-in for a train step: every trained parameter changes (a LoRA model: its adapters)."""
    for p in model.parameters():
        if p.requires_grad:
            p.add_(1e-4 * ((-1) ** step))


def baseline(model: torch.nn.Module, directory: str) -> dict:
    from safetensors.torch import load_model, save_model

    path = os.path.join(directory, "model.safetensors")
    t0 = time.perf_counter()
    save_model(model, path)
    t1 = time.perf_counter()
    load_model(model, path)
    t2 = time.perf_counter()
    os.unlink(path)
    return {"total_s": t2 - t0, "save_s": t1 - t0, "load_s": t2 - t1}


async def publish_and_update(
    client: GenerationClient, urls: list[str], model, weights_dir: str, version: int, lora: bool
) -> dict:
    t0 = time.perf_counter()  # the trainer's step end
    path = await asyncio.to_thread(publish_weights, model, weights_dir, version)
    t1 = time.perf_counter()
    aborted = await asyncio.gather(*(client.load_version(u, path, version, lora) for u in urls))
    t2 = time.perf_counter()
    served = await asyncio.gather(*(client.weight_version(u) for u in urls))
    if any(v != str(version) for v in served):
        raise RuntimeError(f"servers report versions {served} after updating to {version}")
    for name in os.listdir(weights_dir):  # the manager deletes older versions once all servers hold v
        if name.isdigit() and int(name) < version:
            shutil.rmtree(os.path.join(weights_dir, name), ignore_errors=True)
    return {
        "total_s": t2 - t0,
        "publish_s": t1 - t0,
        "update_s": t2 - t1,
        "t_update_start": t1,
        "t_end": t2,
        "aborted": sum(aborted),
        "bytes": sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)),
    }


async def measure(
    model, urls: list[str], weights_dir: str, scratch: str, repeats: int, inflight: int, max_new: int, lora: bool
) -> dict:
    """Full weights: the baseline and realrl's path; a LoRA model: realrl's path only."""
    vocab = model.config.vocab_size
    async with GenerationClient(timeout_s=600) as client:
        for u in urls:
            await client.wait_healthy(u, timeout_s=300)
        load = InflightLoad(client, urls, inflight, vocab, max_new)
        idle, loaded, base = [], [], []
        version = 0
        # warm-up (first-call allocations on both sides; not counted)
        version += 1
        nudge(model, version)
        await publish_and_update(client, urls, model, weights_dir, version, lora)
        if not lora:
            baseline(model, scratch)
        for r in range(repeats):
            if not lora:
                version += 1
                nudge(model, version)
                base.append(baseline(model, scratch))
            version += 1
            nudge(model, version)
            idle.append(await publish_and_update(client, urls, model, weights_dir, version, lora))
            if inflight:
                version += 1
                nudge(model, version)
                load.start()
                await asyncio.sleep(1.0)  # every request is decoding
                n_before = len(load.pauses)
                loaded.append(await publish_and_update(client, urls, model, weights_dir, version, lora))
                deadline = time.monotonic() + 60
                while len(load.pauses) - n_before < loaded[-1]["aborted"] and time.monotonic() < deadline:
                    await asyncio.sleep(0.01)  # every aborted request has resumed
                loaded[-1]["pauses_s"] = [p["pause_s"] for p in load.pauses[n_before:]]
                await load.stop()
    med = lambda rows, key: statistics.median(r[key] for r in rows)  # noqa: E731
    out = {
        "realrl_idle": {k: med(idle, k) for k in ("total_s", "publish_s", "update_s", "bytes")},
        "runs": {"baseline": base, "realrl_idle": idle, "realrl_inflight": loaded},
    }
    if base:
        out["baseline"] = {k: med(base, k) for k in ("total_s", "save_s", "load_s")}
        out["ratio"] = out["realrl_idle"]["total_s"] / out["baseline"]["total_s"]
    if loaded:
        pauses = [p for r in loaded for p in r["pauses_s"]]
        out["realrl_inflight"] = {k: med(loaded, k) for k in ("total_s", "publish_s", "update_s")}
        out["realrl_inflight"].update(
            aborted_per_update=statistics.mean(r["aborted"] for r in loaded),
            pause_s_median=statistics.median(pauses) if pauses else None,
            pause_s_max=max(pauses) if pauses else None,
            pauses=len(pauses),
        )
        if base:
            out["ratio_inflight"] = out["realrl_inflight"]["total_s"] / out["baseline"]["total_s"]
    for rows in out["runs"].values():
        for row in rows:
            row.pop("t_update_start", None)
            row.pop("t_end", None)
    return out


def run_model(
    name: str, model, dtype: str, servers: int, repeats: int, inflight: int, max_new: int, lora_rank: int
) -> dict:
    """Full weights (and the baseline), then, with lora_rank > 0, the same
    model as a LoRA actor (fresh servers on the same base): what a version
    costs each way, and the trainer's memory each way (`train_memory`)."""
    n_params = sum(p.numel() for p in model.parameters())
    work = tempfile.mkdtemp(prefix=f"weight-publish-{name}-")
    running: list = []
    try:
        model_dir = os.path.join(work, "model")
        model.save_pretrained(model_dir)
        bytes_on_disk = sum(
            os.path.getsize(os.path.join(model_dir, f)) for f in os.listdir(model_dir) if f.endswith(".safetensors")
        )
        t0 = time.monotonic()
        modes = [("full", model)]
        if lora_rank:
            from realrl.api.cli_args import LoraConfig
            from realrl.impl import lora

            lora_config = LoraConfig(rank=lora_rank)
            modes.append(("lora", lora.wrap(copy.deepcopy(model), lora_config)))
        result: dict = {}
        for mode, trained in modes:
            running = start_servers(model_dir, servers, dtype, work)
            scratch = os.path.join(work, f"scratch-{mode}")
            os.makedirs(scratch)
            measured = asyncio.run(
                measure(
                    trained,
                    [u for _, u in running],
                    os.path.join(work, f"weights-{mode}"),
                    scratch,
                    repeats,
                    inflight,
                    max_new,
                    lora=mode == "lora",
                )
            )
            for proc, url in running:
                if proc.poll() is not None:
                    raise RuntimeError(f"server {url} exited with {proc.returncode}")
            stop_servers(running)
            running = []
            measured["trained_params"] = sum(p.numel() for p in trained.parameters() if p.requires_grad)
            measured["trainer_memory"] = train_memory(model_dir, lora_rank if mode == "lora" else 0)
            if mode == "full":
                result.update(measured)
            else:
                result["lora"] = dict(measured, rank=lora_rank)
                result["lora_apply"] = adapter_apply_cost(model, trained, lora_config, work)
        result.update(
            params=n_params,
            bytes=bytes_on_disk,
            dtype=dtype,
            servers=servers,
            repeats=repeats,
            inflight_per_server=inflight,
            seconds=time.monotonic() - t0,
        )
        return result
    finally:
        stop_servers(running)
        for _ in range(20):  # (an interrupted publish may still be writing from its thread)
            shutil.rmtree(work, ignore_errors=True)
            if not os.path.exists(work):
                break
            time.sleep(0.5)


# ---- transports: disk vs broadcast (--transport) ---------------------------------------------


def copy_floor(tensors: dict, repeats: int) -> float:
    """One memory copy of the weights: every tensor into one preallocated flat
    buffer on the weights' device (the least a snapshot can cost), median of `repeats`."""
    from realrl.impl.weights.broadcast import Manifest

    manifest = Manifest.of(tensors)
    device = next(iter(tensors.values())).device
    views = manifest.views(torch.empty(manifest.nbytes, dtype=torch.uint8, device=device))
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for name, t in tensors.items():
            views[name].copy_(t)
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def sync(device: torch.device) -> None:
    """Waits for the work queued on `device` (CUDA runs copies asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def disk_floor(tensors: dict, readers: int, scratch: str, repeats: int) -> float:
    """The weights written once and read `readers` times (safetensors, one
    process, sequential; from and into the weights' device): the least the
    disk path can cost, median of `repeats`."""
    from safetensors.torch import load_file, save_file

    path = os.path.join(scratch, "floor.safetensors")
    plain = {k: v.contiguous() for k, v in tensors.items()}
    device = next(iter(plain.values())).device
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        save_file(plain, path)
        for _ in range(readers):
            load_file(path, device=str(device))
        sync(device)
        times.append(time.perf_counter() - t0)
        os.unlink(path)
    return statistics.median(times)


async def transport_version(
    kind: str, client, urls, model, weights_dir: str, version: int, sender, driver=None
) -> dict:
    """One version, step end -> every server in `urls` serves it: the trainer's
    stall, the time to all servers, and (disk, a `-copy` broadcast) the time until its directory
    exists (None for a broadcast that writes none)."""
    from realrl.impl.weights.broadcast import published_tensors

    t0 = time.perf_counter()
    if kind == "disk":
        path = await asyncio.to_thread(publish_weights, model, weights_dir, version)
        t1 = time.perf_counter()
        await asyncio.gather(*(client.update_weights_from_disk(u, path, version) for u in urls))
        t2 = t3 = time.perf_counter()
        moved = dir_bytes(path) * (1 + len(urls))
    else:
        sender.publish(version, published_tensors(model))
        t1 = time.perf_counter()
        if driver is not None:  # SGLang's routes
            answers = await asyncio.gather(*(driver.await_version(u, version, 300) for u in urls))
            if not all(ok for ok, _ in answers):
                raise RuntimeError(f"broadcast of version {version} failed: {answers}")
        else:
            answers = await asyncio.gather(*(client.await_weight_version(u, version, 300) for u in urls))
            if not all(a.success for a in answers):
                raise RuntimeError(f"broadcast of version {version} failed: {[a.message for a in answers]}")
        t2 = time.perf_counter()
        await asyncio.to_thread(sender.wait_idle, 300)  # the sender is done (and wrote it, with -copy)
        written = os.path.join(weights_dir, str(version))
        t3 = time.perf_counter() if sender.after_send is not None else None
        moved = sender.manifest.nbytes * len(urls) + (dir_bytes(written) if os.path.isdir(written) else 0)
    served = await asyncio.gather(*(client.weight_version(u) for u in urls))
    if any(v != str(version) for v in served):
        raise RuntimeError(f"servers report versions {served} after {kind} version {version}")
    for name in os.listdir(weights_dir):  # the manager deletes older versions once all servers hold v
        if name.isdigit() and int(name) < version:
            shutil.rmtree(os.path.join(weights_dir, name), ignore_errors=True)
    wire = sender.seconds.get(version) if sender is not None else None
    on_disk = t3 - t0 if t3 is not None else None
    return {"stall_s": t1 - t0, "to_all_s": t2 - t0, "on_disk_s": on_disk, "bytes_moved": moved, "wire_s": wire}


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


async def measure_transports(
    model, urls, counts, kinds, work, repeats, inflight, max_new, bucket_bytes, backend: str = "gloo"
) -> dict:
    """For each server count n (the first n servers) and each transport: the
    versions' stall, time to all servers, generation pause, bytes moved
    (the broadcast over `backend`)."""
    from realrl.impl.weights.broadcast import GroupSpec, Manifest, Sender, StoreServer, published_tensors
    from realrl.system.weight_broadcast_sglang import SGLangDriver

    tensors = published_tensors(model)
    scratch = os.path.join(work, "scratch-transports")
    os.makedirs(scratch, exist_ok=True)
    out: dict = {"copy_floor_s": copy_floor(tensors, max(3, repeats)), "rows": []}
    store = StoreServer("127.0.0.1")
    version = 1000
    try:
        async with GenerationClient(timeout_s=600) as client:
            for u in urls:
                await client.wait_healthy(u, timeout_s=300)
            for n in counts:
                members = urls[:n]
                floor = disk_floor(tensors, n, scratch, max(3, repeats))
                for kind in kinds:
                    base = kind.removesuffix("-copy")  # (-copy: every version written after the wire)
                    weights_dir = os.path.join(work, f"weights-{kind}-{n}")
                    os.makedirs(weights_dir, exist_ok=True)
                    sender = driver = None

                    def to_disk(v, views, d=weights_dir):
                        publish_weights(model, d, v, state_dict={k: t.clone() for k, t in views.items()})

                    copy = to_disk if base != kind else None
                    if base != "disk":  # (a group: each member in its own with the sender, or one of all)
                        spec = GroupSpec(
                            f"bench-{kind}-{n}",
                            "127.0.0.1",
                            store.port,
                            1 + n,
                            backend,
                            bucket_bytes,
                            300,
                            protocol="sglang" if base.startswith("sglang-") else "realrl",
                            member_groups="one" if base.removesuffix("-nomarks").endswith("-one") else "pairs",
                        )
                    if base.startswith("sglang-"):
                        driver = SGLangDriver(spec, {u: r for r, u in enumerate(members, start=1)}, client, b"")
                        if base.endswith("-nomarks"):  # (each bucket asked for without waiting for a mark)
                            done = asyncio.get_running_loop().create_future()
                            done.set_result(None)
                            driver._bucket_sent = lambda *_, done=done: done
                        packed = Manifest.of(tensors, packed=True)
                        sender = Sender(spec, b"", packed, "127.0.0.1", after_send=copy)
                    if base in ("broadcast", "broadcast-one"):
                        for rank, u in enumerate(members, start=1):
                            await client.join_weights_group(u, spec, rank)
                        sender = Sender(spec, b"", Manifest.of(tensors), "127.0.0.1", after_send=copy)
                    load = InflightLoad(client, members, inflight, model.config.vocab_size, max_new)
                    rows = []
                    for r in range(repeats + 1):  # the first: warm-up (first-call allocations), not counted
                        version += 1
                        nudge(model, version)
                        if inflight:
                            load.start()
                            await asyncio.sleep(1.0)  # every request is decoding
                        n_before = len(load.pauses)
                        row = await transport_version(
                            kind, client, members, model, weights_dir, version, sender, driver
                        )
                        if inflight:
                            # An aborted request resumes within its pause; a server that resumes its requests
                            # itself (the torch server re-prefills them under the new weights) aborts none.
                            deadline = time.monotonic() + 3
                            while len(load.pauses) == n_before and time.monotonic() < deadline:
                                await asyncio.sleep(0.01)
                            await asyncio.sleep(0.5)  # the other aborted requests resume
                            row["pauses_s"] = [p["pause_s"] for p in load.pauses[n_before:]]
                            await load.stop()
                        if r:
                            rows.append(row)
                    if sender is not None:
                        sender.close()
                        if driver is not None:
                            await asyncio.wait_for(driver._task, 60)  # (it destroys the groups on the servers)
                        else:
                            for u in members:
                                await client.leave_weights_group(u)
                    pauses = [p for row in rows for p in row.get("pauses_s", [])]
                    med = lambda key: statistics.median(row[key] for row in rows)  # noqa: E731
                    out["rows"].append(
                        {
                            "transport": kind,
                            "servers": n,
                            "stall_s": med("stall_s"),
                            "to_all_s": med("to_all_s"),
                            "on_disk_s": med("on_disk_s") if rows[0]["on_disk_s"] is not None else None,
                            "bytes_moved": med("bytes_moved"),
                            "wire_s": med("wire_s") if sender is not None else None,
                            "pause_s_median": statistics.median(pauses) if pauses else None,
                            "disk_floor_s": floor,
                            "runs": rows,
                        }
                    )
                    shutil.rmtree(weights_dir, ignore_errors=True)
    finally:
        store.close()
    by = {(row["transport"], row["servers"]): row for row in out["rows"]}
    wire = next((k for k in ("broadcast", "sglang-pairs") if k in kinds), "broadcast")
    ratios = {
        n: by[(wire, n)]["to_all_s"] / by[("disk", n)]["to_all_s"]
        for n in counts
        if (wire, n) in by and ("disk", n) in by
    }
    out["to_all_ratio_by_servers"] = ratios
    if ratios:
        out["ratio"] = ratios.get(2, next(iter(ratios.values())))
    return out


def run_transports(
    name: str,
    model,
    dtype: str,
    counts,
    kinds,
    repeats,
    inflight,
    max_new,
    bucket_mb,
    backend: str = "gloo",
    server_gpus: list[str] | None = None,
) -> dict:
    """`server_gpus`: the servers on CUDA (`start_servers`), None: on CPU."""
    work = tempfile.mkdtemp(prefix=f"weight-transport-{name}-")
    running: list = []
    try:
        model_dir = os.path.join(work, "model")
        model.save_pretrained(model_dir)
        sglang = any(k.startswith("sglang-") for k in kinds)
        if sglang and any(k.removesuffix("-copy") in ("broadcast", "broadcast-one") for k in kinds):
            raise ValueError("--transport: broadcast (realrl's routes) and sglang-* (SGLang's) need other servers")
        running = start_servers(model_dir, max(counts), dtype, work, emulate_sglang=sglang, gpus=server_gpus)
        result = asyncio.run(
            measure_transports(
                model,
                [u for _, u in running],
                counts,
                kinds,
                work,
                repeats,
                inflight,
                max_new,
                bucket_mb << 20,
                backend,
            )
        )
        for proc, url in running:
            if proc.poll() is not None:
                raise RuntimeError(f"server {url} exited with {proc.returncode}")
        result.update(params=sum(p.numel() for p in model.parameters()), dtype=dtype, repeats=repeats)
        if server_gpus:
            result.update(device="cuda", backend=backend)
        return result
    finally:
        stop_servers(running)
        shutil.rmtree(work, ignore_errors=True)


def print_transport_table(results: dict, repeats: int) -> None:
    print(f"\nweight transports: step end -> every server serves the version; median of {repeats}")
    print(
        f"{'model':<7}{'transport':<21}{'servers':>8}{'stall s':>9}{'copy floor':>11}{'to all s':>9}"
        f"{'disk floor':>11}{'on disk s':>10}{'MB moved':>9}{'pause s':>9}{'wire s':>8}"
    )
    for name, r in results.items():
        for row in r["rows"]:
            pause = f"{row['pause_s_median']:.3f}" if row["pause_s_median"] is not None else "-"
            on_disk = f"{row['on_disk_s']:.3f}" if row["on_disk_s"] is not None else "-"
            print(
                f"{name:<7}{row['transport']:<21}{row['servers']:>8}{row['stall_s']:>9.3f}{r['copy_floor_s']:>11.3f}"
                f"{row['to_all_s']:>9.3f}{row['disk_floor_s']:>11.3f}{on_disk:>10}"
                f"{row['bytes_moved'] / 1e6:>9.0f}{pause:>9}"
                + (f"{row['wire_s']:>8.3f}" if row.get("wire_s") is not None else f"{'-':>8}")
            )
        ratios = ", ".join(f"{n} servers {x:.2f}" for n, x in r["to_all_ratio_by_servers"].items())
        print(f"{name}: time to all servers, broadcast / disk: {ratios}")
    print(
        "stall = the trainer's time in publish (disk: the whole directory; broadcast: the snapshot); copy floor = one "
        "memory copy of the weights; disk floor = safetensors written once + read once per server; on disk = until "
        "the version's directory exists (-copy: written after the broadcast; broadcast writes none); pause = abort -> "
        "first token"
    )


# ---- LoRA: the trainer's memory, and merge vs LoRA forward on the server --------------------------


def train_memory(model_dir: str, lora_rank: int) -> dict:
    """Peak memory of a trainer process doing one GRPO step on `model_dir`
    (LoRA rank `lora_rank`, 0 = full fine-tuning): a fresh process each, so
    nothing else counts (`--train-memory`)."""
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--train-memory", model_dir, str(lora_rank)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def train_step_peak_memory(model_dir: str, lora_rank: int) -> dict:
    """One PPOTrainer inference + train step (2 groups x 2 answers, 16 + 48
    tokens each), as the model worker builds it; peak RSS of this process
    (and peak CUDA allocation when a GPU is at hand)."""
    import resource

    from transformers import AutoModelForCausalLM

    from realrl.api.cli_args import LoraConfig, PPOConfig
    from realrl.impl import lora
    from realrl.impl.ppo.batch import SequenceBatch
    from realrl.impl.ppo.trainer import PPOTrainer, make_optimized

    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    if lora_rank:
        model = lora.wrap(model, LoraConfig(rank=lora_rank))
    trainer = PPOTrainer(
        make_optimized(model, 1e-5, 0.0, (0.9, 0.999), 1e-8, "constant", 0, 1), PPOConfig(group_size=2), 1.0, device
    )
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    ids = [torch.randint(3, vocab, (64,), generator=g) for _ in range(4)]
    batch = SequenceBatch(
        ids,
        [16] * 4,
        [torch.full((48,), -5.0)] * 4,
        torch.tensor([0.0, 1.0, 1.0, 0.0]),
        torch.zeros(4, dtype=bool),
        [[0, 1], [2, 3]],
    )
    trainer.inference(batch, decoupled=True)
    trainer.train_step(batch)
    peak = {"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, "device": device.type}
    if device.type == "cuda":
        peak["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    return peak


@torch.inference_mode()
def decode_steps_s(models: list, batch: int, context: int, repeats: int = 10) -> list[float]:
    """Median seconds of one decode step of each model (one token for each
    of `batch` rows after `context` cached positions; random keys and
    values), the models' steps interleaved so a busy machine slows them alike."""
    from transformers.cache_utils import DynamicCache

    config = models[0].config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    shape = (batch, kv_heads, context, head_dim)
    times: list[list[float]] = [[] for _ in models]
    for _ in range(repeats + 1):
        ids = torch.randint(3, config.vocab_size, (batch, 1))
        for model, out in zip(models, times):
            cache = DynamicCache(config=config)
            for layer in range(config.num_hidden_layers):
                cache.update(torch.randn(shape), torch.randn(shape), layer)
            t0 = time.perf_counter()
            model(
                input_ids=ids,
                attention_mask=torch.ones(batch, context + 1, dtype=torch.long),
                position_ids=torch.full((batch, 1), context),
                past_key_values=cache,
                use_cache=True,
            )
            out.append(time.perf_counter() - t0)
    return [statistics.median(t[1:]) for t in times]


def adapter_apply_cost(base, lora_model, lora_config, work: str, batches=(1, 16, 64), context: int = 128) -> dict:
    """The torch server's two ways to serve an adapter, on copies of `base`:
    (a) merged into the weights (`AdapterTargets.apply`: what the server
    does), (b) a LoRA forward (peft's unmerged `lora.Linear`, the adapter's
    tensors copied in). Each: seconds to apply a new version, and seconds
    per decode step at each batch size."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    from realrl.impl import lora
    from realrl.impl.generation.torch_server.weights import AdapterTargets, read_adapter
    from realrl.system.model_worker import save_model

    torch.set_num_threads(1)  # a server's default (server.torch.num_threads)
    path = os.path.join(work, "adapter")
    save_model(lora_model, path)
    adapter = read_adapter(path)
    merged = copy.deepcopy(base).eval()
    targets = AdapterTargets(merged)
    forward = lora.wrap(copy.deepcopy(base), lora_config).eval()
    tensors = load_file(os.path.join(path, "adapter_model.safetensors"))

    def timed(fn) -> float:
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])

    with torch.inference_mode():
        out = {
            "apply_merge_s": timed(lambda: targets.apply(adapter)),
            "apply_forward_s": timed(lambda: set_peft_model_state_dict(forward, tensors)),
        }
        ids = torch.randint(3, base.config.vocab_size, (1, 32))
        out["max_logit_difference"] = float((merged(ids).logits - forward(input_ids=ids).logits).abs().max())
    out["decode"] = {}
    for b in batches:
        m, f = decode_steps_s([merged, forward], b, context)
        extra = f - m
        out["decode"][b] = {
            "merged_s": m,
            "forward_s": f,
            # decode steps after which merging (a slower apply, then free steps) has cost less
            "break_even_steps": (out["apply_merge_s"] - out["apply_forward_s"]) / extra if extra > 0 else None,
        }
    return out


def print_lora_tables(results: dict, servers: int, repeats: int) -> None:
    rank = next(iter(results.values()))["lora"]["rank"]
    print(
        f"\nLoRA rank {rank} vs full fine-tuning: one version, step end -> {servers} server(s) serve it "
        f"(median of {repeats}), and the trainer's peak memory in one GRPO step"
    )
    print(
        f"{'model':<7}{'mode':<6}{'trained':>10}{'bytes/version':>15}{'publish s':>10}{'update s':>9}"
        f"{'total s':>9}{'in-flight s':>12}{'trainer peak MB':>17}"
    )
    for name, r in results.items():
        for mode, m in (("full", r), ("lora", r["lora"])):
            i, f = m["realrl_idle"], m.get("realrl_inflight")
            memory = m["trainer_memory"]
            peak = memory.get("cuda_peak_allocated_mb", memory["peak_rss_mb"])
            print(
                f"{name:<7}{mode:<6}{m['trained_params'] / 1e6:>9.2f}M{int(i['bytes']):>15,}{i['publish_s']:>10.3f}"
                f"{i['update_s']:>9.3f}{i['total_s']:>9.3f}{f['total_s'] if f else float('nan'):>12.3f}{peak:>17.0f}"
            )
    device = next(iter(results.values()))["trainer_memory"]["device"]
    print(f"trainer peak: {'peak CUDA allocation' if device == 'cuda' else 'peak RSS of the process (CPU)'}")
    print("\nthe torch server: an adapter merged into the weights vs a LoRA forward (peft, unmerged); 1 thread")
    print(
        f"{'model':<7}{'apply s: merge':>15}{'forward':>9}{'|':>3}  decode step s per batch size: merged / LoRA forward"
    )
    for name, r in results.items():
        a = r["lora_apply"]
        steps = "  ".join(f"{b}: {d['merged_s']:.4f} / {d['forward_s']:.4f}" for b, d in a["decode"].items())
        print(f"{name:<7}{a['apply_merge_s']:>15.4f}{a['apply_forward_s']:>9.4f}{'|':>3}  {steps}")


def visible_gpus() -> list[str]:
    """The GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (the first: the trainer's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()][: torch.cuda.device_count()]
    return [str(i) for i in range(torch.cuda.device_count())]


def cuda_plan(args, overrides: list[str]) -> tuple[str, str | None]:
    """`--device cuda`: the broadcast's backend as realrl picks it with the
    trainer and the torch servers on CUDA (`weights.backend`, auto unless an
    override says otherwise), and why the run cannot go on (None: it can)."""
    if not args.transport:
        return "", "needs --transport (the comparison of the weight transports)"
    if torch.version.cuda is None:
        return "", f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "(not set)")
        return "", f"no CUDA device is visible to torch {torch.__version__} (CUDA_VISIBLE_DEVICES={visible})"
    from realrl.api.cli_args import parse_allocation_mode
    from realrl.experiment.build import weights_backend
    from realrl.experiment.config import load_config

    cfg = load_config(
        [f"fileroot={args.fileroot}", "train.device=cuda", "server.torch.device=cuda"]
        + [o for o in overrides if o.startswith("weights.")]
    )
    backend = weights_backend(cfg, parse_allocation_mode(cfg.allocation_mode))
    kinds = [k.strip() for k in args.transport.split(",") if k.strip()]
    if backend == "nccl" and any(k != "disk" for k in kinds) and torch.cuda.device_count() < 2:
        return backend, (
            "a broadcast over nccl needs 2 GPUs (NCCL refuses two ranks of one group on one GPU), "
            f"{torch.cuda.device_count()} visible; --transport disk runs on one"
        )
    return backend, None


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 repeats (< 2 minutes on 2 cores)")
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--models",
        default="tiny,100m",
        help="comma-separated: tiny, 100m, <N>mib (a random Llama of about N MiB of weights in --dtype, "
        "e.g. 200mib,800mib: the 100m model's shape at another width)",
    )
    parser.add_argument("--servers", default="1", help="servers; with --transport a list (e.g. 1,2,4)")
    parser.add_argument(
        "--transport", default="", help="disk,broadcast: compare the transports (docs/design.md §8) instead"
    )
    parser.add_argument("--bucket-mb", type=int, default=64, help="--transport broadcast: MiB per bucket")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="--transport: the trainer's weights and the servers on CPU, or on GPUs (the broadcast over NCCL)",
    )
    parser.add_argument("--repeats", type=int, default=None, help="default 5 (quick: 2)")
    parser.add_argument("--dtype", choices=sorted(_DTYPES), default="float32")
    parser.add_argument("--inflight", type=int, default=4, help="requests generating per server (0: none)")
    parser.add_argument("--fileroot", default=os.path.join(_REPO, "runs", "bench"))
    parser.add_argument("--lora-rank", type=int, default=8, help="the LoRA rows' rank (0: no LoRA rows)")
    parser.add_argument("--train-memory", nargs=2, metavar=("MODEL_DIR", "RANK"), help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args()
    if args.train_memory:  # the child of train_memory()
        print(json.dumps(train_step_peak_memory(args.train_memory[0], int(args.train_memory[1]))))
        return
    backend, trainer_device, server_gpus = "gloo", torch.device("cpu"), None
    if args.device == "cuda":
        backend, why_not = cuda_plan(args, overrides)
        if why_not is not None:  # (before any model is built or server started)
            print(f"weight_publish: --device cuda: {why_not}", file=sys.stderr)
            sys.exit(2)
        visible = visible_gpus()
        trainer_device, server_gpus = torch.device("cuda", 0), visible[1:] or visible[:1]
    repeats = args.repeats or (2 if args.quick else 5)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the servers on the way out
    torch.set_num_threads(1)  # the trainer's default (train.num_threads=1)
    dtype = _DTYPES[args.dtype]
    results = {}
    if args.transport:
        kinds = [k.strip() for k in args.transport.split(",") if k.strip()]
        counts = [int(n) for n in args.servers.split(",")]
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            model = make_model(name, dtype, args.fileroot, overrides)
            if model is None:
                parser.error(f"unknown model {name!r} (tiny, 100m, <N>mib)")
            model = model.to(trainer_device)
            max_new = 200 if name == "tiny" else 1024
            results[name] = run_transports(
                name,
                model,
                args.dtype,
                counts,
                kinds,
                repeats,
                args.inflight,
                max_new,
                args.bucket_mb,
                backend,
                server_gpus,
            )
        print_transport_table(results, repeats)
        if args.device == "cuda":
            print(
                f"on CUDA: the trainer's weights on GPU {visible_gpus()[0]} ({torch.cuda.get_device_name(0)}), "
                f"the servers on GPU(s) {','.join(server_gpus)}; broadcast over {backend}"
            )
        if args.json:
            main_ratio = (results["100m"] if "100m" in results else next(iter(results.values()))).get("ratio")
            with open(args.json, "w") as f:
                json.dump({"ratio": main_ratio, **results}, f, indent=1)
            print(f"wrote {args.json}")
        return
    args.servers = int(args.servers)
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        model = make_model(name, dtype, args.fileroot, overrides)
        if model is None:
            parser.error(f"unknown model {name!r} (tiny, 100m, <N>mib)")
        max_new = 200 if name == "tiny" else 1024  # (the tiny model has 256 positions)
        results[name] = run_model(
            name, model, args.dtype, args.servers, repeats, args.inflight, max_new, args.lora_rank
        )
        del model

    print(
        f"\nweight publication: step end -> {args.servers} torch server(s) serve the new version, vs "
        f"safetensors save_model + load_model in one process; {args.dtype}, median of {repeats}"
    )
    print(
        f"{'model':<7}{'params':>8}{'MB':>7}{'baseline s':>11}{'realrl s':>10}{'publish':>9}{'update':>8}"
        f"{'ratio':>7}{'in-flight s':>12}{'ratio':>7}{'aborted':>8}{'pause med/max s':>17}"
    )
    for name, r in results.items():
        b, i = r["baseline"], r["realrl_idle"]
        line = (
            f"{name:<7}{r['params'] / 1e6:>7.1f}M{r['bytes'] / 1e6:>7.1f}{b['total_s']:>11.3f}{i['total_s']:>10.3f}"
            f"{i['publish_s']:>9.3f}{i['update_s']:>8.3f}{r['ratio']:>7.2f}"
        )
        f = r.get("realrl_inflight")
        if f:
            pause = f"{f['pause_s_median']:.3f}/{f['pause_s_max']:.3f}" if f["pauses"] else "-"
            line += f"{f['total_s']:>12.3f}{r['ratio_inflight']:>7.2f}{f['aborted_per_update']:>8.1f}{pause:>17}"
        print(line)
    print(
        "baseline = save_model + load_model; realrl = publish_weights + update_weights_from_disk on every server "
        "(idle servers; 'in-flight': with requests generating); pause = abort -> first token after resuming"
    )
    if args.lora_rank:
        print_lora_tables(results, args.servers, repeats)
    if args.json:
        main_ratio = results["100m"]["ratio"] if "100m" in results else next(iter(results.values()))["ratio"]
        with open(args.json, "w") as f:
            json.dump({"ratio": main_ratio, **results}, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; everything this script started is stopped", file=sys.stderr)
        sys.exit(130)
