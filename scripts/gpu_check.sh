#!/usr/bin/env bash
# Checks realrl's CUDA paths on a GPU machine in one step (under 10 minutes)
# and writes one JSON of figures (scripts/gpu_check.py says what it runs).
#
#   bash scripts/gpu_check.sh [--wheels DIR] [--out FILE] [--workdir DIR] [--budget-s S]
#
# Python: $REALRL_PYTHON, else python3: the interpreter whose torch has CUDA.
# --wheels DIR installs the wheels scripts/gpu_wheels.sh downloaded, offline,
# first: into <workdir>/site (default workdir: $TMPDIR or /tmp, then
# realrl-gpu-check), put ahead on PYTHONPATH, so they serve together with the
# machine's own torch. (A `--system-site-packages` virtualenv would not see
# that torch when python3 is itself a virtualenv, as it often is on GPU
# images.) Without CUDA it says why it skipped, writes that in the JSON and
# exits 0; it exits 1 if a check failed.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${REALRL_PYTHON:-python3}"
wheels=""
budget=()
out="$repo/benchmarks/results/gpu_check.json"
work="${TMPDIR:-/tmp}/realrl-gpu-check"
while [ $# -gt 0 ]; do
  case "$1" in
    --wheels) wheels="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --workdir) work="$2"; shift 2 ;;
    --budget-s) budget=(--budget-s "$2"); shift 2 ;;
    *) echo "usage: bash scripts/gpu_check.sh [--wheels DIR] [--out FILE] [--workdir DIR] [--budget-s S]" >&2; exit 2 ;;
  esac
done

extra="{}"
pythonpath="$repo"
if [ -n "$wheels" ]; then
  shopt -s nullglob
  files=("$wheels"/*.whl)
  if [ ${#files[@]} -eq 0 ]; then
    echo "gpu_check: no wheels in $wheels (scripts/gpu_wheels.sh DIR downloads them)" >&2
    exit 2
  fi
  site="$work/site"
  rm -rf "$site"
  mkdir -p "$site"
  "$py" -m pip install --quiet --no-index --no-deps --no-compile --disable-pip-version-check \
    --target "$site" "${files[@]}"
  echo "gpu_check: installed ${#files[@]} wheels from $wheels into $site (offline)"
  pythonpath="$site:$repo"
  extra="$("$py" -c 'import json, os, sys; print(json.dumps({"wheels": {"dir": sys.argv[1], "site": sys.argv[2], "installed": sorted(os.path.basename(w) for w in sys.argv[3:])}}))' "$wheels" "$site" "${files[@]}")"
fi
export PYTHONPATH="$pythonpath${PYTHONPATH:+:$PYTHONPATH}"
exec "$py" "$repo/scripts/gpu_check.py" --out "$out" --extra "$extra" "${budget[@]}"
