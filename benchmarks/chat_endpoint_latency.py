"""What the OpenAI-compatible endpoint adds to each generation call.

256 concurrent episodes in one process and event loop (as in one rollout
worker), each making 3 calls that continue one conversation, against a
simulated generation path (every call takes `--gen-ms` and returns
`--new-tokens` tokens ending with EOS, as the partial-rollout manager would
answer; no model, so only realrl's own work is measured):

- `direct`: a token-level agent, `await self.generate(prompt_ids + ...)`;
- `endpoint`: an agent function, `await client.chat.completions.create(...)`
  through the real `openai` client and the endpoint (HTTP on 127.0.0.1,
  request parsing, chat-template rendering or stitching, tool-call parsing,
  turn recording, the answer's JSON).

Per call the wall time from the agent's side; the table shows p50 and p99 of
each mode, what the endpoint adds (p50 and p99 of endpoint minus those of
direct), and the process's CPU time per call (client and endpoint share the
event loop, so at high concurrency a call waits for the others' CPU work:
the CPU time is the figure that does not depend on the machine's load).
`--json PATH` writes them with a top-level "ratio" (endpoint p50 / direct
p50). `--quick` runs 64 episodes.

    python benchmarks/chat_endpoint_latency.py [--episodes 256] [--gen-ms 1000] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from realrl.api.agent_api import Agent, AgentSettings, PromptRecord  # noqa: E402
from realrl.api.generation_api import GenerationRequest, GenerationResult  # noqa: E402
from realrl.impl.agents.function_agent import FunctionAgent  # noqa: E402
from realrl.impl.environments.math_env import MathEnv  # noqa: E402
from tests.impl.openai_compat.chat_kit import char_chat_tokenizer  # noqa: E402

TURNS = 3
LATENCIES: dict[str, list[float]] = {"direct": [], "endpoint": []}
TOOLS = [{"type": "function", "function": {"name": "calc", "parameters": {"type": "object"}}}]


class SimulatedGeneration:
    """Answers after `delay_s` with `answer` (token ids ending with EOS)."""

    def __init__(self, answer: list[int], delay_s: float):
        self.answer, self.delay_s = answer, delay_s

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        await asyncio.sleep(self.delay_s)
        n, ids = request.group_size, self.answer
        return GenerationResult(
            request.qid, list(request.prompt_ids), [list(ids)] * n, [[-0.5] * len(ids)] * n, [[0] * len(ids)] * n,
            [False] * n, [0] * n, [0] * n,
        )  # fmt: skip


class DirectAgent(Agent):
    """The same conversation at the token level."""

    async def collect_trajectory(self, prompt, env):
        context = list(prompt.prompt_ids)
        follow = self.tokenizer.encode("<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n")
        for _ in range(TURNS):
            start = time.perf_counter()
            result = await self.generate(context, n=1)
            LATENCIES["direct"].append(time.perf_counter() - start)
            context = context + result.output_ids[0] + follow
        return []


async def episode(client, row):
    """The agent function of the `endpoint` mode."""
    messages = list(row["messages"])
    for _ in range(TURNS):
        start = time.perf_counter()
        reply = await client.chat.completions.create(model="m", messages=messages, tools=TOOLS)
        LATENCIES["endpoint"].append(time.perf_counter() - start)
        messages += [reply.choices[0].message, {"role": "user", "content": "Go on."}]
    return 1.0


async def run_mode(
    agent: Agent, prompts: list[PromptRecord], generator: SimulatedGeneration, calls: list[float]
) -> tuple[float, float]:
    """Wall and CPU seconds of all episodes together, after 4 episodes that
    warm up (imports, template caches; `calls` is cleared of theirs)."""
    await asyncio.gather(*(agent.run_episode(p, MathEnv(), generator) for p in prompts[:4]))
    calls.clear()
    wall, cpu = time.perf_counter(), time.process_time()
    await asyncio.gather(*(agent.run_episode(p, MathEnv(), generator) for p in prompts))
    return time.perf_counter() - wall, time.process_time() - cpu


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1] if len(values) > 1 else values[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--gen-ms", type=float, default=1000.0)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-chars", type=int, default=400)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    episodes = 64 if args.quick else args.episodes

    tokenizer = char_chat_tokenizer()
    with tempfile.TemporaryDirectory() as model_dir:
        tokenizer.save_pretrained(model_dir)
        settings = AgentSettings(tokenizer_path=model_dir, tokenizer=tokenizer, gconfig={"max_new_tokens": 256})
        answer = tokenizer.encode(("It is " * 20)[: args.new_tokens - 1], add_special_tokens=False)
        generator = SimulatedGeneration(answer + [tokenizer.eos_token_id], args.gen_ms / 1000)
        text = ("Q: what is 12+30? " * 40)[: args.prompt_chars]
        messages = [{"role": "user", "content": text}]
        prompt_ids = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True, return_dict=False)
        prompts = [
            PromptRecord(qid=f"q{i}@0", prompt=text, prompt_ids=list(prompt_ids), solutions=["42"])
            for i in range(episodes)
        ]
        function_agent = FunctionAgent(settings, fn=f"{os.path.abspath(__file__)}:episode")
        # The agent function is loaded as a module of its own: its calls are recorded there.
        latencies = {
            "direct": LATENCIES["direct"],
            "endpoint": sys.modules[function_agent.fn.__module__].LATENCIES["endpoint"],
        }
        agents = {"direct": DirectAgent(settings), "endpoint": function_agent}
        spent = {mode: asyncio.run(run_mode(agents[mode], prompts, generator, latencies[mode])) for mode in agents}
    rows = {}
    for mode, values in latencies.items():
        wall, cpu = spent[mode]
        rows[mode] = {
            "calls": len(values),
            "p50_ms": 1000 * percentile(values, 50),
            "p99_ms": 1000 * percentile(values, 99),
            "cpu_ms_per_call": 1000 * cpu / len(values),
            "wall_s": wall,
        }
    added = {f"added_{q}_ms": rows["endpoint"][f"{q}_ms"] - rows["direct"][f"{q}_ms"] for q in ("p50", "p99")}
    print(f"{episodes} concurrent episodes x {TURNS} calls, generation {args.gen_ms:g} ms per call")
    print(f"{'mode':10} {'calls':>6} {'p50 ms':>8} {'p99 ms':>8} {'cpu ms/call':>12} {'wall s':>7}")
    for mode, r in rows.items():
        cells = f"{r['p50_ms']:8.1f} {r['p99_ms']:8.1f} {r['cpu_ms_per_call']:12.2f} {r['wall_s']:7.2f}"
        print(f"{mode:10} {r['calls']:6d} {cells}")
    print(f"endpoint adds: p50 {added['added_p50_ms']:.1f} ms, p99 {added['added_p99_ms']:.1f} ms")
    result = {
        "ratio": rows["endpoint"]["p50_ms"] / rows["direct"]["p50_ms"],
        "episodes": episodes,
        "gen_ms": args.gen_ms,
        **added,
        **{f"{mode}_{k}": v for mode, row in rows.items() for k, v in row.items()},
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
