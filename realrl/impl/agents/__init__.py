"""Built-in agents; importing this package registers them: `"single-step"`
(also as `"math-single-step"`), `"math-multi-turn"`, and the chat-API agents
`"function"` (`rollout.agent_fn`) and `"external"`."""

from realrl.impl.agents import function_agent, math_multi_turn, single_step  # noqa: F401
