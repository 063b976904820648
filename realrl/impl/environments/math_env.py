"""The `"math"` environment: scores a group of answers against a prompt's solutions.

    env = make_env("math", timeout_s=5.0)
    await env.reset(options={"prompt": record})          # a PromptRecord
    _, rewards, terminated, truncated, info = await env.step(["81", "80", ...])

`rewards` is a list of 0.0/1.0, one per answer, from
`realrl.impl.verifiers.math_verifier`: numeric answers are checked in-process,
LaTeX ones in verifier child processes, all answers of a step concurrently and
each cut off at `timeout_s` (a check that times out or crashes scores 0).
With `answer_format="exact"` (the synthetic arithmetic task) an answer
must be exactly a number, e.g. "81"; the default `"extract"` takes the final
answer out of free text ("... so the answer is \\boxed{81}").
Every `step` verifies the batch it is given against the same solutions and
returns `terminated=True`; a multi-turn agent may call it again for its next
turn's answers. `info` holds `n_correct` and `n_answers`.
"""

from __future__ import annotations

import asyncio
from typing import Any

from realrl.api.agent_api import PromptRecord
from realrl.api.env_api import EnvironmentService, register_environment
from realrl.impl.verifiers.math_verifier import (
    DEFAULT_TIMEOUT_S,
    MathVerifier,
    exact_numeric_score,
    get_default_verifier,
)

ANSWER_FORMATS = ("extract", "exact")


class MathEnv(EnvironmentService):
    def __init__(
        self, timeout_s: float = DEFAULT_TIMEOUT_S, verifier: MathVerifier | None = None, answer_format: str = "extract"
    ):
        if timeout_s <= 0:
            raise ValueError(f"math env timeout_s must be positive, got {timeout_s}")
        if answer_format not in ANSWER_FORMATS:
            raise ValueError(f"math env answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        self.timeout_s = timeout_s
        self.answer_format = answer_format
        # Envs are made per episode; the verifier (and its child processes) is
        # shared by the whole process unless a test injects its own.
        self._verifier = verifier
        self._solutions: list[str] | None = None

    async def reset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]:
        options = options or {}
        if "prompt" in options:
            record: PromptRecord = options["prompt"]
            solutions = record.solutions
        elif "solutions" in options:
            solutions = options["solutions"]
        else:
            raise ValueError("math env reset needs options={'prompt': PromptRecord} (or {'solutions': [...]})")
        if not solutions:
            raise ValueError("math env reset: the prompt has no solutions")
        self._solutions = [str(s) for s in solutions]
        return None, {}

    async def step(self, action: list[str]) -> tuple[Any, list[float], bool, bool, dict]:
        if self._solutions is None:
            raise RuntimeError("math env: step() before reset()")
        if isinstance(action, str):
            raise TypeError("math env step takes a list of answer strings, not one string")
        if self.answer_format == "exact":
            rewards = [exact_numeric_score(a, self._solutions) for a in action]
        else:
            verifier = self._verifier or get_default_verifier()
            rewards = await asyncio.gather(*(verifier.averify(a, self._solutions, self.timeout_s) for a in action))
        rewards = [float(r) for r in rewards]
        n_correct = sum(r > 0.5 for r in rewards)
        return None, rewards, True, False, {"n_correct": n_correct, "n_answers": len(rewards)}


register_environment("math", MathEnv)
