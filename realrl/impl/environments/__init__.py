"""Built-in environments; importing this package registers them: `"math"` and
`"reward-fn"` (a user's reward function, `rollout.reward_fn`)."""

from realrl.impl.environments import math_env, reward_fn_env  # noqa: F401
