"""Fixtures for the generation tests: a tiny random Llama saved to disk, the
reference model loaded in the test process, and real torch-server subprocesses
on 127.0.0.1 (killed by process group in teardown)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

EOS_ID = 1
MAX_POSITIONS = 4096


def tiny_llama_config() -> LlamaConfig:
    # initializer_range is larger than usual so the random model has peaked
    # next-token distributions (greedy comparisons far from ties).
    return LlamaConfig(
        vocab_size=64,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=0,
        eos_token_id=EOS_ID,
        pad_token_id=0,
        initializer_range=0.1,
        tie_word_embeddings=False,
    )


def save_perturbed(src_dir: str, dst_dir: str, seed: int, scale: float = 0.05, max_shard_size=None) -> None:
    """A copy of the model in src_dir with every weight nudged (new 'trained' weights)."""
    model = AutoModelForCausalLM.from_pretrained(src_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(dst_dir, **kwargs)


def load_reference(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> str:
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config())
    model.generation_config.eos_token_id = EOS_ID
    model.generation_config.pad_token_id = 0
    path = str(tmp_path_factory.mktemp("tiny_llama"))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def reference_model(tiny_llama_dir):
    torch.set_num_threads(1)
    return load_reference(tiny_llama_dir)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One torch server subprocess in its own process group."""

    def __init__(self, model_dir: str, log_path: str, extra_args: tuple[str, ...] = ()):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [
            sys.executable,
            "-m",
            "realrl.impl.generation.torch_server",
            "--model-path",
            model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--num-threads",
            "1",
            *extra_args,
        ]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-5000:]

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"torch server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise TimeoutError(f"torch server not healthy after {timeout_s}s:\n{self.log()}")

    def terminate(self) -> None:
        """SIGTERM only (`kill` then waits): several servers stop side by side."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=15)
            except ProcessLookupError:
                pass
        self._log.close()


@pytest.fixture
def start_server(tmp_path):
    """Factory: start_server(model_dir, *extra_args) -> ServerProcess (healthy; with
    wait=False started only: several servers start side by side, then `wait_healthy` each)."""
    servers: list[ServerProcess] = []

    def start(model_dir: str, *extra_args: str, wait: bool = True) -> ServerProcess:
        server = ServerProcess(model_dir, str(tmp_path / f"server{len(servers)}.log"), extra_args)
        servers.append(server)
        if wait:
            server.wait_healthy()
        return server

    yield start
    for server in servers:
        server.terminate()
    for server in servers:
        server.kill()


@pytest.fixture(scope="module")
def shared_server(tiny_llama_dir, tmp_path_factory):
    """A server the read-only tests of one module share (never paused or updated)."""
    server = ServerProcess(tiny_llama_dir, str(tmp_path_factory.mktemp("server") / "server.log"))
    try:
        server.wait_healthy()
        yield server
    finally:
        server.kill()
