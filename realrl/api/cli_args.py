"""User-facing configuration (Hydra structured configs, docs/design.md §10).

`realrl/configs/async-ppo.yaml` holds the defaults; every field can be
overridden on the command line, e.g.

    realrl train ppo.train_batch_size=32 rollout.max_head_offpolicyness=2

`validate(config)` checks every value on its own and raises `ConfigError`
with a one-line message naming the key; `realrl.experiment.checks.check_environment`
then checks what needs the machine (fileroot writable, plugins importable,
agent/env types registered, generation lengths within the model's positions),
still before anything is created or started.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from realrl.api.generation_api import GenerationHyperparameters
from realrl.base.name_resolve import NameResolveConfig


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


@dataclasses.dataclass
class ModelConfig:
    path: str = ""  # an HF model directory; "" = the tiny model kit, built locally
    dtype: str = "float32"  # float32 | bfloat16 | float16
    gradient_checkpointing: bool = False


@dataclasses.dataclass
class TinyKitConfig:
    """Used when model.path is empty: a tiny Llama + char tokenizer + synthetic
    arithmetic, warm-started so RL has a reward signal (cached under fileroot)."""

    seed: int = 1
    cache_dir: str = ""  # "" = <fileroot>/cache; built once per recipe, then reused
    # Supervised steps before RL (0 = the recipe's default, 1000). With your own
    # dataset.train_path, choose them so the policy solves part of the task.
    warm_start_steps: int = 0


@dataclasses.dataclass
class DatasetConfig:
    train_path: str = ""  # math JSONL: {query_id, prompt, answer|solutions, task}; "" = the tiny kit's
    test_path: str = ""
    max_prompt_len: int = 256  # longer prompts are skipped (and counted)
    shuffle: bool = True


@dataclasses.dataclass
class OptimizerConfig:
    lr: float = 1e-5
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    gradient_clipping: float = 1.0
    warmup_steps: int = 0
    lr_scheduler: str = "constant"  # constant | linear | cosine


@dataclasses.dataclass
class PPOConfig:
    algorithm: str = "grpo"  # grpo (group-normalised advantages) | ppo (critic + GAE)
    group_size: int = 8  # answers sampled per prompt
    train_batch_size: int = 16  # trajectories (prompts) per train step
    ppo_n_minibatches: int = 1  # optimizer steps per train step
    eps_clip: float = 0.2
    c_clip: float | None = None  # dual clip for negative advantages
    value_eps_clip: float = 0.2
    use_decoupled_loss: bool = True  # recompute proximal logprobs; docs/design.md §9
    behav_imp_weight_cap: float | None = 5.0
    kl_ctl: float = 0.0  # > 0 loads a frozen reference model
    kl_estimator: str = "k1"  # k1 | k2 | k3 | abs
    discount: float = 1.0
    gae_lambda: float = 1.0
    reward_scaling: float = 1.0
    reward_bias: float = 0.0
    adv_norm: bool = True  # PPO: whiten advantages over the batch
    group_std_norm: bool = True  # GRPO: divide by the group's std
    loss_aggregation: str = "token"  # token | seq
    max_tokens_per_mb: int = 8192  # micro-batch token budget (FFD packing)
    # Train a prompt's answers in rows that hold the prompt once (where a FLOP estimate says it pays).
    share_prompts: bool = True


@dataclasses.dataclass
class AgentConfig:
    type: str = "single-step"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class EnvConfig:
    type: str = "math"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class RolloutConfig:
    n_workers: int = 1  # rollout worker processes (any number: a step takes its batch from all trainers together)
    max_head_offpolicyness: int = 4  # η; 0 = synchronous PPO
    max_concurrent_rollouts: int = 64  # prompts in flight across all rollout workers
    new_tokens_per_chunk: int = 1 << 30  # chunked generation (partial rollouts)
    success_rate_lb: float = 0.0  # drop groups whose accuracy is below ...
    success_rate_ub: float = 1.0  # ... or above this (e.g. 0.99 drops all-correct groups)
    gconfig: GenerationHyperparameters = dataclasses.field(default_factory=GenerationHyperparameters)
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    # A reward function instead of an environment: "path/to/task.py:reward",
    # "module:function" or a registered name (sets env to "reward-fn").
    reward_fn: str = ""
    reward_fn_timeout: float = 10.0  # seconds per call; a call cut off scores 0
    # A rollout worker that dies is started again (it takes over its data shard;
    # its running rollouts go back to admission and are generated again), this often.
    max_restarts: int = 3
    request_timeout: float = 600.0
    request_retries: int = 3


@dataclasses.dataclass
class TorchServerConfig:
    device: str = "cpu"
    dtype: str = "float32"
    max_running_requests: int = 256
    num_threads: int = 1  # torch CPU threads of the server process
    # Check the length limit before EOS / stop tokens, as SGLang does (a request
    # whose last allowed token is EOS reports `length`): tests the runtime against it.
    length_before_eos: bool = False


@dataclasses.dataclass
class SGLangConfig:
    dtype: str = "bfloat16"
    mem_fraction_static: float = 0.8
    context_length: int | None = None
    max_running_requests: int | None = None
    disable_radix_cache: bool = False
    log_level: str = "warning"
    extra_args: list[str] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ServerConfig:
    torch: TorchServerConfig = dataclasses.field(default_factory=TorchServerConfig)
    sglang: SGLangConfig = dataclasses.field(default_factory=SGLangConfig)
    startup_timeout: float = 300.0
    weight_update_timeout: float = 120.0
    weight_update_retries: int = 3
    # Servers that come and go (docs/architecture.md): the manager checks every
    # server's /health each health_check_interval s (health_check_timeout each);
    # health_check_failures in a row or a refused connection take it out of routing.
    health_check_interval: float = 2.0
    health_check_timeout: float = 5.0
    health_check_failures: int = 3
    # A server process that dies is restarted (current weights, then it rejoins),
    # at most max_restarts times within restart_window s; then the trial fails.
    max_restarts: int = 3
    restart_window: float = 600.0


@dataclasses.dataclass
class TrainConfig:
    device: str = "cpu"  # cpu | cuda
    # torch CPU threads per model worker; 0 = auto: in local mode the cores the
    # CPU generation servers' threads leave, shared by the trainers (>= 1)
    num_threads: int = 0
    fsdp: bool = False  # shard params/grads/optimizer across data-parallel ranks (CUDA)


@dataclasses.dataclass
class EvalConfig:
    every_n_steps: int = 10  # 0 = only before and after training
    max_new_tokens: int = 0  # 0 = rollout.gconfig.max_new_tokens
    batch_size: int = 256
    max_prompts: int = 0  # 0 = the whole test split


@dataclasses.dataclass
class SaverConfig:
    # Recovery checkpoints every N steps and/or every M minutes (0 = never; with
    # recover=auto, 0 means the defaults: every 20 steps and every 10 minutes).
    checkpoint_every_n_steps: int = 0
    checkpoint_every_minutes: float = 0.0
    save_final_model: bool = True


@dataclasses.dataclass
class RayConfig:
    address: str = ""  # the cluster to join; "" = RAY_ADDRESS, else the cluster this node is part of ("auto")


@dataclasses.dataclass
class SlurmConfig:
    """mode=slurm: the trial as one batch job (docs/slurm.md maps each key to its sbatch option)."""

    partition: str = ""  # --partition; "" = the cluster's default
    nodes: int = 1  # --nodes
    gpus_per_node: int = 0  # --gpus-per-node; 0 = none
    cpus_per_node: int = 0  # --cpus-per-task (one task per node); 0 = whole nodes (--exclusive)
    mem: str = ""  # --mem per node, e.g. 64G; "" = the partition's default
    time: str = ""  # --time, e.g. 12:00:00 or 2-00:00:00; "" = the partition's default
    account: str = ""  # --account
    qos: str = ""  # --qos
    constraint: str = ""  # --constraint
    job_name: str = ""  # --job-name; "" = realrl-<experiment_name>-<trial_name>
    sbatch_args: list[str] = dataclasses.field(default_factory=list)  # more #SBATCH options, e.g. [--exclude=n7]
    srun_args: list[str] = dataclasses.field(default_factory=list)  # more options of every worker's srun step
    setup: list[str] = dataclasses.field(default_factory=list)  # shell lines before the launcher (module load ...)
    dry_run: bool = False  # print the batch script (and write it under the log directory), submit nothing
    follow: bool = True  # wait for the job, stream its progress, return its exit code; false = print the job id


@dataclasses.dataclass
class ConsoleConfig:
    """What the launcher's console shows (docs/observability.md): on a terminal one progress bar;
    redirected (not a TTY), a plain line for the first step, every N-th and the last."""

    every_n_steps: int = 10


@dataclasses.dataclass
class StatsConfig:
    """Where per-step stats go besides stats.jsonl and TensorBoard (docs/observability.md)."""

    wandb: bool = False  # Weights & Biases in offline mode (<log_dir>/wandb/), if wandb is installed


@dataclasses.dataclass
class WatchdogConfig:
    """The hang watchdog (docs/observability.md): once every worker runs, no new
    training step or stage for `timeout` seconds writes a hang report (every
    worker's stacks and progress) to the log directory and stops the trial."""

    timeout: float = 300.0  # seconds without training progress; 0 = off. Above your longest step/evaluation
    action: str = "stop"  # stop (exit code 1, like a failed worker) | report (write the report, keep running)


@dataclasses.dataclass
class AsyncPPOConfig:
    experiment_name: str = "async-ppo"
    trial_name: str = "run0"
    mode: str = "local"  # local | ray | slurm
    seed: int = 1
    fileroot: str = "runs"  # logs, weights, checkpoints, caches live under here
    # "<gen backend>.d<dp>p<pp>m<tp>+d<dp>p<pp>m<tp>": generation servers + trainers
    allocation_mode: str = "torch.d1p1m1+d1p1m1"
    total_train_steps: int = 40
    heartbeat_ttl: float = 5.0
    # multi-node modes: the address every worker binds ("" = its node's address from Ray or Slurm);
    # local mode binds 127.0.0.1
    bind_address: str = ""
    recover: str = "disabled"  # disabled | auto (resume from the newest checkpoint, and restart after a failure)
    recover_retries: int = 3  # recover=auto: restarts after failures before giving up
    plugins: list[str] = dataclasses.field(default_factory=list)
    name_resolve: NameResolveConfig = dataclasses.field(default_factory=lambda: NameResolveConfig(type="etcd3"))
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    tiny_kit: TinyKitConfig = dataclasses.field(default_factory=TinyKitConfig)
    dataset: DatasetConfig = dataclasses.field(default_factory=DatasetConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    saver: SaverConfig = dataclasses.field(default_factory=SaverConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    console: ConsoleConfig = dataclasses.field(default_factory=ConsoleConfig)
    stats: StatsConfig = dataclasses.field(default_factory=StatsConfig)
    watchdog: WatchdogConfig = dataclasses.field(default_factory=WatchdogConfig)


# ---- allocation_mode --------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParallelShape:
    dp: int
    pp: int
    tp: int

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.tp


@dataclasses.dataclass(frozen=True)
class AllocationMode:
    gen_backend: str  # torch | sglang
    gen: ParallelShape  # dp = number of generation servers, tp = tensor parallel per server
    train: ParallelShape  # dp = number of model workers


GEN_BACKENDS = ("torch", "sglang")
_SHAPE = r"d(\d+)p(\d+)m(\d+)"
_ALLOC = re.compile(rf"^(?P<backend>[a-z]+)\.{_SHAPE}\+{_SHAPE}$")


def parse_allocation_mode(mode: str) -> AllocationMode:
    """Parses the legacy syntax, e.g. `sglang.d4p1m1+d2p1m1`, and rejects the
    shapes realrl does not run, saying what is supported."""
    m = _ALLOC.match(mode.strip())
    if m is None:
        raise ConfigError(
            f"allocation_mode: {mode!r} is not '<backend>.d<dp>p<pp>m<tp>+d<dp>p<pp>m<tp>' "
            "(e.g. torch.d1p1m1+d1p1m1 or sglang.d4p1m1+d2p1m1)"
        )
    backend = m.group("backend")
    g = ParallelShape(*(int(x) for x in m.groups()[1:4]))
    t = ParallelShape(*(int(x) for x in m.groups()[4:7]))
    if backend not in GEN_BACKENDS:
        raise ConfigError(
            f"allocation_mode: unknown generation backend {backend!r}; supported: {', '.join(GEN_BACKENDS)}"
        )
    if min(g.dp, g.pp, g.tp, t.dp, t.pp, t.tp) < 1:
        raise ConfigError(f"allocation_mode: in {mode!r}, every degree must be >= 1")
    if g.pp != 1:
        raise ConfigError(
            f"allocation_mode: in {mode!r}, generation pipeline parallelism (p{g.pp}) is not supported; use p1"
        )
    if backend == "torch" and g.tp != 1:
        raise ConfigError(
            f"allocation_mode: in {mode!r}, the torch backend runs one device per server (m1); "
            "use more servers (d) or the sglang backend for tensor parallelism"
        )
    if t.pp != 1 or t.tp != 1:
        raise ConfigError(
            f"allocation_mode: in {mode!r}, training supports data parallelism only (d<N>p1m1; "
            "set train.fsdp=true to shard parameters across the data-parallel ranks)"
        )
    return AllocationMode(backend, g, t)


# ---- validation -------------------------------------------------------------


TORCH_DTYPES = ("float32", "bfloat16", "float16")
SGLANG_DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")
SGLANG_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _check(cond: bool, key: str, message: str) -> None:
    if not cond:
        raise ConfigError(f"{key}: {message}")


def _key_first(message: str) -> str:
    """`rollout.gconfig.top_p must be ...` -> `rollout.gconfig.top_p: must be ...`."""
    key, sep, rest = message.partition(" ")
    return f"{key}: {rest}" if sep and "." in key and not key.endswith(":") else message


def validate(cfg: AsyncPPOConfig) -> AllocationMode:
    """Checks `cfg` before any process starts; returns the parsed allocation."""
    _check(cfg.mode in ("local", "ray", "slurm"), "mode", f"must be local|ray|slurm, got {cfg.mode!r}")
    for key in ("experiment_name", "trial_name"):
        value = getattr(cfg, key)
        _check(
            bool(re.fullmatch(r"[A-Za-z0-9_.\-]+", value or "")),
            key,
            f"must be non-empty letters, digits, '_', '-', '.', got {value!r}",
        )
    try:
        alloc = parse_allocation_mode(cfg.allocation_mode)
    except ConfigError as e:
        raise ConfigError(str(e)) from None
    _check(cfg.recover in ("disabled", "auto"), "recover", f"must be disabled|auto, got {cfg.recover!r}")
    _check(
        cfg.recover_retries >= 0,
        "recover_retries",
        f"must be >= 0 (0 = resume by hand only), got {cfg.recover_retries}",
    )
    _check(cfg.saver.checkpoint_every_minutes >= 0, "saver.checkpoint_every_minutes", "must be >= 0 (0 = never)")
    _check(cfg.total_train_steps >= 1, "total_train_steps", "must be >= 1")
    _check(cfg.heartbeat_ttl >= 1, "heartbeat_ttl", "must be >= 1 second")
    try:
        cfg.name_resolve.validate()
    except ValueError as e:
        raise ConfigError(_key_first(str(e))) from None

    _check(cfg.model.dtype in TORCH_DTYPES, "model.dtype", f"must be {'|'.join(TORCH_DTYPES)}, got {cfg.model.dtype!r}")
    _check(
        bool(cfg.dataset.train_path) or not cfg.dataset.test_path,
        "dataset.test_path",
        "set dataset.train_path too (or neither, for the synthetic arithmetic task)",
    )
    _check(cfg.dataset.max_prompt_len >= 1, "dataset.max_prompt_len", "must be >= 1")
    _check(cfg.tiny_kit.warm_start_steps >= 0, "tiny_kit.warm_start_steps", "must be >= 0 (0 = default)")

    p = cfg.ppo
    _check(p.algorithm in ("grpo", "ppo"), "ppo.algorithm", f"must be grpo|ppo, got {p.algorithm!r}")
    _check(p.group_size >= 1, "ppo.group_size", "must be >= 1")
    _check(p.algorithm != "grpo" or p.group_size >= 2, "ppo.group_size", "GRPO needs >= 2 answers per prompt")
    _check(
        p.train_batch_size >= alloc.train.dp,
        "ppo.train_batch_size",
        f"must be >= the number of trainers ({alloc.train.dp})",
    )
    _check(p.ppo_n_minibatches >= 1, "ppo.ppo_n_minibatches", "must be >= 1")
    _check(
        p.train_batch_size // alloc.train.dp >= p.ppo_n_minibatches,
        "ppo.ppo_n_minibatches",
        "must not exceed the trajectories per trainer per step",
    )
    _check(0 < p.eps_clip < 1, "ppo.eps_clip", "must be in (0, 1)")
    _check(p.value_eps_clip > 0, "ppo.value_eps_clip", f"must be > 0, got {p.value_eps_clip}")
    _check(p.c_clip is None or p.c_clip > 1, "ppo.c_clip", "must be > 1 (or null)")
    _check(
        p.behav_imp_weight_cap is None or p.behav_imp_weight_cap > 1,
        "ppo.behav_imp_weight_cap",
        "must be > 1 (or null)",
    )
    _check(p.kl_ctl >= 0, "ppo.kl_ctl", "must be >= 0")
    _check(
        p.kl_estimator in ("k1", "k2", "k3", "abs"), "ppo.kl_estimator", f"must be k1|k2|k3|abs, got {p.kl_estimator!r}"
    )
    _check(0 <= p.discount <= 1, "ppo.discount", "must be in [0, 1]")
    _check(0 <= p.gae_lambda <= 1, "ppo.gae_lambda", "must be in [0, 1]")
    _check(p.loss_aggregation in ("token", "seq"), "ppo.loss_aggregation", "must be token|seq")
    _check(p.max_tokens_per_mb >= 16, "ppo.max_tokens_per_mb", "must be >= 16")

    o = cfg.optimizer
    _check(o.lr > 0, "optimizer.lr", "must be > 0")
    _check(
        o.lr_scheduler in ("constant", "linear", "cosine"),
        "optimizer.lr_scheduler",
        f"must be constant|linear|cosine, got {o.lr_scheduler!r}",
    )
    _check(o.gradient_clipping >= 0, "optimizer.gradient_clipping", "must be >= 0 (0 = off)")
    _check(o.weight_decay >= 0, "optimizer.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _check(0 <= o.beta1 < 1, "optimizer.beta1", f"must be in [0, 1), got {o.beta1}")
    _check(0 <= o.beta2 < 1, "optimizer.beta2", f"must be in [0, 1), got {o.beta2}")
    _check(o.eps > 0, "optimizer.eps", f"must be > 0, got {o.eps}")
    _check(o.warmup_steps >= 0, "optimizer.warmup_steps", f"must be >= 0 (0 = no warmup), got {o.warmup_steps}")

    r = cfg.rollout
    _check(r.n_workers >= 1, "rollout.n_workers", "must be >= 1")
    _check(r.max_head_offpolicyness >= 0, "rollout.max_head_offpolicyness", "must be >= 0")
    _check(r.max_concurrent_rollouts >= 1, "rollout.max_concurrent_rollouts", "must be >= 1")
    _check(r.new_tokens_per_chunk >= 1, "rollout.new_tokens_per_chunk", "must be >= 1")
    _check(
        0 <= r.success_rate_lb <= r.success_rate_ub <= 1,
        "rollout.success_rate_lb",
        "need 0 <= success_rate_lb <= success_rate_ub <= 1",
    )
    try:
        r.gconfig.validate("rollout.gconfig")
    except ValueError as e:
        raise ConfigError(_key_first(str(e))) from None
    _check(
        r.max_restarts >= 0,
        "rollout.max_restarts",
        f"must be >= 0 (0 = a dead rollout worker stops the trial), got {r.max_restarts}",
    )
    _check(r.reward_fn_timeout > 0, "rollout.reward_fn_timeout", f"must be > 0 seconds, got {r.reward_fn_timeout}")
    _check(
        not r.reward_fn or r.env.type in ("math", "reward-fn"),
        "rollout.reward_fn",
        f"replaces the environment; it cannot be combined with rollout.env.type={r.env.type}",
    )
    _check(r.request_timeout > 0, "rollout.request_timeout", f"must be > 0 seconds, got {r.request_timeout}")
    _check(r.request_retries >= 0, "rollout.request_retries", f"must be >= 0 (0 = no retry), got {r.request_retries}")

    _check(cfg.train.device in ("cpu", "cuda"), "train.device", f"must be cpu|cuda, got {cfg.train.device!r}")
    _check(not cfg.train.fsdp or cfg.train.device == "cuda", "train.fsdp", "needs train.device=cuda")
    _check(cfg.train.num_threads >= 0, "train.num_threads", "must be >= 0 (0 = auto)")
    s, ts, sg = cfg.server, cfg.server.torch, cfg.server.sglang
    _check(ts.device in ("cpu", "cuda"), "server.torch.device", f"must be cpu|cuda, got {ts.device!r}")
    _check(ts.dtype in TORCH_DTYPES, "server.torch.dtype", f"must be {'|'.join(TORCH_DTYPES)}, got {ts.dtype!r}")
    _check(
        ts.max_running_requests >= 1,
        "server.torch.max_running_requests",
        f"must be >= 1, got {ts.max_running_requests}",
    )
    _check(ts.num_threads >= 1, "server.torch.num_threads", "must be >= 1")
    _check(sg.dtype in SGLANG_DTYPES, "server.sglang.dtype", f"must be {'|'.join(SGLANG_DTYPES)}, got {sg.dtype!r}")
    _check(
        0 < sg.mem_fraction_static <= 1,
        "server.sglang.mem_fraction_static",
        f"must be in (0, 1], got {sg.mem_fraction_static}",
    )
    _check(
        sg.context_length is None or sg.context_length >= 1,
        "server.sglang.context_length",
        f"must be >= 1 (or null = the model's), got {sg.context_length}",
    )
    _check(
        sg.max_running_requests is None or sg.max_running_requests >= 1,
        "server.sglang.max_running_requests",
        f"must be >= 1 (or null = SGLang's default), got {sg.max_running_requests}",
    )
    _check(
        sg.log_level in SGLANG_LOG_LEVELS,
        "server.sglang.log_level",
        f"must be {'|'.join(SGLANG_LOG_LEVELS)}, got {sg.log_level!r}",
    )
    _check(s.startup_timeout > 0, "server.startup_timeout", f"must be > 0 seconds, got {s.startup_timeout}")
    _check(
        s.weight_update_timeout > 0,
        "server.weight_update_timeout",
        f"must be > 0 seconds, got {s.weight_update_timeout}",
    )
    _check(
        s.weight_update_retries >= 0,
        "server.weight_update_retries",
        f"must be >= 0 (0 = no retry), got {s.weight_update_retries}",
    )
    _check(
        s.health_check_interval > 0,
        "server.health_check_interval",
        f"must be > 0 seconds, got {s.health_check_interval}",
    )
    _check(
        s.health_check_timeout > 0, "server.health_check_timeout", f"must be > 0 seconds, got {s.health_check_timeout}"
    )
    _check(s.health_check_failures >= 1, "server.health_check_failures", f"must be >= 1, got {s.health_check_failures}")
    _check(
        s.max_restarts >= 0,
        "server.max_restarts",
        f"must be >= 0 (0 = a dead server fails the trial), got {s.max_restarts}",
    )
    _check(s.restart_window > 0, "server.restart_window", f"must be > 0 seconds, got {s.restart_window}")
    ev = cfg.eval
    _check(ev.every_n_steps >= 0, "eval.every_n_steps", "must be >= 0")
    _check(ev.batch_size >= 1, "eval.batch_size", f"must be >= 1, got {ev.batch_size}")
    _check(
        ev.max_new_tokens >= 0,
        "eval.max_new_tokens",
        f"must be >= 0 (0 = rollout.gconfig.max_new_tokens), got {ev.max_new_tokens}",
    )
    _check(ev.max_prompts >= 0, "eval.max_prompts", f"must be >= 0 (0 = the whole test split), got {ev.max_prompts}")
    _check(cfg.saver.checkpoint_every_n_steps >= 0, "saver.checkpoint_every_n_steps", "must be >= 0")
    validate_slurm(cfg.slurm)
    validate_watchdog(cfg.watchdog)
    _check(
        cfg.console.every_n_steps >= 1,
        "console.every_n_steps",
        f"must be >= 1 (a plain line every N steps when the output is not a terminal), got {cfg.console.every_n_steps}",
    )
    return alloc


def validate_watchdog(w: WatchdogConfig) -> None:
    _check(w.timeout == 0 or w.timeout >= 5, "watchdog.timeout", f"must be 0 (off) or >= 5 seconds, got {w.timeout}")
    _check(w.action in ("stop", "report"), "watchdog.action", f"must be stop|report, got {w.action!r}")


_SLURM_NAME = re.compile(r"[A-Za-z0-9_.,:+=@%\-]+")  # what a value on an #SBATCH line may hold
_SLURM_TIME = re.compile(r"(\d+-)?\d+(:\d+){0,2}|UNLIMITED|INFINITE", re.IGNORECASE)
_SLURM_MEM = re.compile(r"\d+[KMGT]?", re.IGNORECASE)


def validate_slurm(s: SlurmConfig) -> None:
    """The slurm.* keys (they are written into a batch script: no newline, no stray shell)."""
    _check(s.nodes >= 1, "slurm.nodes", f"must be >= 1, got {s.nodes}")
    _check(s.gpus_per_node >= 0, "slurm.gpus_per_node", f"must be >= 0 (0 = none), got {s.gpus_per_node}")
    _check(s.cpus_per_node >= 0, "slurm.cpus_per_node", f"must be >= 0 (0 = whole nodes), got {s.cpus_per_node}")
    _check(
        not s.mem or bool(_SLURM_MEM.fullmatch(s.mem)), "slurm.mem", f"must be a size like 64G or 500M, got {s.mem!r}"
    )
    _check(
        not s.time or bool(_SLURM_TIME.fullmatch(s.time)),
        "slurm.time",
        f"must be minutes, [D-]HH:MM:SS, D-HH or UNLIMITED, got {s.time!r}",
    )
    for key in ("partition", "account", "qos", "job_name"):
        value = getattr(s, key)
        _check(
            not value or bool(_SLURM_NAME.fullmatch(value)),
            f"slurm.{key}",
            f"must be letters, digits and _.,:+=@%-, got {value!r}",
        )
    _check(
        not s.constraint or bool(re.fullmatch(r"[A-Za-z0-9_.,:+=@%&|*!()\[\]\-]+", s.constraint)),
        "slurm.constraint",
        f"must be a Slurm feature expression (e.g. a100&ib), got {s.constraint!r}",
    )
    for key in ("sbatch_args", "srun_args"):
        for arg in getattr(s, key):
            _check(
                isinstance(arg, str) and arg.startswith("-") and "\n" not in arg and "\r" not in arg,
                f"slurm.{key}",
                f"entries must be options starting with '-' on one line, got {arg!r}",
            )
    for line in s.setup:
        _check(
            isinstance(line, str) and "\n" not in line and "\r" not in line,
            "slurm.setup",
            f"entries must be single shell lines, got {line!r}",
        )
