"""Built-in agents; importing this package registers them: `"single-step"`
(also as `"math-single-step"`) and `"math-multi-turn"`."""

from realrl.impl.agents import math_multi_turn, single_step  # noqa: F401
