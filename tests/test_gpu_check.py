"""scripts/gpu_check.sh and scripts/gpu_wheels.sh where there is no GPU (CI):
the check skips, says why in its output and its JSON, and exits 0; given
wheels it installs them offline first, ahead of what the interpreter has; the
wheel download resolves realrl's pins without torch (dry run: no network)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import zipfile

import tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_script(*args: str, **env: str) -> subprocess.CompletedProcess:
    # No device visible even where torch has CUDA: the check must skip here.
    environ = dict(os.environ, REALRL_PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="", **env)
    return subprocess.run(["bash", *args], cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)


def fake_wheel(directory, name: str, version: str) -> str:
    """A minimal wheel of a pure-Python package `name` (an importable module)."""
    path = os.path.join(directory, f"{name}-{version}-py3-none-any.whl")
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{f},,\n" for f in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for arcname, text in files.items():
            z.writestr(arcname, text)
    return path


def test_without_cuda_the_check_skips_says_why_and_exits_0(tmp_path):
    out = tmp_path / "gpu_check.json"
    work = str(tmp_path / "work")
    proc = run_script("scripts/gpu_check.sh", "--out", str(out), "--workdir", work, "--budget-s", "300")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["skipped"] is True
    assert re.fullmatch(
        r"torch \S+ is built without CUDA|no CUDA device is visible to torch \S+ \(.*\)", result["reason"]
    )
    assert proc.stdout.strip() == f"gpu_check: skipped: {result['reason']}; wrote {out}"
    assert result["packages"]["transformers"] == "5.23.0"  # what this interpreter would import


def test_wheels_are_installed_offline_first_and_come_first(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    # A wheel named like one of realrl's dependencies: installed, it shadows the interpreter's own.
    name = os.path.basename(fake_wheel(wheels, "msgpack", "0.0.1"))
    out, work = tmp_path / "gpu_check.json", tmp_path / "work"
    proc = run_script("scripts/gpu_check.sh", "--wheels", str(wheels), "--out", str(out), "--workdir", str(work))
    assert proc.returncode == 0, proc.stderr
    site = work / "site"
    assert proc.stdout.startswith(f"gpu_check: installed 1 wheels from {wheels} into {site} (offline)\n")
    result = json.loads(out.read_text())
    assert result["skipped"] is True and result["wheels"] == {
        "dir": str(wheels),
        "site": str(site),
        "installed": [name],
    }
    assert result["packages"]["msgpack"] == "0.0.1" and (site / "msgpack" / "__init__.py").is_file()

    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_script("scripts/gpu_check.sh", "--wheels", str(empty), "--out", str(out))
    assert proc.returncode == 2 and "no wheels in" in proc.stderr


def test_wheel_download_takes_realrl_pins_without_torch(tmp_path):
    dest = tmp_path / "wheels"
    proc = run_script("scripts/gpu_wheels.sh", "--dry-run", str(dest))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    requirements = [line.strip() for line in lines[1 : lines.index(next(x for x in lines if x.startswith("command:")))]]
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    pinned = [r for r in project["dependencies"] if not r.startswith("torch")]
    assert requirements == pinned + ["pytest==9.0.3", "pytest-timeout==2.4.0"]
    assert all("==" in r for r in requirements)
    command = lines[-1]
    for part in (
        "--only-binary=:all:",
        "--python-version 3.12",
        "--implementation cp",
        "--platform manylinux2014_x86_64",
    ):
        assert part in command
    assert not dest.exists()  # a dry run downloads nothing
    assert run_script("scripts/gpu_wheels.sh").returncode == 2  # DIR is required


def test_the_paged_engine_step_skips_without_cuda_and_runs_on_cpu_as_a_dry_run(tmp_path):
    """benchmarks/paged_engine_gpu.py (gpu_check's paged_engine step): without
    CUDA it writes why and exits 0; --cpu-dry-run takes every step of it on a
    tiny model (no graphs or kernel profile on a CPU), so the GPU run's own
    code has run before it meets a GPU."""
    environ = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "paged.json"
    script = [sys.executable, "benchmarks/paged_engine_gpu.py", "--json", str(out)]
    proc = subprocess.run(script, cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text()) == {"skipped": True, "reason": proc.stdout.split("skipped: ")[1].strip()}
    proc = subprocess.run(
        [*script, "--cpu-dry-run"], cwd=REPO, env=environ, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(out.read_text())
    assert result["ok"] and result["parity"]["paged"]["max_abs_delta_logprob"] <= 1e-4
    assert result["parity"]["greedy_tokens_equal"] and result["graphs"]["tokens_equal"]
    assert result["throughput"]["8"]["tokens"] > 0 and "fraction" in result["gpu_busy"]


def test_weight_publish_on_cuda_refuses_in_one_line_without_cuda_and_the_summary_shows_its_ratio(tmp_path):
    """gpu_check's weight_publish_nccl step: without CUDA, `weight_publish.py
    --device cuda` says why in one line and exits 2 before any model or
    server exists; on a GPU its JSON's broadcast / disk ratio at 2 servers is
    in the check's summary line."""
    environ = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "benchmarks/weight_publish.py", "--transport", "disk,broadcast", "--servers", "1,2"]
    cmd += ["--models", "tiny", "--device", "cuda", f"--fileroot={tmp_path}/runs"]
    proc = subprocess.run(cmd, cwd=REPO, env=environ, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert re.fullmatch(
        r"weight_publish: --device cuda: (torch \S+ is built without CUDA|no CUDA device is visible to .*)\n",
        proc.stderr,
    )
    assert not (tmp_path / "runs").exists()

    sys.path.insert(0, os.path.join(REPO, "scripts"))
    try:
        from gpu_check import summarize
    finally:
        sys.path.pop(0)
    figures = {"ratio": 0.4, "tiny": {"to_all_ratio_by_servers": {"1": 0.5, "2": 0.25}, "backend": "nccl"}}
    checks = {"weight_publish_nccl": {"ok": True, "figures": figures}}
    assert summarize(checks) == ": weights broadcast (nccl) / disk at 2 servers: tiny x0.25"
