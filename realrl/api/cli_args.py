"""User-facing configuration (Hydra structured configs, docs/design.md §10).

`realrl/configs/async-ppo.yaml` holds the defaults; every field can be
overridden on the command line, e.g.

    realrl train ppo.train_batch_size=32 rollout.max_head_offpolicyness=2

Each field's help is the docstring under it; `realrl config` prints them all
and docs/config.md is generated from them (`python -m realrl config
--markdown > docs/config.md`).

`validate(config)` checks every value on its own and raises `ConfigError`
with a one-line message naming the key; `realrl.experiment.checks.check_environment`
then checks what needs the machine (fileroot writable, plugins importable,
agent/env types registered, generation lengths within the model's positions),
still before anything is created or started.

(Over 700 lines on purpose: the schema with one help docstring per key and
`validate`, which checks those same keys; a new key, its help and its check
are one edit in one file.)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from realrl.api.generation_api import GenerationHyperparameters
from realrl.api.served_sampling import served_sampling
from realrl.api.sglang_api import emulated_release
from realrl.api.vllm_api import VLLM_MAX_LORA_RANK, vllm_release
from realrl.base.name_resolve import NameResolveConfig


class ConfigError(ValueError):
    """A bad configuration value; the message names the key."""


@dataclasses.dataclass
class LoraConfig:
    """LoRA (peft): train low-rank adapters on the frozen policy; a published
    version is the adapter with the tokenizer files, not a full model
    (docs/design.md §8)."""

    rank: int = 0
    """Adapter rank r; 0 = off (full fine-tuning)."""
    alpha: float = 16.0
    """The adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training; > 0 makes the train
    forward random, so the proximal logprobs take a pass of their own."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: ["all-linear"])
    """Linear layers that get an adapter: module names (e.g. [q_proj,v_proj]),
    or [all-linear]: every linear layer but the output head (the attention and
    MLP projections)."""


@dataclasses.dataclass
class ModelConfig:
    """The policy model (and the critic and reference models derived from it)."""

    path: str = ""
    """A Hugging Face model directory; "" = the tiny model kit, built locally."""
    dtype: str = "float32"
    """Training dtype: float32 | bfloat16 | float16 (forward and backward, published versions, final model)."""
    fp32_master: bool = True
    """With a 16-bit dtype, keep the trained weights and the optimizer state in float32 and run forward
    and backward in dtype (torch.autocast): mixed precision, as GPU trainers do. false: the weights
    themselves are 16-bit (half the memory; an update below their precision is lost, e.g. lr 1e-6
    on a weight of 0.02 in bf16). LoRA adapters are float32 either way (the base stays in dtype)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, more compute."""
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)


@dataclasses.dataclass
class TinyKitConfig:
    """Used when model.path is empty: a tiny Llama + char tokenizer + synthetic
    arithmetic, warm-started so RL has a reward signal (cached under fileroot)."""

    seed: int = 1
    """Seed of the kit's model weights, tokenizer data and warm start."""
    cache_dir: str = ""
    """Where the kit is built, once per recipe, then reused; "" = <fileroot>/cache."""
    warm_start_steps: int = 0
    """Supervised steps before RL (0 = the recipe's default, 1000). With your own
    dataset.train_path, choose them so the policy solves part of the task."""


@dataclasses.dataclass
class DatasetConfig:
    """The prompts: rows of a JSONL or Parquet file or a `datasets.save_to_disk`
    directory (docs/models_and_data.md, docs/design.md §13)."""

    train_path: str = ""
    """Training prompts (.jsonl, .parquet or a save_to_disk directory); "" = the tiny kit's synthetic arithmetic."""
    test_path: str = ""
    """Held-out prompts for greedy evaluation; "" = no evaluation (with train_path set)."""
    prompt_key: str = "prompt"
    """The row field holding the prompt text (dotted = nested); a row may carry `messages` instead."""
    answer_key: str = "answer"
    """The row field holding the answer, or a list of accepted answers (`... #### 42` and `\\boxed{}` verify)."""
    id_key: str = "query_id"
    """The row field holding its id; ids are generated when absent."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template, when it has one (false = raw text)."""
    system_prompt: str = ""
    """A system message before each plain prompt rendered with the chat template ("" = none)."""
    max_prompt_len: int = 256
    """Prompts longer than this many tokens are skipped (and counted)."""
    shuffle: bool = True
    """Shuffle the training prompts (with `seed`)."""


@dataclasses.dataclass
class OptimizerConfig:
    """AdamW for the actor (and critic)."""

    lr: float = 1e-5
    """Learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    beta1: float = 0.9
    """AdamW beta1."""
    beta2: float = 0.999
    """AdamW beta2."""
    eps: float = 1e-8
    """AdamW epsilon."""
    gradient_clipping: float = 1.0
    """Clip the global gradient norm to this (0 = off)."""
    warmup_steps: int = 0
    """Linear learning-rate warmup over this many train steps (0 = none); the schedule advances once per train
    step, however many minibatches the step runs."""
    lr_scheduler: str = "constant"
    """The learning rate after warmup: constant | linear | cosine (decay to `min_lr_ratio` x lr at the last
    train step)."""
    min_lr_ratio: float = 0.0
    """Where linear and cosine decay end, as a fraction of `lr` (0 = decay to 0)."""


@dataclasses.dataclass
class PPOConfig:
    """The RL algorithm (docs/design.md §9, docs/algorithms.md). A preset sets
    several of these at once: `algorithm=<name>` (realrl/configs/algorithm/)."""

    adv_estimator: str = "grpo"
    """Advantage estimator: grpo (group mean/std) | dr_grpo (group mean, no std) | rloo (leave-one-out
    baseline) | reinforce_plus_plus (batch-whitened returns) | gae (PPO with a critic)."""
    policy_loss: str = "ppo"
    """Policy loss: ppo (token ratio, clipped) | gspo (sequence-level, length-normalised ratio) | cispo
    (clipped, stop-gradient importance weight on the logprob)."""
    group_size: int = 8
    """Answers sampled per prompt."""
    train_batch_size: int = 16
    """Trajectories (prompts, each with its group_size answers) per train step."""
    ppo_n_minibatches: int = 1
    """Optimizer steps per train step."""
    eps_clip: float = 0.2
    """PPO ratio clip ε (the lower bound): the ratio is clipped to [1 - ε, 1 + eps_clip_high]."""
    eps_clip_high: float | None = None
    """The upper clip bound ε_high (DAPO's clip-higher); null = eps_clip."""
    c_clip: float | None = None
    """Dual clip for negative advantages (> 1); null = off."""
    value_eps_clip: float = 0.2
    """gae: clip of the value loss."""
    use_decoupled_loss: bool = True
    """Recompute the proximal policy's logprobs and weight each token by π_prox/π_behav (docs/design.md §9);
    false = standard PPO against the behaviour policy."""
    behav_imp_weight_cap: float | None = 5.0
    """Rollout correction: the cap (> 1) on the behaviour importance weight π_prox/π_behav; null = no cap."""
    behav_imp_weight_mode: str = "mask"
    """What the cap does: mask (MIS: a token or sequence above it gets no loss) | truncate (TIS: its
    weight becomes the cap)."""
    behav_imp_weight_level: str = "token"
    """token (a weight per token) | sequence (one weight per sequence: the product over its tokens) |
    geometric (one per sequence: the geometric mean of its tokens' weights, GSPO's)."""
    kl_ctl: float = 0.0
    """KL in the reward: coefficient of a per-token penalty against a frozen reference model; > 0
    loads that model."""
    kl_estimator: str = "k1"
    """KL-in-reward estimator: k1 | k2 | k3 | low-var | abs."""
    use_kl_loss: bool = False
    """KL as a loss term against a frozen reference model (loaded), weighted by kl_loss_coef."""
    kl_loss_coef: float = 0.001
    """With use_kl_loss: the KL term's coefficient."""
    kl_loss_estimator: str = "low-var"
    """With use_kl_loss: k1 | k2 | k3 | low-var | abs (gradient through the policy's logprobs)."""
    entropy_coef: float = 0.0
    """Entropy bonus: loss -= entropy_coef · (aggregated entropy of the policy); 0 = off."""
    discount: float = 1.0
    """gae and reinforce_plus_plus: discount γ."""
    gae_lambda: float = 1.0
    """gae: λ."""
    reward_scaling: float = 1.0
    """reward = ((score - 0.5) * 2 - reward_bias) * reward_scaling."""
    reward_bias: float = 0.0
    """See reward_scaling."""
    adv_norm: bool = True
    """gae: whiten advantages over the batch (across ranks); reinforce_plus_plus always does."""
    loss_agg_mode: str = "token-mean"
    """How per-token losses become one: token-mean | seq-mean-token-mean | seq-mean-token-sum |
    seq-mean-token-sum-norm (÷ max_new_tokens), exact over micro-batches and ranks."""
    overlong_buffer_len: int = 0
    """DAPO's soft overlong punishment: answers within this many tokens of max_new_tokens lose up to
    overlong_penalty_factor, linearly; 0 = overlong_buffer_frac of max_new_tokens."""
    overlong_buffer_frac: float = 0.0
    """The overlong buffer as a fraction of rollout.gconfig.max_new_tokens (when overlong_buffer_len is 0)."""
    overlong_penalty_factor: float = 0.0
    """The overlong punishment's largest penalty (added to the reward); 0 = off."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: answers cut by the length budget train no token (their rewards still
    count in their group's baseline)."""
    max_tokens_per_mb: int = 8192
    """Micro-batch token budget (first-fit-decreasing packing)."""
    share_prompts: bool = True
    """Train a prompt's answers in rows that hold the prompt once, and rows of uneven widths side by side in
    one (each where a FLOP estimate says it pays)."""


ADV_ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae")
POLICY_LOSSES = ("ppo", "gspo", "cispo")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3", "low-var", "abs")
# Keys that were replaced: using one is an error that names what to use instead.
REPLACED_KEYS = {
    "ppo.algorithm": "ppo.adv_estimator (grpo | dr_grpo | rloo | reinforce_plus_plus | gae; "
    "ppo.algorithm=ppo is ppo.adv_estimator=gae) or a preset, algorithm=<name>",
    "ppo.loss_aggregation": "ppo.loss_agg_mode (token -> token-mean, seq -> seq-mean-token-mean)",
    "ppo.group_std_norm": "ppo.adv_estimator (group_std_norm=false is ppo.adv_estimator=dr_grpo)",
}


@dataclasses.dataclass
class AgentConfig:
    """The agent that turns a prompt into trajectories (docs/custom_tasks.md)."""

    type: str = "single-step"
    """A registered agent: single-step | math-multi-turn | function | external | one a plugin
    registers; or a class of your own, "path/to/file.py:Class" or "pkg.module:Class"."""
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the agent (checked against its signature; new keys need no `+`)."""


@dataclasses.dataclass
class EnvConfig:
    """The environment that scores an agent's answers (docs/custom_tasks.md)."""

    type: str = "math"
    """A registered environment: math | reward-fn | one a plugin registers."""
    args: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Keyword arguments of the environment (checked against its signature; new keys need no `+`)."""


@dataclasses.dataclass
class RolloutConfig:
    """Rollout workers: admission, agents and environments, generation requests."""

    n_workers: int = 1
    """Rollout worker processes (any number: a step takes its batch from all trainers together)."""
    max_head_offpolicyness: int = 4
    """η: how many versions a trajectory's weights may lag the trainer's; 0 = synchronous PPO."""
    max_concurrent_rollouts: int = 64
    """Prompts in flight across all rollout workers."""
    new_tokens_per_chunk: int = 1 << 30
    """Chunked generation (partial rollouts): new tokens per request, then the answer is resubmitted."""
    success_rate_lb: float = 0.0
    """Drop groups whose accuracy is below this ..."""
    success_rate_ub: float = 1.0
    """... or above this (e.g. 0.99 drops all-correct groups)."""
    gconfig: GenerationHyperparameters = dataclasses.field(default_factory=GenerationHyperparameters)
    """Sampling parameters of the rollouts."""
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)
    agent_fn: str = ""
    """An agent as one async function over an OpenAI client: "path/to/agent.py:run" or
    "module:run", `async def run(client, row) -> float | dict` (sets agent.type to "function")."""
    env: EnvConfig = dataclasses.field(default_factory=EnvConfig)
    reward_fn: str = ""
    """A reward function instead of an environment: "path/to/task.py:reward",
    "module:function" or a registered name (sets env to "reward-fn")."""
    reward_fn_timeout: float = 10.0
    """Seconds per reward function call; a call cut off scores 0."""
    episode_timeout: float = 3600.0
    """Seconds one episode of a function or external agent may take; one still running then is dropped
    (counted `episode_timeouts`), its calls cancelled, and its group goes on without it."""
    dynamic_sampling: bool = False
    """DAPO's dynamic sampling: a group whose answers all score the same (no signal for a group
    baseline) is rejected; it costs no staleness budget and the step waits for informative groups."""
    max_rejected_batches: int = 20
    """Stop the trial, saying why, when the agent rejects this many train batches' worth of groups
    while one step waits (the task is too easy or too hard for the filter); 0 = never."""
    max_restarts: int = 3
    """A rollout worker that dies is started again (it takes over its data shard;
    its running rollouts go back to admission and are generated again), this often."""
    request_timeout: float = 600.0
    """Seconds a generation request may take before it is retried."""
    request_retries: int = 3
    """Failures in a row before an answer's generation fails (backoff 0.5, 1, 2, ... s)."""
    no_server_timeout: float = 300.0
    """Seconds an answer waits while no generation server is up (e.g. the only one is being restarted) before
    its generation fails; such waiting does not count against request_retries."""
    routing: str = "client"
    """client: each rollout worker routes its generation requests itself, from the routing table the
    manager publishes (no manager call per request); manager: it asks the manager per request
    (two HTTP calls per generation call; the baseline of benchmarks/control_plane.py)."""


@dataclasses.dataclass
class TorchServerConfig:
    """The built-in torch generation server (allocation_mode torch.*)."""

    device: str = "cpu"
    """cpu | cuda."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16. auto: bfloat16 on cuda (as SGLang and vLLM
    serve), float32 on cpu; the trainer's own logprobs correct for the difference
    (behaviour importance weights, docs/algorithms.md)."""
    max_running_requests: int = 256
    """Requests decoded together; more wait in the server's queue."""
    num_threads: int = 1
    """torch CPU threads of the server process."""
    max_threads: int = 0
    """Up to this many torch threads while the rest of the machine leaves cores
    idle (the trainer waits for rollouts part of each step; at the first step, for
    the whole first batch), never fewer than num_threads: the count is checked
    before each forward that follows one of 0.1 s or more of thread time (a small
    model's decode steps never are; realrl/base/cpu_threads.py). 0 = auto: in local mode on
    CPU an even share of the cores among the servers, elsewhere num_threads (fixed).
    Two servers whose counts differ at a moment may differ in a logprob's last bits."""
    length_before_eos: bool = False
    """Check the length limit before EOS / stop tokens, as SGLang does (a request
    whose last allowed token is EOS reports `length`): tests the runtime against it."""
    emulate_sglang: str = ""
    """For tests: an SGLang release (e.g. 0.5.16) whose behaviours the server copies
    where they differ (health that waits behind weight loads, response shapes,
    aborts by rid prefix, pauses that end waiting requests, length before EOS);
    empty = off. The server also reads SGLANG_HEALTH_CHECK_TIMEOUT as SGLang does."""
    emulate_sglang_dp: int = 1
    """With emulate_sglang: the data-parallel ranks SGLang would report (per-rank lists
    in its answers when > 1)."""
    emulate_vllm: str = ""
    """For tests: a vLLM release (e.g. 0.33) whose routes, bodies and refusals the
    server answers instead of SGLang's; the runtime then drives it as it drives vLLM.
    Empty = off."""
    engine: str = "auto"
    """KV cache layout: paged (a block pool, a group's answers sharing their prompt's
    blocks, CUDA graphs on GPU) | dense (left-padded buffers) | auto: paged on cuda,
    dense on cpu and for sliding-window / hybrid models (docs/design.md §6)."""
    kv_cache_tokens: int | None = None
    """Paged engine: tokens the KV pool holds; null = max_running_requests x 2048
    (model positions permitting), on cuda at most half the free GPU memory. Lower it
    when a trainer shares the GPU."""


@dataclasses.dataclass
class SGLangConfig:
    """SGLang generation servers (allocation_mode sglang.*; needs CUDA and the sglang extra)."""

    dtype: str = "bfloat16"
    """SGLang's --dtype: auto | half | float16 | bfloat16 | float | float32."""
    mem_fraction_static: float = 0.8
    """SGLang's --mem-fraction-static: the GPU memory share for weights and KV cache."""
    context_length: int | None = None
    """SGLang's --context-length; null = the model's."""
    max_running_requests: int | None = None
    """SGLang's --max-running-requests; null = SGLang's default."""
    disable_radix_cache: bool = False
    """SGLang's --disable-radix-cache."""
    log_level: str = "warning"
    """SGLang's --log-level: debug | info | warning | error | critical."""
    extra_args: list[str] = dataclasses.field(default_factory=list)
    """More SGLang command-line arguments, appended verbatim."""


@dataclasses.dataclass
class VLLMConfig:
    """vLLM generation servers (allocation_mode vllm.*; needs CUDA and vLLM >= 0.32)."""

    dtype: str = "bfloat16"
    """vLLM's --dtype: auto | half | float16 | bfloat16 | float | float32."""
    gpu_memory_utilization: float = 0.8
    """vLLM's --gpu-memory-utilization: the GPU memory share for weights and KV cache."""
    max_model_len: int | None = None
    """vLLM's --max-model-len; null = the model's."""
    max_num_seqs: int | None = None
    """vLLM's --max-num-seqs; null = vLLM's default."""
    extra_args: list[str] = dataclasses.field(default_factory=list)
    """More vLLM command-line arguments, appended verbatim."""


@dataclasses.dataclass
class ServerConfig:
    """Generation servers and their manager (docs/architecture.md, "Generation servers that come and go")."""

    torch: TorchServerConfig = dataclasses.field(default_factory=TorchServerConfig)
    sglang: SGLangConfig = dataclasses.field(default_factory=SGLangConfig)
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)
    startup_timeout: float = 300.0
    """Seconds a server may take to answer /health after it starts."""
    weight_update_timeout: float = 120.0
    """Seconds one server may take to load a new weight version; one that takes longer leaves routing
    (as a dead one) and rejoins once healthy, loading the current version first."""
    weight_update_retries: int = 3
    """Retries of a weight update a server refused; still refused, the trial stops naming the server."""
    health_check_interval: float = 2.0
    """The manager checks every server's /health this often (seconds)."""
    health_check_timeout: float = 5.0
    """Seconds one /health check may take. Under weights.transport=broadcast with SGLang servers, also how
    long a member may still be taking a version every other member holds, while a newer one waits, before
    it leaves routing and the weight group (docs/design.md §8)."""
    health_check_failures: int = 3
    """Failed checks in a row (or one refused connection) that take a server out of routing."""
    max_restarts: int = 3
    """A server process that dies is restarted (current weights, then it rejoins),
    at most max_restarts times within restart_window s; then the trial fails."""
    restart_window: float = 600.0
    """Seconds over which max_restarts counts."""


@dataclasses.dataclass
class WeightsConfig:
    """How each new weight version reaches the generation servers (docs/design.md §8)."""

    transport: str = "auto"
    """auto | disk (an HF directory each server loads) | broadcast (buckets over a process group of the trainer and the
    servers; a version is written to disk only when a server needs it from there: one that joins, restarts or falls
    out of the group, which the manager asks the trainer for). broadcast needs torch or SGLang servers (not vLLM
    yet) and a full model (no LoRA). auto: broadcast where the trial can take it, over gloo (CPU; NCCL is not
    measured yet), and a version's weights (the model's parameters in model.dtype) are at least
    weights.auto_broadcast_mb, else disk (what measures faster on each side of that size: docs/benchmarks.md)."""
    auto_broadcast_mb: int = 256
    """auto: broadcast from this many MiB of weights per version (on a 2-core CPU machine whole runs tie from
    23 to 283 MiB, disk is faster at 3 MiB and broadcast at 407 MiB; a version alone reaches 1-2 servers
    faster by broadcast at every size measured; docs/benchmarks.md). On another machine measure it:
    benchmarks/weight_publish.py --transport disk,broadcast --servers 1,2,4 --models <N>mib, and
    benchmarks/vs_inprocess.py --transport disk,broadcast."""
    backend: str = "auto"
    """broadcast: auto (nccl when trainer and servers run on cuda, else gloo) | gloo | nccl."""
    bucket_mb: int = 64
    """broadcast: MiB per broadcast bucket."""


@dataclasses.dataclass
class JudgeModelConfig:
    """The judge's model."""

    path: str = ""
    """A HF model directory (with a chat template) served frozen as the judge; "" = no judge."""


@dataclasses.dataclass
class JudgeConfig:
    """A judge model for rewards (docs/custom_tasks.md, "Rewards from a judge model"):
    a reward function `async def reward(prompt, completion, answer, judge)` gets an
    `openai.AsyncOpenAI` for it, as does an agent function `run(client, row, judge)`; an
    environment class that takes `judge` gets a factory of one (`await judge()`). Its servers
    use the run's backend (torch only for now),
    never receive the trainer's weights and never serve rollouts."""

    model: JudgeModelConfig = dataclasses.field(default_factory=JudgeModelConfig)
    n_servers: int = 1
    """Judge servers (each a process of the run's backend, with server.torch's settings)."""
    request_timeout: float = 8.0
    """Seconds one judge call may take; a call that takes longer fails: the answer scores 0 and is counted.
    With a reward function, below rollout.reward_fn_timeout (the whole reward call's limit)."""
    max_new_tokens: int = 256
    """The most tokens one judge answer may have (a call's max_tokens is capped to it)."""


@dataclasses.dataclass
class TrainConfig:
    """The trainers (model workers)."""

    device: str = "cpu"
    """cpu | cuda."""
    num_threads: int = 0
    """torch CPU threads per model worker; 0 = auto: in local mode the cores the
    CPU generation servers' threads leave, shared by the trainers (>= 1), and on
    CPU up to an even share of all cores while the rest of the machine leaves
    cores idle (the servers wait for a version part of each step), where a
    training step lasts 1 s or more."""
    fsdp: bool = False
    """Shard parameters, gradients and optimizer state across data-parallel ranks (FSDP2, CUDA)."""


@dataclasses.dataclass
class EvalConfig:
    """Greedy evaluation on dataset.test_path by the trainers."""

    every_n_steps: int = 10
    """Evaluate every N train steps; 0 = only before and after training."""
    max_new_tokens: int = 0
    """0 = rollout.gconfig.max_new_tokens."""
    batch_size: int = 256
    """Prompts per evaluation batch."""
    max_prompts: int = 0
    """Evaluate the first N prompts; 0 = the whole test split."""


@dataclasses.dataclass
class SaverConfig:
    """Recovery checkpoints and the final model (docs/architecture.md, "Recovery")."""

    checkpoint_every_n_steps: int = 0
    """Recovery checkpoints every N steps (0 = never; with recover=auto, 0 means every 20 steps)."""
    checkpoint_every_minutes: float = 0.0
    """... and/or every M minutes (0 = never; with recover=auto, 0 means every 10 minutes)."""
    save_final_model: bool = True
    """Save the trained model under <fileroot>/models/<experiment>/<trial>/final/."""


@dataclasses.dataclass
class RayConfig:
    """mode=ray: every worker under a Ray actor on a node of the cluster (README, "Several machines (Ray)")."""

    address: str = ""
    """The cluster to join; "" = RAY_ADDRESS, else the cluster this node is part of ("auto")."""


@dataclasses.dataclass
class SlurmConfig:
    """mode=slurm: the trial as one batch job (docs/slurm.md maps each key to its sbatch option)."""

    partition: str = ""
    """--partition; "" = the cluster's default."""
    nodes: int = 1
    """--nodes."""
    gpus_per_node: int = 0
    """--gpus-per-node; 0 = none."""
    cpus_per_node: int = 0
    """--cpus-per-task (one task per node); 0 = whole nodes (--exclusive)."""
    mem: str = ""
    """--mem per node, e.g. 64G; "" = the partition's default."""
    time: str = ""
    """--time, e.g. 12:00:00 or 2-00:00:00; "" = the partition's default."""
    account: str = ""
    """--account."""
    qos: str = ""
    """--qos."""
    constraint: str = ""
    """--constraint."""
    job_name: str = ""
    """--job-name; "" = realrl-<experiment_name>-<trial_name>."""
    sbatch_args: list[str] = dataclasses.field(default_factory=list)
    """More #SBATCH options, e.g. [--exclude=n7]."""
    srun_args: list[str] = dataclasses.field(default_factory=list)
    """More options of every worker's srun step."""
    setup: list[str] = dataclasses.field(default_factory=list)
    """Shell lines before the launcher (module load ...)."""
    dry_run: bool = False
    """Print the batch script (and write it under the log directory), submit nothing."""
    follow: bool = True
    """Wait for the job, stream its progress, return its exit code; false = print the job id."""


@dataclasses.dataclass
class ConsoleConfig:
    """What the launcher's console shows (docs/observability.md): on a terminal one progress bar;
    redirected (not a TTY), a plain line for the first step, every N-th and the last."""

    every_n_steps: int = 10
    """A plain line every N steps when the output is not a terminal."""


@dataclasses.dataclass
class StatsConfig:
    """Where per-step stats go besides stats.jsonl and TensorBoard (docs/observability.md)."""

    wandb: bool = False
    """Weights & Biases in offline mode (<log_dir>/wandb/), if wandb is installed."""


@dataclasses.dataclass
class WatchdogConfig:
    """The hang watchdog (docs/observability.md): once every worker runs, no new
    training step or stage for `timeout` seconds writes a hang report (every
    worker's stacks and progress) to the log directory and stops the trial."""

    timeout: float = 300.0
    """Seconds without training progress; 0 = off. Above your longest step/evaluation."""
    action: str = "stop"
    """stop (exit code 1, like a failed worker) | report (write the report, keep running)."""


@dataclasses.dataclass
class SecurityConfig:
    """The trial secret on every hop (docs/design.md §14)."""

    enabled: bool = True
    """false: no secret, no keys: anyone who reaches the trial's ports can steer it (a warning says so). For a
    network you isolate yourself, and for measuring what security costs."""


@dataclasses.dataclass
class AsyncPPOConfig:
    """The whole config of `realrl train` (defaults: realrl/configs/async-ppo.yaml)."""

    experiment_name: str = "async-ppo"
    """Names the experiment: logs, weights and checkpoints live under <fileroot>/*/<experiment>/<trial>/."""
    trial_name: str = "run0"
    """Names one run of the experiment; one launcher per trial at a time."""
    mode: str = "local"
    """local (subprocesses on this machine) | ray | slurm."""
    seed: int = 1
    """Seed of model initialisation, shuffling and sampling."""
    fileroot: str = "runs"
    """Logs, weights, checkpoints and caches live under here (a relative path is from the working directory)."""
    allocation_mode: str = "torch.d1p1m1+d1p1m1"
    """"<gen backend>.d<dp>p<pp>m<tp>+d<dp>p<pp>m<tp>": generation servers + trainers."""
    total_train_steps: int = 40
    """Train steps of the trial."""
    heartbeat_ttl: float = 5.0
    """Seconds a worker's status key lives without a heartbeat."""
    bind_address: str = ""
    """Multi-node modes: the address every worker binds ("" = its node's address from Ray or Slurm);
    local mode binds 127.0.0.1."""
    recover: str = "disabled"
    """disabled | auto (resume from the newest checkpoint, and restart after a failure)."""
    recover_retries: int = 3
    """recover=auto: restarts after failures before giving up."""
    plugins: list[str] = dataclasses.field(default_factory=list)
    """Modules or .py files imported in every worker (they register agents, environments, reward functions)."""
    name_resolve: NameResolveConfig = dataclasses.field(default_factory=lambda: NameResolveConfig(type="etcd3"))
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    tiny_kit: TinyKitConfig = dataclasses.field(default_factory=TinyKitConfig)
    dataset: DatasetConfig = dataclasses.field(default_factory=DatasetConfig)
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    ppo: PPOConfig = dataclasses.field(default_factory=PPOConfig)
    rollout: RolloutConfig = dataclasses.field(default_factory=RolloutConfig)
    server: ServerConfig = dataclasses.field(default_factory=ServerConfig)
    weights: WeightsConfig = dataclasses.field(default_factory=WeightsConfig)
    judge: JudgeConfig = dataclasses.field(default_factory=JudgeConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    saver: SaverConfig = dataclasses.field(default_factory=SaverConfig)
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)
    slurm: SlurmConfig = dataclasses.field(default_factory=SlurmConfig)
    console: ConsoleConfig = dataclasses.field(default_factory=ConsoleConfig)
    stats: StatsConfig = dataclasses.field(default_factory=StatsConfig)
    watchdog: WatchdogConfig = dataclasses.field(default_factory=WatchdogConfig)
    security: SecurityConfig = dataclasses.field(default_factory=SecurityConfig)


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
    gen_backend: str  # torch | sglang | vllm
    gen: ParallelShape  # dp = number of generation servers, tp = tensor parallel per server
    train: ParallelShape  # dp = number of model workers


GEN_BACKENDS = ("torch", "sglang", "vllm")
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


def validate_judge(cfg: AsyncPPOConfig, alloc: AllocationMode) -> None:
    judge = cfg.judge
    if not judge.model.path:
        return
    _check(cfg.mode == "local", "judge.model.path", f"judge servers run in mode=local only, got mode={cfg.mode}")
    _check(
        alloc.gen_backend == "torch",
        "judge.model.path",
        "judge servers need the torch backend (allocation_mode torch.*)",
    )
    _check(judge.n_servers >= 1, "judge.n_servers", f"must be >= 1, got {judge.n_servers}")
    _check(judge.request_timeout > 0, "judge.request_timeout", f"must be > 0, got {judge.request_timeout}")
    if cfg.rollout.reward_fn:  # the judge's call must fit in the reward call
        _check(
            judge.request_timeout < cfg.rollout.reward_fn_timeout,
            "judge.request_timeout",
            f"must be > 0 and < rollout.reward_fn_timeout ({cfg.rollout.reward_fn_timeout}), "
            f"got {judge.request_timeout}",
        )
    _check(judge.max_new_tokens >= 1, "judge.max_new_tokens", f"must be >= 1, got {judge.max_new_tokens}")
    # (that something takes the judge, the reward function or the environment, is checked once the
    # plugins are loaded: realrl/experiment/checks.py)


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

    validate_judge(cfg, alloc)
    _check(cfg.model.dtype in TORCH_DTYPES, "model.dtype", f"must be {'|'.join(TORCH_DTYPES)}, got {cfg.model.dtype!r}")
    validate_lora(cfg.model.lora)
    _check(
        bool(cfg.dataset.train_path) or not cfg.dataset.test_path,
        "dataset.test_path",
        "set dataset.train_path too (or neither, for the synthetic arithmetic task)",
    )
    _check(cfg.dataset.max_prompt_len >= 1, "dataset.max_prompt_len", "must be >= 1")
    _check(cfg.tiny_kit.warm_start_steps >= 0, "tiny_kit.warm_start_steps", "must be >= 0 (0 = default)")

    p = cfg.ppo
    _check(
        p.adv_estimator in ADV_ESTIMATORS,
        "ppo.adv_estimator",
        f"must be {'|'.join(ADV_ESTIMATORS)}, got {p.adv_estimator!r}",
    )
    _check(
        p.policy_loss in POLICY_LOSSES, "ppo.policy_loss", f"must be {'|'.join(POLICY_LOSSES)}, got {p.policy_loss!r}"
    )
    _check(p.group_size >= 1, "ppo.group_size", "must be >= 1")
    _check(
        p.adv_estimator not in ("grpo", "dr_grpo", "rloo") or p.group_size >= 2,
        "ppo.group_size",
        f"ppo.adv_estimator={p.adv_estimator} needs >= 2 answers per prompt",
    )
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
    _check(p.eps_clip_high is None or p.eps_clip_high > 0, "ppo.eps_clip_high", "must be > 0 (or null = eps_clip)")
    _check(p.value_eps_clip > 0, "ppo.value_eps_clip", f"must be > 0, got {p.value_eps_clip}")
    _check(p.c_clip is None or p.c_clip > 1, "ppo.c_clip", "must be > 1 (or null)")
    _check(
        p.c_clip is None or p.policy_loss == "ppo",
        "ppo.c_clip",
        f"the dual clip is a ppo policy loss's; set it to null for policy_loss={p.policy_loss}",
    )
    _check(
        p.behav_imp_weight_cap is None or p.behav_imp_weight_cap > 1,
        "ppo.behav_imp_weight_cap",
        "must be > 1 (or null)",
    )
    _check(
        p.behav_imp_weight_mode in ("truncate", "mask"),
        "ppo.behav_imp_weight_mode",
        f"must be truncate|mask, got {p.behav_imp_weight_mode!r}",
    )
    _check(
        p.behav_imp_weight_level in ("token", "sequence", "geometric"),
        "ppo.behav_imp_weight_level",
        f"must be token|sequence|geometric, got {p.behav_imp_weight_level!r}",
    )
    _check(p.kl_ctl >= 0, "ppo.kl_ctl", "must be >= 0")
    for key in ("kl_estimator", "kl_loss_estimator"):
        value = getattr(p, key)
        _check(value in KL_ESTIMATORS, f"ppo.{key}", f"must be {'|'.join(KL_ESTIMATORS)}, got {value!r}")
    _check(p.kl_loss_coef >= 0, "ppo.kl_loss_coef", f"must be >= 0, got {p.kl_loss_coef}")
    _check(p.entropy_coef >= 0, "ppo.entropy_coef", f"must be >= 0 (0 = off), got {p.entropy_coef}")
    _check(0 <= p.discount <= 1, "ppo.discount", "must be in [0, 1]")
    _check(0 <= p.gae_lambda <= 1, "ppo.gae_lambda", "must be in [0, 1]")
    _check(
        p.loss_agg_mode in LOSS_AGG_MODES,
        "ppo.loss_agg_mode",
        f"must be {'|'.join(LOSS_AGG_MODES)}, got {p.loss_agg_mode!r}",
    )
    max_new = cfg.rollout.gconfig.max_new_tokens
    _check(
        0 <= p.overlong_buffer_len <= max_new,
        "ppo.overlong_buffer_len",
        f"must be in [0, rollout.gconfig.max_new_tokens={max_new}], got {p.overlong_buffer_len}",
    )
    _check(
        0 <= p.overlong_buffer_frac <= 1, "ppo.overlong_buffer_frac", f"must be in [0, 1], got {p.overlong_buffer_frac}"
    )
    _check(p.overlong_penalty_factor >= 0, "ppo.overlong_penalty_factor", "must be >= 0 (0 = off)")
    _check(
        p.overlong_penalty_factor == 0 or p.overlong_buffer_len or round(p.overlong_buffer_frac * max_new) >= 1,
        "ppo.overlong_penalty_factor",
        "needs an overlong buffer: ppo.overlong_buffer_len or ppo.overlong_buffer_frac (of max_new_tokens) >= 1 token",
    )
    _check(p.max_tokens_per_mb >= 16, "ppo.max_tokens_per_mb", "must be >= 16")

    o = cfg.optimizer
    _check(o.lr > 0, "optimizer.lr", "must be > 0")
    _check(
        o.lr_scheduler in ("constant", "linear", "cosine"),
        "optimizer.lr_scheduler",
        f"must be constant|linear|cosine, got {o.lr_scheduler!r}",
    )
    _check(0 <= o.min_lr_ratio <= 1, "optimizer.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
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
        r.max_rejected_batches >= 0,
        "rollout.max_rejected_batches",
        f"must be >= 0 (0 = never), got {r.max_rejected_batches}",
    )
    _check(
        0 <= r.success_rate_lb <= r.success_rate_ub <= 1,
        "rollout.success_rate_lb",
        "need 0 <= success_rate_lb <= success_rate_ub <= 1",
    )
    try:
        r.gconfig.validate("rollout.gconfig")
    except ValueError as e:
        raise ConfigError(_key_first(str(e))) from None
    served = served_sampling(
        alloc.gen_backend, cfg.server.torch.emulate_sglang, cfg.server.torch.emulate_vllm, cfg.server.sglang.extra_args
    ).refusal(r.gconfig.sampling_params())
    _check(served is None, "rollout.gconfig", f"{served}")
    _check(
        alloc.gen_backend != "vllm" or cfg.model.lora.rank <= VLLM_MAX_LORA_RANK,
        "model.lora.rank",
        f"vLLM serves LoRA ranks up to {VLLM_MAX_LORA_RANK} (--max-lora-rank), got {cfg.model.lora.rank}",
    )
    _check(
        r.max_restarts >= 0,
        "rollout.max_restarts",
        f"must be >= 0 (0 = a dead rollout worker stops the trial), got {r.max_restarts}",
    )
    _check(r.reward_fn_timeout > 0, "rollout.reward_fn_timeout", f"must be > 0 seconds, got {r.reward_fn_timeout}")
    _check(r.episode_timeout > 0, "rollout.episode_timeout", f"must be > 0 seconds, got {r.episode_timeout}")
    _check(
        not r.reward_fn or r.env.type in ("math", "reward-fn"),
        "rollout.reward_fn",
        f"replaces the environment; it cannot be combined with rollout.env.type={r.env.type}",
    )
    _check(
        not r.agent_fn or r.agent.type in ("single-step", "function"),
        "rollout.agent_fn",
        f"replaces the agent; it cannot be combined with rollout.agent.type={r.agent.type}",
    )
    _check(r.request_timeout > 0, "rollout.request_timeout", f"must be > 0 seconds, got {r.request_timeout}")
    _check(r.request_retries >= 0, "rollout.request_retries", f"must be >= 0 (0 = no retry), got {r.request_retries}")
    _check(r.no_server_timeout > 0, "rollout.no_server_timeout", f"must be > 0 seconds, got {r.no_server_timeout}")
    _check(r.routing in ("client", "manager"), "rollout.routing", f"must be client|manager, got {r.routing!r}")

    _check(cfg.train.device in ("cpu", "cuda"), "train.device", f"must be cpu|cuda, got {cfg.train.device!r}")
    _check(not cfg.train.fsdp or cfg.train.device == "cuda", "train.fsdp", "needs train.device=cuda")
    _check(cfg.train.num_threads >= 0, "train.num_threads", "must be >= 0 (0 = auto)")
    s, ts, sg = cfg.server, cfg.server.torch, cfg.server.sglang
    _check(ts.device in ("cpu", "cuda"), "server.torch.device", f"must be cpu|cuda, got {ts.device!r}")
    _check(
        ts.dtype in ("auto", *TORCH_DTYPES),
        "server.torch.dtype",
        f"must be auto|{'|'.join(TORCH_DTYPES)}, got {ts.dtype!r}",
    )
    _check(
        ts.engine in ("auto", "paged", "dense"), "server.torch.engine", f"must be auto|paged|dense, got {ts.engine!r}"
    )
    _check(
        ts.kv_cache_tokens is None or ts.kv_cache_tokens >= 16,
        "server.torch.kv_cache_tokens",
        f"must be null or >= 16, got {ts.kv_cache_tokens}",
    )
    _check(
        ts.max_running_requests >= 1,
        "server.torch.max_running_requests",
        f"must be >= 1, got {ts.max_running_requests}",
    )
    _check(ts.num_threads >= 1, "server.torch.num_threads", "must be >= 1")
    _check(ts.max_threads >= 0, "server.torch.max_threads", f"must be >= 0 (0 = auto), got {ts.max_threads}")
    if ts.emulate_sglang:
        try:
            emulated_release(ts.emulate_sglang)
        except ValueError as e:
            raise ConfigError(f"server.torch.emulate_sglang: {e}") from None
    _check(ts.emulate_sglang_dp >= 1, "server.torch.emulate_sglang_dp", f"must be >= 1, got {ts.emulate_sglang_dp}")
    if ts.emulate_vllm:
        try:
            vllm_release(ts.emulate_vllm)
        except ValueError as e:
            raise ConfigError(f"server.torch.emulate_vllm: {e}") from None
        _check(
            not ts.emulate_sglang, "server.torch.emulate_vllm", "emulates vLLM; it excludes server.torch.emulate_sglang"
        )
    vc = cfg.server.vllm
    _check(vc.dtype in SGLANG_DTYPES, "server.vllm.dtype", f"must be {'|'.join(SGLANG_DTYPES)}, got {vc.dtype!r}")
    _check(
        0 < vc.gpu_memory_utilization <= 1,
        "server.vllm.gpu_memory_utilization",
        f"must be in (0, 1], got {vc.gpu_memory_utilization}",
    )
    _check(
        vc.max_model_len is None or vc.max_model_len >= 1,
        "server.vllm.max_model_len",
        f"must be >= 1 (or null = the model's), got {vc.max_model_len}",
    )
    _check(
        vc.max_num_seqs is None or vc.max_num_seqs >= 1,
        "server.vllm.max_num_seqs",
        f"must be >= 1 (or null = vLLM's default), got {vc.max_num_seqs}",
    )
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
    validate_weights(cfg, alloc)
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


def validate_weights(cfg: AsyncPPOConfig, alloc: AllocationMode) -> None:
    w = cfg.weights
    _check(
        w.transport in ("auto", "disk", "broadcast"),
        "weights.transport",
        f"must be auto|disk|broadcast, got {w.transport!r}",
    )
    _check(w.auto_broadcast_mb >= 0, "weights.auto_broadcast_mb", f"must be >= 0 MiB, got {w.auto_broadcast_mb}")
    _check(w.backend in ("auto", "gloo", "nccl"), "weights.backend", f"must be auto|gloo|nccl, got {w.backend!r}")
    _check(w.bucket_mb >= 1, "weights.bucket_mb", f"must be >= 1 MiB, got {w.bucket_mb}")
    _check(
        w.backend != "nccl"
        or (cfg.train.device == "cuda" and (alloc.gen_backend == "sglang" or cfg.server.torch.device == "cuda")),
        "weights.backend",
        "nccl needs train.device=cuda and the servers on cuda (SGLang, or server.torch.device=cuda)",
    )
    if w.transport == "broadcast" and (refusal := broadcast_refusal(cfg, alloc)) is not None:
        _check(False, *refusal)


def broadcast_refusal(cfg: AsyncPPOConfig, alloc: AllocationMode) -> tuple[str, str] | None:
    """Why this trial cannot take `weights.transport=broadcast` (the key to
    blame, the reason), or None: a config error when asked for, disk under auto."""
    # vLLM 0.32/0.33 have weight-transfer routes (`entrypoints/rl/online/api_router.py`:
    # /init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update),
    # over NCCL or CUDA IPC engines only; realrl does not drive them yet (docs/design.md §8).
    if alloc.gen_backend == "vllm" or (alloc.gen_backend == "torch" and cfg.server.torch.emulate_vllm):
        return (
            "weights.transport",
            f"broadcast is not wired for vLLM servers yet (allocation_mode {cfg.allocation_mode!r}); use disk",
        )
    if cfg.model.lora.rank != 0:
        return "weights.transport", "broadcast moves full weights; LoRA adapters go on disk"
    if cfg.server.torch.emulate_sglang and cfg.server.torch.emulate_sglang_dp != 1:
        return (
            "server.torch.emulate_sglang_dp",
            "must be 1 with weights.transport=broadcast (SGLang asserts one data-parallel rank for a distributed "
            "weight update)",
        )
    return None


ALL_LINEAR = "all-linear"


def validate_lora(lora: LoraConfig) -> None:
    _check(lora.rank >= 0, "model.lora.rank", f"must be >= 0 (0 = off), got {lora.rank}")
    _check(lora.alpha > 0, "model.lora.alpha", f"must be > 0, got {lora.alpha}")
    _check(0 <= lora.dropout < 1, "model.lora.dropout", f"must be in [0, 1), got {lora.dropout}")
    targets = list(lora.target_modules)
    _check(bool(targets), "model.lora.target_modules", "must name at least one module (or [all-linear])")
    _check(
        ALL_LINEAR not in targets or targets == [ALL_LINEAR],
        "model.lora.target_modules",
        f"{ALL_LINEAR} stands alone, got {targets}",
    )
    for name in targets:
        _check(
            isinstance(name, str) and bool(re.fullmatch(r"[A-Za-z_][\w.\-]*", name)),
            "model.lora.target_modules",
            f"entries must be module names like q_proj, got {name!r}",
        )


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
