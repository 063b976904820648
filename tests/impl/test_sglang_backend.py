"""Generation backends: the commands they build and the availability check.

SGLang cannot be installed on a machine without a GPU (docs/design.md §6), so its
path is covered here by the exact argv and environment it builds, by the
worker refusing to start a process when SGLang is missing, and by the version
check against a stand-in distribution (a package directory with its
dist-info, which `importlib.metadata` reads as it reads an installed SGLang)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest

from realrl.api.cli_args import SGLangConfig, TorchServerConfig
from realrl.api.system_api import GenerationServerConfig
from realrl.base.name_resolve import NameResolveConfig
from realrl.impl.generation.backends import (
    BackendUnavailableError,
    GenerationBackend,
    SGLangBackend,
    TorchBackend,
    get_backend,
    register_backend,
)
from realrl.launcher.local import LocalLauncher, WorkerGroup

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def flags(argv: list[str]) -> dict[str, str | bool]:
    """`--name value` pairs and bare `--switch`es of an argv, in a dict."""
    out: dict[str, str | bool] = {}
    i = 0
    while i < len(argv):
        assert argv[i].startswith("--"), argv[i:]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]] = argv[i + 1]
            i += 2
        else:
            out[argv[i]] = True
            i += 1
    return out


def test_sglang_command_for_a_full_config():
    config = GenerationServerConfig(
        backend="sglang",
        model_path="/models/qwen",
        weight_version=3,
        seed=7,
        tp_size=2,
        sglang=SGLangConfig(
            dtype="float16",
            mem_fraction_static=0.65,
            context_length=4096,
            max_running_requests=128,
            disable_radix_cache=True,
            log_level="info",
            extra_args=["--chunked-prefill-size", "2048", "--enable-metrics"],
        ),
    )
    argv = SGLangBackend().command(config, "127.0.0.1", 31000, base_gpu_id=4)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    assert argv[-3:] == ["--chunked-prefill-size", "2048", "--enable-metrics"]  # verbatim, last
    assert flags(argv[3:]) == {
        "--model-path": "/models/qwen",
        "--host": "127.0.0.1",
        "--port": "31000",
        "--tp-size": "2",
        "--base-gpu-id": "4",
        "--mem-fraction-static": "0.65",
        "--dtype": "float16",
        "--random-seed": "7",
        "--weight-version": "3",
        "--skip-tokenizer-init": True,  # we send token ids and read output ids
        # /generate's priority (the episode order): lower values first, as the torch server admits them
        "--enable-priority-scheduling": True,
        "--schedule-low-priority-values-first": True,
        "--log-level": "info",
        "--context-length": "4096",
        "--max-running-requests": "128",
        "--disable-radix-cache": True,
        "--chunked-prefill-size": "2048",
        "--enable-metrics": True,
    }
    # /health without a generation, which would wait behind weight updates
    assert SGLangBackend().env(config) == {
        "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION": "false",
        "SGLANG_RETURN_ORIGINAL_LOGPROB": "false",
    }


def test_sglang_command_leaves_unset_options_to_sglang():
    argv = get_backend("sglang").command(GenerationServerConfig(backend="sglang", model_path="/m"), "127.0.0.1", 30000)
    f = flags(argv[3:])
    for unset in ("--context-length", "--max-running-requests", "--disable-radix-cache"):
        assert unset not in f
    defaults = (f["--tp-size"], f["--base-gpu-id"], f["--dtype"], f["--mem-fraction-static"])
    assert defaults == ("1", "0", "bfloat16", "0.8")
    assert f["--skip-tokenizer-init"] is True


def test_torch_command():
    config = GenerationServerConfig(
        model_path="/m",
        seed=5,
        weight_version=2,
        torch=TorchServerConfig(device="cpu", dtype="bfloat16", max_running_requests=32, num_threads=3),
    )
    argv = TorchBackend().command(config, "127.0.0.1", 20001)
    assert argv[:3] == [sys.executable, "-m", "realrl.impl.generation.torch_server"]
    assert flags(argv[3:]) == {
        "--model-path": "/m",
        "--host": "127.0.0.1",
        "--port": "20001",
        "--device": "cpu",
        "--dtype": "bfloat16",
        "--max-running-requests": "32",
        "--seed": "5",
        "--weight-version": "2",
        "--num-threads": "3",
        "--engine": "auto",
    }
    config.torch.engine, config.torch.kv_cache_tokens = "paged", 4096
    assert {
        k: v
        for k, v in flags(TorchBackend().command(config, "127.0.0.1", 20001)[3:]).items()
        if "-engine" in k or "-kv" in k
    } == {
        "--engine": "paged",
        "--kv-cache-tokens": "4096",
    }
    config.torch.engine, config.torch.kv_cache_tokens = "auto", None
    # On CUDA, server i gets its own device.
    config.torch.device = "cuda"
    assert flags(TorchBackend().command(config, "127.0.0.1", 20001, base_gpu_id=1)[3:])["--device"] == "cuda:1"
    config.torch.length_before_eos = True  # SGLang's order of finish checks
    assert flags(TorchBackend().command(config, "127.0.0.1", 20001)[3:])["--length-before-eos"] is True
    TorchBackend().check_available()  # always available
    assert TorchBackend().env(config) == {}
    # Emulating SGLang (tests): the release and ranks, launched with SGLang's environment.
    config.torch.emulate_sglang, config.torch.emulate_sglang_dp = "0.5.16", 2
    f = flags(TorchBackend().command(config, "127.0.0.1", 20001)[3:])
    assert (f["--emulate-sglang"], f["--emulate-sglang-dp"]) == ("0.5.16", "2")
    assert TorchBackend().env(config) == SGLangBackend().env(config)


def test_missing_sglang_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "sglang", None)  # as on a machine without SGLang
    with pytest.raises(BackendUnavailableError, match=r"pip install 'realrl\[sglang\]'.*torch backend"):
        get_backend("sglang").check_available()


def stand_in_sglang(root, version: str) -> str:
    """A directory that holds an "installed" SGLang `version`: the package and its dist-info."""
    (root / "sglang").mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("raise ImportError('a stand-in: never imported')\n")
    info = root / f"sglang-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return str(root)


@pytest.mark.parametrize("version, ok", [("0.5.5", False), ("0.5.15", False), ("0.5.16", True), ("0.5.23", True)])
def test_sglang_older_than_the_pinned_release_is_refused(tmp_path, monkeypatch, version, ok):
    monkeypatch.syspath_prepend(stand_in_sglang(tmp_path, version))
    monkeypatch.delitem(sys.modules, "sglang", raising=False)
    if ok:
        get_backend("sglang").check_available()
        return
    with pytest.raises(BackendUnavailableError) as info:
        get_backend("sglang").check_available()
    assert str(info.value).startswith(f"SGLang {version} is installed here; realrl needs SGLang >= 0.5.16")


def test_an_old_sglang_is_a_one_line_config_error_before_anything_starts(tmp_path):
    env = dict(os.environ, PYTHONPATH=stand_in_sglang(tmp_path / "site", "0.5.6"))
    fileroot = tmp_path / "runs"
    proc = subprocess.run(
        [sys.executable, "training/main_async_ppo.py", f"fileroot={fileroot}", "allocation_mode=sglang.d1p1m1+d1p1m1"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "realrl: config error: allocation_mode: SGLang 0.5.6 is installed here; realrl needs SGLang >= 0.5.16 "
        "(the first release with every flag and field realrl uses): `pip install 'sglang[srt]>=0.5.16'`"
    ]
    assert not fileroot.exists()  # nothing started


def test_registry_lists_choices_and_takes_plugins():
    with pytest.raises(KeyError, match=r"unknown generation backend 'trt'; registered: \[.*'sglang', 'torch', 'vllm'"):
        get_backend("trt")

    class EchoBackend(GenerationBackend):
        name = "echo-test"

        def command(self, config, host, port, base_gpu_id=0):
            return ["echo", config.model_path, host, str(port)]

    register_backend("echo-test", EchoBackend)
    assert get_backend("echo-test").command(GenerationServerConfig(model_path="/m"), "h", 1) == ["echo", "/m", "h", "1"]
    with pytest.raises(ValueError, match="already registered"):
        register_backend("torch", EchoBackend)


def _sglang_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("sglang") is not None


@pytest.mark.skipif(_sglang_installed(), reason="SGLang is installed here: the worker would launch it")
def test_sglang_worker_fails_before_starting_any_process(tmp_path, capfd):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    nr = NameResolveConfig(type="file", file_root=str(tmp_path / "nr"))
    launcher = LocalLauncher("sgltest", f"t{uuid.uuid4().hex[:8]}", str(tmp_path), nr, heartbeat_ttl=2)
    config = GenerationServerConfig(backend="sglang", model_path=str(model_dir), tp_size=2)
    assert launcher.run([WorkerGroup("generation_server", 1, config)], timeout=120) == 1
    err = capfd.readouterr().err
    assert "worker generation_server/0 failed" in err
    assert "BackendUnavailableError: the sglang generation backend needs SGLang" in err
    assert not [f for f in os.listdir(launcher.log_dir) if f.endswith(".server.log")]  # no server was started
    assert "starting sglang server" not in open(launcher.log_path("generation_server", 0)).read()


def test_sglang_lora_names_its_target_modules(tiny_llama_dir):
    """`--lora-target-modules all` would also give the embeddings and the LM
    head adapter buffers in SGLang (v0.5.23 `lora/lora_manager.py:807-815`):
    all-linear is named module by module, as the trainer resolves it."""
    from realrl.api.cli_args import LoraConfig

    def targets(modules: list[str]) -> list[str]:
        config = GenerationServerConfig(
            backend="sglang", model_path=tiny_llama_dir, lora=LoraConfig(rank=8, target_modules=modules)
        )
        argv = SGLangBackend().command(config, "127.0.0.1", 30000)
        assert flags(argv[3 : argv.index("--lora-target-modules")])["--max-lora-rank"] == "8"
        return argv[argv.index("--lora-target-modules") + 1 :]

    linear = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    assert targets(["all-linear"]) == linear and "lm_head" not in linear
    assert targets(["q_proj", "v_proj"]) == ["q_proj", "v_proj"]


def test_vllm_command_env_and_availability(monkeypatch):
    """vLLM's launch line (realrl.impl.generation.backends.VLLMBackend): the
    dev routes, the token-in route, the logprobs realrl trains with, a seed,
    tensor parallelism on the server's own GPUs; LoRA with a rank vLLM takes."""
    from realrl.api.cli_args import LoraConfig, VLLMConfig
    from realrl.impl.generation.backends import VLLMBackend

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = GenerationServerConfig(
        backend="vllm",
        model_path="/models/qwen",
        seed=7,
        tp_size=2,
        vllm=VLLMConfig(max_model_len=4096, extra_args=["--enforce-eager"]),
    )
    argv = VLLMBackend().command(config, "10.0.0.5", 31000, base_gpu_id=2)
    assert argv[:7] == [
        "env",
        "CUDA_VISIBLE_DEVICES=2,3",
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        "/models/qwen",
    ]
    assert argv[-1] == "--enforce-eager"
    assert flags(argv[7:]) == {
        "--host": "10.0.0.5",
        "--port": "31000",
        "--enable-scale-out": True,
        "--logprobs-mode": "processed_logprobs",
        "--seed": "7",
        "--tensor-parallel-size": "2",
        "--dtype": "bfloat16",
        "--gpu-memory-utilization": "0.8",
        "--max-model-len": "4096",
        "--enforce-eager": True,
    }
    assert VLLMBackend().env(config) == {"VLLM_SERVER_DEV_MODE": "1"}
    config.lora = LoraConfig(rank=12)
    f = flags(VLLMBackend().command(config, "127.0.0.1", 31000)[7:])
    assert (f["--enable-lora"], f["--max-loras"], f["--max-cpu-loras"]) == (True, "2", "3")
    assert f["--max-lora-rank"] == "16"  # 12 -> 16
    assert VLLMBackend().env(config)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "true"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")  # the launcher's devices for this worker
    assert VLLMBackend().command(config, "127.0.0.1", 31000)[1] == "CUDA_VISIBLE_DEVICES=5,6"
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'vllm>=0.32'.*torch backend"):
        VLLMBackend().check_available()
    # The torch server emulating vLLM: launched as vLLM is.
    emulated = GenerationServerConfig(model_path="/m", torch=TorchServerConfig(emulate_vllm="0.33"))
    assert flags(TorchBackend().command(emulated, "127.0.0.1", 1)[3:])["--emulate-vllm"] == "0.33"
    assert TorchBackend().env(emulated) == {"VLLM_SERVER_DEV_MODE": "1"}


def test_vllm_gets_the_trials_key_in_a_private_config_file(tmp_path):
    """vLLM's `--api-key` is the trial's HTTP key (docs/design.md §14), in a
    0600 `--config` YAML beside the secret, never on its command line."""
    import json
    import stat

    from realrl.base import trial_secret
    from realrl.impl.generation.backends import VLLMBackend

    secret = trial_secret.ensure_secret(str(tmp_path / "run"))
    config = GenerationServerConfig(backend="vllm", model_path="/models/qwen")
    args = VLLMBackend().secure_args(config, secret, "gen-0")
    key = trial_secret.load_keys(secret).http_api_key
    assert args[0] == "--config" and len(args) == 2 and args[1].endswith(".yaml") and key not in " ".join(args)
    assert os.path.dirname(args[1]) == os.path.dirname(secret)
    assert stat.S_IMODE(os.stat(args[1]).st_mode) == 0o600
    with open(args[1]) as f:
        assert json.load(f) == {"api-key": key}  # JSON is YAML: vLLM reads it as `--api-key <key>`
