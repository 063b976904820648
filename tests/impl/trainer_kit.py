"""Helpers for the PPOTrainer tests: a trainer over a tiny HF Llama, synthetic
batches, and the child entry point of the data-parallel tests.

    python -m tests.impl.trainer_kit SPEC.json RANK OUT.pt

runs `steps` x (inference + train_step) on the SPEC's data for RANK in a
`world_size`-rank process group on 127.0.0.1 and saves the stats, the
per-model forward counts and the full (unsharded) weights to OUT.pt.

Modes:
  plain - gradients summed by one flat all-reduce (the ModelWorker's non-FSDP path)
  hook  - plain, plus a tiny all-reduce in every forward pass: a stand-in for
          FSDP's per-forward collectives
  fsdp  - FSDP2 per decoder layer, loss scaled by the world size (as ModelWorker)

With `checksums` in the SPEC, OUT.pt also holds the rank's weights report
(`weights_report`; `perturb_rank` nudges that rank's shard).
"""

from __future__ import annotations

import collections
import datetime
import json
import random
import sys

import torch
import torch.distributed as dist

from realrl.api.cli_args import LoraConfig, PPOConfig
from realrl.base.process import exit_process
from realrl.impl import lora
from realrl.impl.ppo.batch import SequenceBatch
from realrl.impl.ppo.models import AdapterDisabled, CriticModel
from realrl.impl.ppo.trainer import PPOTrainer, make_optimized


def make_groups(
    seed: int,
    n_groups: int,
    group_size: int,
    prompt_len: tuple[int, int],
    gen_len: tuple[int, int],
    vocab: int = 64,
    shared_prompt: bool = False,
) -> list[list[dict]]:
    """Random trajectories as JSON-able dicts: one list of sequences per group.
    Rewards are 0/1 with both values in every group (a GRPO learning signal).
    `shared_prompt`: a group's answers follow one prompt (as sampled groups do)."""
    rng = random.Random(seed)
    groups = []
    for _ in range(n_groups):
        group = []
        prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(*prompt_len))]
        for k in range(group_size):
            if not shared_prompt:
                prompt = [rng.randrange(2, vocab) for _ in range(rng.randint(*prompt_len))]
            P, G = len(prompt), rng.randint(*gen_len)
            group.append(
                {
                    "ids": prompt + [rng.randrange(2, vocab) for _ in range(G)],
                    "prompt_len": P,
                    # near the random model's own logprobs, so importance weights stay near 1
                    "behav": [-4.2 + 0.1 * rng.gauss(0, 1) for _ in range(G)],
                    "reward": float(k % 2),
                    "no_eos": rng.random() < 0.3,
                }
            )
        groups.append(group)
    return groups


def make_batch(groups: list[list[dict]]) -> SequenceBatch:
    input_ids, prompt_lens, behav, rewards, no_eos, index = [], [], [], [], [], []
    for group in groups:
        index.append(list(range(len(input_ids), len(input_ids) + len(group))))
        for s in group:
            input_ids.append(torch.tensor(s["ids"], dtype=torch.long))
            prompt_lens.append(s["prompt_len"])
            behav.append(torch.tensor(s["behav"], dtype=torch.float32))
            rewards.append(s["reward"])
            no_eos.append(s["no_eos"])
    return SequenceBatch(
        input_ids,
        prompt_lens,
        behav,
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(no_eos, dtype=torch.bool),
        index,
    )


def shard(model: torch.nn.Module) -> None:
    """FSDP2 per decoder layer, then the rest (as ModelWorker's `_shard`)."""
    from torch.distributed.fsdp import fully_shard

    inner = lora.base_model(model)
    body = getattr(inner, "model", None) or getattr(inner, "backbone", None)
    for layer in body.layers:
        fully_shard(layer)
    fully_shard(inner)


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over ranks (as ModelWorker's hook)."""
    x = x.clone()
    dist.all_reduce(x)
    return x


def sync_grads(model: torch.nn.Module) -> None:
    """Sum gradients over ranks in one flat all-reduce (as ModelWorker without FSDP)."""
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset : offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def build_trainer(
    model_dir: str,
    ppo: PPOConfig,
    device: torch.device,
    mode: str = "plain",
    process_group=None,
    attn_implementation: str = "sdpa",
    lora_rank: int = 0,
) -> tuple[PPOTrainer, collections.Counter]:
    """A trainer over the tiny model in `model_dir`, and a Counter of the
    forward passes of each of its models ('actor', 'critic', 'ref').
    `lora_rank` > 0: the actor trains LoRA adapters (initialised alike on
    every rank), the reference is its base (adapters off)."""
    from transformers import AutoModelForCausalLM

    world = dist.get_world_size(process_group) if process_group is not None else 1

    def optimized(model):
        return make_optimized(model, 1e-3, 0.0, (0.9, 0.999), 1e-8, "constant", 0, 10)

    load = dict(dtype=torch.float32, attn_implementation=attn_implementation)
    actor = AutoModelForCausalLM.from_pretrained(model_dir, **load).to(device)
    critic = CriticModel.from_pretrained(model_dir, device=device, **load) if ppo.adv_estimator == "gae" else None
    if lora_rank:
        torch.manual_seed(0)
        actor = lora.wrap(actor, LoraConfig(rank=lora_rank, alpha=2 * lora_rank))
    ref = None
    use_ref = ppo.kl_ctl > 0 or ppo.use_kl_loss
    if use_ref and lora_rank:
        ref = AdapterDisabled(actor)
    elif use_ref:
        ref = AutoModelForCausalLM.from_pretrained(model_dir, **load).to(device)
        ref.requires_grad_(False).eval()
    if mode == "fsdp":
        for model in (actor, critic):
            if model is not None:
                shard(model)

    forwards: collections.Counter = collections.Counter()
    for name, model in (("actor", actor), ("critic", critic), ("ref", ref)):
        if model is None or (name == "ref" and lora_rank):  # (the reference runs the actor: counted there)
            continue

        def count(module, args, name=name):
            forwards[name] += 1
            if mode == "hook":  # ranks with unequal forward counts hang here
                dist.all_reduce(torch.ones(1, device=device), group=process_group)

        model.register_forward_pre_hook(count)

    trainer = PPOTrainer(
        optimized(actor),
        ppo,
        temperature=1.0,
        device=device,
        gradient_clipping=1.0,
        critic=optimized(critic) if critic is not None else None,
        ref=ref,
        all_reduce_sum=all_reduce_sum if world > 1 else (lambda x: x),
        sync_grads=sync_grads if mode != "fsdp" and world > 1 else (lambda m: None),
        process_group=process_group,
        loss_scale=float(world) if mode == "fsdp" else 1.0,
        max_new_tokens=16,
    )
    forwards.clear()  # the constructor's shared-prompt probe is not a step's forward
    return trainer, forwards


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter unsharded (a collective under FSDP: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if isinstance(p, DTensor) else p
        out[name] = t.detach().cpu().clone()
    return out


def weights_report(model: torch.nn.Module, rank: int, world: int, perturb_rank: int | None) -> dict:
    """What this rank's ModelWorker `spec` reports for the weights check
    after a train step under FSDP: rank 0 gathers the full weights and
    expects every rank's shard checksum from them (as `_handle_train_step`),
    then every rank checksums its own shard. `perturb_rank`'s shard is
    nudged in between: a rank whose weights diverged after the step."""
    from realrl.system.model_worker import full_state_dict
    from realrl.system.weights_check import expected_shard_checksums, local_shard_checksum, state_checksum

    full = full_state_dict(model)  # a collective: every rank calls it
    report = {"dp_rank": rank}
    if rank == 0:
        report["expected_shard_checksums"] = expected_shard_checksums(model, full, world)
        report["full_checksum"] = state_checksum(full)
    if rank == perturb_rank:
        with torch.no_grad():
            name, p = next((n, p) for n, p in model.named_parameters() if n.endswith("q_proj.weight"))
            p.to_local()[0, 0] += 1e-3
    report["checksum"] = local_shard_checksum(model)
    return report


def run_steps(trainer: PPOTrainer, groups: list[list[dict]], steps: int) -> list[dict[str, float]]:
    stats = []
    for _ in range(steps):
        batch = make_batch(groups)
        trainer.inference(batch, decoupled=True)
        stats.append(trainer.train_step(batch))
    return stats


def main(spec_path: str, rank: int, out_path: str) -> None:
    spec = json.load(open(spec_path))
    torch.set_num_threads(1)
    world = spec["world_size"]
    if spec["device"] == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if spec["device"] == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{spec['port']}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=spec.get("pg_timeout", 60)),
    )
    try:
        trainer, forwards = build_trainer(
            spec["model_dir"],
            PPOConfig(**spec["ppo"]),
            device,
            spec["mode"],
            dist.group.WORLD,
            lora_rank=spec.get("lora_rank", 0),
        )
        stats = run_steps(trainer, spec["data"][rank], spec["steps"])
        weights = {"actor": full_weights(trainer.actor.model)}
        if trainer.critic is not None:
            weights["critic"] = full_weights(trainer.critic.model)
        result = {"stats": stats, "forwards": dict(forwards), "weights": weights}
        if spec.get("checksums"):
            result["spec"] = weights_report(trainer.actor.model, rank, world, spec.get("perturb_rank"))
        torch.save(result, out_path)
        # Both ranks done before either tears gloo down: one rank destroying the
        # group while the other still talks to it can abort (std::terminate) in gloo.
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
    exit_process(0)  # the test waits for both ranks: not through the interpreter's teardown of torch
