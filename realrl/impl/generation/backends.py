"""Generation backends: how to launch one inference server process.

A backend knows three things about its server (docs/design.md §6):

- `check_available()`: whether it can run here at all, checked *before* any
  process starts, so a missing package (or one too old) fails with a message
  that says what to do instead of a crash deep inside a child process;
- `command(config, host, port, base_gpu_id)`: the argv that starts it;
- `env(config)`: environment variables the server needs on top of ours.

Both built-in servers speak the same HTTP API, so everything after launch
(health, generation, weight updates) goes through the shared
`realrl.impl.generation.client.GenerationClient`.

Built-ins: "torch" (the realrl torch server, CPU or GPU) and "sglang"
(`python -m sglang.launch_server`, CUDA only). A plugin adds one with
`register_backend(name, cls)`; the GenerationServer worker picks it by
`GenerationServerConfig.backend`.

**SGLang, as its source says it behaves.** Read from SGLang's released wheels
on PyPI, 0.4.6 to 0.5.23: the repository (1.2 GB) was too large to fetch, and
the wheels carry no commit id (`_version.py`: `commit_id = None`), so a
release stands in for a commit. Wheels (sha256, first 16 hex digits):
sglang 0.5.16 `d5f345a18953dd35`, 0.5.17 `575e38f5683624de`, 0.5.23
`00b3cd5b265ac76c` (`sglang-<v>-cp311-cp311-manylinux_2_34_x86_64.whl`).
Paths below are under `sglang/srt/`, line numbers of the version named.

- `/health` runs a one-token generation, which waits behind a paused server
  and behind `update_weights_from_disk` (it holds the write lock of the lock
  every generation reads), and answers 503 after `SGLANG_HEALTH_CHECK_TIMEOUT`
  (20 s) with no output: v0.5.16 `entrypoints/http_server.py:616-690`
  `health_generate`, `managers/tokenizer_manager.py:654-657` (generate_request),
  `:1751-1783` (update_weights_from_disk). We launch with
  `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false` (plain 200; it works from
  0.5.6: v0.5.16 `http_server.py:633-637`), and the manager does not count a
  failed health check against a server it is loading weights into.
- `update_weights_from_disk` answers `success: false` with HTTP 400
  (v0.5.16 `http_server.py:1171-1197`); with data parallelism
  `num_paused_requests` is a list, one per rank, and `success` their AND
  (v0.5.16 `tokenizer_manager.py:1791-1814`). After loading, the scheduler
  flushes the prefix cache; a flush refused (requests still running or
  queued, which needs a pause other than `abort`: realrl never pauses) fails
  an assert that takes the server down in 0.5.16..0.5.20 (v0.5.16
  `managers/scheduler_components/weight_updater.py:103-123`; the worker
  restarts it), and in 0.5.23 returns `success: false` **although the new
  weights serve** (v0.5.23 `weight_updater.py:120-163`), the weight version
  left unchanged. The manager treats both as a failed update and retries:
  loading the same directory again is idempotent and sets the version; until
  then tokens are labelled with the older version, which only overstates
  their staleness (their logprobs are the ones they were sampled with).
- `/get_server_info` holds the server arguments and `internal_states` (one
  per rank), no request counts (v0.5.16 `http_server.py:733-765`); the
  counts are in `GET /v1/loads`, one entry per rank (v0.5.16
  `entrypoints/v1_loads.py:72-123`, `managers/load_snapshot.py:193-199`).
- `/model_info` exists from 0.5.6, `/get_model_info` in every version
  (v0.5.16 `http_server.py:693-720`); `/get_weight_version` answers 404 from
  0.5.8.
- `/abort_request {rid}` is forwarded only for a rid the server knows
  exactly, and the scheduler then ends every request whose rid *starts
  with* it, queued or running (v0.5.16 `tokenizer_manager.py:1711-1727`,
  `managers/scheduler.py:4030-4060`); realrl's rids are never prefixes of
  one another (`client.new_rid`).
- `/pause_generation` takes a JSON body from 0.5.6, `{}` at least
  (`PauseGenerationReqInput`, v0.5.16 `managers/io_struct.py:1490-1509`,
  `http_server.py:1622-1632`); its default mode `abort` repeats an abort of
  every request, waiting ones included, until none is left (v0.5.16
  `tokenizer_manager.py:1729-1743`).
- Logprobs (v0.5.16 `layers/sampler.py:95-230`): `output_token_logprobs` is
  `log(softmax(logits / T))` of the token, before top-k/top-p/min-p, unless
  `SGLANG_RETURN_ORIGINAL_LOGPROB` is set (then before the temperature; we
  launch with it false). Penalizers, `min_new_tokens` among them, change the
  logits before the sampler (`model_executor/model_runner.py:1475-1483`,
  `sampling/penaltylib/min_new_tokens.py`), so both logprobs below see its
  ban. `return_sampling_mask` (`managers/io_struct.py:208`) adds
  `output_token_sampling_logprobs`: log(p_T(token) / the mass the filters
  keep), the logprob under the distribution the token was drawn from
  (`sampler.py:281-393`), 0.0 for a greedy token (`:310-327`). A request with
  it and no finite `top_k` is refused (`managers/scheduler.py:2225-2234`:
  the support mask it returns too would be unbounded; `set_finish_with_abort`
  gives the abort status 400, `managers/schedule_batch.py:1645-1657`, which
  the tokenizer manager raises, `tokenizer_manager.py:1451-1457`, and the
  HTTP server answers 400 `{"error": {"message"}}`, `http_server.py:872-878,
  2006-2009`), as is one under speculative decoding. 0.5.23 also refuses a
  top_k above `--sampling-mask-max-tokens` (4096; v0.5.23
  `managers/scheduler.py:3160-3181`, `:3513-3518`,
  `tokenizer_manager.py:1891-1921`, `http_server.py:983-990, 2246-2250`).
  The client asks for it only when the sampling filters
  (`needs_sampling_logprobs`); realrl refuses what the installed release
  would refuse before anything is sent (`realrl.api.served_sampling`).
- A request aborted while in the waiting queue (never started, or retracted
  back there: `/pause_generation {"mode": "retract"}`, or the scheduler
  short of KV cache) is answered by the tokenizer manager from what it was
  streamed: tokens and logprobs, no `output_token_sampling_logprobs`
  (v0.5.23 `managers/scheduler.py:5685-5703` `abort_request`,
  `tokenizer_manager.py:3577-3640` `_handle_abort_req`). The partial rollout
  drops those tokens and generates them again.
- `/generate`'s `priority` is one integer per body (a batch's prompts share
  it: v0.5.6 `managers/io_struct.py:213, 624`); with
  `--enable-priority-scheduling --schedule-low-priority-values-first` (how
  realrl launches it; both exist from before 0.5.6) the waiting queue is
  sorted by (priority, arrival), lower first (`schedule_policy.py:100-106`),
  a request without one gets the lowest (`scheduler.py:1504-1510`), and a
  waiting request 10 or more better than a running one may preempt it
  (`--priority-scheduling-preemption-threshold`, 10: `scheduler.py:1744-1765`,
  `PrefillAdder`).
- The finish order: up to 0.5.16 the length limit before EOS (v0.5.16
  `managers/schedule_batch.py:1476-1506`), from 0.5.23 EOS first (v0.5.23
  `managers/schedule_batch.py:2007-2041`); the partial rollout ends an answer
  on its last token's EOS either way.
- LoRA: `--lora-target-modules all` also allocates adapter buffers for the
  embeddings and the LM head (v0.5.23 `lora/lora_manager.py:807-815`);
  realrl names the modules. A request names its adapter (`lora_path`), but
  its `weight_version` is the server's when it ends.

The torch server reproduces these behaviours for tests
(`server.torch.emulate_sglang`, `realrl.impl.generation.torch_server.sglang_compat`).

**The lowest SGLang realrl runs with: 0.5.16** (`SGLANG_MIN_VERSION`), the
first release with every flag and field it uses: `--weight-version` and
`weight_version` in `update_weights_from_disk` (0.5.0rc2), the body of
`/pause_generation`, `/model_info` and the health switch (0.5.6), `/v1/loads`
(0.5.10), and `return_sampling_mask` with `output_token_sampling_logprobs`,
the logprob under the distribution a token was drawn from (v0.5.16
`managers/io_struct.py:208`, `layers/sampler.py:329-393`; absent in 0.5.15).
`check_available` refuses an older one before anything starts.

This module imports nothing heavy (no torch, no sglang): the worker and the
config validation import it in processes that must stay light.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import sys

from packaging.version import InvalidVersion, Version

from realrl.api.cli_args import ALL_LINEAR
from realrl.api.system_api import GenerationServerConfig
from realrl.api.vllm_api import OLDEST_VLLM, vllm_max_lora_rank
from realrl.base import trial_secret
from realrl.base.registry import Registry

SGLANG_MIN_VERSION = "0.5.16"  # see the module docstring


class BackendUnavailableError(RuntimeError):
    """The backend cannot run on this machine (e.g. its package is missing)."""


class GenerationBackend:
    """Base class of a backend. Subclasses set `name` and implement `command`."""

    name: str = ""

    def check_available(self) -> None:
        """Raise BackendUnavailableError (with what to do) if it cannot run here."""

    def command(self, config: GenerationServerConfig, host: str, port: int, base_gpu_id: int = 0) -> list[str]:
        """The argv that starts one server on host:port. `base_gpu_id` is the
        first GPU (of those visible to the process) this server may use."""
        raise NotImplementedError

    def env(self, config: GenerationServerConfig) -> dict[str, str]:
        """Environment variables the server process gets on top of the worker's."""
        return {}

    def secure_args(self, config: GenerationServerConfig, secret_path: str, server_name: str) -> list[str]:
        """Arguments (after `command`'s) that make the server demand the trial's HTTP key
        (docs/design.md §14), never the key itself; `server_name` names a file of its own."""
        return []


def _module_available(name: str) -> bool:
    # find_spec does not import the package (importing sglang takes seconds
    # and initialises CUDA); a None entry in sys.modules means "blocked".
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


class TorchBackend(GenerationBackend):
    """The built-in torch server (`realrl.impl.generation.torch_server`)."""

    name = "torch"

    def command(self, config: GenerationServerConfig, host: str, port: int, base_gpu_id: int = 0) -> list[str]:
        torch_cfg = config.torch
        device = torch_cfg.device
        if device == "cuda":  # one device per server: server i gets the i-th GPU
            device = f"cuda:{base_gpu_id}"
        cmd = [
            sys.executable,
            "-m",
            "realrl.impl.generation.torch_server",
            "--model-path",
            config.model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--device",
            device,
            "--dtype",
            torch_cfg.dtype,
            "--max-running-requests",
            str(torch_cfg.max_running_requests),
            "--seed",
            str(config.seed),
            "--weight-version",
            str(config.weight_version),
            "--num-threads",
            str(torch_cfg.num_threads),
            "--engine",
            torch_cfg.engine,
        ]
        if torch_cfg.max_threads > torch_cfg.num_threads and device == "cpu":
            cmd += ["--max-threads", str(torch_cfg.max_threads)]
        if torch_cfg.kv_cache_tokens is not None:
            cmd += ["--kv-cache-tokens", str(torch_cfg.kv_cache_tokens)]
        if torch_cfg.length_before_eos:
            cmd.append("--length-before-eos")
        if config.judge:
            cmd.append("--frozen")
        if torch_cfg.emulate_vllm:
            cmd += ["--emulate-vllm", torch_cfg.emulate_vllm]
        if torch_cfg.emulate_sglang:
            cmd += [
                "--emulate-sglang",
                torch_cfg.emulate_sglang,
                "--emulate-sglang-dp",
                str(torch_cfg.emulate_sglang_dp),
            ]
        return cmd

    def secure_args(self, config: GenerationServerConfig, secret_path: str, server_name: str) -> list[str]:
        # It reads the secret itself; weights load only from the trial's weights directory.
        args = ["--secret-file", secret_path]
        return args + ["--weights-dir", config.weights_dir] if config.weights_dir else args

    def env(self, config: GenerationServerConfig) -> dict[str, str]:
        # Emulating an engine: launched as it is.
        if config.torch.emulate_vllm:
            return VLLMBackend().env(config)
        return SGLangBackend().env(config) if config.torch.emulate_sglang else {}


class SGLangBackend(GenerationBackend):
    """`python -m sglang.launch_server` with arguments computed from the config.

    The runtime sends token ids and reads output ids, so the server skips its
    tokenizer (`--skip-tokenizer-init`). A LoRA run adds `--enable-lora
    --max-lora-rank R --lora-target-modules ...` (named one by one, also for
    all-linear: `lora_target_modules`), so adapters can be loaded by name later. Flag names follow SGLang's ServerArgs
    (`tp_size` -> `--tp-size`, ...); `sglang.extra_args` are appended verbatim.
    """

    name = "sglang"

    def check_available(self) -> None:
        if not _module_available("sglang"):
            raise BackendUnavailableError(
                "the sglang generation backend needs SGLang, which is not installed here: "
                "`pip install 'realrl[sglang]'` on a CUDA machine; on CPU use the torch backend "
                "(allocation_mode=torch.d<N>p1m1+d<M>p1m1)"
            )
        try:  # the distribution's metadata: importing sglang would initialise CUDA
            installed = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            installed = "unknown"
        try:
            too_old = Version(installed) < Version(SGLANG_MIN_VERSION)
        except InvalidVersion:
            too_old = True
        if too_old:
            raise BackendUnavailableError(
                f"SGLang {installed} is installed here; realrl needs SGLang >= {SGLANG_MIN_VERSION} "
                f"(the first release with every flag and field realrl uses): `pip install "
                f"'sglang[srt]>={SGLANG_MIN_VERSION}'`"
            )

    def env(self, config: GenerationServerConfig) -> dict[str, str]:
        # /health answers without a generation, so it does not wait behind a
        # weight update; the logprobs are those after temperature scaling,
        # which the trainer reproduces (see the module docstring).
        return {"SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false", "SGLANG_RETURN_ORIGINAL_LOGPROB": "false"}

    def secure_args(self, config: GenerationServerConfig, secret_path: str, server_name: str) -> list[str]:
        # SGLang's `--api-key` (every route but /health*, /ready and /metrics needs it), given in its
        # `--config` YAML, a 0600 file beside the secret: a command line is visible to every local user.
        # SGLang loads weights from any path it is given: only the key keeps others from it.
        path = os.path.join(os.path.dirname(secret_path), f"{server_name}.sglang.yaml")
        key = trial_secret.load_keys(secret_path).http_api_key
        trial_secret.write_private(path, json.dumps({"api-key": key}).encode())  # JSON is YAML
        return ["--config", path]

    def command(self, config: GenerationServerConfig, host: str, port: int, base_gpu_id: int = 0) -> list[str]:
        sg = config.sglang
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            config.model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--tp-size",
            str(config.tp_size),
            "--base-gpu-id",
            str(base_gpu_id),
            "--mem-fraction-static",
            str(sg.mem_fraction_static),
            "--dtype",
            sg.dtype,
            "--random-seed",
            str(config.seed),
            "--weight-version",
            str(config.weight_version),
            "--skip-tokenizer-init",
            # `/generate`'s `priority`: the rollout worker's episode order, lower first (docs/design.md §6)
            "--enable-priority-scheduling",
            "--schedule-low-priority-values-first",
            "--log-level",
            sg.log_level,
        ]
        if sg.context_length is not None:
            cmd += ["--context-length", str(sg.context_length)]
        if sg.max_running_requests is not None:
            cmd += ["--max-running-requests", str(sg.max_running_requests)]
        if sg.disable_radix_cache:
            cmd.append("--disable-radix-cache")
        if config.lora.rank > 0:  # versions after 0 are adapters, loaded by name (docs/design.md §8)
            targets = lora_target_modules(config)
            cmd += ["--enable-lora", "--max-lora-rank", str(config.lora.rank), "--lora-target-modules", *targets]
        cmd += [str(a) for a in sg.extra_args]
        return cmd


def lora_target_modules(config: GenerationServerConfig) -> list[str]:
    """The module names a LoRA server adapts, named one by one: SGLang's
    `all` also allocates adapter buffers for the embeddings and the LM head
    (v0.5.23 `lora/lora_manager.py:807-815`: `EMBEDDING_NAMES` added), which
    realrl's adapters never train. all-linear is resolved as the trainer
    resolves it (`realrl.impl.lora.target_modules`), from the model's config."""
    if list(config.lora.target_modules) != [ALL_LINEAR]:
        return list(config.lora.target_modules)
    from realrl.impl.lora import model_target_modules  # torch: only for a LoRA run

    return model_target_modules(config.model_path, [ALL_LINEAR])


class VLLMBackend(GenerationBackend):
    """`vllm serve <model>` (vLLM >= 0.32, CUDA only), driven through
    `realrl.impl.generation.vllm_client` (routes: `realrl.api.vllm_api`).

    - `VLLM_SERVER_DEV_MODE=1` for the dev routes realrl loads weights with
      (`/pause`, `/collective_rpc`, `/reset_prefix_cache`,
      `/update_weight_version`: v0.33 `entrypoints/launchers/api_server/
      routers.py:46-53`); `--enable-scale-out` for the token-in route
      `/inference/v1/generate` (`entrypoints/scale_out/factories.py:87-110`);
      `--logprobs-mode processed_logprobs`: the sampled token's logprob after
      temperature (and the filters, which realrl refuses on vLLM:
      `realrl.api.served_sampling`), which the trainer reproduces.
    - `--seed`, `--tensor-parallel-size`; a server's GPUs are picked with
      CUDA_VISIBLE_DEVICES (vLLM has no base GPU flag).
    - LoRA: `VLLM_ALLOW_RUNTIME_LORA_UPDATING=true` (for
      `/v1/load_lora_adapter`, `entrypoints/serve/lora/api_router.py`),
      `--enable-lora --max-loras 2` (the serving version and the previous
      one) `--max-cpu-loras 3` (every adapter the client keeps registered
      during a switch, v-2 to v, stays cached: the default is max_loras,
      v0.33 `config/lora.py:121-122`) `--max-lora-rank R`, R the smallest
      rank vLLM takes that holds the adapters (v0.33 `config/lora.py:27`).
    - The server starts at vLLM's own weight version; the generation server
      sets realrl's with `/update_weight_version` before it registers.

    Security: the trial's HTTP key is vLLM's `--api-key`, given in a 0600
    `--config` YAML as SGLang's is (`secure_args`). It guards only `/v1`,
    `/v2`, `/inference` and `/cohere` (v0.33
    `entrypoints/serve/middleware/authenticate.py:11`): the dev routes,
    weight loading among them, answer anyone who reaches the port. The
    server binds the trial's private address (the worker's `host`, 127.0.0.1
    in local mode) and must never be exposed beyond it.
    """

    name = "vllm"

    def check_available(self) -> None:
        if not _module_available("vllm"):
            raise BackendUnavailableError(
                "the vllm generation backend needs vLLM, which is not installed here: "
                f"`pip install 'vllm>={OLDEST_VLLM}'` on a CUDA machine; on CPU use the torch backend "
                "(allocation_mode=torch.d<N>p1m1+d<M>p1m1)"
            )
        try:
            installed = importlib.metadata.version("vllm")
            too_old = Version(installed) < Version(OLDEST_VLLM)
        except (importlib.metadata.PackageNotFoundError, InvalidVersion):
            installed, too_old = "unknown", True
        if too_old:
            raise BackendUnavailableError(
                f"vLLM {installed} is installed here; realrl needs vLLM >= {OLDEST_VLLM} (per-token weight "
                f"versions of /inference/v1/generate, /pause modes): `pip install 'vllm>={OLDEST_VLLM}'`"
            )

    def secure_args(self, config: GenerationServerConfig, secret_path: str, server_name: str) -> list[str]:
        # `--api-key` in a 0600 `--config` YAML beside the secret (vLLM reads `key: value` pairs as flags,
        # v0.33 `utils/argparse_utils.py` `load_config_file`), never on the command line.
        path = os.path.join(os.path.dirname(secret_path), f"{server_name}.vllm.yaml")
        key = trial_secret.load_keys(secret_path).http_api_key
        trial_secret.write_private(path, json.dumps({"api-key": key}).encode())  # JSON is YAML
        return ["--config", path]

    def env(self, config: GenerationServerConfig) -> dict[str, str]:
        env = {"VLLM_SERVER_DEV_MODE": "1"}
        if config.lora.rank > 0:
            env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "true"
        return env

    def command(self, config: GenerationServerConfig, host: str, port: int, base_gpu_id: int = 0) -> list[str]:
        vc = config.vllm
        visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
        devices = visible or [str(i) for i in range(base_gpu_id + config.tp_size)]
        chosen = devices[base_gpu_id : base_gpu_id + config.tp_size] if not visible else devices[: config.tp_size]
        cmd = [
            "env",
            f"CUDA_VISIBLE_DEVICES={','.join(chosen)}",
            sys.executable,
            "-m",
            "vllm.entrypoints.cli.main",
            "serve",
            config.model_path,
            "--host",
            host,
            "--port",
            str(port),
            "--enable-scale-out",
            "--logprobs-mode",
            "processed_logprobs",
            "--seed",
            str(config.seed),
            "--tensor-parallel-size",
            str(config.tp_size),
            "--dtype",
            vc.dtype,
            "--gpu-memory-utilization",
            str(vc.gpu_memory_utilization),
        ]
        if vc.max_model_len is not None:
            cmd += ["--max-model-len", str(vc.max_model_len)]
        if vc.max_num_seqs is not None:
            cmd += ["--max-num-seqs", str(vc.max_num_seqs)]
        if config.lora.rank > 0:
            rank = vllm_max_lora_rank(config.lora.rank)
            cmd += ["--enable-lora", "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", str(rank)]
        cmd += [str(a) for a in vc.extra_args]
        return cmd


BACKENDS: Registry[type[GenerationBackend]] = Registry("generation backend")


def register_backend(name: str, cls: type[GenerationBackend]) -> None:
    """Make `cls` available as `GenerationServerConfig.backend = name`."""
    BACKENDS.register(name, cls)


def get_backend(name: str) -> GenerationBackend:
    """An instance of the backend registered as `name` (KeyError lists the choices)."""
    return BACKENDS.make(name)


register_backend(TorchBackend.name, TorchBackend)
register_backend(SGLangBackend.name, SGLangBackend)
register_backend(VLLMBackend.name, VLLMBackend)
