"""A multi-turn agent with a calculator tool, written against the OpenAI chat API.

    python training/main_async_ppo.py rollout.agent_fn=examples/tool_agent/agent.py:run

Up to two turns per episode. A turn may call `calc`; its result comes back as
a tool message and the model goes on. A wrong answer gets the question asked
again. Full credit for the right number within the two turns.
"""

import ast
import json
import operator

CALC = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression of integers with + - *.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    },
}
OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calc(expression: str) -> str:
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(expression)

    try:
        return str(value(ast.parse(expression.strip()[:64], mode="eval").body))
    except (ValueError, SyntaxError, RecursionError):
        return "error"


async def run(client, row):
    messages, tool_calls = list(row["messages"]), 0
    for turn in (1, 2):
        reply = await client.chat.completions.create(model="policy", messages=messages, tools=[CALC], max_tokens=64)
        message = reply.choices[0].message
        messages.append(message)
        if message.tool_calls:
            tool_calls += 1
            call = message.tool_calls[0]
            try:
                result = calc(str(json.loads(call.function.arguments).get("expression", "")))
            except (ValueError, AttributeError):
                result = "error"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        elif (message.content or "").strip() == str(row["answer"]).strip():
            return {"reward": 1.0, "turns": turn, "tool_calls": tool_calls}
        else:
            messages.append({"role": "user", "content": row["messages"][-1]["content"]})
    return {"reward": 0.0, "turns": 2, "tool_calls": tool_calls}
