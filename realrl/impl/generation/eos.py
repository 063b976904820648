"""A model's EOS token ids, read from its HF directory without loading weights.

The partial-rollout manager needs them to tell a finished answer from one cut
by length (docs/design.md §6): SGLang checks the length limit before EOS, so an answer
whose last allowed token is EOS comes back as `finish_reason=length`.

Sources, all merged (any may be missing): `eos_token_id` of
`generation_config.json` and of `config.json` (an int, a list or null), and the
tokenizer's `eos_token_id`.
"""

from __future__ import annotations

import json
import os
from typing import Any


def token_ids(value: Any) -> set[int]:
    """An `eos_token_id` value of an HF config (an int, a list or null) as a set."""
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def eos_token_ids_in_dir(model_dir: str, tokenizer: Any = None) -> frozenset[int]:
    """The EOS ids of the model in `model_dir`. `tokenizer` (anything with an
    `eos_token_id`) saves loading one; without it, the directory's tokenizer is
    loaded if it has one (`tokenizer_config.json`)."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if os.path.exists(path):
            with open(path) as f:
                ids |= token_ids(json.load(f).get("eos_token_id"))
    if tokenizer is None and os.path.exists(os.path.join(model_dir, "tokenizer_config.json")):
        from transformers import AutoTokenizer  # heavy: only when needed

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer is not None:
        ids |= token_ids(getattr(tokenizer, "eos_token_id", None))
    return frozenset(ids)
