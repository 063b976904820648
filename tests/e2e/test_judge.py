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


# An environment class that takes `judge` (a plugin registers it): it asks
# the judge about every answer and reports its calls and failures in `info`.
ENV_PLUGIN = """
import asyncio

from realrl.api.env_api import EnvironmentService, register_environment


class JudgedAnswers(EnvironmentService):
    def __init__(self, judge):
        self.judge = judge

    async def reset(self, seed=None, options=None):
        self.record = options["prompt"]
        return None, {}

    async def ask(self, client, answer):
        try:
            reply = await client.chat.completions.create(
                model="judge",
                messages=[{"role": "user", "content": self.record.prompt + answer + " Correct?"}],
                max_tokens=4,
                temperature=0,
            )
            return reply.choices[0].message.content is not None
        except Exception:
            return False

    async def step(self, answers):
        client = await self.judge()
        answered = await asyncio.gather(*(self.ask(client, a) for a in answers))
        scores = [float(ok and a.strip() == self.record.answer) for ok, a in zip(answered, answers)]
        info = {"judge_calls": len(answers), "judge_failures": answered.count(False)}
        return None, scores, True, False, info


register_environment("judged-answers", JudgedAnswers)
"""


def test_an_environment_that_takes_the_judge(tmp_path, kit_cache):
    """An environment class whose constructor takes `judge` gets the trial's
    judge (`client = await judge()`), in training and in evaluation."""
    (tmp_path / "judged_env.py").write_text(ENV_PLUGIN)
    judge = make_judge(str(tmp_path / "judge"))
    steps = 2
    _, summary, stats = run(
        tmp_path,
        kit_cache,
        "judge-env",
        f"total_train_steps={steps}",
        "eval.every_n_steps=2",
        "eval.max_prompts=8",
        f"plugins=[{tmp_path / 'judged_env.py'}]",
        "rollout.env.type=judged-answers",
        f"judge.model.path={judge}",
        "judge.request_timeout=30",
    )
    consumed = summary["trajectories"]["consumed"]
    assert summary["steps"] == steps and consumed == steps * 16
    assert summary["judge"] == {"calls": consumed * 8, "failures": 0}  # group_size 8 answers per trajectory
    assert [s["env/judge_calls"] for s in stats if "train/actor_loss" in s] == [16.0 * 8] * steps
    assert len(summary["eval_history"]) == 2  # evaluation made the environment too, judge included


AGENT_FILE = """
async def run(client, row, judge):
    reply = await client.chat.completions.create(model="policy", messages=row["messages"], max_tokens=8)
    answer = reply.choices[0].message.content or ""
    verdict = await judge.chat.completions.create(
        model="judge", messages=[{"role": "user", "content": row["prompt"] + answer + " Correct?"}], max_tokens=4
    )
    judged = verdict.choices[0].message.content is not None
    return {"reward": float(answer.strip() == row["answer"]), "judged": float(judged)}
"""


def test_an_agent_function_that_takes_the_judge(tmp_path, kit_cache):
    """`async def run(client, row, judge)`: the agent function gets the judge's client beside its own."""
    (tmp_path / "judged_agent.py").write_text(AGENT_FILE)
    judge = make_judge(str(tmp_path / "judge"))
    _, summary, _ = run(
        tmp_path,
        kit_cache,
        "judge-agent",
        "total_train_steps=1",
        "eval.every_n_steps=0",
        "eval.max_prompts=8",
        f"rollout.agent_fn={tmp_path / 'judged_agent.py'}:run",
        f"judge.model.path={judge}",
    )
    assert summary["steps"] == 1 and summary["trajectories"]["consumed"] == 16
    log = open(os.path.join(tmp_path, "logs", "async-ppo-tiny", "judge-agent", "rollout_worker-0.log")).read()
    assert "'fn/judged': 1.0" in log  # every episode's judge call was answered


def test_bad_judge_config_is_one_line(tmp_path, kit_cache):
    (tmp_path / "judged.py").write_text(REWARD_FILE)
    (tmp_path / "judged_agent.py").write_text(AGENT_FILE)
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
        (
            [f"rollout.agent_fn={tmp_path / 'judged_agent.py'}:run"],
            r"^rollout.agent_fn: takes `judge` but no judge is configured \(judge.model.path\)$",
        ),
        (
            [f"judge.model.path={tmp_path}"],
            r"^judge.model.path: a judge needs rollout.reward_fn or rollout.agent_fn \(a function that takes "
            r"`judge`\) or an environment that takes `judge` \(rollout.env.type='math' does not\)$",
        ),
        (
            [reward, f"judge.model.path={tmp_path}", "judge.request_timeout=10"],
            r"^judge.request_timeout: must be > 0 and < rollout.reward_fn_timeout \(10.0\), got 10.0$",
        ),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            build_experiment(load_config([*base, *overrides]))
