"""Fixtures shared by the system tests."""

from __future__ import annotations

import pytest

from realrl.impl.math_data import MathDataRecipe, write_math_dataset
from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model

TINY = TinyModelConfig(hidden_size=64, num_layers=2, num_heads=2, intermediate_size=128, max_position_embeddings=2048)


@pytest.fixture(scope="session")
def tiny_kit(tmp_path_factory) -> dict:
    """A random-init tiny Llama + char tokenizer (one HF directory) and a small
    arithmetic data set. Accuracy is irrelevant here; mechanics are not."""
    root = tmp_path_factory.mktemp("rollout_kit")
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, TINY, seed=3)
    model_dir = str(root / "model")
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    train_path, _ = write_math_dataset(str(root / "data"), MathDataRecipe(seed=2, n_train=40, n_test=4))
    return {"model_dir": model_dir, "train_path": train_path, "eos": tokenizer.eos_token_id, "root": str(root)}
