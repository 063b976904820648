"""What every worker process is told about itself (the launcher writes it).

A worker process is started as `python -m realrl.system.worker_base --spec F`,
where F is a JSON `WorkerSpec`: which class to run, its `WorkerInfo`, and its
own config (a dataclass of the worker's `config_cls`, as plain JSON). No
pickle: a spec file is data, never code.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from realrl.base.name_resolve import NameResolveConfig


@dataclasses.dataclass
class WorkerInfo:
    experiment_name: str
    trial_name: str
    worker_type: str
    worker_index: int = 0
    worker_count: int = 1
    name_resolve: NameResolveConfig = dataclasses.field(default_factory=NameResolveConfig)
    log_dir: str = ""
    # The status key's TTL; a SIGKILLed worker's status vanishes within it.
    heartbeat_ttl: float = 5.0
    mode: str = "local"  # local | ray | slurm
    bind_address: str = ""  # multi-node only; local mode always binds 127.0.0.1
    plugins: list[str] = dataclasses.field(default_factory=list)
    # Exit when the launcher's keep-alive key disappears (the launcher died).
    watch_launcher: bool = True
    # The trial secret's file (docs/design.md §14); "" = security off (security.enabled=false).
    secret_path: str = ""

    @property
    def tag(self) -> str:
        return f"{self.worker_type}/{self.worker_index}"


@dataclasses.dataclass
class WorkerSpec:
    worker_class: str  # "module.path:ClassName"
    info: WorkerInfo
    config: Any = None  # JSON-able: the worker's config dataclass as a dict

    def to_json(self) -> str:
        config = self.config
        if dataclasses.is_dataclass(config):
            config = to_plain(config)
        return json.dumps(
            {"worker_class": self.worker_class, "info": dataclasses.asdict(self.info), "config": config}, indent=1
        )

    @staticmethod
    def from_json(text: str) -> WorkerSpec:
        raw = json.loads(text)
        info_raw = raw["info"]
        info_raw["name_resolve"] = NameResolveConfig(**info_raw["name_resolve"])
        return WorkerSpec(worker_class=raw["worker_class"], info=WorkerInfo(**info_raw), config=raw["config"])


def to_plain(config: Any) -> Any:
    """A config dataclass (possibly nested) as JSON-able containers."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def from_plain(config_cls: type, raw: Any) -> Any:
    """The inverse of `to_plain`, with type checking by OmegaConf: a wrong key
    or type raises an error naming the key."""
    from omegaconf import OmegaConf

    if raw is None:
        return config_cls()
    merged = OmegaConf.merge(OmegaConf.structured(config_cls), raw)
    return OmegaConf.to_object(merged)


# ---- per-worker configs -------------------------------------------------------
# realrl/experiment/build.py derives these from the user's AsyncPPOConfig; each worker
# gets only what it needs, so a worker can also be started on its own (tests).

from realrl.api.agent_api import AgentSettings  # noqa: E402
from realrl.api.cli_args import (  # noqa: E402
    AgentConfig,
    DatasetConfig,
    EnvConfig,
    LoraConfig,
    OptimizerConfig,
    PPOConfig,
    SGLangConfig,
    TorchServerConfig,
    VLLMConfig,
)


@dataclasses.dataclass
class WeightTransportConfig:
    """How versions move (docs/design.md §8), as the launcher resolved `weights.*`."""

    transport: str = "disk"  # disk | broadcast
    backend: str = "gloo"  # broadcast: gloo | nccl (auto resolved)
    bucket_bytes: int = 64 << 20
    timeout_s: float = 120.0  # one collective; a peer slower than this fails the group
    # realrl: torch servers' group routes (/join_weights_group); sglang: SGLang's own
    # (/init_weights_update_group, ...), for SGLang servers and the torch server emulating one.
    protocol: str = "realrl"


@dataclasses.dataclass
class GenerationServerConfig:
    backend: str = "torch"  # torch | sglang | vllm
    model_path: str = ""  # initial weights (version `weight_version`)
    weight_version: int = 0
    seed: int = 1
    tp_size: int = 1  # sglang tensor parallelism
    startup_timeout: float = 300.0
    torch: TorchServerConfig = dataclasses.field(default_factory=TorchServerConfig)
    sglang: SGLangConfig = dataclasses.field(default_factory=SGLangConfig)
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)
    # A (re)started server loads the trainer's current version from <weights_dir>/<v>/ before it registers.
    weights_dir: str = ""
    # A server process that dies is restarted, at most max_restarts times within
    # restart_window seconds; one more death fails the worker (and the trial).
    max_restarts: int = 3
    restart_window: float = 600.0
    # rank > 0: versions after 0 are LoRA adapters (SGLang starts with its LoRA flags).
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)
    # A judge model's server: started frozen (weight changes refused), registered
    # under names.judge_server, never given the trainer's weights.
    judge: bool = False

    @property
    def server_api(self) -> str:
        """The HTTP API the server speaks: "vllm" (vLLM, or the torch server
        emulating it) or "sglang" (SGLang, the torch server)."""
        return server_api(self.backend, self.torch.emulate_vllm)


def server_api(backend: str, emulate_vllm: str = "") -> str:
    """The HTTP API of a run's generation servers (`realrl.impl.generation.make_client`)."""
    return "vllm" if backend == "vllm" or (backend == "torch" and emulate_vllm) else "sglang"


@dataclasses.dataclass
class GserverManagerConfig:
    n_servers: int = 1
    train_batch_size: int = 16  # trajectories per train step (the staleness unit)
    max_head_offpolicyness: int = 4
    max_concurrent_rollouts: int = 64
    total_train_steps: int = 0  # the trial's steps: no rollout past their batches is admitted (0: no end)
    # Weight version v of the actor lives in <weights_dir>/<v>/ (docs/design.md §8).
    weights_dir: str = ""
    weight_update_timeout: float = 120.0
    weight_update_retries: int = 3
    poll_interval: float = 0.1  # seconds between reads of model_version
    # Health checks: every server's /health every health_check_interval seconds;
    # health_check_failures failures in a row (or a refused connection) take it
    # out of routing until it answers again and holds the current weights.
    health_check_interval: float = 2.0
    health_check_timeout: float = 5.0
    health_check_failures: int = 3
    lora: bool = False  # versions after 0 are LoRA adapters (loaded with /load_lora_adapter)
    server_api: str = "sglang"  # sglang | vllm: the servers' HTTP API (`server_api`)
    n_rollout_workers: int = 1  # /reset_rollout_worker refuses any other index
    weights: WeightTransportConfig = dataclasses.field(default_factory=WeightTransportConfig)


@dataclasses.dataclass
class RolloutWorkerConfig:
    dataset_path: str = ""
    dataset: DatasetConfig = dataclasses.field(default_factory=DatasetConfig)  # keys and rendering (§13)
    tokenizer_path: str = ""
    max_prompt_len: int = 256
    shuffle: bool = True
    seed: int = 1
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    agent_settings: AgentSettings = dataclasses.field(
        default_factory=AgentSettings
    )  # experiment/config.py: agent_settings
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    max_concurrent_rollouts: int = 64  # episodes in flight in this worker
    # Episodes per admission priority, in start order (one trainer batch's share; rollout_worker.py)
    episodes_per_priority: int = 1
    new_tokens_per_chunk: int = 1 << 30
    n_pullers: int = 1  # trainer data-parallel size (pushers are grouped onto pullers)
    request_timeout: float = 600.0
    request_retries: int = 3
    no_server_timeout: float = 300.0  # seconds an answer waits while no generation server is up
    routing: str = "client"  # client | manager (realrl/system/client_routing.py)
    sample_log_every: int = 20  # write every N-th finished trajectory's text to the log dir
    lora: bool = False  # each request names the LoRA adapter of the version it is scheduled on
    server_api: str = "sglang"  # sglang | vllm: the servers' HTTP API (`server_api`)


@dataclasses.dataclass
class ModelWorkerConfig:
    model_path: str = ""
    tokenizer_path: str = ""
    dtype: str = "float32"
    fp32_master: bool = True  # a 16-bit dtype: float32 weights and optimizer, compute in dtype (autocast)
    device: str = "cpu"
    num_threads: int = 1
    # > num_threads: up to this many while cores are idle (realrl/base/cpu_threads.py)
    max_threads: int = 0
    fsdp: bool = False
    gradient_checkpointing: bool = False
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)  # rank > 0: train adapters only
    seed: int = 1
    dp_size: int = 1
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    total_train_steps: int = 1  # for lr schedules
    temperature: float = 1.0  # sampling temperature: training logprobs use the same scaling
    max_new_tokens: int = 16  # the generation budget (Dr. GRPO's constant length, DAPO's overlong buffer)
    ref_model_path: str = ""  # a frozen reference policy when ppo.kl_ctl > 0
    weights_dir: str = ""  # publish version v of the actor to <weights_dir>/<v>/
    weights: WeightTransportConfig = dataclasses.field(default_factory=WeightTransportConfig)
    checkpoint_dir: str = ""  # recovery checkpoints
    max_buffered_trajectories: int = 100000
    # evaluation: the rollout's agent and environment on the test split, greedy,
    # on this trainer's weights (each data-parallel rank scores its share)
    eval_dataset_path: str = ""
    dataset: DatasetConfig = dataclasses.field(default_factory=DatasetConfig)  # keys and rendering (§13)
    eval_max_new_tokens: int = 16
    eval_batch_size: int = 256
    eval_max_prompts: int = 0
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    agent_settings: AgentSettings = dataclasses.field(default_factory=AgentSettings)
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)


@dataclasses.dataclass
class MasterWorkerConfig:
    n_model_workers: int = 1
    total_train_steps: int = 1
    train_batch_size: int = 16
    max_head_offpolicyness: int = 4
    adv_estimator: str = "grpo"  # gae: a critic, whose values need the inference pass
    # Stop the trial when the agent rejects this many groups while one step waits (0: never).
    max_rejected_groups: int = 0
    use_kl_loss: bool = False
    use_decoupled_loss: bool = True
    kl_ctl: float = 0.0
    evaluate: bool = True  # greedy evaluation before/after training (needs a test split)
    eval_every_n_steps: int = 0
    checkpoint_every_n_steps: int = 0
    checkpoint_every_minutes: float = 0.0
    n_rollout_workers: int = 1  # whose data cursors go into checkpoints
    save_final_model: bool = True
    recover: bool = False
    checkpoint_dir: str = ""  # the model workers' checkpoints (step<N>/ subdirectories)
    final_model_dir: str = ""  # the trained model is saved here at the end
    rpc_timeout: float = 3600.0  # a confirmed request (e.g. a train step) may run this long
    rpc_warn_after: float = 10.0  # warn about a request no model worker has confirmed after this long ...
    rpc_receipt_timeout: float = 60.0  # ... and fail the trial after this long
    fetch_poll_interval: float = 0.05
    wandb: bool = False  # also log the stats to Weights & Biases, offline (stats.wandb)

    @property
    def needs_inference(self) -> bool:
        """Whether a step runs `inference`: proximal logprobs, reference logprobs or values."""
        return self.use_decoupled_loss or self.kl_ctl > 0 or self.use_kl_loss or self.adv_estimator == "gae"
