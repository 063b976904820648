"""ModelWorker: holds the policy (and optional critic / reference) and trains it.

One ModelWorker per data-parallel rank. It pulls trajectories from its own
puller (`PullerStreamDataset`) and answers the master's requests:

| handle      | kind  | what                                                         |
|-------------|-------|--------------------------------------------------------------|
| spec        | cheap | rank, sizes, current weight version, buffer stats            |
| inventory   | cheap | drop stale trajectories; describe the oldest buffered ones   |
| stats       | cheap | stream accounting (received/taken/dropped/buffered)          |
| assemble    | long  | this step's batch: take the chosen trajectories, send those  |
|             |       | planned for other ranks, receive the ones planned for us     |
|             |       | (one rank: `oldest: B`, its B oldest, no inventory first)    |
| inference   | long  | proximal / reference logprobs and values for the step batch  |
| train_step  | long  | one PPO/GRPO update, then publish the new weights            |
| evaluate    | long  | greedy accuracy on the test split (rank 0)                   |
| save        | long  | save the HF model to a directory                             |
| checkpoint  | long  | save a recovery checkpoint; `load` restores one               |

Cheap handles run on the serving thread and are answered even while a long
one runs on the worker thread (so the master can keep filling the next batch).

A step's batch is chosen by the master from what all ranks hold together
(docs/design.md §7): no rank has a quota, so trajectories that land unevenly (one
rollout worker faster, a filter that hits one shard) never stall a step.
`assemble` moves the trajectories planned for another rank over a gloo group
of their own (also when training runs on NCCL), in the wire format (no
pickle), point to point.

Weights (docs/design.md §8): after each train step rank 0 writes the actor as HF
safetensors, with the tokenizer files, chat template and generation config of
the model directory it started from (an ordinary HF directory), into a temp
directory, renames it to `<weights_dir>/<version>/`, and only then sets
`model_version/actor`; a half-written version is never visible. (With
`weights.transport=broadcast` a version that reached every server over the
wire is written only when the manager asks: realrl/system/weight_broadcast.py.) With
`lora.rank` > 0 the actor is wrapped with peft LoRA adapters
(`realrl.impl.lora`): only they train, and a version (with the tokenizer
files), a checkpoint and the final model's `adapter/` hold them alone; the KL
reference is the actor with
the adapters off. Data parallelism uses torch.distributed (gloo on CPU, NCCL on CUDA);
gradients are summed over ranks and the loss is normalised by the global token
count, so every rank ends a step with identical weights.

(Over 700 lines on purpose: one worker's request handlers, its data-parallel
batch exchange and its weight publication share the rank's state; splitting
them would scatter one process's life across files.)
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
import time
import uuid

import numpy as np
import torch
import torch.distributed as dist

from realrl.api.env_api import make_env
from realrl.api.system_api import ModelWorkerConfig
from realrl.api.trajectory import Trajectory
from realrl.base import cpu_threads, faults, name_resolve, names, network, wire
from realrl.impl import lora
from realrl.impl.ppo.batch import SequenceBatch
from realrl.impl.ppo.models import AdapterDisabled, CriticModel, compute_in, load_policy
from realrl.impl.ppo.trainer import Optimized, PPOTrainer, optimized_as_configured
from realrl.impl.weights.on_disk import version_dirs
from realrl.system.ledger import KeyLedger
from realrl.system.request_reply_stream.reply_server import NameResolvingReplyServer
from realrl.system.stream_dataset import PullerStreamDataset
from realrl.system.version_announce import VersionAnnouncer
from realrl.system.weights_check import (
    checked_parameters,
    expected_shard_checksums,
    local_shard_checksum,
    nudge_local_weights,
    weights_checksum,
)
from realrl.system.worker_base import PollResult, Worker

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
ACTOR = "actor"


def save_model(
    model: torch.nn.Module,
    path: str,
    max_shard_size: str = "2GB",
    state_dict: dict | None = None,
    tokenizer_source: str | None = None,
    dtype: torch.dtype | None = None,
) -> None:
    """HF safetensors of `model` (or of `state_dict` in its layout); of a LoRA
    model, the adapter alone in peft's format (adapter_model.safetensors +
    adapter_config.json). With `tokenizer_source` (the model directory the run
    started from), its tokenizer files, chat template and generation config
    are copied in after the weights (`copy_tokenizer_files`), so the directory
    loads with `AutoTokenizer` and generates like the user's model. `dtype`
    (a full model): the weights and config.json's dtype in it, whatever the
    model holds (the float32 master of a mixed-precision run)."""
    adapter = lora.is_lora(model)
    if adapter:
        lora.save_adapter(model, path, state_dict)
    else:
        if dtype is not None:
            state_dict = cast_state_dict(model.state_dict() if state_dict is None else state_dict, dtype)
        model.save_pretrained(path, max_shard_size=max_shard_size, state_dict=state_dict)
        if dtype is not None:  # save_pretrained writes the dtype the model's parameters have
            config_path = os.path.join(path, "config.json")
            with open(config_path) as f:
                hf_config = json.load(f)
            hf_config["dtype"] = str(dtype).removeprefix("torch.")
            with open(config_path, "w") as f:
                json.dump(hf_config, f, indent=2, sort_keys=True)
    if tokenizer_source:
        copy_tokenizer_files(tokenizer_source, path, adapter=adapter)


def cast_state_dict(state_dict: dict, dtype: torch.dtype) -> dict:
    """Floating tensors in `dtype`; tied entries (one tensor under two names) stay one tensor."""
    cast: dict[int, torch.Tensor] = {}
    out = {}
    for name, tensor in state_dict.items():
        if tensor.is_floating_point() and tensor.dtype != dtype:
            tensor = cast.setdefault(id(tensor), tensor.detach().to(dtype))
        out[name] = tensor
    return out


# What save_pretrained writes of the model itself (and a peft adapter's own
# config); every other file of the model directory (tokenizer, chat template,
# generation config, ...) is the user's.
_MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "adapter_config.json",
)
# Weights in any format a full Hugging Face snapshot may hold beside the
# safetensors (gpt2 ships flax_model.msgpack, tf_model.h5, rust_model.ot):
# large, and none of them the trained model.
_WEIGHT_SUFFIXES = (
    ".safetensors",
    ".bin",
    ".pt",
    ".pth",
    ".ckpt",
    ".index.json",
    ".msgpack",
    ".h5",
    ".ot",
    ".onnx",
    ".onnx_data",
    ".gguf",
    ".tflite",
)


def copy_tokenizer_files(source: str, path: str, adapter: bool = False) -> None:
    """The user's tokenizer files, chat template and generation config, copied
    unchanged from the model directory the run started from (a tokenizer saved
    by transformers may change class or gain tokens). Into a LoRA adapter
    directory (`adapter`) without `added_tokens.json`: SGLang reads that file
    in an adapter as tokens the adapter adds to the vocabulary (releases
    before sglang PR 17905, January 2026, refused an adapter whose "added"
    tokens are the base vocabulary's own; later ones filter them out), so
    nothing depends on that filter; tokenizer.json and tokenizer_config.json
    still carry the added tokens for AutoTokenizer."""
    for name in sorted(os.listdir(source)):
        src = os.path.join(source, name)
        if (
            name in _MODEL_FILES
            or (adapter and name == "added_tokens.json")
            or not os.path.isfile(src)
            or name.endswith(_WEIGHT_SUFFIXES)
        ):
            continue
        shutil.copyfile(src, os.path.join(path, name))


def publish_weights(
    model: torch.nn.Module,
    weights_dir: str,
    version: int,
    max_shard_size: str = "2GB",
    state_dict: dict | None = None,
    tokenizer_source: str | None = None,
    dtype: torch.dtype | None = None,
) -> str:
    """Writes `model` (`save_model`, with the tokenizer files of
    `tokenizer_source`, in `dtype`) to `<weights_dir>/<version>/` atomically:
    everything is in the temporary directory before the rename makes it visible.
    (A trainer publishing every step keeps a `VersionWriter`: the same
    directory, written without save_pretrained after the first.)"""
    return VersionWriter(tokenizer_source, dtype, max_shard_size).publish(model, weights_dir, version, state_dict)


def remove_versions_after(weights_dir: str, version: int) -> list[str]:
    """Deletes `<weights_dir>/<u>` for integer u > version (directories, not
    symlinks): a resume's discarded versions, which a previous launch wrote.
    Under weights.transport=broadcast the resumed trainer writes its versions
    only on demand, so a stale one would otherwise be loaded as its own (§8)."""
    removed = [path for u, path in version_dirs(weights_dir).items() if u > version]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


class _Layout:
    """What `save_model` wrote for a model: its one safetensors file (the names in
    it, its metadata; `head`, the file's header bytes, and `entries`, its tensors'
    names, dtypes and shapes in the file's order, when the file is the header then
    those tensors' bytes end to end, else None) and the bytes of every other file."""

    __slots__ = ("names", "metadata", "files", "head", "entries", "mode")

    def __init__(
        self,
        names: list[str],
        metadata: dict[str, str] | None,
        files: dict[str, bytes],
        head: bytes | None = None,
        entries: list[tuple[str, torch.dtype, torch.Size]] | None = None,
        mode: int = 0o644,
    ):
        self.names, self.metadata, self.files = names, metadata, files
        self.head, self.entries, self.mode = head, entries, mode


class VersionWriter:
    """Publishes a model's weight versions (`publish`) as `publish_weights` does.
    The first through `save_model` (save_pretrained); if that directory is one
    safetensors file whose every tensor is the state dict's own under the same
    name (tied duplicates left out as save_pretrained leaves them), later
    versions are written directly: those tensors with safetensors, and the other
    files as the first version had them (config, generation config, tokenizer:
    none changes while the run trains). save_pretrained derives all of that
    again each time, several times the cost of writing a small model's tensors,
    on the trainer's step. Anything else (LoRA adapters, shards, names that
    save_pretrained converts) goes through `save_model` every time."""

    def __init__(self, tokenizer_source: str | None, dtype: torch.dtype | None = None, max_shard_size: str = "2GB"):
        self.tokenizer_source, self.dtype, self.max_shard_size = tokenizer_source, dtype, max_shard_size
        self._layout: _Layout | None = None
        self._learned = False  # the first version was written (and `_layout` set if it may be used)
        self.n_direct = 0  # versions written without save_pretrained

    def publish(self, model: torch.nn.Module, weights_dir: str, version: int, state_dict: dict | None = None) -> str:
        """`model` (or `state_dict` in its layout) as `<weights_dir>/<version>/`, atomically."""
        final = os.path.join(weights_dir, str(version))
        tmp = os.path.join(weights_dir, f".tmp-{version}-{uuid.uuid4().hex[:8]}")
        os.makedirs(weights_dir, exist_ok=True)
        layout = self._layout
        if layout is not None:
            os.makedirs(tmp)
            self._write_direct(layout, model, tmp, state_dict)
            self.n_direct += 1
        else:
            save_model(model, tmp, self.max_shard_size, state_dict, self.tokenizer_source, self.dtype)
            if not self._learned:
                self._learned = True
                self._layout = _layout_of(tmp, self._state(model, state_dict))
        old = None
        if os.path.exists(final):  # a re-run of this version (recovery): replace it, never leaving it half-deleted
            old = os.path.join(weights_dir, f".old-{version}-{uuid.uuid4().hex[:8]}")
            os.rename(final, old)
        os.rename(tmp, final)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return final

    def _state(self, model: torch.nn.Module, state_dict: dict | None) -> dict | None:
        """The tensors save_model writes from (None: a LoRA model, whose adapter it writes)."""
        if lora.is_lora(model):
            return None
        state = model.state_dict() if state_dict is None else state_dict
        return state if self.dtype is None else cast_state_dict(state, self.dtype)

    def _write_direct(self, layout: _Layout, model: torch.nn.Module, path: str, state_dict: dict | None) -> None:
        state = self._state(model, state_dict)
        weights = os.path.join(path, _WEIGHTS_FILE)
        if layout.entries is None or not _write_stream(weights, layout, state):
            from safetensors.torch import save_file

            save_file({name: state[name].contiguous() for name in layout.names}, weights, layout.metadata)
        for name, data in layout.files.items():
            with open(os.path.join(path, name), "wb") as f:
                f.write(data)


def _write_stream(path: str, layout: _Layout, state: dict) -> bool:
    """The safetensors file of `state` as `layout` describes it, written as its first
    version's header and then each tensor's bytes from the tensor itself, in one
    gathered write: the bytes safetensors' `save_file` writes (same names, dtypes,
    shapes, so the same header), without its per-tensor Python and its copy of every
    tensor into one buffer first. False (nothing written) if a tensor's dtype or shape
    is not the layout's."""
    chunks: list = [layout.head]
    for name, dtype, shape in layout.entries or ():
        tensor = state[name].detach()
        if tensor.dtype != dtype or tensor.shape != shape:
            return False
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        chunks.append(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())
    views = [memoryview(c).cast("B") for c in chunks if len(c)]
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, layout.mode)
    try:
        while views:  # writev may write part of the list: go on from where it stopped
            n = os.writev(fd, views[:_IOV_MAX])
            while views and n >= len(views[0]):
                n -= len(views[0])
                views.pop(0)
            if n:
                views[0] = views[0][n:]
    finally:
        os.close(fd)
    return True


_IOV_MAX = 512  # buffers per writev (Linux allows 1024)
# safetensors' dtype names of the dtypes a stream-written file may hold.
_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


_WEIGHTS_FILE = "model.safetensors"


def _layout_of(path: str, state: dict | None) -> _Layout | None:
    """The layout of the directory save_model just wrote at `path` from `state`, if later
    versions may be written directly: one safetensors file holding, under each name,
    exactly the state dict's tensor of that name; None otherwise."""
    from safetensors import safe_open

    files = os.listdir(path)
    if state is None or _WEIGHTS_FILE not in files:
        return None
    for name in files:
        if name != _WEIGHTS_FILE and (name.endswith(_WEIGHT_SUFFIXES) or not os.path.isfile(os.path.join(path, name))):
            return None  # shards, or something else than plain files beside the weights
    with safe_open(os.path.join(path, _WEIGHTS_FILE), framework="pt") as f:
        names, metadata = list(f.keys()), f.metadata()
        for name in names:
            tensor = state.get(name)
            if not isinstance(tensor, torch.Tensor) or not torch.equal(f.get_tensor(name), tensor.detach().cpu()):
                return None
    contents = {}
    for name in files:
        if name != _WEIGHTS_FILE:
            with open(os.path.join(path, name), "rb") as fh:
                contents[name] = fh.read()
    return _Layout(names, metadata, contents, *_stream_layout(os.path.join(path, _WEIGHTS_FILE), state))


def _stream_layout(path: str, state: dict) -> tuple[bytes | None, list | None, int]:
    """The safetensors file at `path` (written from `state`) as header bytes and its tensors
    in file order, if it is exactly the header (8-byte length, JSON) and then those
    tensors' bytes end to end, each as `state` holds it; else (None, None). And its mode."""
    mode = os.stat(path).st_mode & 0o777
    if sys.byteorder != "little":  # safetensors is little-endian; a tensor's bytes are the machine's
        return None, None, mode
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = f.read(size)
    info = json.loads(header)
    info.pop("__metadata__", None)
    entries, offset = [], 0
    for name in sorted(info, key=lambda k: info[k]["data_offsets"][0]):
        tensor, (start, end) = state[name], info[name]["data_offsets"]
        nbytes = tensor.numel() * tensor.element_size()
        if (
            start != offset
            or end - start != nbytes
            or info[name]["dtype"] != _SAFETENSORS_DTYPES.get(tensor.dtype)
            or info[name]["shape"] != list(tensor.shape)
        ):
            return None, None, mode
        entries.append((name, tensor.dtype, tensor.shape))
        offset = end
    if 8 + size + offset != os.path.getsize(path):
        return None, None, mode
    return size.to_bytes(8, "little") + header, entries, mode


def _sampled_lens(t: Trajectory) -> list[int]:
    """Per sequence, the completion tokens the policy sampled (a multi-turn
    sequence's context tokens between its turns are not)."""
    if t.loss_mask:
        return [int(m.sum()) for m in t.loss_mask]
    return [n - p for n, p in zip(t.seq_lens, t.prompt_len)]


def _env_sums(trajectories: list[Trajectory]) -> dict[str, float]:
    """The environment `info` numbers the agents put in `metadata["env"]`, summed."""
    sums: dict[str, float] = {}
    for t in trajectories:
        env = t.metadata.get("env")
        for k, v in env.items() if isinstance(env, dict) else ():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                sums[str(k)] = sums.get(str(k), 0.0) + float(v)
    return sums


def _token_staleness(trajectories: list[Trajectory], current_version: int) -> dict[str, int]:
    """How many generated (sampled) tokens of `trajectories` have each
    staleness (`current_version` minus the weight version that generated the
    token); context tokens inside a completion generated nothing."""
    sampled = [
        np.asarray(versions, dtype=np.int64)[t.loss_mask[i]] if t.loss_mask else versions
        for t in trajectories
        for i, versions in enumerate(t.versions)
    ]
    if not sampled:
        return {}
    # One count over the step's tokens (not one np.unique per sequence: 128 of them a default step).
    values, counts = np.unique(current_version - np.concatenate(sampled).astype(np.int64), return_counts=True)
    return {str(v): c for v, c in zip(values.tolist(), counts.tolist())}


def trainer_state(opt: Optimized, fsdp: bool) -> dict:
    """What a checkpoint holds of one Optimized: the trained parameters (a
    LoRA model: its adapters only; buffers and frozen weights come from the
    model files), the optimizer and the schedule; full (gathered to every
    rank, on CPU) under FSDP, where it is a collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=fsdp, cpu_offload=fsdp, ignore_frozen_params=lora.is_lora(opt.model))
    model_sd, optim_sd = get_state_dict(opt.model, opt.optimizer, options=options)
    return {"model": model_sd, "optimizer": optim_sd, "scheduler": opt.scheduler.state_dict()}


def load_trainer_state(opt: Optimized, state: dict, fsdp: bool) -> None:
    """Restores `trainer_state` exactly (a LoRA model: its adapters; the frozen base is left as loaded)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    partial = lora.is_lora(opt.model)
    if partial:  # every adapter must be there; only frozen weights may be missing
        trainable = set(lora.trainable_state(opt.model))
        if set(state["model"]) != trainable:
            raise ValueError(
                f"checkpoint adapters do not match the model: missing {sorted(trainable - set(state['model']))[:3]}, "
                f"unexpected {sorted(set(state['model']) - trainable)[:3]}"
            )
    set_state_dict(
        opt.model,
        opt.optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optimizer"],
        options=StateDictOptions(full_state_dict=fsdp, strict=not partial),
    )
    opt.scheduler.load_state_dict(state["scheduler"])


def full_state_dict(model: torch.nn.Module) -> dict:
    """The full (unsharded, CPU) state dict of an FSDP model, of a LoRA model
    only its adapters; a collective: every rank calls it (rank 0 gets it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=lora.is_lora(model))
    return get_model_state_dict(model, options=options)


def _shard(model: torch.nn.Module) -> None:
    """FSDP2 over the data-parallel group: each decoder layer its own unit (one
    all-gather per layer, not one for the whole model), then the rest."""
    from torch.distributed.fsdp import fully_shard

    inner = lora.base_model(model)
    body = getattr(inner, "model", None) or getattr(inner, "backbone", None)  # causal LM or CriticModel
    for layer in getattr(body, "layers", []):
        fully_shard(layer)
    fully_shard(inner)  # a LoRA model's HF model is the root: generate() calls its forward, which unshards


def eval_agent(cfg: ModelWorkerConfig, tokenizer):
    """The run's agent as evaluation runs it (greedy, one answer, `eval_max_new_tokens`)."""
    from realrl.api.agent_api import make_agent

    settings = dataclasses.replace(cfg.agent_settings, tokenizer=tokenizer)
    return make_agent(cfg.agent.type, settings.for_evaluation(cfg.eval_max_new_tokens), **cfg.agent.args)


def evaluate_policy(
    cfg: ModelWorkerConfig, agent, model, tokenizer, device, version, dp_rank=0, dp_size=1, all_ranks_busy=None
):
    """This rank's share of the test prompts through the run's agent and
    environment on `model` (realrl/impl/evaluation.py): (prompts, outcomes,
    the generator). The trainers' evaluation; `realrl eval` scores with the
    same pieces, derived from the same config (tests/impl/test_eval_agrees.py)."""
    import asyncio

    from realrl.impl import datasets
    from realrl.impl.evaluation import ModelGenerator, evaluate_prompts

    records = datasets.load_records(cfg.eval_dataset_path, cfg.dataset)
    if cfg.eval_max_prompts:
        records = records[: cfg.eval_max_prompts]
    prompts, _ = datasets.prompt_records(records[dp_rank::dp_size], tokenizer, cfg.dataset)
    for p in prompts:
        p.qid = f"eval-{p.qid}"
    generator = ModelGenerator(
        model, tokenizer, device, version, batch_size=cfg.eval_batch_size, all_ranks_busy=all_ranks_busy
    )
    results = asyncio.run(evaluate_prompts(agent, lambda: make_env(cfg.env.type, **cfg.env.args), prompts, generator))
    return prompts, results, generator


class ModelWorker(Worker):
    config_cls = ModelWorkerConfig

    # ---- set-up ------------------------------------------------------------------
    def _configure(self, config: ModelWorkerConfig) -> None:
        self.cfg = config
        torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed + self.info.worker_index)
        self.dp_rank, self.dp_size = self.info.worker_index, config.dp_size
        self.device = torch.device("cuda", 0) if config.device == "cuda" else torch.device("cpu")
        if config.device == "cuda":
            torch.cuda.set_device(self.device)
        self._init_distributed()

        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer

        import realrl.impl.agents  # noqa: F401  evaluation runs the built-in agents and environments
        import realrl.impl.environments  # noqa: F401

        transformers.logging.disable_progress_bar()  # a "Writing model shards" bar per published version
        dtype = _DTYPES[config.dtype]
        self._source = config.tokenizer_path or config.model_path  # its tokenizer files go into every saved model
        self.tokenizer = AutoTokenizer.from_pretrained(self._source)
        self._eval_agent = None  # made at the first evaluation (the agent may load things)
        self._warned_length_cut = False
        self.lora = config.lora.rank > 0
        # Mixed precision: float32 weights and optimizer state, forward and backward in `dtype`
        # (LoRA: peft keeps the adapters float32 over a `dtype` base by itself).
        mixed = config.fp32_master and dtype != torch.float32 and not self.lora
        trained_dtype = torch.float32 if mixed else dtype
        # What is published and saved: the run's dtype, whatever the trainer holds.
        self.save_dtype = dtype if mixed else None
        self._versions = VersionWriter(self._source, self.save_dtype)  # the weight versions rank 0 publishes
        actor = load_policy(config.model_path, dtype, config.fp32_master, self.lora, self.device)
        if config.gradient_checkpointing:
            actor.gradient_checkpointing_enable()
        if self.lora:
            # The same adapters on every rank (the seed above differs per rank): ranks start identical.
            with torch.random.fork_rng(devices=[self.device] if config.device == "cuda" else []):
                torch.manual_seed(config.seed)
                actor = lora.wrap(actor, config.lora)
        self.expected_shard_checksums: list[str] | None = None  # FSDP, rank 0: see dp_weights_identical
        if config.fsdp:
            if self.dp_rank == 0:  # every rank loaded the same full weights
                full = {n: p.detach() for n, p in checked_parameters(actor)}
                self.expected_shard_checksums = expected_shard_checksums(actor, full, self.dp_size)
            _shard(actor)
        o, ppo = config.optimizer, config.ppo

        def optimized(model):
            return optimized_as_configured(model, o, config.total_train_steps)

        self.actor = optimized(actor)
        trained = [actor]
        self.critic = None
        if ppo.adv_estimator == "gae":
            critic = CriticModel.from_pretrained(config.model_path, trained_dtype, self.device)
            if mixed:
                compute_in(critic, self.device.type, dtype)
            if config.fsdp:
                _shard(critic)
            self.critic = optimized(critic)
            trained.append(critic)
        self._idle_cores, self._threads = None, None
        if config.max_threads > config.num_threads and self.device.type == "cpu":
            # More threads while the servers leave cores idle (they wait for a version part of each step).
            self._idle_cores = cpu_threads.IdleCores().start()
            self._threads = cpu_threads.FollowIdleCores(
                trained, config.num_threads, config.max_threads, self._idle_cores
            )
        self.ref = None
        use_ref = ppo.kl_ctl > 0 or ppo.use_kl_loss
        if use_ref and self.lora and not config.ref_model_path:
            self.ref = AdapterDisabled(actor)  # the base under the adapters: no second copy
        elif use_ref:
            self.ref = AutoModelForCausalLM.from_pretrained(config.ref_model_path or config.model_path, dtype=dtype).to(
                self.device
            )
            self.ref.requires_grad_(False).eval()
        self.trainer = PPOTrainer(
            self.actor,
            ppo,
            config.temperature,
            self.device,
            o.gradient_clipping,
            critic=self.critic,
            ref=self.ref,
            all_reduce_sum=self._all_reduce_sum,
            sync_grads=self._sync_grads,
            process_group=dist.group.WORLD if self.dp_size > 1 else None,
            # FSDP averages gradients over ranks; our losses are normalised by
            # the global token count and must be summed, so scale by the world size.
            loss_scale=float(self.dp_size) if config.fsdp else 1.0,
            max_new_tokens=config.max_new_tokens,
        )

        self.version = 0
        self.step_trajectories: list = []
        self._assembled: SequenceBatch | None = None  # the step's batch, built by `assemble`
        self.step_batch: SequenceBatch | None = None
        # A token id past an embedding table kills inference (IndexError), a sequence past the model's
        # positions stalls a step: the puller rejects such trajectories as invalid (check_trainable).
        # The vocabulary bound is the embedding's size (config.vocab_size), not len(tokenizer).
        embedded = [actor, self.critic.model.backbone if self.critic is not None else None]
        if self.ref is not None and not isinstance(self.ref, AdapterDisabled):
            embedded.append(self.ref)
        vocab_size = min(m.get_input_embeddings().num_embeddings for m in embedded if m is not None)
        self.dataset = PullerStreamDataset(
            self.experiment_name,
            self.trial_name,
            self.dp_rank,
            config.max_buffered_trajectories,
            vocab_size=vocab_size,
            host=self.bind_host,
            max_positions=getattr(actor.config.get_text_config(decoder=True), "max_position_embeddings", None),
            # +1: the ranks step together, but rank 0 announces a version while another rank may not
            # have counted that step yet, and rollouts of it can reach that rank's puller first.
            newest_version=lambda: self.version + 1,
        )
        self.server = NameResolvingReplyServer(
            self.experiment_name, self.trial_name, self.info.worker_index, interrupt=self.raise_if_exiting
        )
        for name in ("spec", "inventory", "stats"):
            self.server.register(name, getattr(self, f"_handle_{name}"))
        for name in ("assemble", "inference", "train_step", "evaluate", "save", "checkpoint", "load"):
            self.server.register(name, getattr(self, f"_handle_{name}"), long_running=True)
        self._announcer: VersionAnnouncer | None = None
        if self.dp_rank == 0:
            self._set_version(0)
        self._broadcast = None  # weights.transport=broadcast: rank 0's sender (docs/design.md §8)
        if self.dp_rank == 0 and config.weights.transport == "broadcast":
            from realrl.system.weight_broadcast import BroadcastPublisher

            self._broadcast = BroadcastPublisher(
                config.weights,
                self.actor.model,
                self.save_dtype,
                self._write_version,
                self.experiment_name,
                self.trial_name,
                self.bind_host,
            )
            if not self.cfg.fsdp:  # (under FSDP a version's tensors are gathered at each publish)
                self._broadcast.prepare()
        if self.dp_rank == 0 and self._broadcast is None:  # (broadcast: its sender's thread announces)
            self._announcer = VersionAnnouncer(self._announce_version)
        self.logger.info(
            "actor with %.2fM parameters (%.3fM trainable%s) on %s; dp %d/%d",
            sum(p.numel() for p in actor.parameters()) / 1e6,
            sum(p.numel() for p in actor.parameters() if p.requires_grad) / 1e6,
            f": LoRA rank {config.lora.rank} on {sorted(actor.peft_config['default'].target_modules)}"
            if self.lora
            else "",
            self.device,
            self.dp_rank,
            self.dp_size,
        )

    def _init_distributed(self) -> None:
        self.data_group = None  # gloo group that moves trajectories between ranks
        if self.dp_size <= 1 and not self.cfg.fsdp:  # FSDP needs a process group, even of one
            return
        key = names.distributed_init(self.experiment_name, self.trial_name, "model_worker")
        if self.dp_rank == 0:
            port = network.find_free_port(self.experiment_name, self.trial_name, host=self.bind_host)
            name_resolve.add(key, f"{self.bind_host}:{port}", replace=True)
        addr = name_resolve.wait(key, timeout=300)
        backend = "nccl" if self.cfg.device == "cuda" else "gloo"
        # gloo would otherwise pick the interface of the hostname's address
        os.environ.setdefault("GLOO_SOCKET_IFNAME", network.interface_of(self.bind_host))
        dist.init_process_group(backend, init_method=f"tcp://{addr}", rank=self.dp_rank, world_size=self.dp_size)
        if self.dp_size > 1:
            self.data_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        self.logger.info("joined %s process group at %s", backend, addr)

    def _all_reduce_sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.dp_size > 1:
            x = x.clone()
            dist.all_reduce(x)
        return x

    def _sync_grads(self, model: torch.nn.Module) -> None:
        """Sums gradients over data-parallel ranks in one flat all-reduce (FSDP
        reduces its own, as a mean, so its loss is scaled by the world size)."""
        if self.dp_size <= 1 or self.cfg.fsdp:
            return
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a rank with no data this minibatch still joins
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def _set_version(self, version: int) -> None:
        self.version = version
        if self._announcer is not None:  # (the step goes on: the write is the announcer thread's)
            self._announcer.announce(version)
        else:
            self._announce_version(version)

    def _announce_version(self, version: int) -> None:
        """`model_version/actor` = version (any thread): its directory is on disk, unless
        it went through a broadcast group (docs/design.md §8)."""
        name_resolve.add(
            names.model_version(self.experiment_name, self.trial_name, ACTOR),
            str(version),
            replace=True,
            delete_on_exit=False,
        )

    # ---- loop ----------------------------------------------------------------------------
    def _poll(self) -> PollResult:
        handled = self.server.serve(timeout=0.05)
        return PollResult(batch_count=handled)

    def _progress_info(self) -> dict:
        stats = self.dataset.stats()
        return {
            "buffered": stats["buffered"],
            "received": stats["received"],
            "version": self.version,
            "requests": self.server.n_pending,
        }

    def _exit_hook(self) -> None:
        if getattr(self, "_announcer", None) is not None:
            try:
                self._announcer.close()  # the version handed over last is written
            except RuntimeError as e:  # (e.g. the name service gone as an aborted trial ends: no one to tell)
                self.logger.warning("%s", e)
        if getattr(self, "_broadcast", None) is not None:
            self._broadcast.close()  # versions still queued go out
        for closer in ("server", "dataset"):
            obj = getattr(self, closer, None)
            if obj is not None:
                obj.close()
        if getattr(self, "_idle_cores", None) is not None:
            self._idle_cores.stop()
        if dist.is_initialized():
            dist.destroy_process_group()

    # ---- cheap handles -------------------------------------------------------------------
    def _handle_spec(self, data=None) -> dict:
        spec = {
            "dp_rank": self.dp_rank,
            "dp_size": self.dp_size,
            "version": self.version,
            "n_params": sum(p.numel() for p in self.actor.model.parameters()),
            # Whether `inference` runs a model for the decoupled loss (else `train_step` prepares the batch).
            "inference_computes": self.trainer.inference_computes(decoupled=True),
            **self.dataset.stats(),
        }
        if data and data.get("checksum"):  # compared by dp_weights_identical
            model = self.actor.model
            spec["checksum"] = local_shard_checksum(model) if self.cfg.fsdp else weights_checksum(model)
            if self.cfg.fsdp and self.dp_rank == 0:
                spec["expected_shard_checksums"] = self.expected_shard_checksums
        return spec

    def _handle_stats(self, data=None) -> dict:
        return self.dataset.stats()

    def _handle_inventory(self, data: dict) -> dict:
        """Drops buffered trajectories staler than `min_version` and describes
        the `limit` oldest left, for the master to choose the step's batch."""
        items, dropped = self.dataset.inventory(int(data["min_version"]), int(data["limit"]))
        return {"items": items, "n_dropped": dropped, "invalid": self.dataset.n_invalid}

    # ---- long handles --------------------------------------------------------------------
    def _handle_assemble(self, data: dict) -> dict:
        """This rank's share of the step's batch. `take` lists the keys of this
        rank's buffer that go into the batch and `send_to` the rank each goes
        to (this rank or another); `recv_from[r]` is how many come from rank r.
        Returns what the master logs about the trajectories this rank trains.
        A single rank's form, `oldest: B` with `min_version`: `inventory` and
        the take in one request: the B oldest are the batch once it holds B
        (else `held`, and nothing is taken); `n_dropped` and `invalid` as
        `inventory` reports them."""
        if "oldest" in data:
            want = int(data["oldest"])
            items, dropped = self.dataset.inventory(int(data["min_version"]), want)
            counts = {"n_dropped": dropped, "invalid": self.dataset.n_invalid}
            if len(items) < want:
                return {"held": len(items), **counts}
            keys = [item[0] for item in items]
            take = {"take": keys, "send_to": [self.dp_rank] * len(keys), "recv_from": {}}
            return {**self._handle_assemble({**take, "current_version": data["current_version"]}), **counts}
        keys, dests = [int(k) for k in data["take"]], [int(r) for r in data["send_to"]]
        taken = self.dataset.take(keys)
        outgoing: dict[int, list[Trajectory]] = {}
        for traj, dest in zip(taken, dests):
            outgoing.setdefault(dest, []).append(traj)
        mine = outgoing.pop(self.dp_rank, [])
        recv_from = {int(r): int(n) for r, n in data["recv_from"].items() if int(r) != self.dp_rank and int(n)}
        if outgoing or recv_from:
            mine += self._exchange(outgoing, recv_from)
        self.step_trajectories = mine
        # The batch is built here, not in the train step: with one rank the master asks for it
        # right behind the previous train step, while it reads that step's reply.
        self._assembled = SequenceBatch.from_trajectories(mine)
        current = int(data["current_version"])
        return {
            "staleness": [current - t.min_version_start for t in mine],
            "version_start": [t.min_version_start for t in mine],
            "rewards": [r for t in mine for r in t.reward],
            "qids": [t.qid for t in mine],  # the stats' record of what trained
            "scores": [float(x) for t in mine for x in t.scores],
            # the most generate() calls one episode had in flight at once
            "generate_in_flight": [float(t.metadata.get("max_generate_in_flight", 1)) for t in mine],
            "seq_lens": [n for t in mine for n in t.seq_lens],
            "gen_lens": [n for t in mine for n in _sampled_lens(t)],  # sampled tokens: context inside excluded
            "n_tokens": sum(t.n_tokens for t in mine),
            "n_moved_out": sum(len(v) for v in outgoing.values()),
            "token_staleness": _token_staleness(mine, current),
            "env": _env_sums(mine),
        }

    def _exchange(self, outgoing: dict[int, list[Trajectory]], recv_from: dict[int, int]) -> list[Trajectory]:
        """Point-to-point over the data group: sizes first, then the payloads
        (wire format). Every rank posts all its sends and receives before it
        waits, so no order of ranks can deadlock."""
        group = self.data_group
        payloads = {
            r: torch.frombuffer(bytearray(wire.dumps([t.to_wire() for t in trajs])), dtype=torch.uint8)
            for r, trajs in outgoing.items()
        }
        sizes_out = {r: torch.tensor([len(p)], dtype=torch.int64) for r, p in payloads.items()}  # alive until sent
        sizes_in = {r: torch.zeros(1, dtype=torch.int64) for r in recv_from}
        works = [dist.isend(t, dst=r, group=group) for r, t in sizes_out.items()]
        works += [dist.irecv(t, src=r, group=group) for r, t in sizes_in.items()]
        for w in works:
            w.wait()
        buffers = {r: torch.empty(int(t.item()), dtype=torch.uint8) for r, t in sizes_in.items()}
        works = [dist.isend(p, dst=r, group=group) for r, p in payloads.items()]
        works += [dist.irecv(b, src=r, group=group) for r, b in buffers.items()]
        for w in works:
            w.wait()
        received: list[Trajectory] = []
        for r, buf in sorted(buffers.items()):
            view = memoryview(buf.numpy())  # our own rank's message: its size is the limit
            messages = wire.loads(view, max_message_bytes=max(len(view), wire.DEFAULT_MAX_MESSAGE_BYTES))
            if len(messages) != recv_from[r]:
                raise RuntimeError(f"rank {r} sent {len(messages)} trajectories, the plan says {recv_from[r]}")
            received += [Trajectory.from_wire(m) for m in messages]
        return received

    def _handle_inference(self, data: dict) -> dict:
        t0 = time.monotonic()
        self.step_batch = self._assembled_batch()
        self.trainer.inference(self.step_batch, decoupled=bool(data.get("decoupled", True)))
        return {"seconds": time.monotonic() - t0}

    def _assembled_batch(self) -> SequenceBatch:
        """The step's batch: `assemble`'s, once."""
        batch, self._assembled = self._assembled, None
        return SequenceBatch.from_trajectories(self.step_trajectories) if batch is None else batch

    def _handle_train_step(self, data: dict) -> dict:
        if self.dp_rank == 0 and getattr(self, "_checkpointed", False):  # a test's trainer dying after a checkpoint
            faults.point("model_worker.step_after_checkpoint")
        t0 = time.monotonic()
        if self.step_batch is None:  # no `inference` request this step: nothing in it runs a model
            self.step_batch = self._assembled_batch()
            self.trainer.inference(self.step_batch, decoupled=bool(data.get("decoupled", False)))
        stats = self.trainer.train_step(self.step_batch)
        stats["train_seconds"] = time.monotonic() - t0
        if self._threads is not None:
            self._threads.step_took(stats["train_seconds"])
        stats["completion_tokens"] = float(self.step_batch.n_completion_tokens())
        # Answers cut by max_new_tokens (no EOS): most of them means the budget is too small.
        stats["length_cut_frac"] = float(self.step_batch.no_eos.float().mean()) if len(self.step_batch.no_eos) else 0.0
        if stats["length_cut_frac"] > 0.5 and not self._warned_length_cut:
            self._warned_length_cut = True
            self.logger.warning(
                "%.0f%% of this step's answers hit rollout.gconfig.max_new_tokens without an EOS: "
                "raise it if the answers are cut (train/length_cut_frac in stats.jsonl; warned once)",
                100 * stats["length_cut_frac"],
            )
        self.step_trajectories, self.step_batch = [], None
        new_version = int(data["version"])
        t1 = time.monotonic()
        state_dict = self._full_state_dict(self.actor.model)  # a collective under FSDP: every rank calls it
        if data.get("last_step", True):  # hashing the full weights costs: the end's check needs the last step's
            self._expect_shards(state_dict)
        self._publish(new_version, state_dict)
        if data.get("last_step", True) and self._announcer is not None:  # (the trial's end looks at it)
            self._announcer.flush()
        stats["publish_seconds"] = time.monotonic() - t1
        if self.dp_rank == self.dp_size - 1 and faults.point("model_worker.weights_drift"):
            nudge_local_weights(self.actor.model)  # a test: this rank's weights drift from the others'
        return stats

    def _publish(self, version: int, state_dict: dict | None, disk_only: bool = False) -> None:
        """Rank 0 writes weight version `version` (in the run's dtype) and
        announces it; the other ranks only take the number. With a broadcast
        epoch, rank 0 snapshots it for the group and the sender's thread
        announces it, written to disk only if the group failed or the manager
        asks (`disk_only`: a resume's version, §8)."""
        if self.dp_rank == 0 and not disk_only and self._broadcast is not None:
            if self._broadcast.publish(version, state_dict, self._announce_version):
                self.version = version
                return
        if self.dp_rank == 0:
            self._write_version(version, state_dict)
            if self._broadcast is not None:
                self._broadcast.written = max(self._broadcast.written, version)
            self._set_version(version)
        else:
            self.version = version

    def _write_version(self, version: int, state_dict: dict) -> None:
        """Version `version`'s directory (from a snapshot on the broadcast sender's thread)."""
        self._versions.publish(self.actor.model, self.cfg.weights_dir, version, state_dict)

    def _full_state_dict(self, model: torch.nn.Module) -> dict | None:
        """The full (unsharded, CPU) state dict under FSDP, of a LoRA model
        only its adapters; None for a plain model, which save_pretrained
        reads itself."""
        return full_state_dict(model) if self.cfg.fsdp else None

    def _expect_shards(self, state_dict: dict | None) -> None:
        """Rank 0 under FSDP: the shard checksums of the weights just gathered."""
        if self.cfg.fsdp and self.dp_rank == 0:
            self.expected_shard_checksums = expected_shard_checksums(self.actor.model, state_dict, self.dp_size)

    def _handle_evaluate(self, data: dict) -> dict:
        """Every test prompt of this rank's share through the run's agent and
        environment, greedy, on this trainer's current weights (the contract:
        realrl/impl/evaluation.py). The master merges the ranks' sums (eval_metrics.merge)."""
        from realrl.impl.eval_metrics import samples, summarize

        t0 = time.monotonic()
        if self._eval_agent is None:
            self._eval_agent = eval_agent(self.cfg, self.tokenizer)
        model = self.actor.model
        was_training = model.training
        model.eval()
        try:
            prompts, results, generator = evaluate_policy(
                self.cfg,
                self._eval_agent,
                model,
                self.tokenizer,
                self.device,
                self.version,
                self.dp_rank,
                self.dp_size,
                all_ranks_busy=self._all_ranks_busy if self.cfg.fsdp else None,
            )
        finally:
            model.train(was_training)
        return {
            **summarize(results),
            "seconds": time.monotonic() - t0,
            "batches": generator.n_batches,
            "samples": samples(prompts, results),
        }

    def _all_ranks_busy(self, have_batch: bool, running: bool) -> tuple[bool, bool]:
        flags = torch.tensor([float(have_batch), float(running)], device=self.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return bool(flags[0]), bool(flags[1])

    def _handle_save(self, data: dict) -> dict:
        """The trained actor as an HF model directory (and the tokenizer). A
        LoRA actor: its adapter in `<path>/adapter/`, and merged into the base
        weights as a plain HF model in `<path>` (loads without peft)."""
        state_dict = self._full_state_dict(self.actor.model)
        if self.dp_rank == 0:
            path = data["path"]
            os.makedirs(path, exist_ok=True)
            if self.lora:
                adapter = os.path.join(path, "adapter")
                save_model(self.actor.model, adapter, state_dict=state_dict, tokenizer_source=self._source)
                lora.save_merged(adapter, self.cfg.model_path, path, _DTYPES[self.cfg.dtype])
                copy_tokenizer_files(self._source, path)
            else:
                save_model(
                    self.actor.model, path, state_dict=state_dict, tokenizer_source=self._source, dtype=self.save_dtype
                )
        return {"path": data["path"]}

    def _handle_checkpoint(self, data: dict) -> dict:
        """Writes this rank's part of a recovery checkpoint into `dir` (the
        master's temporary directory, which it renames once every part and the
        manifest are there): rank 0 the models, optimizers, schedules and
        version; every rank its buffered trajectories (so none is lost) and
        the keys its puller took (so a copy of one after a resume is
        `restored`, not trained again). The reply is the rollouts complete at
        its puller (all of their trajectories taken: a ledger), for the data
        ledger."""
        directory = data["dir"]
        state = {"actor": trainer_state(self.actor, self.cfg.fsdp)}  # every rank: a collective under FSDP
        if self.critic is not None:
            state["critic"] = trainer_state(self.critic, self.cfg.fsdp)
        buffered, seen, complete = self.dataset.checkpoint()
        with open(os.path.join(directory, f"buffer-rank{self.dp_rank}.wire"), "wb") as f:
            f.write(wire.dumps({"trajectories": [t.to_wire() for t in buffered], "seen": seen.to_wire()}))
        if self.dp_rank == 0:
            torch.save(state, os.path.join(directory, "model_worker.pt"))
            with open(os.path.join(directory, "meta.json"), "w") as f:
                json.dump({"version": self.version, "step": int(data["step"]), "dp_size": self.dp_size}, f)
        self._checkpointed = True
        return {"complete": complete.to_wire(), "buffered": len(buffered)}

    def _handle_load(self, data: dict) -> dict:
        """Restores a checkpoint the master has verified: models, version, and
        the buffered trajectories of the ranks that wrote it (rank files
        spread over this trial's ranks when the data-parallel size changed)."""
        path = data["path"]
        # Our own checkpoint file; weights_only keeps it data-only.
        state = torch.load(os.path.join(path, "model_worker.pt"), map_location="cpu", weights_only=True)
        load_trainer_state(self.actor, state["actor"], self.cfg.fsdp)
        if self.critic is not None and "critic" in state:
            load_trainer_state(self.critic, state["critic"], self.cfg.fsdp)
        with open(os.path.join(path, "meta.json")) as f:
            meta = json.load(f)
        version = int(meta["version"])
        restored, seen = [], KeyLedger()
        for r in range(int(meta.get("dp_size", 1))):
            buffer_path = os.path.join(path, f"buffer-rank{r}.wire")
            if os.path.exists(buffer_path):
                with open(buffer_path, "rb") as f:
                    msg = wire.loads(f.read())
                # Every rank knows every rank's keys: a rollout worker's puller may differ now.
                seen.update(KeyLedger.from_wire(msg.get("seen", {})))
                if r % self.dp_size == self.dp_rank:
                    restored += [Trajectory.from_wire(t) for t in msg["trajectories"]]
        self.dataset.restore(restored, seen)
        state_dict = self._full_state_dict(self.actor.model)
        self._expect_shards(state_dict)
        if self.dp_rank == 0 and self._broadcast is not None:  # (a previous launch's later versions)
            for path in remove_versions_after(self.cfg.weights_dir, version):
                self.logger.info("removed %s: a version after the checkpoint's, of a previous launch", path)
        self._publish(version, state_dict, disk_only=True)  # then a new epoch (docs/design.md §8)
        if self._announcer is not None:  # (announced before the master says where training starts)
            self._announcer.flush()
        return {"version": version, "restored": len(restored)}
