"""Built-in agents; importing this package registers them:
`"math-single-step"` and `"math-multi-turn"`."""

from realrl.impl.agents import math_multi_turn, math_single_step  # noqa: F401
