"""The models the trainer drives: the critic, the base model under a LoRA
actor (the KL reference), the forward passes that give per-completion-token
logprobs and values, and what a model supports (randomness in train mode,
shared-prompt rows: each checked on a tiny probe)."""

from __future__ import annotations

import torch
import torch.nn as nn

from realrl.base.logging import getLogger
from realrl.impl.ppo.batch import MicroBatch, SequenceBatch, make_micro_batch
from realrl.impl.ppo.logprobs import entropy_from_logits, gather_logprobs
from realrl.impl.weights.in_memory import in_own_memory

logger = getLogger("ppo")


def train_forward_is_deterministic(model: nn.Module, fn, device: torch.device) -> bool:
    """Whether `model`'s train-mode forward is the same function as its eval
    one, decided from what it does, not from its config's key names: no
    dropout module with p > 0, and on a tiny probe two train-mode forwards
    (`fn(model, micro_batch)`) are bit-equal and match an eval-mode one. A
    dropout applied functionally (e.g. Llama's `attention_dropout`) or MoE
    router jitter shows in the probe. The RNG state is left as it was. False
    errs on the safe side (a separate proximal pass)."""
    if any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules()):
        return False
    ids = torch.randint(0, int(text_config(model.config).vocab_size), (12,), generator=torch.Generator().manual_seed(1))
    batch = SequenceBatch(
        [ids[:6], ids[6:]],
        [3, 3],
        [torch.zeros(3), torch.zeros(3)],
        torch.zeros(2),
        torch.zeros(2, dtype=torch.bool),
        [[0], [1]],
    )
    mb = make_micro_batch(batch, [[0], [1]], device)
    was_training = model.training
    devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            model.train()
            first, second = fn(model, mb).float(), fn(model, mb).float()
            model.eval()
            evaluated = fn(model, mb).float()
    finally:
        model.train(was_training)
    if not torch.equal(first, second):
        return False
    return bool(torch.allclose(first, evaluated, rtol=1e-3, atol=1e-3))


class CriticModel(nn.Module):
    """A value model: the policy's transformer body plus a scalar head."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    @classmethod
    def from_pretrained(
        cls, path: str, dtype: torch.dtype, device: torch.device | str = "cpu", **kwargs
    ) -> CriticModel:
        """The value model on `device`, trained from there (on the CPU: in
        memory of its own, else its first optimizer step copies every page
        out of the checkpoint file: `in_own_memory`)."""
        from transformers import AutoModel

        backbone = AutoModel.from_pretrained(path, dtype=dtype, **kwargs)
        model = cls(backbone, backbone.config.hidden_size).to(dtype=dtype, device=device)
        in_own_memory(model)  # CPU tensors only: on a GPU `.to` has copied them already
        return model

    @property
    def config(self):
        return self.backbone.config

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids
        ).last_hidden_state
        return self.value_head(hidden).squeeze(-1).float()  # [B, T]


def load_policy(path: str, dtype: torch.dtype, fp32_master: bool, lora: bool, device: torch.device) -> nn.Module:
    """The causal LM at `path` as the trainer holds it: with a 16-bit `dtype` and
    `fp32_master` (not LoRA, whose base stays in `dtype`), float32 weights
    computing in `dtype` (`compute_in`), else weights in `dtype`. `realrl eval`
    loads a model this way too, so it scores with the trainer's arithmetic."""
    from transformers import AutoModelForCausalLM

    mixed = fp32_master and dtype != torch.float32 and not lora
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32 if mixed else dtype).to(device)
    if not lora:  # (LoRA's base is never written: it may stay in the mapped file)
        in_own_memory(model)  # on the CPU: else the first optimizer step copies every page out of the file
    if mixed:
        compute_in(model, device.type, dtype)
    return model


def compute_in(model: nn.Module, device_type: str, dtype: torch.dtype) -> nn.Module:
    """Mixed precision: `model`'s forward (so its backward too, and generate)
    runs under torch.autocast in `dtype` while its weights, their gradients and
    the optimizer state stay float32. Matmuls see the weights rounded to
    `dtype`, as the server holding the published `dtype` weights does; an
    update smaller than `dtype`'s precision still accumulates in the float32
    weights. The model object is unchanged otherwise (save_pretrained, FSDP,
    gradient checkpointing, which replays the autocast state)."""
    model.forward = torch.autocast(device_type, dtype=dtype)(model.forward)
    return model


class AdapterDisabled(nn.Module):
    """The base model under a LoRA actor: the actor's forward with its
    adapters switched off (peft's `disable_adapter`), so the KL reference
    needs no second copy of the weights."""

    def __init__(self, actor: nn.Module):
        super().__init__()
        self.actor = actor
        self.train(actor.training)

    @property
    def config(self):
        return self.actor.config

    def forward(self, *args, **kwargs):
        with self.actor.disable_adapter():
            return self.actor(*args, **kwargs)


def forward_logprobs(model: nn.Module, mb: MicroBatch, temperature: float | torch.Tensor) -> torch.Tensor:
    """[n, C] logprobs of each completion token (grad flows when enabled);
    `temperature`: one, or an [n] tensor of one per sequence."""
    logits = model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
    ).logits
    return gather_logprobs(mb.at_sources(logits)[:, :-1], mb.targets, temperature)


def forward_logprobs_and_entropy(
    model: nn.Module, mb: MicroBatch, temperature: float | torch.Tensor, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, C] logprobs of each completion token and the policy's entropy at
    it (with gradient only for an entropy bonus: otherwise a statistic)."""
    logits = model(
        input_ids=mb.input_ids, attention_mask=mb.attention_mask, position_ids=mb.position_ids, use_cache=False
    ).logits
    logits = mb.at_sources(logits)[:, :-1]
    logp = gather_logprobs(logits, mb.targets, temperature)
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach(), temperature)
    return logp, entropy


def forward_values(critic: nn.Module, mb: MicroBatch) -> torch.Tensor:
    """[n, C+1] values at each completion token's source and at the last token."""
    return mb.at_sources(critic(mb.input_ids, mb.attention_mask, mb.position_ids))


def text_config(config):
    """The language model's part of a (possibly multimodal) HF config."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def shared_prompt_mask_kind(model: nn.Module) -> str | None:
    """How a model takes shared-prompt rows: "bool" (SDPA) or "additive"
    (eager) masks; None for attention kernels without custom 4-D masks
    (flash-attention, flex) and for sliding-window attention (a custom mask
    replaces the window), which then train one sequence per row."""
    config = getattr(model, "config", None)
    text = text_config(config)
    if (getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True)) or any(
        "sliding" in str(t) for t in getattr(text, "layer_types", None) or ()
    ):
        return None
    return {"sdpa": "bool", "eager": "additive"}.get(getattr(config, "_attn_implementation", None))


@torch.no_grad()
def shared_rows_match(model: nn.Module, fn, device: torch.device, additive_mask: bool) -> bool:
    """Whether `model` gives a shared-prompt row the outputs of separate rows
    (`fn(model, micro_batch)`: logprobs or values), on a tiny probe: models
    whose positions do not come from position_ids alone (e.g. ALiBi biases
    built from the 2-D mask) fail it and train one sequence per row."""
    ids = torch.randint(0, int(text_config(model.config).vocab_size), (9,), generator=torch.Generator().manual_seed(0))
    seqs = [torch.cat([ids[:4], ids[4:7]]), torch.cat([ids[:4], ids[7:]])]
    batch = SequenceBatch(
        seqs, [4, 4], [torch.zeros(3), torch.zeros(2)], torch.zeros(2), torch.zeros(2, dtype=torch.bool), [[0, 1]]
    )
    was_training = model.training
    model.eval()
    try:
        shared = fn(model, make_micro_batch(batch, [[0, 1]], device, additive_mask=additive_mask)).float()
        separate = fn(model, make_micro_batch(batch, [[0], [1]], device)).float()
    except Exception as e:  # a model that cannot take the rows at all
        logger.info("shared-prompt rows off: %s does not take them (%s: %s)", type(model).__name__, type(e).__name__, e)
        return False
    finally:
        model.train(was_training)
    tol = 1e-4 if shared.dtype == torch.float32 and next(model.parameters()).dtype == torch.float32 else 5e-2
    extra = shared.shape[1] - 3  # values carry the last token's too
    diff = torch.cat([(shared - separate)[0, : 3 + extra], (shared - separate)[1, : 2 + extra]]).abs()
    if diff.max() > tol * (1 + separate.abs().max()):
        logger.info(
            "shared-prompt rows off: %s gives them other outputs than separate rows (max difference %.3g)",
            type(model).__name__,
            float(diff.max()),
        )
        return False
    return True
