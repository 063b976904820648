"""`realrl eval` scores a model exactly as the trainers' evaluation does
(docs/custom_tasks.md, "How evaluation scores a prompt").

A user's run: their own Llama-architecture model with a chat template, their
data written by `datasets.save_to_disk`. The trainers' evaluation is the model
worker's own (`evaluate_policy` with the `ModelWorkerConfig` that
`build_experiment` makes of the training command); `realrl eval` gets only
`model.path` and `dataset.test_path`. Both run the same weights on the same
prompts and must give the same per-prompt scores.

Real parts: a tiny random Llama (the character tokenizer, a chat template),
`datasets.save_to_disk`, the real agent, math environment and verifier.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def user_model(tmp_path_factory) -> str:
    from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    config = TinyModelConfig(
        hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, max_position_embeddings=512
    )
    path = str(tmp_path_factory.mktemp("user_model"))
    model = build_tiny_model(tokenizer, config, seed=5)
    with torch.no_grad():  # digits come up often in its greedy text: answers to score, amid free text
        model.lm_head.weight[[tokenizer.convert_tokens_to_ids(c) for c in "0123456789"]] *= 1.5
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_rows(path: str, answers: list[str]) -> str:
    import datasets

    rows = [{"question": f"What is {i} plus {i}?", "solution": a} for i, a in enumerate(answers)]
    datasets.Dataset.from_list(rows).save_to_disk(path)
    return path


def trainers_evaluation(tmp_path, common: list[str], data: str) -> tuple[list, list]:
    """(prompts, outcomes) of the model worker's evaluation in a trial of this command."""
    from transformers import AutoTokenizer

    from realrl.experiment.build import build_experiment
    from realrl.experiment.config import load_config
    from realrl.impl.ppo.models import load_policy
    from realrl.system.model_worker import eval_agent, evaluate_policy

    cfg = load_config([*common, f"dataset.train_path={data}", f"dataset.test_path={data}", f"fileroot={tmp_path}"])
    (worker,) = [g.config for g in build_experiment(cfg).groups if g.name == "model_worker"]
    tokenizer = AutoTokenizer.from_pretrained(worker.tokenizer_path)
    model = load_policy(worker.model_path, torch.float32, worker.fp32_master, False, torch.device("cpu")).eval()
    with torch.no_grad():
        prompts, outcomes, _ = evaluate_policy(worker, eval_agent(worker, tokenizer), model, tokenizer, "cpu", 0)
    return prompts, outcomes


def test_realrl_eval_scores_a_users_model_and_data_as_training_does(user_model, tmp_path, capsys):
    from realrl.cli.eval import main

    common = [
        f"model.path={user_model}",
        "dataset.prompt_key=question",
        "dataset.answer_key=solution",
        "rollout.gconfig.max_new_tokens=12",
        "train.device=cpu",
    ]
    # Each answer is a number the random model's greedy completion ends in (free text around it),
    # so training's evaluation scores those prompts 1: the data set has something to agree on.
    n = 24
    probe = save_rows(str(tmp_path / "probe"), ["0"] * n)
    _, outcomes = trainers_evaluation(tmp_path / "probe-run", common, probe)
    answers = [(re.findall(r"\d+", o.text) or ["123456789"])[-1] for o in outcomes]
    data = save_rows(str(tmp_path / "test"), answers)

    prompts, trained = trainers_evaluation(tmp_path / "run", common, data)
    assert prompts[0].prompt.startswith("<user>What is 0 plus 0?")  # the chat template rendered it
    assert sum(o.score for o in trained) >= 3, [o.text for o in trained]
    assert any(o.score == 1.0 and o.text.strip() != a for o, a in zip(trained, answers))  # free text scored

    out = tmp_path / "eval.json"
    assert main([*common, f"dataset.test_path={data}", "--output", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["n"] == n
    assert result["n_correct"] == sum(o.score >= 1.0 for o in trained)
    assert result["score_sum"] == pytest.approx(sum(o.score for o in trained))
    assert [s["completion"] for s in result["samples"]] == [o.text for o in trained[:3]]


@pytest.mark.parametrize("dataset_sha256, answer_format", [("", "exact"), ("ab12", None)])
def test_the_kits_synthetic_test_file_is_scored_as_bare_numbers(tmp_path, dataset_sha256, answer_format):
    """Training on the kit's synthetic arithmetic checks bare numbers; `realrl
    eval` of the kit's test file does too, and of a kit warm-started on a
    user's data set (a copy of it: `dataset_sha256`) does not."""
    from realrl.experiment.config import env_config, load_config

    (tmp_path / "kit.json").write_text(json.dumps({"recipe": {"dataset_sha256": dataset_sha256}}))
    (tmp_path / "test.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    env = env_config(load_config([f"dataset.test_path={tmp_path / 'test.jsonl'}"]))
    assert env.args.get("answer_format") == answer_format
    assert env_config(load_config([])).args == {"answer_format": "exact"}  # training on the kit's own data
