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
# The recipe on top of the defaults: the learning rate decays (cosine) to a tenth by
# the last step. The run is judged by its last weights; at a constant rate they
# keep moving a last-digit shift shared by many answers to the end, and one run in
# nine stopped at a low (docs/benchmarks.md, "The default run"). Arguments override it.
recipe=(optimizer.lr_scheduler=cosine optimizer.min_lr_ratio=0.1)
exec "$REALRL_PY" training/main_async_ppo.py "${recipe[@]}" "$@"
