"""An agent with tool calls, and what it measures (a plugin: `plugins=["benchmarks.sim.agent"]`).

`"sim-tool"`: an episode makes `turns` generation calls (one answer each, the
context growing by each answer), and between two calls waits
`tool_latency_s` (uniform in ±50 %) as if a tool ran, so most episodes are
waiting at any moment and many are in flight. Scores are 0: nothing here is
learned. The first `warm_episodes` episodes of the process (the initial fill
of the rollout worker) start at a random phase of a steady state, with
1..`turns` calls left and up to one tool wait before the first, so the load
is steady from the start instead of one burst of first calls.

Measured: the wall time of every call (`via`: through the partial-rollout
manager, the routing and the server; `via_resumed`: such a call that a weight
update interrupted and that resumed on the new version), and of a direct
twin of each: a call made from the same process at the same moment straight
to a random simulated server with the same context and sampling parameters
(`direct`; `direct_resumed`: such a call that a weight update interrupted
after its first token, sent again to the same server with what it had, as a
plain client would).
Twins started at the same moments meet the same moments of the trial: a
call through the runtime starts when its tool wait ends, however late the
event loop wakes it, while a prober at a steady pace starts fewer calls
while the loop is stalled (a late sleep is one tick, not ten) and so misses
the slowest moments (after each new version, while the simulated servers
update). With `probe_interval_s` > 0 a direct call is started that
often instead (not waiting for the previous one). Of each call, the time it
spent outside the servers: its wall time minus what the servers reported
spending on it (`GenerationResult.server_s`, the direct call's
`e2e_latency`). Lines `<via|direct> <wall clock at the end> <seconds>
<seconds outside the servers>` are appended to
`<latency_dir>/rollout-<pid>.txt` about once a second, with the process's
event-loop lateness above 5 ms (`lag`) and garbage-collector pauses (`gc0`,
`gc1`, `gc2` by generation).

`"sim-null"`: an environment that is never asked anything.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time

from realrl.api.agent_api import Agent, AgentSettings, PromptRecord, register_agent
from realrl.api.env_api import EnvironmentService, register_environment
from realrl.api.trajectory import Trajectory
from realrl.base import name_resolve, names
from realrl.impl.generation.client import GenerationClient, GenerationServerError, GenerationServerUnavailable

FLUSH_INTERVAL_S = 1.0
LAG_TICK_S = 0.01  # the event loop's lateness is sampled this often


class NullEnv(EnvironmentService):
    async def step(self, action):
        return None, 0.0, True, False, {}


class ToolAgent(Agent):
    def __init__(
        self,
        settings: AgentSettings | None = None,
        turns: int = 4,
        tool_latency_s: float = 1.0,
        warm_episodes: int = 0,
        latency_dir: str = "",
        experiment: str = "",
        trial: str = "",
        probe_interval_s: float = 0.0,
        seed: int = 0,
    ):
        super().__init__(settings)
        if turns < 1:
            raise ValueError(f"turns must be >= 1, got {turns}")
        self.turns = turns
        self.tool_latency_s = tool_latency_s
        self.warm_episodes = warm_episodes
        self.experiment, self.trial = experiment, trial
        self.probe_interval_s = probe_interval_s
        self._rng = random.Random(seed + os.getpid())
        self._episodes = 0
        self._last_context: list[int] | None = None
        self._lines: list[str] = []
        self._path = os.path.join(latency_dir, f"rollout-{os.getpid()}.txt") if latency_dir else ""
        self._prober: asyncio.Task | None = None
        self._lag_watch: asyncio.Task | None = None
        self._client: GenerationClient | None = None  # the direct calls' own client, and the servers
        self._urls: list[str] = []
        self._probes: set[asyncio.Task] = set()
        self._gc_started = 0.0
        if self._path:  # the process's collector pauses (a full collection over many episodes is long)
            gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_started = time.monotonic()
        else:
            self._record(f"gc{info['generation']}", time.monotonic() - self._gc_started)

    async def _watch_lag(self) -> None:
        """How late the event loop wakes a LAG_TICK_S sleep (lateness above 5 ms is recorded)."""
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LAG_TICK_S)
            late = time.monotonic() - t0 - LAG_TICK_S
            if late > 0.005:
                self._record("lag", late)

    def _record(self, kind: str, seconds: float, outside_s: float | None = None) -> None:
        extra = "" if outside_s is None else f" {outside_s:.6f}"
        self._lines.append(f"{kind} {time.time():.3f} {seconds:.6f}{extra}\n")

    async def collect_trajectory(self, prompt: PromptRecord, env: EnvironmentService) -> list[Trajectory]:
        if self._prober is None and self._path:
            self._prober = asyncio.create_task(self._probe_loop())
            self._lag_watch = asyncio.create_task(self._watch_lag())
        self._episodes += 1
        turns = self.turns
        if self._episodes <= self.warm_episodes:
            turns = self._rng.randint(1, self.turns)
            await asyncio.sleep(self._rng.uniform(0, self.tool_latency_s))
        context = list(prompt.prompt_ids)
        results = []
        for turn in range(turns):
            if turn:
                await asyncio.sleep(self.tool_latency_s * self._rng.uniform(0.5, 1.5))
            self._last_context = context
            if self.probe_interval_s == 0:
                self._probe(context)  # its direct twin, started at the same moment
            t0 = time.monotonic()
            result = await self.generate(context, n=1)
            wall = time.monotonic() - t0
            # (a call whose tokens span two weight versions was interrupted by an update and resumed)
            spanned = len(set(result.output_versions[0])) > 1
            self._record("via_resumed" if spanned else "via", wall, wall - result.server_s[0])
            results.append(result)
            context = context + list(result.output_ids[0])
        zeros = [0.0] * len(results)
        return [Trajectory.from_results(prompt, results, zeros, self.settings.rewards(zeros))]

    async def _probe_loop(self) -> None:
        """Opens the direct calls' client, then starts a direct call every
        probe_interval_s (0: none here, each call through the runtime starts its
        twin), not waiting for the previous one; and flushes the file."""
        root = names.gen_servers(self.experiment, self.trial)
        self._urls = sorted(await asyncio.to_thread(name_resolve.get_subtree, root))
        last_flush = time.monotonic()
        async with GenerationClient(timeout_s=600) as client:
            self._client = client
            try:
                while True:
                    await asyncio.sleep(self.probe_interval_s or FLUSH_INTERVAL_S)
                    if self.probe_interval_s and self._last_context is not None:
                        self._probe(self._last_context)
                    if time.monotonic() - last_flush >= FLUSH_INTERVAL_S:
                        last_flush = time.monotonic()
                        lines, self._lines = self._lines, []
                        with open(self._path, "a") as f:
                            f.writelines(lines)
            finally:
                self._client = None

    def _probe(self, context: list[int]) -> None:
        """A call straight to a random simulated server, with `context` and the runtime calls'
        sampling parameters, in a task of its own (none while the client is not open)."""
        if self._client is None or not self._urls:
            return
        gconfig = self.settings.gconfig
        params = {"max_new_tokens": gconfig.max_new_tokens, "temperature": gconfig.temperature}
        task = asyncio.create_task(self._direct(self._client, self._rng.choice(self._urls), context, params))
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _direct(self, client: GenerationClient, url: str, context: list[int], params: dict) -> None:
        t0 = time.monotonic()
        try:
            server_s, interrupted = await direct_call(client, url, context, params)
        except (GenerationServerError, GenerationServerUnavailable):
            return  # a server going away at the end of the trial
        wall = time.monotonic() - t0
        self._record("direct_resumed" if interrupted else "direct", wall, wall - server_s)


async def direct_call(client: GenerationClient, url: str, context: list[int], params: dict) -> tuple[float, bool]:
    """One generation straight to `url`, as a plain client of one server would make it: an
    answer a weight update interrupted is sent again with what it has, to the same server,
    until it is complete. Returns the seconds the server reported spending on it (summed over
    its requests), and whether it was interrupted after its first token (as a call through the
    runtime is told apart: its tokens span two weight versions)."""
    output: list[int] = []
    server_s, interrupted = 0.0, False
    while True:
        left = params["max_new_tokens"] - len(output)
        result = await client.generate(url, context + output, dict(params, max_new_tokens=left))
        output += result.output_ids
        server_s += result.meta_info.e2e_latency or 0.0
        if result.finish_reason != "abort" or len(output) >= params["max_new_tokens"]:
            return server_s, interrupted
        interrupted = interrupted or bool(output)


register_agent("sim-tool", ToolAgent)
register_environment("sim-null", NullEnv)
