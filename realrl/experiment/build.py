"""From the user's AsyncPPOConfig to one `WorkerGroup` per worker kind.

`build_experiment(cfg)` validates the config (`validate`, then
`check_environment`; both before anything is created), places the GPUs
(local mode), resolves the model and data (building the tiny-model kit when
no model is given), lays out the trial's directories and derives every
worker's config. `realrl/experiment/run.py` launches the groups.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
from collections.abc import Callable

from realrl.api.cli_args import AllocationMode, AsyncPPOConfig, ConfigError, broadcast_refusal, validate
from realrl.api.system_api import (
    GenerationServerConfig,
    GserverManagerConfig,
    MasterWorkerConfig,
    ModelWorkerConfig,
    RolloutWorkerConfig,
    WeightTransportConfig,
    server_api,
)
from realrl.base.logging import getLogger
from realrl.experiment.checks import check_environment
from realrl.experiment.config import (
    TrialPaths,
    agent_config,
    agent_settings,
    env_config,
    evaluation_fields,
    trial_paths,
)
from realrl.launcher.local import WorkerGroup

logger = getLogger("experiment")


@dataclasses.dataclass
class Experiment:
    groups: list[WorkerGroup]
    paths: TrialPaths
    model_path: str
    train_path: str
    test_path: str


def resolve_model_and_data(cfg: AsyncPPOConfig, fileroot: str) -> tuple[str, str, str]:
    """(model_path, train_path, test_path); builds the tiny kit when needed."""
    model_path, train_path, test_path = cfg.model.path, cfg.dataset.train_path, cfg.dataset.test_path
    if model_path and not os.path.isfile(os.path.join(model_path, "config.json")):
        raise ConfigError(f"model.path: {model_path!r} is not a Hugging Face model directory (no config.json)")
    for key, path in (("dataset.train_path", train_path), ("dataset.test_path", test_path)):
        if path and not os.path.exists(path):
            raise ConfigError(f"{key}: no such file or directory {path!r}")
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


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def version_weight_bytes(model_path: str, dtype: str) -> int:
    """What each published version moves: the model's parameters (counted
    from its safetensors headers; no tensor is read) in `dtype`; a model
    without safetensors, its weight files' size; 0 when it has none."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        return sum(os.path.getsize(f) for f in glob.glob(os.path.join(model_path, "*.bin")))
    count = 0
    for path in files:
        with safe_open(path, "pt") as f:
            count += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return count * _DTYPE_BYTES.get(dtype, 4)


def weights_backend(cfg: AsyncPPOConfig, alloc: AllocationMode) -> str:
    """`weights.backend`, with auto decided (docs/design.md §8): nccl when the
    trainer and the servers are all on CUDA, else gloo."""
    w = cfg.weights
    servers_on_cuda = alloc.gen_backend == "sglang" or cfg.server.torch.device == "cuda"
    on_cuda = cfg.train.device == "cuda" and servers_on_cuda
    return w.backend if w.backend != "auto" else ("nccl" if on_cuda else "gloo")


def weights_transport(cfg: AsyncPPOConfig, alloc: AllocationMode, model_path: str, backend: str) -> str:
    """`weights.transport`, with auto decided (docs/design.md §8): broadcast
    where the trial can take it, over gloo (the backend it was measured
    on), and a version is at least `weights.auto_broadcast_mb`, else disk."""
    w = cfg.weights
    if w.transport != "auto":
        return w.transport
    refusal = broadcast_refusal(cfg, alloc)
    if refusal is not None:
        transport, why = "disk", f"no broadcast here: {refusal[0]}: {refusal[1]}"
    elif backend != "gloo":
        transport, why = "disk", f"broadcast over {backend} is not measured yet; weights.transport=broadcast uses it"
    else:
        mib = version_weight_bytes(model_path, cfg.model.dtype) / (1 << 20)
        transport = "broadcast" if mib >= w.auto_broadcast_mb else "disk"
        why = f"{mib:.1f} MiB of weights per version, weights.auto_broadcast_mb {w.auto_broadcast_mb}"
    logger.info("weights.transport auto: %s (%s)", transport, why)
    return transport


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
        adv_estimator=ppo.adv_estimator,
        max_rejected_groups=rollout.max_rejected_batches * ppo.train_batch_size,
        use_kl_loss=ppo.use_kl_loss,
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
    w = cfg.weights
    sglang_servers = alloc.gen_backend == "sglang" or (alloc.gen_backend == "torch" and cfg.server.torch.emulate_sglang)
    backend = weights_backend(cfg, alloc)
    weights = WeightTransportConfig(
        transport=weights_transport(cfg, alloc, model_path, backend),
        backend=backend,
        bucket_bytes=w.bucket_mb << 20,
        timeout_s=cfg.server.weight_update_timeout,
        protocol="sglang" if sglang_servers else "realrl",
    )
    model_worker = ModelWorkerConfig(
        model_path=model_path,
        tokenizer_path=model_path,
        dtype=cfg.model.dtype,
        fp32_master=cfg.model.fp32_master,
        device=cfg.train.device,
        num_threads=train_threads,
        max_threads=trainer_max_threads(cfg, alloc),
        fsdp=cfg.train.fsdp,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        lora=cfg.model.lora,
        seed=cfg.seed,
        dp_size=n_train,
        ppo=ppo,
        optimizer=cfg.optimizer,
        total_train_steps=cfg.total_train_steps,
        temperature=temperature,
        max_new_tokens=rollout.gconfig.max_new_tokens,
        weights_dir=paths.weights_dir,
        weights=weights,
        checkpoint_dir=paths.checkpoint_dir,
        **evaluation_fields(cfg, model_path, test_path),
    )
    gen_server = GenerationServerConfig(
        backend=alloc.gen_backend,
        model_path=model_path,
        seed=cfg.seed,
        tp_size=alloc.gen.tp,
        startup_timeout=cfg.server.startup_timeout,
        torch=dataclasses.replace(cfg.server.torch, max_threads=server_max_threads(cfg, alloc)),
        sglang=cfg.server.sglang,
        vllm=cfg.server.vllm,
        weights_dir=paths.weights_dir,
        max_restarts=cfg.server.max_restarts,
        restart_window=cfg.server.restart_window,
        lora=cfg.model.lora,
    )
    manager = GserverManagerConfig(
        n_servers=alloc.gen.dp,
        train_batch_size=ppo.train_batch_size,
        max_head_offpolicyness=rollout.max_head_offpolicyness,
        max_concurrent_rollouts=rollout.max_concurrent_rollouts,
        total_train_steps=cfg.total_train_steps,
        weights_dir=paths.weights_dir,
        weight_update_timeout=cfg.server.weight_update_timeout,
        weight_update_retries=cfg.server.weight_update_retries,
        health_check_interval=cfg.server.health_check_interval,
        health_check_timeout=cfg.server.health_check_timeout,
        health_check_failures=cfg.server.health_check_failures,
        lora=cfg.model.lora.rank > 0,
        server_api=server_api(alloc.gen_backend, cfg.server.torch.emulate_vllm),
        n_rollout_workers=rollout.n_workers,
        weights=weights,
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
        dataset=cfg.dataset,
        tokenizer_path=model_path,
        max_prompt_len=max_prompt_len,
        shuffle=cfg.dataset.shuffle,
        seed=cfg.seed,
        agent=agent_config(cfg),
        agent_settings=agent_settings(cfg, model_path),
        env=rollout.env,
        max_concurrent_rollouts=per_worker_concurrency,
        episodes_per_priority=-(-cfg.ppo.train_batch_size // rollout.n_workers),
        new_tokens_per_chunk=rollout.new_tokens_per_chunk,
        n_pullers=n_train,
        request_timeout=rollout.request_timeout,
        request_retries=rollout.request_retries,
        no_server_timeout=rollout.no_server_timeout,
        routing=rollout.routing,
        lora=cfg.model.lora.rank > 0,
        server_api=server_api(alloc.gen_backend, cfg.server.torch.emulate_vllm),
    )

    # One CPU thread pool per process: on a small machine, oversubscription
    # (every process using every core) is the main source of slowness.
    def threads(n: int) -> dict[str, str]:
        return {"OMP_NUM_THREADS": str(n), "MKL_NUM_THREADS": str(n), "TOKENIZERS_PARALLELISM": "false"}

    gen_on_gpu = alloc.gen_backend in ("sglang", "vllm") or cfg.server.torch.device == "cuda"
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
        *judge_groups(cfg, gen_server, threads(cfg.server.torch.num_threads)),
        WorkerGroup("rollout_worker", rollout.n_workers, rollout_worker, env=threads(1), restarts=rollout.max_restarts),
    ]
    return Experiment(groups, paths, model_path, train_path, test_path)


def judge_groups(cfg: AsyncPPOConfig, gen_server: GenerationServerConfig, env: dict) -> list[WorkerGroup]:
    """The judge's servers (docs/design.md §11): the run's backend on the judge's
    model, frozen, registered where the manager never looks; CPU only for now."""
    if not cfg.judge.model.path:
        return []
    judge = dataclasses.replace(
        gen_server,
        model_path=os.path.abspath(cfg.judge.model.path),
        judge=True,
        weights_dir="",
        # (SGLang's API whatever the policy's servers emulate: realrl.impl.judge's client speaks it)
        torch=dataclasses.replace(cfg.server.torch, device="cpu", emulate_vllm=""),
        lora=dataclasses.replace(cfg.model.lora, rank=0),
    )
    return [
        WorkerGroup(
            "judge_server",
            cfg.judge.n_servers,
            judge,
            env=env,
            cpus_per_worker=cfg.server.torch.num_threads,
            restarts=cfg.server.max_restarts,
        )
    ]


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
    gen_on_cpu = alloc.gen_backend == "torch" and cfg.server.torch.device == "cpu"
    gen_threads = cfg.server.torch.num_threads * alloc.gen.dp if gen_on_cpu else 0
    return max(1, (cores - gen_threads) // alloc.train.dp)


def trainer_max_threads(cfg: AsyncPPOConfig, alloc: AllocationMode) -> int:
    """With `train.num_threads` auto, in local mode on CPU, a trainer takes
    more threads than `trainer_threads` while the rest of the machine leaves
    cores idle (the generation servers wait for a version part of each step),
    up to an even share of this process's cores: realrl/base/cpu_threads.py."""
    floor = trainer_threads(cfg, alloc)
    if cfg.train.num_threads or cfg.mode != "local" or cfg.train.device != "cpu":
        return floor
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(floor, cores // alloc.train.dp)


def server_max_threads(cfg: AsyncPPOConfig, alloc: AllocationMode) -> int:
    """The most torch threads a CPU generation server runs while the rest of the
    machine leaves cores idle (`server.torch.max_threads`; 0 = auto: in local mode
    an even share of this process's cores among the servers, elsewhere the fixed
    `server.torch.num_threads`)."""
    ts = cfg.server.torch
    if ts.max_threads:
        return max(ts.max_threads, ts.num_threads)
    if cfg.mode != "local" or alloc.gen_backend != "torch" or ts.device != "cpu":
        return ts.num_threads
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(ts.num_threads, cores // alloc.gen.dp)


def place_gpus(cfg: AsyncPPOConfig, alloc: AllocationMode) -> tuple[list[dict], list[dict]]:
    """CUDA_VISIBLE_DEVICES of each generation server and of each model worker
    (empty lists when neither side uses a GPU).

    As in AReaL's allocation_mode, generation servers take the first GPUs (tp
    each) and the trainers the next ones, one per data-parallel rank. When the
    machine has fewer GPUs than that, both sides share them round-robin (fine for
    small models; a warning says so). Each worker then sees only its own GPUs."""
    gen_on_gpu = alloc.gen_backend in ("sglang", "vllm") or cfg.server.torch.device == "cuda"
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
