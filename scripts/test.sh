#!/usr/bin/env bash
# The project's test command: sets everything up on first use, checks format and
# lint with ruff (seconds; `ruff format .` fixes the layout), then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/base -x`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
"$REALRL_PY" -m ruff format --check --quiet . || { echo "ruff: run '$REALRL_PY -m ruff format .'" >&2; exit 1; }
"$REALRL_PY" -m ruff check --quiet .
exec "$REALRL_PY" -m pytest "$@"
