"""model.dtype=bfloat16 with model.fp32_master (the default): the weights and
Adam's state stay float32 and forward/backward run in bf16 under autocast
(`compute_in`). With the weights themselves in bf16, a small update is lost:
the reason the master exists."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from realrl.impl.ppo.models import compute_in
from realrl.impl.random_models import build_random_model


def moved(model: torch.nn.Module, before: dict) -> float:
    """The fraction of weight elements the step changed."""
    changed = sum(int((p != before[n]).sum()) for n, p in model.named_parameters())
    return changed / sum(p.numel() for p in model.parameters())


def one_step(model: torch.nn.Module, ids: torch.Tensor, lr: float) -> tuple[dict, torch.Tensor]:
    """One AdamW step on the next-token loss; the weights before it and the logits."""
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    logits = model(input_ids=ids).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    loss.backward()
    optimizer.step()
    return before, logits.detach()


def test_a_bf16_run_with_a_float32_master_keeps_the_updates_bf16_weights_lose(tmp_path):
    path = build_random_model("qwen2.5", str(tmp_path / "model"))
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    lr = 1e-6  # an RL learning rate: far below bf16's precision at weights of ~0.02 (about 1e-4)

    pure = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    before, pure_logits = one_step(pure, ids, lr)
    assert moved(pure, before) < 0.05  # only weights near 0 moved: the rest of the update is lost

    master = compute_in(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), "cpu", torch.bfloat16)
    before, logits = one_step(master, ids, lr)
    assert logits.dtype == torch.bfloat16  # the matmuls ran in bf16
    assert all(p.dtype == torch.float32 for p in master.parameters())
    assert moved(master, before) > 0.99  # every weight took its update
    # The same computation as the bf16 model's up to bf16 rounding (autocast keeps norms in float32).
    assert (logits.float() - pure_logits.float()).abs().max() < 0.1
