"""`realrl eval model.path=DIR dataset.test_path=FILE [KEY=VALUE ...] [--output FILE]`

Scores any HF model directory (a run's `final/`, one of its checkpoints, a
downloaded model) the way training evaluates: every row of
`dataset.test_path` rendered as training renders it (keys, chat template:
`dataset.*`), the run's agent and environment or reward function
(`rollout.agent.*`, `rollout.env.*`, `rollout.reward_fn`), greedy, with
`eval.max_new_tokens` (0 = `rollout.gconfig.max_new_tokens`) new tokens per
answer, `eval.batch_size` answers per forward, `eval.max_prompts` rows at most
(0 = all), in this process on `train.device` in `model.dtype`. Prints one JSON
line (and writes it to FILE with `--output`): `accuracy`, `score_mean`,
`turns_mean` (generation calls per episode) and `solved_within_<k>` for k = 1
.. the most turns any episode made (the share solved by its k-th call), the
counts `n`, `n_correct`, `score_sum`, and three samples. A bad key or file is
one line naming the key, exit code 2.
"""

from __future__ import annotations

import json
import sys
import time

from realrl.api.cli_args import AsyncPPOConfig, ConfigError
from realrl.cli.trial import HelpRequested, UsageError, parse_trial_args
from realrl.experiment.config import evaluation_fields, load_config


def evaluate_model(cfg: AsyncPPOConfig) -> dict:
    """Accuracy of cfg.model.path on cfg.dataset.test_path (module docstring)."""
    import torch
    from transformers import AutoTokenizer

    from realrl.api.system_api import ModelWorkerConfig
    from realrl.impl.eval_metrics import metrics, samples, summarize
    from realrl.impl.generation.torch_server.model import DTYPES
    from realrl.impl.ppo.models import load_policy
    from realrl.system.model_worker import eval_agent, evaluate_policy

    t0 = time.monotonic()
    # What the trainers' evaluation gets from the same config, and their loading of the model.
    setup = ModelWorkerConfig(**evaluation_fields(cfg, cfg.model.path, cfg.dataset.test_path))
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    device = torch.device(cfg.train.device)
    lora = cfg.model.lora.rank > 0
    model = load_policy(cfg.model.path, DTYPES[cfg.model.dtype], cfg.model.fp32_master, lora, device).eval()
    with torch.no_grad():
        prompts, results, _ = evaluate_policy(setup, eval_agent(setup, tokenizer), model, tokenizer, device, 0)
    summary = summarize(results)
    return {
        "model": cfg.model.path,
        "dataset": cfg.dataset.test_path,
        **metrics(summary),  # accuracy, score_mean, turns_mean, solved_within_<k>
        **{k: summary[k] for k in ("n", "n_correct", "score_sum")},
        "seconds": round(time.monotonic() - t0, 2),
        "samples": samples(prompts, results),
    }


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        _, overrides, options = parse_trial_args(args, __doc__, valued=("--output",), positional_names=())
    except HelpRequested as e:
        print(e)
        return 0
    except UsageError as e:
        print(f"realrl eval: {e}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(overrides, options["--config-name"], options["--config-dir"])
        for key, value in (("model.path", cfg.model.path), ("dataset.test_path", cfg.dataset.test_path)):
            if not value:
                raise ConfigError(f"{key}: required by realrl eval")
        from realrl.experiment.checks import check_datasets, check_model_path, check_plugins

        check_model_path(cfg)
        check_plugins(cfg)
        check_datasets(cfg)
        if cfg.judge.model.path:  # its judge servers live only inside a trial
            raise ConfigError("judge.model.path: realrl eval starts no judge servers")
        if cfg.rollout.reward_fn:
            from realrl.impl.reward_fn import load_reward_fn, takes_judge

            try:
                reward_fn = load_reward_fn(cfg.rollout.reward_fn)
            except ValueError as e:
                raise ConfigError(f"rollout.reward_fn: {e}") from None
            if takes_judge(reward_fn):  # its judge servers live only inside a trial
                raise ConfigError("rollout.reward_fn: takes `judge`, and realrl eval starts no judge servers")
        if cfg.rollout.agent_fn:
            from realrl.impl.agents.function_agent import load_agent_fn
            from realrl.impl.reward_fn import takes_judge

            try:
                agent_fn = load_agent_fn(cfg.rollout.agent_fn)
            except ValueError as e:
                raise ConfigError(f"rollout.agent_fn: {e}") from None
            if takes_judge(agent_fn):
                raise ConfigError("rollout.agent_fn: takes `judge`, and realrl eval starts no judge servers")
    except ConfigError as e:
        print(f"realrl: config error: {e}", file=sys.stderr)
        return 2
    from realrl.base.plugins import load_plugins
    from realrl.experiment.config import plugin_paths

    load_plugins(plugin_paths(cfg))
    result = evaluate_model(cfg)
    line = json.dumps(result)
    print(line, flush=True)
    if options["--output"]:
        with open(options["--output"], "w") as f:
            f.write(line + "\n")
    return 0
