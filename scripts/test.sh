#!/usr/bin/env bash
# The project's test command: sets everything up on first use, then runs pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/base -x`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/bootstrap.sh"
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec "$REALRL_PY" -m pytest "$@"
