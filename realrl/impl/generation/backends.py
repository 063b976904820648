"""Generation backends: how to launch one inference server process.

A backend knows two things about its server (docs/design.md §6):

- `check_available()`: whether it can run here at all, checked *before* any
  process starts, so a missing package fails with a message that says what to
  do instead of a crash deep inside a child process;
- `command(config, host, port, base_gpu_id)`: the argv that starts it.

Both built-in servers speak the same HTTP API, so everything after launch
(health, generation, weight updates) goes through the shared
`realrl.impl.generation.client.GenerationClient`.

Built-ins: "torch" (the realrl torch server, CPU or GPU) and "sglang"
(`python -m sglang.launch_server`, CUDA only). A plugin adds one with
`register_backend(name, cls)`; the GenerationServer worker picks it by
`GenerationServerConfig.backend`.

This module imports nothing heavy (no torch, no sglang): the worker and the
config validation import it in processes that must stay light.
"""

from __future__ import annotations

import importlib.util
import sys

from realrl.api.system_api import GenerationServerConfig
from realrl.base.registry import Registry


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
        ]
        if torch_cfg.length_before_eos:
            cmd.append("--length-before-eos")
        return cmd


class SGLangBackend(GenerationBackend):
    """`python -m sglang.launch_server` with arguments computed from the config.

    The runtime sends token ids and reads output ids, so the server skips its
    tokenizer (`--skip-tokenizer-init`). Flag names follow SGLang's ServerArgs
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
            "--log-level",
            sg.log_level,
        ]
        if sg.context_length is not None:
            cmd += ["--context-length", str(sg.context_length)]
        if sg.max_running_requests is not None:
            cmd += ["--max-running-requests", str(sg.max_running_requests)]
        if sg.disable_radix_cache:
            cmd.append("--disable-radix-cache")
        cmd += [str(a) for a in sg.extra_args]
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
