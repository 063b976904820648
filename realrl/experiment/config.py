"""The user's config: loading it and the values derived from it (docs/design.md §10).

`load_config(overrides)` has Hydra compose a defaults file with `key=value`
overrides into a typed `AsyncPPOConfig` (schema: `realrl/api/cli_args.py`,
Hydra node `async_ppo_schema`). The defaults files live in `realrl/configs/`
(`async-ppo.yaml` by default; `config_name` picks another file there). A
user's own directory (`config_dir`) is searched first: its files may build on
the schema node and on the package's files in their `defaults` lists, and the
package's files on the user's (e.g. a config group of their own). Any Hydra or
OmegaConf error becomes a `ConfigError` whose one-line message names the key.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

from realrl.api.agent_api import AgentSettings
from realrl.api.cli_args import (
    REPLACED_KEYS,
    AgentConfig,
    AsyncPPOConfig,
    ConfigError,
    EnvConfig,
    parse_allocation_mode,
)
from realrl.api.served_sampling import served_sampling
from realrl.base.plugins import absolute_spec, is_object_spec

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
DEFAULT_CONFIG = "async-ppo"
SCHEMA_NODE = "async_ppo_schema"

# Free-form dicts: their keys are the plugin's to define, so a new key needs no
# Hydra `+` (an override of one becomes `++`, "add or replace").
FREE_FORM_KEYS = ("rollout.agent.args.", "rollout.env.args.")


def load_config(
    overrides: list[str] | tuple[str, ...] = (), config_name: str = DEFAULT_CONFIG, config_dir: str | None = None
) -> AsyncPPOConfig:
    """Composes defaults + overrides into a typed AsyncPPOConfig; any error
    becomes a ConfigError whose message names the key."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name=SCHEMA_NODE, node=AsyncPPOConfig)
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key in REPLACED_KEYS:
            raise ConfigError(f"{key}: was replaced by {REPLACED_KEYS[key]}")
    overrides = [f"++{o}" if o.startswith(FREE_FORM_KEYS) else o for o in overrides]
    search = [CONFIG_DIR]
    if config_dir is not None:
        if not os.path.isdir(config_dir):
            raise ConfigError(f"--config-dir: no such directory {os.path.abspath(config_dir)}")
        search.insert(0, os.path.abspath(config_dir))
    # Hydra reads the primary config from one directory (the first that has
    # it); the others are on its search path, for `defaults` lists and groups.
    primary = next((d for d in search if os.path.isfile(os.path.join(d, f"{config_name}.yaml"))), search[0])
    others = [d for d in search if d != primary]
    if others:
        quoted = ", ".join("'file://" + d.replace("\\", "\\\\").replace("'", "\\'") + "'" for d in others)
        overrides.append(f"hydra.searchpath=[{quoted}]")
    try:
        with initialize_config_dir(config_dir=primary, version_base=None):
            cfg = compose(config_name=config_name, overrides=overrides)
        typed = OmegaConf.to_object(cfg)
    except Exception as e:  # Hydra / OmegaConf errors: keep the line that says what and where
        raise ConfigError(_unknown_key_line(e, overrides) or _error_line(e)) from None
    size_new_tokens(typed)
    return typed


# rollout.gconfig.max_new_tokens=0: the tiny kit's answers are a few digits; a
# real model's reasoning takes hundreds of tokens (half its positions at most).
TINY_KIT_NEW_TOKENS, MODEL_NEW_TOKENS = 8, 1024


def size_new_tokens(cfg: AsyncPPOConfig) -> None:
    """Replaces rollout.gconfig.max_new_tokens=0 with a size for the model."""
    gconfig = cfg.rollout.gconfig
    if gconfig.max_new_tokens != 0:
        return
    if not cfg.model.path:
        gconfig.max_new_tokens = TINY_KIT_NEW_TOKENS
        return
    positions = None
    try:  # an unreadable config.json is reported by the checks, not here
        with open(os.path.join(cfg.model.path, "config.json"), encoding="utf-8") as f:
            config = json.load(f)
        config = config.get("text_config") or config
        positions = config.get("max_position_embeddings") or config.get("n_positions")
    except (OSError, ValueError, AttributeError):
        pass
    sized = MODEL_NEW_TOKENS
    if isinstance(positions, int) and positions > 1:
        sized = min(sized, positions // 2)
    gconfig.max_new_tokens = sized


def schema_keys(node: type = AsyncPPOConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the schema (a dataclass's fields, recursively)."""
    keys = []
    for f in dataclasses.fields(node):
        key = f"{prefix}{f.name}"
        keys.append(key)
        if dataclasses.is_dataclass(f.default_factory if f.default_factory is not dataclasses.MISSING else None):
            keys += schema_keys(f.default_factory, f"{key}.")
    return keys


def _unknown_key_line(e: Exception, overrides: list[str]) -> str | None:
    """`<key>: unknown key; did you mean <nearest>?` for a key the schema does not have."""
    cause = e.__cause__ or e
    text = str(cause)
    if not re.search(r"Key '[^']*' not in '", text):
        return None
    full_key = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.strip().startswith("full_key:")), "")
    # the whole key as the user wrote it (`modle.path`, whose full_key is `modle`)
    written = [o.lstrip("+~").split("=", 1)[0] for o in overrides]
    key = next((w for w in written if full_key and (w == full_key or w.startswith(full_key + "."))), full_key)
    if not key or key in REPLACED_KEYS:  # a replaced key: _error_line names its replacement
        return None
    import difflib

    known = schema_keys()
    nearest = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    hint = f"did you mean {nearest[0]}?" if nearest else "`realrl config` lists the keys"
    return f"{key}: unknown key; {hint}"


def _error_line(e: Exception) -> str:
    cause = e.__cause__ or e
    text = str(cause).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    full_key = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("full_key:")), None)
    if full_key in REPLACED_KEYS:  # a replaced key in a config file
        return f"{full_key}: was replaced by {REPLACED_KEYS[full_key]}"
    missing = re.search(r"Could not find '(algorithm/[^']*)'", text)
    if missing:
        return f"algorithm: no preset {missing.group(1)!r}; presets: {', '.join(algorithm_presets())}"
    message = next((ln for ln in lines if not ln.startswith(("full_key:", "object_type", "reference_type"))), text)
    if full_key and full_key not in message:
        return f"{full_key}: {message}"
    return message


def algorithm_presets() -> list[str]:
    """The names `algorithm=<name>` takes: realrl/configs/algorithm/*.yaml."""
    return sorted(f[: -len(".yaml")] for f in os.listdir(os.path.join(CONFIG_DIR, "algorithm")) if f.endswith(".yaml"))


# ---- values derived from the config ------------------------------------------------------


@dataclasses.dataclass
class TrialPaths:
    fileroot: str
    log_dir: str
    weights_dir: str  # <fileroot>/weights/<exp>/<trial>/actor/<version>/ (docs/design.md §8)
    checkpoint_dir: str
    final_model_dir: str
    summary: str


def trial_paths(cfg: AsyncPPOConfig) -> TrialPaths:
    root = os.path.abspath(cfg.fileroot)
    exp, trial = cfg.experiment_name, cfg.trial_name
    log_dir = os.path.join(root, "logs", exp, trial)
    return TrialPaths(
        fileroot=root,
        log_dir=log_dir,
        weights_dir=os.path.join(root, "weights", exp, trial, "actor"),
        checkpoint_dir=os.path.join(root, "checkpoints", exp, trial),
        final_model_dir=os.path.join(root, "models", exp, trial, "final"),
        summary=os.path.join(log_dir, "summary.json"),
    )


def agent_settings(cfg: AsyncPPOConfig, tokenizer_path: str) -> AgentSettings:
    """The run-wide settings every agent gets (its own args are rollout.agent.args)."""
    return AgentSettings(
        tokenizer_path=tokenizer_path,
        group_size=cfg.ppo.group_size,
        gconfig=dataclasses.replace(cfg.rollout.gconfig),
        reward_bias=cfg.ppo.reward_bias,
        reward_scaling=cfg.ppo.reward_scaling,
        success_rate_lb=cfg.rollout.success_rate_lb,
        success_rate_ub=cfg.rollout.success_rate_ub,
        dynamic_sampling=cfg.rollout.dynamic_sampling,
        served=served_sampling(
            parse_allocation_mode(cfg.allocation_mode).gen_backend,
            cfg.server.torch.emulate_sglang,
            cfg.server.torch.emulate_vllm,
            cfg.server.sglang.extra_args,
        ),
        episode_timeout=cfg.rollout.episode_timeout,
    )


def evaluation_fields(cfg: AsyncPPOConfig, model_path: str, test_path: str) -> dict:
    """What evaluation runs (the `eval_*`, dataset, agent and environment fields
    of `ModelWorkerConfig`), derived alike for the trainers (experiment/build.py)
    and `realrl eval` (realrl/cli/eval.py), so both score a model the same way."""
    return dict(
        eval_dataset_path=test_path,
        dataset=cfg.dataset,
        eval_max_new_tokens=cfg.eval.max_new_tokens or cfg.rollout.gconfig.max_new_tokens,
        eval_batch_size=cfg.eval.batch_size,
        eval_max_prompts=cfg.eval.max_prompts,
        agent=agent_config(cfg),
        agent_settings=agent_settings(cfg, model_path),
        env=env_config(cfg),
    )


def agent_config(cfg: AsyncPPOConfig) -> AgentConfig:
    """The agent episodes use: `rollout.agent_fn` becomes the "function"
    agent; file paths are made absolute (workers may run elsewhere)."""
    agent = cfg.rollout.agent
    if cfg.rollout.agent_fn:
        # (the function gets the judge only if it takes `judge`: realrl/impl/agents/function_agent.py)
        judge = {"judge": judge_settings(cfg)} if cfg.judge.model.path else {}
        return AgentConfig(type="function", args={"fn": absolute_spec(cfg.rollout.agent_fn), **judge, **agent.args})
    if is_object_spec(agent.type):
        return dataclasses.replace(agent, type=absolute_spec(agent.type))
    return agent


def env_config(cfg: AsyncPPOConfig) -> EnvConfig:
    """The environment episodes use: `rollout.reward_fn` becomes the
    "reward-fn" environment (a file path made absolute: workers may run
    elsewhere); the synthetic arithmetic task checks bare numbers."""
    env = cfg.rollout.env
    if cfg.rollout.reward_fn:
        return EnvConfig(
            type="reward-fn",
            args={
                "fn": absolute_spec(cfg.rollout.reward_fn),
                "timeout_s": cfg.rollout.reward_fn_timeout,
                "plugins": plugin_paths(cfg),
                **({"judge": judge_settings(cfg)} if cfg.judge.model.path else {}),
                **env.args,
            },
        )
    if cfg.judge.model.path and env_takes_judge(env.type):
        # (the checks refuse a judge that neither the reward function nor the environment takes)
        return dataclasses.replace(env, args={"judge": judge_settings(cfg), **env.args})
    if env.type == "math" and synthetic_arithmetic(cfg):
        # The synthetic arithmetic task's answers are bare numbers ("81");
        # a hedged or decorated answer ("~81") does not count.
        return dataclasses.replace(env, args={"answer_format": "exact", **env.args})
    return env


def synthetic_arithmetic(cfg: AsyncPPOConfig) -> bool:
    """Whether the run's data are the tiny kit's synthetic arithmetic: training
    without a data set of the user's (the kit's own), or `realrl eval` of a
    kit's synthetic test file. Decided by the data, not by which keys the
    command named: `realrl eval` names only `dataset.test_path`, and a user's
    test set is scored as training scored it (free text, answers extracted)."""
    if cfg.dataset.train_path:
        return False
    return not cfg.dataset.test_path or _is_synthetic_kit_file(cfg.dataset.test_path)


def _is_synthetic_kit_file(path: str) -> bool:
    """A data file of a tiny kit (its manifest, `kit.json`, beside it: realrl/impl/tiny_model.py)
    whose recipe drew the data (no `dataset_sha256`: not a copy of a user's data set)."""
    try:
        with open(os.path.join(os.path.dirname(os.path.abspath(path)), "kit.json"), encoding="utf-8") as f:
            return not json.load(f)["recipe"].get("dataset_sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def env_takes_judge(env_type: str) -> bool:
    """Whether the registered environment `env_type` takes a `judge` argument
    (False when it is not registered: the checks name that)."""
    from realrl.api.env_api import ENVIRONMENTS
    from realrl.impl.reward_fn import takes_judge

    try:
        return takes_judge(ENVIRONMENTS.get(env_type))
    except (KeyError, ValueError):
        return False


def judge_settings(cfg: AsyncPPOConfig) -> dict:
    """What a process needs to reach the trial's judge servers (realrl/impl/judge.py)."""
    return {
        "model_path": os.path.abspath(cfg.judge.model.path),
        "experiment_name": cfg.experiment_name,
        "trial_name": cfg.trial_name,
        "request_timeout": cfg.judge.request_timeout,
        "max_new_tokens": cfg.judge.max_new_tokens,
    }


def plugin_paths(cfg: AsyncPPOConfig) -> list[str]:
    """`plugins` with .py files made absolute (workers may run elsewhere)."""
    return [os.path.abspath(p) if p.endswith(".py") else p for p in cfg.plugins]
