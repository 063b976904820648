"""The Agent contract and its registry.

An agent turns one prompt into trajectories. It generates text with
`await self.generate(prompt_ids, n=..., gconfig=...)`, scores the answers
with its environment (`env.step`), and returns a list of `Trajectory`
(docs/design.md §5), usually built with `Trajectory.from_results`:

    class MyAgent(Agent):
        async def collect_trajectory(self, prompt, env):
            result = await self.generate(prompt.prompt_ids)          # group_size answers
            texts = [self.decode(ids) for ids in result.output_ids]
            _, scores, *_ = await env.step(texts)
            return [Trajectory.from_results(prompt, [result], scores, self.settings.rewards(scores))]

Several `generate` calls of one episode may be in flight at once
(`asyncio.gather`): each is an independent request. An empty list rejects the
prompt (e.g. a success-rate filter dropped a group that all scored the same);
rejected prompts use no staleness budget.

Who calls what. The runtime calls `agent.run_episode(prompt, env, generator)`:
during training the rollout worker's generator sends requests to the
generation servers (partial rollouts, per-token weight versions); during
evaluation the trainer runs the same agent on its own current weights with a
greedy generator (`settings.evaluating` is then true, `group_size` 1, filters
off). One agent instance serves every concurrent episode of its process, so
per-episode state lives in local variables, not on `self`.

Settings. Every agent is constructed as `Factory(settings, **args)`:
`settings` (`AgentSettings`) holds the run-wide values from the config
(tokenizer, group size, sampling, reward shaping, success-rate filter) and
`args` the agent's own keyword arguments from `rollout.agent.args`. Register a
new kind with `register_agent("name", Class)`.
"""

from __future__ import annotations

import abc
import contextvars
import dataclasses
import functools
from typing import Any, Protocol

from realrl.api.env_api import EnvironmentService
from realrl.api.generation_api import GenerationHyperparameters, GenerationRequest, GenerationResult
from realrl.api.served_sampling import SamplingRefused, ServedSampling
from realrl.api.trajectory import Trajectory
from realrl.base.registry import Registry

# A full-credit answer: scores at or above this count as correct (accuracy,
# success-rate filter, evaluation). Tasks with partial credit score below it.
FULL_CREDIT = 1.0 - 1e-6


@dataclasses.dataclass
class PromptRecord:
    """One dataset entry as the runtime hands it to an agent."""

    qid: str
    prompt: str
    prompt_ids: list[int]
    solutions: list[str]  # accepted answers (the `answer` field becomes [answer])
    task: str = "math"
    row: dict[str, Any] = dataclasses.field(default_factory=dict)  # the dataset row's other fields
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)  # the runtime's: epoch, rollout_id, ...

    @property
    def answer(self) -> str:
        return self.solutions[0] if self.solutions else ""


@dataclasses.dataclass
class AgentSettings:
    """The run-wide settings every agent gets, from the config (the rollout
    worker and the evaluator build them; `realrl.experiment.config.agent_settings`)."""

    tokenizer_path: str | None = None
    group_size: int = 1  # answers per prompt (`ppo.group_size`)
    gconfig: GenerationHyperparameters = dataclasses.field(default_factory=GenerationHyperparameters)
    reward_bias: float = 0.0  # `ppo.reward_bias` / `ppo.reward_scaling`, see `reward`
    reward_scaling: float = 1.0
    success_rate_lb: float = 0.0  # `rollout.success_rate_lb` / `_ub`, see `keep_group`
    success_rate_ub: float = 1.0
    dynamic_sampling: bool = False  # `rollout.dynamic_sampling`, see `keep_group`
    evaluating: bool = False  # greedy, one answer per prompt, nothing filtered
    # What the generation backend can serve (a filtered call it cannot is refused: `generate`, and the
    # chat endpoint's 400).
    served: ServedSampling = dataclasses.field(default_factory=ServedSampling)
    episode_timeout: float = 3600.0  # `rollout.episode_timeout`: one episode of a chat-level agent, at most
    tokenizer: Any = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.gconfig, dict):
            known = {f.name for f in dataclasses.fields(GenerationHyperparameters)}
            unknown = sorted(set(self.gconfig) - known)
            if unknown:
                raise ValueError(f"unknown gconfig keys {unknown}; known: {sorted(known)}")
            self.gconfig = GenerationHyperparameters(
                **{k: (list(v) if k == "stop_token_ids" else v) for k, v in self.gconfig.items()}
            )
        self.gconfig.validate()
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {self.group_size}")
        if not 0.0 <= self.success_rate_lb <= self.success_rate_ub <= 1.0:
            raise ValueError(
                f"need 0 <= success_rate_lb <= success_rate_ub <= 1, got {self.success_rate_lb}, {self.success_rate_ub}"
            )

    def get_tokenizer(self) -> Any:
        if self.tokenizer is None:
            if not self.tokenizer_path:
                raise ValueError("the agent needs a tokenizer: settings.tokenizer_path or settings.tokenizer")
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_path)
        return self.tokenizer

    def reward(self, score: float) -> float:
        """The training reward of a raw task score: `((score - 0.5) * 2 - bias) * scaling`,
        so 0/1 become -1/+1 and partial credit lies in between (an affine map:
        with GRPO's group normalisation only the differences within a group matter)."""
        return ((float(score) - 0.5) * 2.0 - self.reward_bias) * self.reward_scaling

    def rewards(self, scores: list[float]) -> list[float]:
        return [self.reward(s) for s in scores]

    def keep_group(self, success_rate: float, scores: list[float] | None = None) -> bool:
        """The success-rate filter: keep a group whose fraction of successes
        lies in [lb, ub]; with dynamic sampling (DAPO), also drop a group whose
        `scores` are all equal: its group-relative advantages are all zero.
        Evaluation keeps everything."""
        if self.evaluating:
            return True
        if self.dynamic_sampling and scores is not None and len(scores) > 1 and len(set(scores)) == 1:
            return False
        return self.success_rate_lb <= success_rate <= self.success_rate_ub

    def for_evaluation(self, max_new_tokens: int | None = None) -> AgentSettings:
        """Greedy, one answer per prompt, no filtering (the evaluation contract)."""
        gconfig = dataclasses.replace(
            self.gconfig, greedy=True, max_new_tokens=max_new_tokens or self.gconfig.max_new_tokens, min_new_tokens=0
        )
        return dataclasses.replace(
            self, group_size=1, gconfig=gconfig, success_rate_lb=0.0, success_rate_ub=1.0, evaluating=True
        )


class Generator(Protocol):
    """What runs an agent's generation requests (the rollout worker's partial
    rollouts, the evaluator's local model, or `ServerGenerator` for trying an
    agent against one generation server)."""

    async def generate(self, request: GenerationRequest) -> GenerationResult: ...


@dataclasses.dataclass
class _Episode:
    qid: str
    generator: Generator
    n_requests: int = 0
    max_in_flight: int = 0
    _in_flight: int = 0


_EPISODE: contextvars.ContextVar[_Episode] = contextvars.ContextVar("realrl_episode")


class Agent(abc.ABC):
    def __init__(self, settings: AgentSettings | None = None, **args: Any):
        if args:
            raise TypeError(f"{type(self).__name__} takes no arguments {sorted(args)}")
        self.settings = settings if settings is not None else AgentSettings()

    @abc.abstractmethod
    async def collect_trajectory(self, prompt: PromptRecord, env: EnvironmentService) -> list[Trajectory]: ...

    # ---- for agents ---------------------------------------------------------------
    async def generate(
        self, prompt_ids: list[int], n: int | None = None, gconfig: GenerationHyperparameters | None = None
    ) -> GenerationResult:
        """`n` answers (default `settings.group_size`) to `prompt_ids`, sampled
        with `gconfig` (default `settings.gconfig`). Only inside an episode.
        The result's `turn` is this call's number in the episode (1 = its
        first call; calls in flight together are numbered in the order they
        were made): `Trajectory.from_results` keeps it per sequence as
        `metadata["answer_turn"]`, and evaluation reads it (turns to a solution)."""
        episode = _EPISODE.get(None)
        if episode is None:
            raise RuntimeError("Agent.generate() is only available inside an episode (Agent.run_episode)")
        if self.settings.evaluating:  # the evaluation contract: greedy, whatever the agent asked
            gconfig = dataclasses.replace(gconfig or self.settings.gconfig, greedy=True)
        elif gconfig is not None and (refused := self.settings.served.refusal(gconfig.sampling_params())):
            # Before anything is sent: the backend would fail the call (SGLang) or train on the wrong
            # logprobs (vLLM). An OpenAI-style call gets this as HTTP 400.
            raise SamplingRefused(refused)
        request = GenerationRequest(
            qid=episode.qid,
            prompt_ids=list(prompt_ids),
            group_size=self.settings.group_size if n is None else n,
            gconfig=gconfig or self.settings.gconfig,
        )
        episode.n_requests += 1
        turn = episode.n_requests  # this call's number in its episode, counted when the agent makes it
        episode._in_flight += 1
        episode.max_in_flight = max(episode.max_in_flight, episode._in_flight)
        try:
            result = await episode.generator.generate(request)
        finally:
            episode._in_flight -= 1
        if result.group_size != request.group_size:
            raise RuntimeError(f"generation returned {result.group_size} answers for {request.group_size} asked")
        if isinstance(result, GenerationResult):  # a copy: a generator may hand out one object twice
            result = dataclasses.replace(result, turn=turn)
        return result

    @functools.cached_property
    def tokenizer(self) -> Any:
        return self.settings.get_tokenizer()

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    def next_turn_prompt(
        self, prompt_ids: list[int], output_ids: list[int], content: str, role: str = "user"
    ) -> list[int]:
        """The prompt of the turn after an answer, at the chat template's turn
        boundaries (docs/custom_tasks.md, "The next turn"): the context and the
        answer's tokens as sampled, the template's turn-end token if the answer
        was cut by length, then the template's tokens for a new `role` message
        with `content` up to the next generation prompt. Earlier tokens are
        never re-encoded. A tokenizer without a chat template (or one that
        cannot be continued so): the answer without its EOS, then `content`
        encoded as text."""
        from realrl.impl.openai_compat.rendering import ChatRenderer  # impl: only agents that use it load it

        if "_turn_renderer" not in self.__dict__:
            from realrl.impl.generation.eos import eos_token_ids_in_dir

            path = self.settings.tokenizer_path
            ends = set(eos_token_ids_in_dir(path, self.tokenizer)) if path else {self.tokenizer.eos_token_id}
            ends |= set(self.settings.gconfig.stop_token_ids)
            self._turn_renderer = ChatRenderer(self.tokenizer, ends)
        renderer = self._turn_renderer
        output = list(output_ids)
        bridge = None
        if getattr(self.tokenizer, "chat_template", None):
            bridge = renderer.bridge([{"role": role, "content": content}], None, None)
        if bridge is None:
            while output and output[-1] in renderer.turn_end_ids:
                output.pop()
            return list(prompt_ids) + output + self.tokenizer.encode(content, add_special_tokens=False)
        if not output or output[-1] != bridge.turn_end:
            output.append(bridge.turn_end)  # cut by length: the turn still ends where the template ends it
        return list(prompt_ids) + output + bridge.ids

    def pop_stats(self) -> dict[str, float]:
        """Counters since the last call (e.g. episodes, accuracy) for the
        rollout worker's log; agents without any return {}."""
        return {}

    # ---- for the runtime ------------------------------------------------------------
    async def run_episode(
        self, prompt: PromptRecord, env: EnvironmentService, generator: Generator
    ) -> list[Trajectory]:
        """Runs `collect_trajectory` with `generate` bound to `generator`, and
        checks what it returned. Run it as its own task (the episode lives in
        that task's context and in the tasks it starts)."""
        episode = _Episode(prompt.qid, generator)
        token = _EPISODE.set(episode)
        try:
            trajectories = await self.collect_trajectory(prompt, env)
        finally:
            _EPISODE.reset(token)
        if not isinstance(trajectories, list) or not all(isinstance(t, Trajectory) for t in trajectories):
            raise TypeError(
                f"{type(self).__name__}.collect_trajectory returned {type(trajectories).__name__} for {prompt.qid}; "
                "it must return a list of Trajectory"
            )
        for t in trajectories:
            t.validate()
            t.metadata.setdefault("generate_calls", episode.n_requests)
            t.metadata.setdefault("max_generate_in_flight", episode.max_in_flight)
        return trajectories


AGENTS: Registry[Agent] = Registry("agent")


def register_agent(name: str, factory) -> None:
    AGENTS.register(name, factory)


def make_agent(name: str, settings: AgentSettings | None = None, **args: Any) -> Agent:
    return AGENTS.make(name, settings, **args)
