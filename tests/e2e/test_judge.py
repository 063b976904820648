"""A reward from a judge model, end to end through the launcher: a tiny random
judge on its own frozen torch server, called by the reward function through
its `judge` client, for 3 train steps."""

from __future__ import annotations

import glob
import os

import pytest

from realrl.api.cli_args import ConfigError
from realrl.experiment.build import build_experiment
from realrl.experiment.config import load_config
from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_kit_tokenizer, build_tiny_model
from tests.e2e.test_async_ppo import run

# The judge's answer must come back (a failed call raises and scores 0); the
# score itself is the exact-match rule, so training has its usual signal.
REWARD_FILE = """
async def reward(prompt, completion, answer, judge):
    reply = await judge.chat.completions.create(
        model="judge",
        messages=[{"role": "user", "content": prompt + completion + " Correct?"}],
        max_tokens=4,
        temperature=0,
    )
    assert reply.choices[0].message.content is not None
    return float(completion.strip() == answer)

def sync_reward(prompt, completion, answer, judge):
    return 0.0
"""


def make_judge(path: str, chat_template: bool = True) -> str:
    tokenizer = build_kit_tokenizer() if chat_template else build_char_tokenizer()
    model = build_tiny_model(tokenizer, TinyModelConfig(hidden_size=64, num_layers=2, intermediate_size=128), seed=5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_a_judge_rewards_a_short_trial(tmp_path, kit_cache):
    (tmp_path / "task").mkdir()
    (tmp_path / "task" / "judged.py").write_text(REWARD_FILE)
    judge = make_judge(str(tmp_path / "judge"))
    steps = 3
    _, summary, stats = run(
        tmp_path,
        kit_cache,
        "judge",
        f"total_train_steps={steps}",
        "eval.every_n_steps=0",
        "eval.max_prompts=16",
        f"rollout.reward_fn={tmp_path / 'task' / 'judged.py'}:reward",
        f"judge.model.path={judge}",
        "judge.request_timeout=30",
        "rollout.reward_fn_timeout=40",
        "ppo.group_size=8",
    )
    assert summary["steps"] == steps
    consumed = summary["trajectories"]["consumed"]
    assert consumed == steps * 16
    # Every trained answer (group_size 8 per trajectory) was judged, none failed; the same per step.
    assert summary["judge"] == {"calls": consumed * 8, "failures": 0}
    train_steps = [s for s in stats if "train/actor_loss" in s]
    assert [s["env/judge_calls"] for s in train_steps] == [16.0 * 8] * steps
    assert [s["env/judge_failures"] for s in train_steps] == [0.0] * steps
    # The policy's server took the trainer's weights; the judge's never did.
    logs = os.path.join(tmp_path, "logs", "async-ppo-tiny", "judge")
    policy_log = open(glob.glob(os.path.join(logs, "generation_server-0.server.log"))[0]).read()
    judge_log = open(glob.glob(os.path.join(logs, "judge_server-0.server.log"))[0]).read()
    assert "weights updated from" in policy_log
    assert "weights updated from" not in judge_log and "listening on" in judge_log


def test_bad_judge_config_is_one_line(tmp_path, kit_cache):
    (tmp_path / "judged.py").write_text(REWARD_FILE)
    base = [f"fileroot={tmp_path}", f"tiny_kit.cache_dir={kit_cache}", "trial_name=badjudge"]
    reward = f"rollout.reward_fn={tmp_path / 'judged.py'}:reward"
    cases = [
        ([reward], r"^rollout.reward_fn: takes `judge` but no judge is configured \(judge.model.path\)$"),
        (
            [f"rollout.reward_fn={tmp_path / 'judged.py'}:sync_reward", f"judge.model.path={tmp_path}"],
            r"^rollout.reward_fn: takes `judge`, so it must be an `async def` function$",
        ),
        (
            [reward, f"judge.model.path={make_judge(str(tmp_path / 'plain'), chat_template=False)}"],
            r"^judge.model.path=.*: the judge's tokenizer has no chat template$",
        ),
        ([reward, f"judge.model.path={tmp_path}", "judge.n_servers=0"], r"^judge.n_servers: must be >= 1, got 0$"),
        ([f"judge.model.path={tmp_path}"], r"^judge.model.path: a judge needs rollout.reward_fn"),
        (
            [reward, f"judge.model.path={tmp_path}", "judge.request_timeout=10"],
            r"^judge.request_timeout: must be > 0 and < rollout.reward_fn_timeout \(10.0\), got 10.0$",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_experiment(load_config([*base, *overrides]))
