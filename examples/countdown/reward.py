"""Countdown reward: reach `target` with + - * / and parentheses, using each of
`numbers` at most once (the usual Countdown rule: not every number must be used).

Only the completion's first line counts, stripped. Score:
  1.0  a well-formed expression, only given numbers (each at most as often as
       given), exactly equal to the target;
  0.1 to 0.3  the same but missing the target: 0.1 + 0.2 * closeness, with
       closeness = max(0, 1 - |value - target| / target), so near misses earn a
       little more and an exact hit always earns far more;
  0.0  anything else (garbage, unlisted or reused numbers, division by zero,
       unary minus, over 64 characters).

`answer` (the dataset's demonstration) is not needed: any valid expression counts.
Use it as `rollout.reward_fn=examples/countdown/reward.py:reward`.
"""

from collections import Counter

try:
    from .countdown_expr import ExpressionError, evaluate  # imported as examples.countdown.reward
except ImportError:  # loaded from its file path, with this directory on sys.path
    from countdown_expr import ExpressionError, evaluate


def reward(prompt: str, completion: str, answer: str, numbers: list, target: int, **row) -> float:
    try:
        value, used = evaluate(completion.split("\n", 1)[0].strip())
    except ExpressionError:
        return 0.0
    if Counter(used) - Counter(int(n) for n in numbers):  # a number not given, or used too often
        return 0.0
    target = int(target)
    if value == target:
        return 1.0
    return 0.1 + 0.2 * max(0.0, 1.0 - float(abs(value - target)) / max(abs(target), 1))
