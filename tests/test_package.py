"""The realrl package stands alone: no module imports the repository's scripts
(`training/`), the import graph has no cycle, and a copy installed from a
wheel (not editable) runs its commands, Slurm's batch script included, from a
directory outside the checkout."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections import deque
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "realrl"


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def _imports(name: str, path: Path) -> list[tuple[str, int]]:
    """(imported module, line) of every import statement in the module,
    those inside functions too; relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from a import b`: b may be a module of a (a and a.b are tried below)
            found += [(base, node.lineno)] + [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return found


def _import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (the longest known prefix of each import)."""
    modules = _modules()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for target, _ in _imports(name, path):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                graph[name].add(target)
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> ... -> a) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    cycles = []
    for component in components:  # the shortest cycle through the component's first module
        start = min(component)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while queue:
            v = queue.popleft()
            if start in graph[v]:
                cycle = [v]
                while cycle[-1] != start:
                    cycle.append(came_from[cycle[-1]])
                cycles.append([*reversed(cycle), start])
                break
            for w in sorted(graph[v] & component):
                if w not in came_from and w != start:
                    came_from[w] = v
                    queue.append(w)
    return cycles


def test_no_module_imports_the_repository_scripts():
    """Only `realrl*` is installed: a `training` import fails outside a checkout."""
    offenders = [
        f"{path.relative_to(REPO)}:{line} imports {target}"
        for name, path in _modules().items()
        for target, line in _imports(name, path)
        if target == "training" or target.startswith("training.")
    ]
    assert not offenders, "\n".join(offenders)


def test_the_package_has_no_import_cycle():
    cycles = _cycles(_import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_the_cycle_check_finds_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert _cycles(graph) == [["a", "b", "c", "a"]]


def test_an_installed_copy_runs_outside_the_checkout(tmp_path):
    """`pip install` of a wheel built from the package alone (no network: the
    build uses this environment's setuptools), first on the path, run from a
    directory that is not the checkout."""
    src = tmp_path / "src"
    shutil.copytree(PACKAGE, src / "realrl", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheels), str(src)]
    subprocess.run(build, check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("realrl-*.whl")
    install = [*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=300)
    assert (site / "realrl" / "configs" / "async-ppo.yaml").is_file()

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)

    proc = run(sys.executable, "-c", "import realrl; print(realrl.__file__)")
    assert proc.stdout.strip() == str(site / "realrl" / "__init__.py"), proc.stdout + proc.stderr
    proc = run(sys.executable, "-m", "realrl", "status", "--help")
    assert proc.returncode == 0 and "Shows what every worker of a trial is doing" in proc.stdout, proc.stderr
    proc = run(str(site / "bin" / "realrl"), "status", "--help")  # the console script
    assert proc.returncode == 0 and "Shows what every worker of a trial is doing" in proc.stdout, proc.stderr

    fileroot = tmp_path / "runs"
    proc = run(sys.executable, "-m", "realrl", "train", "mode=slurm", "slurm.dry_run=true", f"fileroot={fileroot}")
    assert proc.returncode == 0, proc.stderr
    script_path = fileroot / "logs" / "async-ppo-tiny" / "run0" / "slurm" / "trial.sbatch"
    script = script_path.read_text()
    assert proc.stdout == script
    # Inside the job: this installed copy, through the package's own entry.
    config = script_path.parent / "trial.yaml"
    assert script.splitlines()[-1] == f"exec {sys.executable} -m realrl train --slurm-job {config}", script
    assert f"export PYTHONPATH={site}" in script and "training" not in script, script


# One concern per module: a file that grows past this many lines says why at its top.
MAX_LINES = 720


def test_a_module_over_700_lines_says_why_at_its_top():
    """Every module under realrl/ is at most ~700 lines, or its docstring
    says why it is longer ("over 700 lines on purpose: ...")."""
    too_long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        n_lines = text.count("\n")
        docstring = ast.get_docstring(ast.parse(text)) or ""
        if n_lines > MAX_LINES and "over 700 lines on purpose" not in docstring.lower():
            too_long.append(f"{path.relative_to(REPO)} ({n_lines} lines)")
    assert not too_long, f"split these by concern, or say why at the top: {too_long}"
