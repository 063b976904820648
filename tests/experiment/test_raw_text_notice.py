"""A model without a chat template trains on raw text: the launcher says so on
its console once, before the trial starts (realrl/experiment/checks.py)."""

from __future__ import annotations

import json
import logging

import pytest

from realrl.api.cli_args import validate
from realrl.experiment.checks import check_environment
from realrl.experiment.config import load_config

TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@pytest.fixture()
def model_dir(tmp_path):
    from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    config = TinyModelConfig(
        hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32, max_position_embeddings=64
    )
    path = tmp_path / "model"
    build_tiny_model(tokenizer, config, seed=1).save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def check(tmp_path, model_dir, *overrides):
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(3)))
    cfg = load_config(
        [
            f"fileroot={tmp_path / 'runs'}",
            f"model.path={model_dir}",
            f"dataset.train_path={data}",
            f"dataset.test_path={data}",
            "rollout.gconfig.max_new_tokens=8",
            *overrides,
        ]
    )
    check_environment(cfg, validate(cfg))


class Console(logging.Handler):
    """What the launcher's loggers print (their handler writes it to stderr)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    def notices(self) -> list[str]:
        lines, self.lines = self.lines, []
        return [line for line in lines if "chat template" in line]


@pytest.fixture()
def console():
    handler = Console()
    logging.getLogger("realrl").addHandler(handler)
    yield handler
    logging.getLogger("realrl").removeHandler(handler)


def test_raw_text_prompts_are_said_once_on_the_console(tmp_path, model_dir, console):
    check(tmp_path, model_dir)
    (line,) = console.notices()  # once for both data files
    assert "has no chat template: the prompts reach the model as raw text, e.g. '0+1='" in line
    check(tmp_path, model_dir, "dataset.chat_template=false")  # raw text is meant: nothing to say
    assert console.notices() == []


def test_an_unused_chat_template_is_said_on_the_console(tmp_path, model_dir, console):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    check(tmp_path, model_dir)  # templated: nothing to say
    assert console.notices() == []
    check(tmp_path, model_dir, "dataset.chat_template=false")
    (line,) = console.notices()
    assert "a chat template that the prompts do not use" in line
