#!/usr/bin/env bash
# Asynchronous GRPO on a laptop CPU: builds a tiny Llama and a character
# tokenizer locally, warm-starts it on synthetic arithmetic, then trains it with
# every realrl worker as its own process. No GPU, no download.
# Extra arguments are Hydra overrides, e.g.
#   bash examples/run_async_ppo.sh total_train_steps=100 rollout.max_head_offpolicyness=2
# The last line printed is `summary: <path of summary.json>`.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
source scripts/bootstrap.sh
exec "$REALRL_PY" training/main_async_ppo.py "$@"
