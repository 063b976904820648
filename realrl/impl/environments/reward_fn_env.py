"""The `"reward-fn"` environment: scores answers with a user's reward function.

    rollout.reward_fn=path/to/task.py:reward      # what a user writes in the config

    def reward(prompt: str, completion: str, answer: str, **row) -> float: ...

`env.step(answers)` calls the function once per answer (all of a step
concurrently) with the prompt text, the answer, the dataset row's `answer`
and its other JSONL fields as keyword arguments, and returns the floats
unchanged (partial credit stays partial). The function runs through
`realrl.impl.reward_fn.RewardFunctionRunner`: a sync function in child
processes, cut off after `timeout_s`; a call that times out, raises or
returns no finite number scores 0 and is counted (`info` of the step:
`reward_timeouts`, `reward_errors`; and `judge_failures` for a function
that takes `judge`, realrl/impl/judge.py: logged as `env/judge_failures`).
"""

from __future__ import annotations

import asyncio
from typing import Any

from realrl.api.agent_api import PromptRecord
from realrl.api.env_api import EnvironmentService, register_environment

# One runner (and its child processes) per function per process: environments
# are made per episode.
_RUNNERS: dict[tuple, Any] = {}


def get_runner(fn: str, timeout_s: float, n_procs: int, plugins: tuple[str, ...] = (), judge: Any = None):
    """The process's runner of `fn`; `judge`: the trial's `JudgeAccess` (make_env gives it), or None."""
    from realrl.impl.reward_fn import RewardFunctionRunner

    key = (fn, timeout_s, n_procs, plugins, id(judge))
    if key not in _RUNNERS:
        _RUNNERS[key] = RewardFunctionRunner(
            fn, timeout_s=timeout_s, n_procs=n_procs, plugins=list(plugins), judge=judge
        )
    return _RUNNERS[key]


def close_runners() -> None:
    """Ends every runner's child processes (they also end at interpreter exit)."""
    for runner in _RUNNERS.values():
        runner.close()
    _RUNNERS.clear()


class RewardFnEnv(EnvironmentService):
    def __init__(
        self,
        fn: str,
        timeout_s: float = 10.0,
        n_procs: int = 2,
        plugins: list[str] | tuple = (),
        judge: Any = None,
    ):
        self.runner = get_runner(fn, timeout_s, n_procs, tuple(plugins), judge)
        self.record: PromptRecord | None = None

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        self.record = (options or {})["prompt"]
        return None, {}

    async def step(self, action: list[str]) -> tuple[Any, list[float], bool, bool, dict]:
        if self.record is None:
            raise RuntimeError("reward-fn env: step() before reset()")
        if isinstance(action, str):
            raise TypeError("reward-fn env step takes a list of answer strings, not one string")
        r = self.record
        outcomes = await asyncio.gather(*(self.runner.score_with_outcome(r.prompt, a, r.answer, r.row) for a in action))
        failed = [failure for _, failure in outcomes]
        info = {"reward_timeouts": failed.count("timeouts"), "reward_errors": failed.count("errors")}
        if self.runner.takes_judge:  # every failure of a function that calls the judge is a judge failure
            info["judge_calls"] = len(action)
            info["judge_failures"] = len(action) - failed.count(None)
        return None, [score for score, _ in outcomes], True, False, info


register_environment("reward-fn", RewardFnEnv)
