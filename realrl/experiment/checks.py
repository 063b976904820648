"""The checks that need the machine, run after `validate` and before anything
is created (docs/design.md §10): `fileroot` writable, plugins importable,
agent and environment types registered and their arguments accepted, the
reward function loadable, Ray reachable, SGLang installed, LoRA target
modules present in the model, generation lengths within the model's
positions. Each failure is a one-line `ConfigError` naming the key.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable

from realrl.api.cli_args import AllocationMode, AsyncPPOConfig, ConfigError
from realrl.base.logging import getLogger
from realrl.base.plugins import is_object_spec
from realrl.experiment.config import agent_config, env_config

logger = getLogger(__name__)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def check_writable_dir(path: str, key: str) -> None:
    """ConfigError naming `key` unless directories can be created at `path`
    (or under it, when it exists). Creates nothing that stays: the first
    existing ancestor is checked with os.access and then by creating and
    removing an empty temporary directory in it (os.access says yes to root
    almost everywhere, e.g. under /proc, where mkdir still fails)."""
    target = os.path.abspath(path)
    probe = target
    while not os.path.lexists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        what = "exists and is not a directory" if probe == target else f"cannot be created: {probe} is not a directory"
        raise ConfigError(f"{key}: {target} {what}; give a writable directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: {target} is not writable ({probe}: permission denied); give a writable directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".realrl-write-check-", dir=probe))
    except OSError as e:
        raise ConfigError(
            f"{key}: {target} is not writable (cannot create a directory in {probe}: "
            f"{e.strerror or e}); give a writable directory"
        ) from None


def check_plugins(cfg: AsyncPPOConfig) -> None:
    """Imports the plugins (and the built-in agents and environments) in this
    process, as every worker will, so an unimportable plugin is a config error."""
    from realrl.base.plugins import load_plugins

    for spec in cfg.plugins:
        if not isinstance(spec, str) or not spec.strip():
            raise ConfigError(f"plugins: entries must be module paths or .py files, got {spec!r}")
    try:
        load_plugins(cfg.plugins)
        import realrl.impl.agents  # noqa: F401  (a plugin registering a built-in name fails here)
        import realrl.impl.environments  # noqa: F401
    except (Exception, SystemExit) as e:
        raise ConfigError(f"plugins: {_one_line(e) or type(e).__name__}") from None


def check_model_path(cfg: AsyncPPOConfig) -> None:
    """A ConfigError when model.path names nothing on disk (before any check reads it)."""
    path = cfg.model.path
    if path and not os.path.exists(path):
        where = "" if os.path.isabs(path) else f", relative to the working directory {os.getcwd()}"
        raise ConfigError(f"model.path: {path!r} does not exist{where} (a Hugging Face model directory)")


def model_positions(cfg: AsyncPPOConfig) -> int | None:
    """The model's max_position_embeddings, from model.path's config.json or,
    for the tiny kit, from its recipe (no build needed); None if not stated."""
    if not cfg.model.path:
        from realrl.impl.tiny_model import TinyKitRecipe  # dataset_recipe keeps the same model shape

        return TinyKitRecipe(seed=cfg.tiny_kit.seed).model.max_position_embeddings
    config_path = os.path.join(cfg.model.path, "config.json")
    if not os.path.isfile(config_path):
        raise ConfigError(f"model.path: {cfg.model.path!r} is not a Hugging Face model directory (no config.json)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"model.path: cannot read {config_path}: {_one_line(e)}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"model.path: {config_path} is not a JSON object")
    text_config = config.get("text_config")  # multimodal models: the decoder's own config
    for c in (text_config if isinstance(text_config, dict) else {}, config):
        for name in ("max_position_embeddings", "n_positions"):
            if isinstance(c.get(name), int) and c[name] > 0:
                return c[name]
    return None


def check_lora_targets(cfg: AsyncPPOConfig) -> None:
    """`model.lora.target_modules` against the model's linear layers, found
    on an empty (meta-device) instance of its architecture."""
    if cfg.model.lora.rank == 0:
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig

    from realrl.impl.lora import target_modules

    if cfg.model.path:
        try:
            config = AutoConfig.from_pretrained(cfg.model.path)
        except Exception as e:
            raise ConfigError(f"model.path: cannot read its config: {_one_line(e)}") from None
    else:  # the tiny kit is a Llama; one small layer has every layer name
        config = LlamaConfig(
            vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=1
        )
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    try:
        target_modules(model, list(cfg.model.lora.target_modules))
    except ValueError as e:
        raise ConfigError(f"model.lora.target_modules: {_one_line(e)}") from None


def check_torch_server_serves(cfg: AsyncPPOConfig) -> None:
    """A ConfigError naming the architecture when the torch server cannot serve
    the model's attention exactly (realrl/impl/generation/torch_server/model.py)."""
    if not cfg.model.path:
        return
    from transformers import AutoConfig

    from realrl.impl.generation.torch_server.model import attention_layout

    try:
        config = AutoConfig.from_pretrained(cfg.model.path)
    except Exception:  # an unreadable config is reported by model_positions / the loader
        return
    try:
        attention_layout(config)
    except ValueError as e:
        raise ConfigError(f"model.path: {_one_line(e)}") from None


def check_datasets(cfg: AsyncPPOConfig) -> None:
    """ConfigError naming the dataset key for a file or row the workers could
    not read, or (with model.path's tokenizer) a prompt they could not render."""
    from realrl.impl import datasets

    tokenizer = None
    if cfg.model.path and os.path.exists(os.path.join(cfg.model.path, "tokenizer_config.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    notice = None
    for key in ("train_path", "test_path"):
        path = getattr(cfg.dataset, key)
        if not path:
            continue
        try:
            records = datasets.load_records(path, cfg.dataset)
            if tokenizer is not None:
                datasets.prompt_records(records, tokenizer, cfg.dataset)
                notice = notice or datasets.template_notice(tokenizer, cfg.dataset, records)
        except (OSError, ValueError) as e:
            raise ConfigError(f"dataset.{key}: {_one_line(e)}") from None
    if notice:  # on the launcher's console, once, before anything starts
        logger.warning("%s", notice)


def check_arguments(factory: Callable, args: dict, key: str, with_settings: bool) -> None:
    """ConfigError naming `key` when `factory` cannot take `args` (an unknown
    or missing keyword), checked from its signature without calling it."""
    import inspect

    try:
        signature = inspect.signature(factory)
    except (TypeError, ValueError):  # a builtin without a signature: let it fail where it runs
        return
    try:
        signature.bind(*([None] if with_settings else []), **args)
    except TypeError as e:
        accepted = [p for p in list(signature.parameters)[int(with_settings) :] if p not in ("self", "args", "kwargs")]
        raise ConfigError(f"{key}: {e}; {getattr(factory, '__name__', factory)} accepts {accepted}") from None


def check_judge(cfg: AsyncPPOConfig, reward_fn) -> None:
    """A reward function that takes `judge` needs an async def and a judge with a chat template."""
    from realrl.impl.reward_fn import is_async_fn, takes_judge

    if not takes_judge(reward_fn):
        return
    if not is_async_fn(reward_fn):
        raise ConfigError("rollout.reward_fn: takes `judge`, so it must be an `async def` function")
    if not cfg.judge.model.path:
        raise ConfigError("rollout.reward_fn: takes `judge` but no judge is configured (judge.model.path)")
    check_judge_model(cfg)


def check_judge_model(cfg: AsyncPPOConfig) -> None:
    """The judge's model directory, with a chat template."""
    from realrl.impl.judge import load_judge_tokenizer

    if not os.path.isdir(cfg.judge.model.path):
        raise ConfigError(f"judge.model.path: {cfg.judge.model.path!r} is not a directory")
    try:
        load_judge_tokenizer(cfg.judge.model.path)
    except ValueError as e:
        raise ConfigError(_one_line(e)) from None


def check_environment(cfg: AsyncPPOConfig, alloc: AllocationMode) -> int | None:
    """The checks that need the file system, the plugins or the model's
    config, run after `validate` and before anything is created (fileroot,
    etcd, the tiny kit, workers). Returns the most positions (prompt + new
    tokens) a generation request may use, or None if the model does not say."""
    check_model_path(cfg)
    check_writable_dir(cfg.fileroot, "fileroot")
    if cfg.tiny_kit.cache_dir and not (cfg.model.path and cfg.dataset.train_path):  # the kit will be built there
        check_writable_dir(cfg.tiny_kit.cache_dir, "tiny_kit.cache_dir")
    check_plugins(cfg)
    from realrl.api.agent_api import AGENTS
    from realrl.api.env_api import ENVIRONMENTS

    env, agent = env_config(cfg), agent_config(cfg)
    for key, name, args, registry in (
        ("rollout.agent.type", agent.type, agent.args, AGENTS),
        ("rollout.env.type", env.type, env.args, ENVIRONMENTS),
    ):
        if name not in registry and not is_object_spec(name):
            hint = "" if cfg.plugins else " (a plugin can register more: plugins=[path/to/plugin.py])"
            raise ConfigError(
                f"{key}: unknown {registry.kind} {name!r}; registered: {', '.join(registry.names())}{hint}"
            )
        try:
            factory = registry.get(name)
        except ValueError as e:
            raise ConfigError(f"{key}: {_one_line(e)}") from None
        check_arguments(factory, args, key.replace(".type", ".args"), with_settings=registry is AGENTS)
    agent_takes_judge = False
    if cfg.rollout.agent_fn:
        from realrl.impl.agents.function_agent import load_agent_fn
        from realrl.impl.reward_fn import takes_judge

        try:
            agent_takes_judge = takes_judge(load_agent_fn(agent.args["fn"]))
        except ValueError as e:
            raise ConfigError(f"rollout.agent_fn: {_one_line(e)}") from None
        if agent_takes_judge and not cfg.judge.model.path:
            raise ConfigError("rollout.agent_fn: takes `judge` but no judge is configured (judge.model.path)")
    if cfg.rollout.reward_fn:
        from realrl.impl.reward_fn import load_reward_fn

        try:
            reward_fn = load_reward_fn(env.args["fn"])
        except ValueError as e:
            raise ConfigError(f"rollout.reward_fn: {_one_line(e)}") from None
        check_judge(cfg, reward_fn)
    elif cfg.judge.model.path:
        if "judge" not in env.args and not agent_takes_judge:
            raise ConfigError(
                "judge.model.path: a judge needs rollout.reward_fn or rollout.agent_fn (a function that takes "
                f"`judge`) or an environment that takes `judge` (rollout.env.type={env.type!r} does not)"
            )
        check_judge_model(cfg)
    if cfg.mode == "ray":
        from realrl.launcher.ray import connect

        connect(cfg.ray.address)  # the launcher keeps this connection
    if alloc.gen_backend in ("sglang", "vllm") and cfg.mode == "local":  # on a cluster, its nodes must have it
        from realrl.impl.generation.backends import BackendUnavailableError, get_backend

        try:
            get_backend(alloc.gen_backend).check_available()
        except BackendUnavailableError as e:
            raise ConfigError(f"allocation_mode: {_one_line(e)}") from None

    check_lora_targets(cfg)
    if alloc.gen_backend == "torch":
        check_torch_server_serves(cfg)
    positions = model_positions(cfg)
    if positions is None:
        check_datasets(cfg)
        return None
    limit = positions
    where = "the model's max_position_embeddings"
    if alloc.gen_backend == "sglang" and cfg.server.sglang.context_length:
        limit, where = cfg.server.sglang.context_length, "server.sglang.context_length"
    if alloc.gen_backend == "vllm" and cfg.server.vllm.max_model_len:
        limit, where = cfg.server.vllm.max_model_len, "server.vllm.max_model_len"
    new_tokens = cfg.rollout.gconfig.max_new_tokens
    if new_tokens >= limit:  # a prompt has at least one token
        raise ConfigError(
            f"rollout.gconfig.max_new_tokens: must be < {limit} ({where}; a prompt takes at least "
            f"one position), got {new_tokens}"
        )
    eval_tokens = cfg.eval.max_new_tokens or new_tokens
    if eval_tokens >= positions:
        key = "eval.max_new_tokens" if cfg.eval.max_new_tokens else "rollout.gconfig.max_new_tokens"
        raise ConfigError(
            f"{key}: must be < {positions} (the model's max_position_embeddings, used by evaluation; "
            f"a prompt takes at least one position), got {eval_tokens}"
        )
    check_datasets(cfg)  # after the cheap checks: it reads the files and may load the tokenizer
    return limit
