#!/usr/bin/env bash
# Downloads every wheel scripts/gpu_check.sh needs, for a GPU machine without
# network: Python 3.12, manylinux x86-64, torch excluded (the GPU machine has
# its own CUDA build). Run it where the package index is reachable, carry DIR
# over, then run `bash scripts/gpu_check.sh --wheels DIR` there.
#
#   bash scripts/gpu_wheels.sh [--dry-run] DIR
#
# What: realrl's dependencies pinned in pyproject.toml (all but torch) plus
# the test runner (pytest, pytest-timeout from the dev extra), with every
# dependency of theirs, resolved for the target by `pip download
# --only-binary=:all: --python-version 3.12 --platform ...`. A pinned package
# published only as source (e.g. antlr4-python3-runtime 4.9.3) is built into a
# wheel here, which must come out pure Python (`none-any`), and the download
# is resolved again with it. --dry-run prints the requirements and the pip
# command and downloads nothing. Environment: PYTHON (default python3) runs
# pip here; GPU_WHEELS_PYTHON_VERSION (3.12) and GPU_WHEELS_PLATFORMS (a
# space-separated list, oldest glibc first: pip prefers the earlier ones)
# describe the target; GPU_WHEELS_SKIP (space-separated names) leaves out the
# wheels of packages the target already has.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${PYTHON:-python3}"
dry_run=0
if [ "${1:-}" = "--dry-run" ]; then dry_run=1; shift; fi
if [ $# -ne 1 ]; then
  echo "usage: bash scripts/gpu_wheels.sh [--dry-run] DIR" >&2
  exit 2
fi
dest="$1"
target_python="${GPU_WHEELS_PYTHON_VERSION:-3.12}"
platforms="${GPU_WHEELS_PLATFORMS:-manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 manylinux_2_28_x86_64}"

# The requirements: pyproject's pinned dependencies without torch, and the test runner.
requirements="$("$py" - "$repo/pyproject.toml" <<'EOF'
import re, sys, tomllib

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
wanted = [r for r in project["dependencies"] if re.match(r"[A-Za-z0-9_.-]+", r).group(0).lower() != "torch"]
wanted += [r for r in project["optional-dependencies"]["dev"] if r.split("==")[0] in ("pytest", "pytest-timeout")]
print("\n".join(wanted))
EOF
)"

platform_args=()
for p in $platforms; do platform_args+=(--platform "$p"); done
download=("$py" -m pip download --dest "$dest" --find-links "$dest" --only-binary=:all:
          --python-version "$target_python" --implementation cp "${platform_args[@]}")

if [ "$dry_run" = 1 ]; then
  echo "requirements:"
  echo "$requirements" | sed 's/^/  /'
  echo "command: ${download[*]} -r <the requirements>"
  exit 0
fi

mkdir -p "$dest"
reqfile="$(mktemp)"
trap 'rm -f "$reqfile"' EXIT
echo "$requirements" > "$reqfile"
for attempt in 1 2 3 4 5; do
  if log="$("${download[@]}" -r "$reqfile" 2>&1)"; then
    break
  fi
  # A package published only as source: build its wheel here (pure Python only), then resolve again.
  missing="$(echo "$log" | sed -n 's/.*No matching distribution found for \([A-Za-z0-9_.-]*==[^ ;]*\).*/\1/p' | head -1)"
  if [ -z "$missing" ] || [ "$attempt" = 5 ]; then
    echo "$log" >&2
    echo "gpu_wheels: the download failed (see above)" >&2
    exit 1
  fi
  echo "gpu_wheels: $missing has no wheel for the target: building one here"
  "$py" -m pip wheel --quiet --no-deps --no-binary=:all: --wheel-dir "$dest" "$missing"
  name="$(echo "${missing%%==*}" | tr '-' '_' | tr '[:upper:]' '[:lower:]')"
  if ! ls "$dest" | tr '[:upper:]' '[:lower:]' | grep -q "^${name}-.*-none-any\.whl$"; then
    echo "gpu_wheels: $missing did not build into a pure-Python wheel; it cannot be carried" >&2
    exit 1
  fi
done
# torch's own stack (its CUDA libraries, bindings and triton) must stay the GPU
# machine's: a cu12 cuda_bindings ahead on PYTHONPATH breaks a cu13 torch.
if ls "$dest" | grep -qiE '^(torch|nvidia_|triton-|cuda_bindings-|cuda_pathfinder-|cuda_toolkit-)'; then
  echo "gpu_wheels: a dependency pulled in torch, triton or CUDA wheels; they are removed (the GPU machine has its own)" >&2
  rm -f "$dest"/torch-*.whl "$dest"/nvidia_*.whl "$dest"/triton-*.whl "$dest"/cuda_bindings-*.whl \
    "$dest"/cuda_pathfinder-*.whl "$dest"/cuda_toolkit-*.whl
fi
# Packages the GPU machine already has, in versions that serve (GPU_WHEELS_SKIP="pyarrow numpy"):
# left behind, so that what is carried stays small.
for name in ${GPU_WHEELS_SKIP:-}; do
  stem="$(echo "$name" | tr '-' '_' | tr '[:upper:]' '[:lower:]')"
  for wheel in "$dest"/*.whl; do
    base="$(basename "$wheel" | tr '[:upper:]' '[:lower:]')"
    if [ "${base%%-*}" = "$stem" ]; then rm -f "$wheel"; echo "gpu_wheels: left out $(basename "$wheel") (GPU_WHEELS_SKIP)"; fi
  done
done
echo "gpu_wheels: $(ls "$dest"/*.whl | wc -l) wheels in $dest ($(du -sh "$dest" | cut -f1)); on the GPU machine: bash scripts/gpu_check.sh --wheels DIR"
