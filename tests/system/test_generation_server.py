"""The GenerationServer worker with real processes: a real torch server on a
tiny random Llama, started by the worker through the local launcher (or as a
bare worker process), real HTTP, a real etcd."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid

import psutil
import pytest

from realrl.api.cli_args import TorchServerConfig
from realrl.api.system_api import GenerationServerConfig, WorkerInfo, WorkerSpec, to_plain
from realrl.base import name_resolve, names
from realrl.base.name_resolve import NameResolveConfig
from realrl.impl.generation import make_client
from realrl.impl.generation.backends import SGLANG_MIN_VERSION
from realrl.launcher.local import WorkerGroup
from tests.system.trial_thread import TrialThread, wait_until

EXP = "gentest"


# ---------------------------------------------------------------- helpers shared with test_gserver_manager


def build_tiny_model(seed: int = 1):
    """The tiny kit's char tokenizer and a small random Llama (fp32)."""
    import torch

    from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer
    from realrl.impl.tiny_model import build_tiny_model as build

    torch.set_num_threads(1)
    tokenizer = build_char_tokenizer()
    size = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128)
    model = build(tokenizer, size, seed=seed)
    return tokenizer, model


def save_tiny_model(path: str, seed: int = 1) -> str:
    tokenizer, model = build_tiny_model(seed)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def worker_children(worker_pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(worker_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


# The servers the runtime's tests meet: the torch server, and the torch server
# emulating SGLang as realrl launches it (the lowest release realrl runs with,
# two data-parallel ranks; realrl.impl.generation.torch_server.sglang_compat).
SERVER_MODES = {"torch": {}, "sglang": {"emulate_sglang": SGLANG_MIN_VERSION, "emulate_sglang_dp": 2}}
# ... and emulating vLLM (its own API: realrl.impl.generation.torch_server.vllm_compat), for the
# tests that cover what differs on it: restarts, weight updates, partial rollouts.
ENGINE_MODES = {**SERVER_MODES, "vllm": {"emulate_vllm": "0.33"}}
SERVER_API = {"torch": "sglang", "sglang": "sglang", "vllm": "vllm"}  # the HTTP API each mode speaks


def server_config(model_dir: str, mode: str = "torch", **kw) -> GenerationServerConfig:
    torch_cfg = TorchServerConfig(num_threads=1, **ENGINE_MODES[mode])
    return GenerationServerConfig(model_path=model_dir, startup_timeout=120, torch=torch_cfg, **kw)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> str:
    return save_tiny_model(str(tmp_path_factory.mktemp("tiny_model")))


async def _generate(url: str, n: int = 8, api: str = "sglang"):
    async with make_client(api, timeout_s=60) as client:
        info = await client.model_info(url)
        result = await client.generate(url, [5, 6, 7, 8], {"max_new_tokens": n, "temperature": 1.0, "ignore_eos": True})
    return info, result


# ---------------------------------------------------------------- tests


def test_server_registers_serves_and_stops_with_the_trial(tmp_path, etcd_server, tiny_model_dir):
    group = WorkerGroup("generation_server", 1, server_config(tiny_model_dir, seed=3))
    trial = TrialThread(tmp_path, etcd_server.addr, [group], EXP)
    try:
        trial.start()
        url = trial.wait_key(names.gen_server(EXP, trial.trial, 0))
        assert url.startswith("http://127.0.0.1:")
        info, result = asyncio.run(_generate(url))
        assert info.weight_version == "0" and info.model_path == tiny_model_dir
        assert len(result.output_ids) == 8 and len(result.output_logprobs) == 8
        assert result.finish_reason == "length" and result.weight_version == "0"

        (worker_pid,) = trial.launcher.worker_pids
        children = worker_children(worker_pid)
        (server,) = [p for p in children if "realrl.impl.generation.torch_server" in " ".join(p.cmdline())]
        assert str(url.rsplit(":", 1)[1]) in server.cmdline()
        # Same process group as the worker (the launcher's group kill reaches it).
        assert os.getpgid(server.pid) == os.getpgid(worker_pid)
        server_log = os.path.join(trial.launcher.log_dir, "generation_server-0.server.log")
        assert "listening on" in open(server_log).read()

        assert trial.complete() == 0
        assert not alive(worker_pid) and not alive(server.pid)
        worker_log = open(trial.launcher.log_path("generation_server", 0)).read()
        assert "stopped the generation server" in worker_log and "exited with code 0" in worker_log
        with pytest.raises(name_resolve.NameEntryNotFoundError):
            trial.repo.get(names.gen_server(EXP, trial.trial, 0))
    finally:
        trial.close()


def test_killed_server_fails_the_worker_and_the_trial_without_restarts(tmp_path, etcd_server, tiny_model_dir, capfd):
    group = WorkerGroup("generation_server", 1, server_config(tiny_model_dir, max_restarts=0))
    trial = TrialThread(tmp_path, etcd_server.addr, [group], EXP)
    try:
        trial.start()
        trial.wait_key(names.gen_server(EXP, trial.trial, 0))
        (worker_pid,) = trial.launcher.worker_pids
        (server,) = worker_children(worker_pid)
        server.send_signal(signal.SIGKILL)

        assert trial.join() == 1
        assert trial.launcher.failed_worker == "generation_server/0"
        err = capfd.readouterr().err
        assert "worker generation_server/0 failed" in err
        assert f"generation server (pid {server.pid}) was killed by signal SIGKILL while serving" in err
        assert "server.max_restarts=0" in err
        assert "listening on" in err  # the tail of the server's log is in the report
        assert not alive(worker_pid) and not alive(server.pid)
    finally:
        trial.close()


@pytest.mark.parametrize("mode", ["torch", "vllm"])
def test_killed_server_restarts_on_the_current_weights_until_max_restarts(
    tmp_path, etcd_server, tiny_model_dir, capfd, mode
):
    """The worker restarts a dead server, which loads the trainer's current
    version before it registers again (same index, new URL: what a server
    added mid-run does too); one death more than max_restarts within
    restart_window fails the worker and the trial. On vLLM (emulated) the
    worker sets the starting version (`/update_weight_version`) and loads
    through pause -> reload_weights -> resume (the restart limit does not
    depend on the backend: checked on torch only)."""
    weights_dir = tmp_path / "weights"
    save_tiny_model(str(weights_dir / "3"), seed=2)  # what the trainer published as version 3
    config = server_config(tiny_model_dir, mode, max_restarts=1, weights_dir=str(weights_dir))
    trial = TrialThread(tmp_path, etcd_server.addr, [WorkerGroup("generation_server", 1, config)], EXP)
    key = names.gen_server(EXP, trial.trial, 0)
    try:
        trial.start()
        first_url = trial.wait_key(key)
        (worker_pid,) = trial.launcher.worker_pids
        (first,) = worker_children(worker_pid)
        trial.set(names.model_version(EXP, trial.trial, "actor"), "3")
        first.send_signal(signal.SIGKILL)

        second_url = wait_until(lambda: (u := trial.get(key)) not in (None, first_url) and u, 180, "re-registration")
        info, result = asyncio.run(_generate(second_url, api=SERVER_API[mode]))
        assert info.weight_version == "3" and result.weight_version == "3"  # the current weights, not model_path's
        assert not alive(first.pid)
        (second,) = worker_children(worker_pid)
        log = open(trial.launcher.log_path("generation_server", 0)).read()
        assert "restarting it (restart 1, at most 1 within 600s)" in log
        assert "loaded the current weight version 3" in log
        if mode != "torch":
            return

        second.send_signal(signal.SIGKILL)
        assert trial.join() == 1
        err = capfd.readouterr().err
        assert "not restarting it: it was restarted 1 times within 600s (server.max_restarts=1)" in err
        assert not alive(worker_pid) and not alive(second.pid)
    finally:
        trial.close()


def test_server_dies_with_its_worker_even_on_sigkill(tmp_path, etcd_server, tiny_model_dir):
    """PR_SET_PDEATHSIG: a SIGKILLed worker (no exit hook runs) still takes its
    server down. The worker runs bare here, without a launcher to clean up."""
    trial_name = f"t{uuid.uuid4().hex[:8]}"
    nr_config = NameResolveConfig(type="etcd3", etcd3_addr=etcd_server.addr)
    info = WorkerInfo(
        EXP,
        trial_name,
        "generation_server",
        name_resolve=nr_config,
        log_dir=str(tmp_path),
        heartbeat_ttl=2,
        watch_launcher=False,
    )
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(
        WorkerSpec(
            "realrl.system.generation_server:GenerationServer", info, to_plain(server_config(tiny_model_dir))
        ).to_json()
    )
    repo = name_resolve.make_repository(nr_config)
    with open(tmp_path / "worker.log", "wb") as log:
        worker = subprocess.Popen(
            [sys.executable, "-m", "realrl.system.worker_base", "--spec", str(spec_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server_pid = None
    try:
        wait_until(lambda: _get(repo, names.gen_server(EXP, trial_name, 0)) or worker.poll() is not None, 120, "server")
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()[-3000:]
        (server,) = worker_children(worker.pid)
        server_pid = server.pid
        os.kill(worker.pid, signal.SIGKILL)  # only the worker, not its group
        worker.wait()
        wait_until(lambda: not alive(server_pid), 30, "the server to die with its worker")
    finally:
        for pid in (worker.pid, server_pid):
            if pid is not None and alive(pid):
                os.kill(pid, signal.SIGKILL)
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        repo.clear_subtree(names.trial_root(EXP, trial_name))
        repo.close()


def _get(repo, key: str) -> str | None:
    try:
        return repo.get(key)
    except name_resolve.NameEntryNotFoundError:
        return None
