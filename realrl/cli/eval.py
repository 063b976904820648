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

import asyncio
import dataclasses
import json
import sys
import time

from realrl.api.cli_args import AsyncPPOConfig, ConfigError
from realrl.cli.trial import HelpRequested, UsageError, parse_trial_args
from realrl.experiment.config import agent_config, agent_settings, env_config, load_config


def evaluate_model(cfg: AsyncPPOConfig) -> dict:
    """Accuracy of cfg.model.path on cfg.dataset.test_path (module docstring)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from realrl.api.agent_api import make_agent
    from realrl.api.env_api import make_env
    from realrl.impl import datasets
    from realrl.impl.eval_metrics import metrics, samples, summarize
    from realrl.impl.evaluation import ModelGenerator, evaluate_prompts
    from realrl.impl.generation.torch_server.model import DTYPES

    t0 = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    records = datasets.load_records(cfg.dataset.test_path, cfg.dataset)
    if cfg.eval.max_prompts:
        records = records[: cfg.eval.max_prompts]
    datasets.warn_unused_template(tokenizer, cfg.dataset)
    prompts, _ = datasets.prompt_records(records, tokenizer, cfg.dataset)
    device = torch.device(cfg.train.device)
    model = AutoModelForCausalLM.from_pretrained(cfg.model.path, dtype=DTYPES[cfg.model.dtype]).to(device).eval()
    agent, env = agent_config(cfg), env_config(cfg)
    settings = dataclasses.replace(agent_settings(cfg, cfg.model.path), tokenizer=tokenizer)
    max_new_tokens = cfg.eval.max_new_tokens or cfg.rollout.gconfig.max_new_tokens
    evaluator = make_agent(agent.type, settings.for_evaluation(max_new_tokens), **agent.args)
    generator = ModelGenerator(model, tokenizer, device, version=0, batch_size=cfg.eval.batch_size)
    with torch.no_grad():
        results = asyncio.run(evaluate_prompts(evaluator, lambda: make_env(env.type, **env.args), prompts, generator))
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
        from realrl.experiment.checks import check_datasets, check_plugins

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
