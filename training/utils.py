"""From the user's AsyncPPOConfig to running worker processes.

`build_experiment(cfg)` validates the config (`validate`, then
`check_environment`: fileroot, plugins, agent/env types, lengths against the
model's positions; both before anything is created), resolves the model and
data (building the tiny-model kit when no model is given), lays out the trial's
directories and returns one `WorkerGroup` per worker kind;
`run_experiment(cfg)` launches them and returns the path of summary.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable

from realrl.api.agent_api import AgentSettings
from realrl.api.cli_args import AllocationMode, AsyncPPOConfig, ConfigError, EnvConfig, validate
from realrl.api.system_api import (
    GenerationServerConfig,
    GserverManagerConfig,
    MasterWorkerConfig,
    ModelWorkerConfig,
    RolloutWorkerConfig,
)
from realrl.base.logging import getLogger
from realrl.launcher.local import LocalLauncher, WorkerGroup

logger = getLogger("training")


@dataclasses.dataclass
class TrialPaths:
    fileroot: str
    log_dir: str
    weights_dir: str  # <fileroot>/weights/<exp>/<trial>/actor/<version>/ (docs/design.md §8)
    checkpoint_dir: str
    final_model_dir: str
    summary: str


@dataclasses.dataclass
class Experiment:
    groups: list[WorkerGroup]
    paths: TrialPaths
    model_path: str
    train_path: str
    test_path: str


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


def resolve_model_and_data(cfg: AsyncPPOConfig, fileroot: str) -> tuple[str, str, str]:
    """(model_path, train_path, test_path); builds the tiny kit when needed."""
    model_path, train_path, test_path = cfg.model.path, cfg.dataset.train_path, cfg.dataset.test_path
    if model_path and not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ConfigError(f"model.path: {model_path!r} is not a Hugging Face model directory (no config.json)")
    for key, path in (("dataset.train_path", train_path), ("dataset.test_path", test_path)):
        if path and not os.path.isfile(path):
            raise ConfigError(f"{key}: no such file {path!r}")
    if not model_path or not train_path:
        from realrl.impl.tiny_model import TinyKitRecipe, build_tiny_kit, dataset_recipe

        if model_path and not train_path:
            raise ConfigError(
                "dataset.train_path: required when model.path is set "
                "(the synthetic task needs the tiny model's tokenizer)"
            )
        cache = os.path.abspath(cfg.tiny_kit.cache_dir) if cfg.tiny_kit.cache_dir else os.path.join(fileroot, "cache")
        dataset = (train_path, test_path or train_path) if train_path else None
        # the tiny model, warm-started on the user's own task or on arithmetic
        recipe = dataset_recipe(*dataset, seed=cfg.tiny_kit.seed) if dataset else TinyKitRecipe(seed=cfg.tiny_kit.seed)
        if cfg.tiny_kit.warm_start_steps:
            recipe = dataclasses.replace(
                recipe, warm_start=dataclasses.replace(recipe.warm_start, steps=cfg.tiny_kit.warm_start_steps)
            )
        kit = build_tiny_kit(cache, recipe, dataset)
        if dataset is None:
            logger.info(
                "tiny kit: %s (warm start: greedy accuracy %.3f, pass@%d %.3f)",
                kit.root,
                kit.warm_start_stats.accuracy,
                kit.warm_start_stats.k,
                kit.warm_start_stats.pass_at_k,
            )
        else:  # its built-in check compares numbers; your task's score is the step-0 evaluation
            logger.info(
                "tiny kit: %s (warm-started on %s; the step-0 evaluation scores it on your task)", kit.root, train_path
            )
        model_path = model_path or kit.model_path
        if not train_path:
            train_path, test_path = kit.train_path, kit.test_path
    return model_path, train_path, test_path


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
    )


def env_config(cfg: AsyncPPOConfig) -> EnvConfig:
    """The environment episodes use: `rollout.reward_fn` becomes the
    "reward-fn" environment (a file path made absolute: workers may run
    elsewhere); the synthetic arithmetic task checks bare numbers."""
    env = cfg.rollout.env
    if cfg.rollout.reward_fn:
        spec = cfg.rollout.reward_fn
        path, sep, name = spec.rpartition(":")
        if sep and path.endswith(".py"):
            spec = f"{os.path.abspath(path)}:{name}"
        plugins = [os.path.abspath(p) if p.endswith(".py") else p for p in cfg.plugins]
        return EnvConfig(
            type="reward-fn",
            args={"fn": spec, "timeout_s": cfg.rollout.reward_fn_timeout, "plugins": plugins, **env.args},
        )
    if not cfg.dataset.train_path and env.type == "math":
        # The synthetic arithmetic task's answers are bare numbers ("81");
        # a hedged or decorated answer ("~81") does not count.
        return dataclasses.replace(env, args={"answer_format": "exact", **env.args})
    return env


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


def check_environment(cfg: AsyncPPOConfig, alloc: AllocationMode) -> int | None:
    """The checks that need the file system, the plugins or the model's
    config, run after `validate` and before anything is created (fileroot,
    etcd, the tiny kit, workers). Returns the most positions (prompt + new
    tokens) a generation request may use, or None if the model does not say."""
    check_writable_dir(cfg.fileroot, "fileroot")
    if cfg.tiny_kit.cache_dir and not (cfg.model.path and cfg.dataset.train_path):  # the kit will be built there
        check_writable_dir(cfg.tiny_kit.cache_dir, "tiny_kit.cache_dir")
    check_plugins(cfg)
    from realrl.api.agent_api import AGENTS
    from realrl.api.env_api import ENVIRONMENTS

    env = env_config(cfg)
    for key, name, args, registry in (
        ("rollout.agent.type", cfg.rollout.agent.type, cfg.rollout.agent.args, AGENTS),
        ("rollout.env.type", env.type, env.args, ENVIRONMENTS),
    ):
        if name not in registry:
            hint = "" if cfg.plugins else " (a plugin can register more: plugins=[path/to/plugin.py])"
            raise ConfigError(
                f"{key}: unknown {registry.kind} {name!r}; registered: {', '.join(registry.names())}{hint}"
            )
        check_arguments(registry.get(name), args, key.replace(".type", ".args"), with_settings=registry is AGENTS)
    if cfg.rollout.reward_fn:
        from realrl.impl.reward_fn import load_reward_fn

        try:
            load_reward_fn(env.args["fn"])
        except ValueError as e:
            raise ConfigError(f"rollout.reward_fn: {_one_line(e)}") from None
    if cfg.mode == "ray":
        from realrl.launcher.ray import connect

        connect(cfg.ray.address)  # the launcher keeps this connection
    if alloc.gen_backend == "sglang" and cfg.mode == "local":  # on a cluster, its nodes must have it
        from realrl.impl.generation.backends import BackendUnavailableError, get_backend

        try:
            get_backend("sglang").check_available()
        except BackendUnavailableError as e:
            raise ConfigError(f"allocation_mode: {_one_line(e)}") from None

    positions = model_positions(cfg)
    if positions is None:
        return None
    limit = positions
    if alloc.gen_backend == "sglang" and cfg.server.sglang.context_length:
        limit = cfg.server.sglang.context_length
    where = "server.sglang.context_length" if limit != positions else "the model's max_position_embeddings"
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
    return limit


def build_experiment(cfg: AsyncPPOConfig, claim_trial: Callable[[], None] | None = None) -> Experiment:
    """`claim_trial()` runs once the config is checked and before anything is
    built (it raises if another launcher runs the same trial)."""
    alloc = validate(cfg)
    max_positions = check_environment(cfg, alloc)  # before anything (fileroot, kit, etcd, workers) is created
    # Locally the GPUs are placed here (a shortage is a config error); on Ray
    # and Slurm, the launcher places them from each group's gpus_per_worker.
    gen_gpus, train_gpus = place_gpus(cfg, alloc) if cfg.mode == "local" else ([], [])
    if claim_trial is not None:
        claim_trial()
    paths = trial_paths(cfg)
    model_path, train_path, test_path = resolve_model_and_data(cfg, paths.fileroot)
    ppo, rollout = cfg.ppo, cfg.rollout
    rollout = dataclasses.replace(rollout, env=env_config(cfg))
    n_train = alloc.train.dp
    temperature = 0.0 if rollout.gconfig.greedy else rollout.gconfig.temperature

    master = MasterWorkerConfig(
        n_model_workers=n_train,
        total_train_steps=cfg.total_train_steps,
        train_batch_size=ppo.train_batch_size,
        max_head_offpolicyness=rollout.max_head_offpolicyness,
        algorithm=ppo.algorithm,
        use_decoupled_loss=ppo.use_decoupled_loss,
        kl_ctl=ppo.kl_ctl,
        evaluate=bool(test_path),
        eval_every_n_steps=cfg.eval.every_n_steps if test_path else 0,
        # With recovery on, checkpoints are taken by default (a crash then costs at most this much).
        checkpoint_every_n_steps=cfg.saver.checkpoint_every_n_steps or (20 if cfg.recover == "auto" else 0),
        checkpoint_every_minutes=cfg.saver.checkpoint_every_minutes or (10.0 if cfg.recover == "auto" else 0.0),
        n_rollout_workers=rollout.n_workers,
        save_final_model=cfg.saver.save_final_model,
        recover=cfg.recover == "auto",
        checkpoint_dir=paths.checkpoint_dir,
        final_model_dir=paths.final_model_dir,
        wandb=cfg.stats.wandb,
    )
    train_threads = trainer_threads(cfg, alloc)
    model_worker = ModelWorkerConfig(
        model_path=model_path,
        tokenizer_path=model_path,
        dtype=cfg.model.dtype,
        device=cfg.train.device,
        num_threads=train_threads,
        fsdp=cfg.train.fsdp,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        seed=cfg.seed,
        dp_size=n_train,
        ppo=ppo,
        optimizer=cfg.optimizer,
        total_train_steps=cfg.total_train_steps,
        temperature=temperature,
        weights_dir=paths.weights_dir,
        checkpoint_dir=paths.checkpoint_dir,
        eval_dataset_path=test_path,
        eval_max_new_tokens=cfg.eval.max_new_tokens or rollout.gconfig.max_new_tokens,
        eval_batch_size=cfg.eval.batch_size,
        eval_max_prompts=cfg.eval.max_prompts,
        agent=rollout.agent,
        agent_settings=agent_settings(cfg, model_path),
        env=rollout.env,
    )
    gen_server = GenerationServerConfig(
        backend=alloc.gen_backend,
        model_path=model_path,
        seed=cfg.seed,
        tp_size=alloc.gen.tp,
        startup_timeout=cfg.server.startup_timeout,
        torch=cfg.server.torch,
        sglang=cfg.server.sglang,
        weights_dir=paths.weights_dir,
        max_restarts=cfg.server.max_restarts,
        restart_window=cfg.server.restart_window,
    )
    manager = GserverManagerConfig(
        n_servers=alloc.gen.dp,
        train_batch_size=ppo.train_batch_size,
        max_head_offpolicyness=rollout.max_head_offpolicyness,
        max_concurrent_rollouts=rollout.max_concurrent_rollouts,
        weights_dir=paths.weights_dir,
        weight_update_timeout=cfg.server.weight_update_timeout,
        weight_update_retries=cfg.server.weight_update_retries,
        health_check_interval=cfg.server.health_check_interval,
        health_check_timeout=cfg.server.health_check_timeout,
        health_check_failures=cfg.server.health_check_failures,
    )
    per_worker_concurrency = -(-rollout.max_concurrent_rollouts // rollout.n_workers)
    max_prompt_len = cfg.dataset.max_prompt_len
    if max_positions is not None and max_prompt_len + rollout.gconfig.max_new_tokens > max_positions:
        # A longer prompt leaves no room for max_new_tokens (the server would
        # refuse it): skip it with the other over-long prompts instead.
        max_prompt_len = max_positions - rollout.gconfig.max_new_tokens
        logger.info(
            "prompts longer than %d tokens are skipped (%d positions - max_new_tokens %d)",
            max_prompt_len,
            max_positions,
            rollout.gconfig.max_new_tokens,
        )
    rollout_worker = RolloutWorkerConfig(
        dataset_path=train_path,
        tokenizer_path=model_path,
        max_prompt_len=max_prompt_len,
        shuffle=cfg.dataset.shuffle,
        seed=cfg.seed,
        agent=rollout.agent,
        agent_settings=agent_settings(cfg, model_path),
        env=rollout.env,
        max_concurrent_rollouts=per_worker_concurrency,
        new_tokens_per_chunk=rollout.new_tokens_per_chunk,
        n_pullers=n_train,
        request_timeout=rollout.request_timeout,
        request_retries=rollout.request_retries,
    )

    # One CPU thread pool per process: on a small machine, oversubscription
    # (every process using every core) is the main source of slowness.
    def threads(n: int) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), "TOKENIZERS_PARALLELISM": "false"}

    gen_on_gpu = alloc.gen_backend == "sglang" or cfg.server.torch.device == "cuda"
    groups = [
        WorkerGroup("master_worker", 1, master, env=threads(1), cpus_per_worker=0),
        WorkerGroup(
            "model_worker",
            n_train,
            model_worker,
            env=threads(train_threads),
            env_per_index=train_gpus,
            cpus_per_worker=train_threads,
            gpus_per_worker=int(cfg.train.device == "cuda"),
        ),
        WorkerGroup(
            "generation_server",
            alloc.gen.dp,
            gen_server,
            env=threads(cfg.server.torch.num_threads),
            env_per_index=gen_gpus,
            cpus_per_worker=cfg.server.torch.num_threads,
            gpus_per_worker=alloc.gen.tp if gen_on_gpu else 0,
            restarts=cfg.server.max_restarts,
        ),
        WorkerGroup("gserver_manager", 1, manager, env=threads(1), cpus_per_worker=0),
        WorkerGroup("rollout_worker", rollout.n_workers, rollout_worker, env=threads(1), restarts=rollout.max_restarts),
    ]
    return Experiment(groups, paths, model_path, train_path, test_path)


def trainer_threads(cfg: AsyncPPOConfig, alloc: AllocationMode) -> int:
    """torch CPU threads per model worker: `train.num_threads`, or with 0
    (auto) in local mode the cores this process may use that the CPU
    generation servers' threads leave, shared by the trainers (at least 1).
    On a cluster the nodes are not visible from here: auto is 1 there."""
    if cfg.train.num_threads:
        return cfg.train.num_threads
    if cfg.mode != "local":
        return 1
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    gen_on_cpu = alloc.gen_backend != "sglang" and cfg.server.torch.device == "cpu"
    gen_threads = cfg.server.torch.num_threads * alloc.gen.dp if gen_on_cpu else 0
    return max(1, (cores - gen_threads) // alloc.train.dp)


def place_gpus(cfg: AsyncPPOConfig, alloc: AllocationMode) -> tuple[list[dict], list[dict]]:
    """CUDA_VISIBLE_DEVICES of each generation server and of each model worker
    (empty lists when neither side uses a GPU).

    As in AReaL's allocation_mode, generation servers take the first GPUs (tp
    each) and the trainers the next ones, one per data-parallel rank. When the
    machine has fewer GPUs than that, both sides share them round-robin (fine for
    small models; a warning says so). Each worker then sees only its own GPUs."""
    gen_on_gpu = alloc.gen_backend == "sglang" or cfg.server.torch.device == "cuda"
    train_on_gpu = cfg.train.device == "cuda"
    if not gen_on_gpu and not train_on_gpu:
        return [], []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        gpus = [g.strip() for g in visible.split(",") if g.strip()]
    else:
        import torch

        gpus = [str(i) for i in range(torch.cuda.device_count())]
    key = (
        "train.device"
        if train_on_gpu
        else ("server.torch.device" if alloc.gen_backend == "torch" else "allocation_mode")
    )
    if not gpus:
        raise ConfigError(f"{key}: asks for a GPU, but none is visible")
    n_gen = alloc.gen.dp * alloc.gen.tp if gen_on_gpu else 0
    n_train = alloc.train.dp if train_on_gpu else 0
    if alloc.gen.tp > len(gpus) or n_train > len(gpus):
        raise ConfigError(
            f"allocation_mode: tensor parallelism {alloc.gen.tp} and {n_train} trainer ranks "
            f"(one GPU each for NCCL) need that many GPUs; {len(gpus)} visible"
        )
    if n_gen + n_train <= len(gpus):
        first_train = n_gen
    else:
        first_train = 0
        logger.warning(
            "%d GPUs for %d generation GPUs + %d trainer GPUs: servers and trainers share GPUs",
            len(gpus),
            n_gen,
            n_train,
        )

    def env(indices) -> dict[str, str]:
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus[i % len(gpus)] for i in indices)}

    tp = alloc.gen.tp
    gen = [env(range(i * tp, (i + 1) * tp)) for i in range(alloc.gen.dp)] if gen_on_gpu else []
    train = [env([first_train + r]) for r in range(alloc.train.dp)] if train_on_gpu else []
    return gen, train


def run_experiment(cfg: AsyncPPOConfig, timeout: float | None = None) -> tuple[int, str]:
    """Runs the trial; returns (exit code, summary path). With recover=auto, a
    trial that fails (a worker died, the name service was lost) is restarted
    from its newest checkpoint, up to `recover_retries` times, each restart
    said on the console and recorded in summary.json under "restarts"."""
    restarts: list[dict] = []
    while True:
        started = time.time()
        code, summary_path, launcher = _run_trial_once(cfg, timeout)
        if code != 1 or cfg.recover != "auto" or len(restarts) >= cfg.recover_retries or launcher is None:
            break
        why = f"worker {launcher.failed_worker} failed" if launcher and launcher.failed_worker else "the trial failed"
        restarts.append({"after_s": round(time.time() - started, 1), "why": why})
        print(
            f"\nrealrl: {why}; restarting the trial from its newest checkpoint "
            f"(restart {len(restarts)} of at most {cfg.recover_retries})",
            file=sys.stderr,
            flush=True,
        )
    if restarts and summary_path and os.path.exists(summary_path):
        with open(summary_path) as f:
            summary = json.load(f)
        summary["restarts"] = restarts
        tmp = summary_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(summary, f, indent=1)
        os.replace(tmp, summary_path)
    return code, summary_path


def _run_trial_once(cfg: AsyncPPOConfig, timeout: float | None = None) -> tuple[int, str, LocalLauncher | None]:
    """One launch of the trial: (exit code, summary path, its launcher). With mode=slurm,
    outside the trial's own batch job: checks the config, submits the job and
    follows it (summary path "" when nothing ran: slurm.dry_run, slurm.follow=false)."""
    launcher: LocalLauncher | None = None
    if cfg.mode == "slurm":
        from realrl.launcher import slurm

        if not slurm.inside_job():
            check_environment(cfg, validate(cfg))  # before anything is written or submitted
            paths = trial_paths(cfg)
            run_dir = os.path.join(paths.fileroot, "run", cfg.experiment_name, cfg.trial_name)
            repo_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
            # (recover=auto restarts happen inside the job, where its launcher runs)
            return (*slurm.submit_trial(cfg, paths.log_dir, paths.summary, run_dir, repo_root), None)

    def claim_trial() -> None:  # once the config is known to be good (the launcher needs valid names)
        nonlocal launcher
        args = (cfg.experiment_name, cfg.trial_name, trial_paths(cfg).fileroot, cfg.name_resolve)
        kwargs = dict(
            heartbeat_ttl=cfg.heartbeat_ttl,
            plugins=[os.path.abspath(p) if p.endswith(".py") else p for p in cfg.plugins],
            echo_worker="master_worker",
            console_every_n_steps=cfg.console.every_n_steps,
            watchdog_timeout=cfg.watchdog.timeout,
            watchdog_action=cfg.watchdog.action,
        )
        if cfg.mode == "ray":
            from realrl.launcher.ray import RayLauncher

            launcher = RayLauncher(*args, ray_address=cfg.ray.address, bind_address=cfg.bind_address, **kwargs)
        elif cfg.mode == "slurm":
            from realrl.launcher.slurm import SlurmLauncher

            launcher = SlurmLauncher(
                *args,
                bind_address=cfg.bind_address,
                gpus_per_node=cfg.slurm.gpus_per_node,
                srun_args=cfg.slurm.srun_args,
                **kwargs,
            )
        else:
            launcher = LocalLauncher(*args, **kwargs)
        launcher.acquire_trial()

    try:
        experiment = build_experiment(cfg, claim_trial)
    except BaseException:
        if launcher is not None:
            launcher.release_trial()
        raise
    assert launcher is not None
    if cfg.recover != "auto" and os.path.exists(experiment.paths.summary):
        os.unlink(experiment.paths.summary)
    code = launcher.run(experiment.groups, timeout=timeout)
    if code == 0 and not os.path.exists(experiment.paths.summary):
        print("realrl: the trial ended without writing a summary", file=sys.stderr)
        code = 1
    return code, experiment.paths.summary, launcher
