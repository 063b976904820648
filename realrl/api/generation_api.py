"""What an agent asks for and gets back when it needs text generated.

An agent puts a `GenerationRequest` (one prompt, `group_size` samples) on its
obs_queue; the rollout worker's PartialRolloutManager turns it into
`group_size` server requests (resubmitting chunks and interrupted requests),
and puts one `GenerationResult` on the agent's act_queue, with per-token
logprobs and weight versions (DESIGN §5–§6).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class GenerationHyperparameters:
    max_new_tokens: int = 16
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k filtering (SGLang's convention)
    greedy: bool = False  # temperature 0
    stop_token_ids: list[int] = dataclasses.field(default_factory=list)

    def validate(self, prefix: str = "gconfig") -> None:
        if self.max_new_tokens <= 0:
            raise ValueError(f"{prefix}.max_new_tokens must be positive, got {self.max_new_tokens}")
        if not 0 <= self.min_new_tokens <= self.max_new_tokens:
            raise ValueError(f"{prefix}.min_new_tokens must be in 0..max_new_tokens, got {self.min_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"{prefix}.temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"{prefix}.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"{prefix}.top_k must be -1 (off) or positive, got {self.top_k}")

    def sampling_params(self, max_new_tokens: int | None = None) -> dict:
        """SGLang-native `sampling_params` (DESIGN §6)."""
        params = {
            "max_new_tokens": self.max_new_tokens if max_new_tokens is None else max_new_tokens,
            "min_new_tokens": self.min_new_tokens,
            "temperature": 0.0 if self.greedy else self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
        }
        if self.stop_token_ids:
            params["stop_token_ids"] = list(self.stop_token_ids)
        return params


@dataclasses.dataclass
class GenerationRequest:
    qid: str
    prompt_ids: list[int]
    group_size: int = 1
    gconfig: GenerationHyperparameters = dataclasses.field(default_factory=GenerationHyperparameters)


@dataclasses.dataclass
class GenerationResult:
    """`group_size` answers to one request; lists are per answer."""

    qid: str
    prompt_ids: list[int]
    output_ids: list[list[int]]
    output_logprobs: list[list[float]]
    output_versions: list[list[int]]  # weight version that produced each token
    no_eos: list[bool]  # stopped by length (or never finished), not by eos/stop
    version_start: list[int]
    version_end: list[int]

    @property
    def group_size(self) -> int:
        return len(self.output_ids)
