"""Agents written against the OpenAI chat API (docs/design.md §11).

**`"function"`** (`rollout.agent_fn=path/to/agent.py:run` or `pkg.module:run`
sets it): an agent is one async function

    async def run(client: openai.AsyncOpenAI, row: dict) -> float | dict: ...

`client` talks to realrl's OpenAI-compatible endpoint for this episode:
every `client.chat.completions.create(...)` is rendered with the model's chat
template, generated through the run's generation path and recorded token for
token (realrl/impl/openai_compat/). `row` is the dataset row: its fields, and
`messages` always (a plain prompt is one user message), `prompt` and
`answer`. The return value is the episode's raw score (1 = full credit, as a
reward function's), or a dict with the score under `reward` and more named
numbers, which go to the rollout worker's stats. Per prompt the function runs
`group_size` times, as independent episodes; their scores form the group.
The environment (`rollout.env`) is not used.

**`"external"`**: the same episodes, driven by a process outside realrl.
Each waits until an agent takes it (`POST /rl/episodes` on the rollout
worker's endpoint), makes its chat calls at the `base_url` it got, and
closes it with the reward (`POST /rl/episodes/<id>/close`).

An episode of either that has not ended within `rollout.episode_timeout`
(for external agents, `episode_timeout_s` if given) is cancelled, its calls
with it, and dropped from its group (counted `episode_timeouts`; external
ones also `external_timeouts`): a hung agent frees its slot.

Trajectory: one per prompt, one sequence per chain of turns of each episode
(`EpisodeRecorder.sequences("chains")`: the turns that extend each other
token for token; the sampled spans have loss_mask True, the tool results,
user turns and template tokens between them are context), each with its
episode's score and shaped reward. Metadata per sequence: `episode`, and
`turns`, how many chat calls it holds.
The success-rate filter counts episodes. An episode whose function raises
scores nothing: it is left out of the group and counted (`fn_errors`,
logged); a prompt whose every episode failed or made no call is rejected. A
generation failure (the servers failed after their retries) fails the
episode as it would any agent's, whatever the function did with the error
its call got.

Own arguments (`rollout.agent.args`): `fn`, `tool_parser` ("hermes"; see
realrl/impl/openai_compat/tool_calls.py), `max_context_tokens` (prompt +
new tokens of a call; default: the model's `max_position_embeddings`),
`episode_timeout_s` (external only; default `rollout.episode_timeout`).
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import dataclasses
import inspect
import json
import math
import os
import time
from typing import Any

import numpy as np

from realrl.api.agent_api import FULL_CREDIT, Agent, AgentSettings, PromptRecord, register_agent
from realrl.api.env_api import EnvironmentService
from realrl.api.generation_api import GenerationHyperparameters, GenerationResult
from realrl.api.trajectory import Trajectory
from realrl.base.logging import getLogger
from realrl.base.plugins import load_object
from realrl.impl.agents.stats import AgentStats
from realrl.impl.generation.eos import eos_token_ids_in_dir
from realrl.impl.openai_compat.chat import ChatConfig, ChatSession
from realrl.impl.openai_compat.endpoint import ChatEndpoint, shared_endpoint
from realrl.impl.openai_compat.rendering import ChatRenderer
from realrl.impl.openai_compat.tool_calls import TOOL_PARSERS
from realrl.impl.openai_compat.turns import RecordedSequence
from realrl.impl.reward_fn import takes_judge  # the same rule as a reward function's

logger = getLogger(__name__)

LOG_EVERY_S = 60.0  # a failing agent function is logged once, then at most this often


def load_agent_fn(spec: str) -> Any:
    """The async function `spec` names; ValueError, one line, if it is not one
    that takes (client, row)."""
    if not isinstance(spec, str) or ":" not in spec:
        raise ValueError(f"agent function {spec!r}: not 'path/to/file.py:function' or 'package.module:function'")
    fn = load_object(spec, "agent function")
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(type(fn), "__call__", None))):
        raise ValueError(f"agent function {spec!r}: {getattr(fn, '__name__', fn)!r} is not an async function")
    try:
        if takes_judge(fn):
            inspect.signature(fn).bind(None, None, judge=None)
        else:
            inspect.signature(fn).bind(None, None)
    except TypeError as e:
        raise ValueError(f"agent function {spec!r}: cannot be called as fn(client, row[, judge]): {e}") from None
    except ValueError:
        pass  # no signature to check
    return fn


def episode_row(prompt: PromptRecord) -> dict[str, Any]:
    """What the agent gets as `row`: the dataset row's fields, `messages`
    (the row's, or the prompt as one user message), `prompt` and `answer`."""
    row = dict(prompt.row)
    if not isinstance(row.get("messages"), list):
        row["messages"] = [{"role": "user", "content": prompt.prompt}]
    row.setdefault("prompt", prompt.prompt)
    row.setdefault("answer", prompt.answer)
    return row


def model_positions(model_dir: str | None) -> int | None:
    """`max_position_embeddings` of the model in `model_dir` (None if not stated)."""
    path = os.path.join(model_dir or "", "config.json")
    if not model_dir or not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        value = json.load(f).get("max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


class EpisodeAbandoned(Exception):
    """An episode that ends without a score and is not an error (counted by whoever raises it)."""


@dataclasses.dataclass
class _Episode:
    """What one run of the function left."""

    session: ChatSession
    score: float | None = None  # None: the function failed
    extras: dict[str, float] = dataclasses.field(default_factory=dict)


class FunctionAgent(Agent):
    uses_chat_endpoint = True  # the rollout worker serves the endpoint for its whole life

    def __init__(
        self,
        settings: AgentSettings | None = None,
        fn: str = "",
        tool_parser: str = "hermes",
        max_context_tokens: int | None = None,
        judge: dict | None = None,
    ):
        super().__init__(settings)
        self.fn = self._load_fn(fn)
        # A function that takes `judge` gets the trial's judge model's client (realrl/impl/judge.py).
        self.judge = None
        if takes_judge(self.fn):
            if judge is None:
                raise ValueError(f"agent function {fn!r} takes `judge` but no judge is configured (judge.model.path)")
            from realrl.impl.judge import judge_access

            self.judge = judge_access(judge)
        tokenizer = self.tokenizer
        path = self.settings.tokenizer_path
        eos = eos_token_ids_in_dir(path, tokenizer) if path else {tokenizer.eos_token_id}
        self.chat_config = ChatConfig(
            tokenizer=tokenizer,
            renderer=ChatRenderer(tokenizer, eos | set(self.settings.gconfig.stop_token_ids)),
            gconfig=self.settings.gconfig,
            tool_parser=TOOL_PARSERS.get(tool_parser),
            max_context_tokens=max_context_tokens or model_positions(path),
            served=self.settings.served,
        )
        self.stats = AgentStats()
        self.counters: collections.Counter = collections.Counter()
        self.extras: collections.defaultdict = collections.defaultdict(list)
        self._last_logged = -math.inf
        self._errors = 0  # agent functions that raised, over the process's life
        self._reasons_seen: set[str] = set()  # why prompts were rendered, each logged once

    def _load_fn(self, spec: str) -> Any:
        return load_agent_fn(spec)

    def pop_stats(self) -> dict[str, float]:
        stats = self.stats.pop()
        stats.update({k: float(v) for k, v in self.counters.items()})
        stats.update({f"fn/{k}": sum(v) / len(v) for k, v in self.extras.items()})
        self.counters.clear()
        self.extras.clear()
        return stats

    # ---- one prompt -------------------------------------------------------------------
    async def collect_trajectory(self, prompt: PromptRecord, env: EnvironmentService) -> list[Trajectory]:
        row = episode_row(prompt)
        episodes = await asyncio.gather(*(self._episode(prompt, row) for _ in range(self.settings.group_size)))
        done = [e for e in episodes if e.score is not None and e.session.recorder.turns]
        scores = [e.score for e in done]
        self.stats.add_episode(scores)
        for e in done:
            self.counters["turns"] += len(e.session.recorder.turns)
            for how, n in e.session.recorder.prompts.items():
                self.counters["prompts_stitched" if how == "stitched" else "prompts_rendered"] += n
                if how not in self._reasons_seen and how not in ("stitched", "rendered: first call"):
                    self._reasons_seen.add(how)
                    logger.info("a chat call's prompt was %s, not continued from an earlier turn's tokens", how)
            for k, v in e.extras.items():
                self.extras[k].append(v)
        success_rate = sum(s >= FULL_CREDIT for s in scores) / len(scores) if scores else 0.0
        if not done or not self.settings.keep_group(success_rate, scores):
            self.stats.n_rejected += 1
            return []
        sequences, seq_scores, meta = [], [], {"episode": [], "turns": []}
        for k, e in enumerate(done):
            for seq in e.session.recorder.sequences("chains"):
                sequences.append(seq)
                seq_scores.append(e.score)
                meta["episode"].append(k)
                meta["turns"].append(len(seq.turns))
        meta.update(episode_scores=scores, solutions=list(prompt.solutions), success_rate=success_rate)
        return [chains_trajectory(prompt, sequences, seq_scores, self.settings.rewards(seq_scores), meta)]

    async def _episode(self, prompt: PromptRecord, row: dict) -> _Episode:
        # The endpoint's handlers run outside this episode's task; the calls
        # they make go through `Agent.generate` in a copy of its context.
        context = contextvars.copy_context()

        async def generate(prompt_ids: list[int], n: int, gconfig: GenerationHyperparameters) -> GenerationResult:
            return await context.run(asyncio.ensure_future, self.generate(prompt_ids, n, gconfig))

        session = ChatSession(self.chat_config, generate, prompt.qid, row)
        episode = _Episode(session)
        async with shared_endpoint() as endpoint:
            base_url = endpoint.open(session)
            deadline = asyncio.timeout(self._timeout_s)
            try:
                async with deadline:
                    value = await self._drive(endpoint, session, base_url, row)
                episode.score, episode.extras = _score(value)
            except asyncio.CancelledError:
                raise
            except EpisodeAbandoned:
                pass
            except Exception as e:
                if isinstance(e, TimeoutError) and deadline.expired():  # (not a timeout of the function's own)
                    self._timed_out(prompt)
                elif session.failure is None:
                    self._function_failed(prompt, e)
            finally:
                endpoint.close_session(session.key)
        if session.failure is not None:
            raise session.failure
        return episode

    async def _drive(self, endpoint: ChatEndpoint, session: ChatSession, base_url: str, row: dict) -> Any:
        """Runs the episode; its return value (the score)."""
        client = endpoint.client(base_url)
        if self.judge is not None:
            return await self.fn(client, dict(row), judge=await self.judge())
        return await self.fn(client, dict(row))

    @property
    def _timeout_s(self) -> float:
        return self.settings.episode_timeout

    def _timed_out(self, prompt: PromptRecord) -> None:
        """An episode that ran past `rollout.episode_timeout`: cancelled (its
        calls with it), dropped from its group, counted."""
        self.counters["episode_timeouts"] += 1
        logger.warning(
            "agent episode of %s ran past rollout.episode_timeout=%g s: dropped (%d so far)",
            prompt.qid,
            self._timeout_s,
            self.counters["episode_timeouts"],
        )

    def _function_failed(self, prompt: PromptRecord, e: Exception) -> None:
        self.counters["fn_errors"] += 1
        self._errors += 1
        now = time.monotonic()
        if now - self._last_logged >= LOG_EVERY_S:
            self._last_logged = now
            logger.warning(
                "agent episode of %s failed (its group goes on without it; %d failures so far): %s: %s",
                prompt.qid,
                self._errors,
                type(e).__name__,
                e,
                exc_info=self._errors == 1,
            )


def chains_trajectory(
    prompt: PromptRecord,
    sequences: list[RecordedSequence],
    scores: list[float],
    rewards: list[float],
    metadata: dict[str, Any],
) -> Trajectory:
    """One trajectory of recorded chains: per sequence its tokens, loss mask,
    logprobs and versions as the recorder laid them out (docs/design.md §5)."""
    sampling_logprobs = [s.sampling_logprobs for s in sequences]
    if all(np.array_equal(a, s.logprobs) for a, s in zip(sampling_logprobs, sequences)):
        sampling_logprobs = []  # nothing filtered: the same as the logprobs
    sampling = [s.sampling for s in sequences]
    return Trajectory(
        qid=prompt.qid,
        task=prompt.task,
        birth_time=time.time(),
        input_ids=[s.input_ids for s in sequences],
        prompt_len=[s.prompt_len for s in sequences],
        logprobs=[s.logprobs for s in sequences],
        versions=[s.versions for s in sequences],
        version_start=[s.version_start for s in sequences],
        version_end=[s.version_end for s in sequences],
        reward=[float(r) for r in rewards],
        no_eos=[s.no_eos for s in sequences],
        scores=[float(x) for x in scores],
        metadata=metadata,
        loss_mask=[s.loss_mask for s in sequences],
        sampling_logprobs=sampling_logprobs,
        sampling=sampling if all(x is not None for x in sampling) else [],
    ).validate()


def _score(value: Any) -> tuple[float, dict[str, float]]:
    """An agent's return value as (score, other named numbers)."""
    extras: dict[str, float] = {}
    if isinstance(value, dict):
        if "reward" not in value:
            raise ValueError(f"an agent's dict result needs a 'reward' key, got keys {sorted(value)}")
        extras = {str(k): _number(v, k) for k, v in value.items() if k != "reward"}
        value = value["reward"]
    return _number(value, "reward"), extras


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"an agent's {name} must be a finite number, got {value!r:.80}")
    return float(value)


class ExternalAgent(FunctionAgent):
    """Episodes driven by an agent outside realrl (see the module docstring)."""

    def __init__(
        self,
        settings: AgentSettings | None = None,
        tool_parser: str = "hermes",
        max_context_tokens: int | None = None,
        episode_timeout_s: float | None = None,
    ):
        if episode_timeout_s is not None and episode_timeout_s <= 0:
            raise ValueError(f"episode_timeout_s must be > 0, got {episode_timeout_s}")
        self.episode_timeout_s = episode_timeout_s  # None: rollout.episode_timeout
        super().__init__(settings, "", tool_parser, max_context_tokens)

    @property
    def _timeout_s(self) -> float:
        return self.episode_timeout_s or self.settings.episode_timeout

    def _load_fn(self, spec: str) -> None:
        return None

    def _timed_out(self, prompt: PromptRecord) -> None:
        self.counters["external_timeouts"] += 1
        super()._timed_out(prompt)

    async def _drive(self, endpoint: ChatEndpoint, session: ChatSession, base_url: str, row: dict) -> Any:
        return await endpoint.offer(session)


register_agent("function", FunctionAgent)
register_agent("external", ExternalAgent)
