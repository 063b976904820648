"""Which sampling parameters a generation backend can serve with both logprobs (docs/design.md §6).

Training with filtered sampling (top_p < 1, a top_k, min_p > 0) needs two
logprobs per token: the unfiltered one and the one under the filtered
distribution the token was drawn from (the decoupled loss's behaviour policy).
Not every engine reports the second for every filter:

- the torch server always does;
- SGLang reports it with `return_sampling_mask` and refuses (HTTP 400) the
  top_k it cannot bound (`realrl.api.sglang_api.sampling_mask_refusal`, per
  release);
- vLLM reports one logprob per token from one server-wide mode
  (`--logprobs-mode`), so it never reports both (`realrl.api.vllm_api`).

`ServedSampling.refusal(params)` says why a request's sampling cannot be
served, once for the run's `rollout.gconfig` (a config error before anything
starts) and again for every agent call that overrides it (`Agent.generate`:
a `SamplingRefused`, HTTP 400 to an OpenAI-style call). The release checked
is the one installed (or emulated): SGLang's rule changed in 0.5.23.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from collections.abc import Sequence

from packaging.version import InvalidVersion, Version

from realrl.api.generation_api import needs_sampling_logprobs
from realrl.api.sglang_api import SAMPLING_MASK_MAX_TOKENS, SamplingParams, sampling_mask_refusal
from realrl.base.http_body import BodyError

# The newest SGLang release whose source was read: its rule applies when none is installed here.
NEWEST_SGLANG_READ = "0.5.23"


class SamplingRefused(BodyError):
    """An agent call's sampling the generation backend cannot serve (HTTP 400)."""

    def __init__(self, message: str):
        super().__init__(message, status=400, reason="sampling_unsupported")


@dataclasses.dataclass
class ServedSampling:
    """What one run's generation backend serves: `engine` "torch", "sglang"
    (`release`: the SGLang version whose rule applies) or "vllm"."""

    engine: str = "torch"
    release: str | None = None
    sampling_mask_max_tokens: int = SAMPLING_MASK_MAX_TOKENS

    def refusal(self, params: SamplingParams) -> str | None:
        """Why these sampling parameters cannot be trained on with this
        backend, or None. Unfiltered or greedy sampling is always served."""
        if not needs_sampling_logprobs(params):
            return None
        filters = _filters(params)
        if self.engine == "vllm":
            return (
                f"vLLM reports one logprob per token ({filters}): it cannot report both the unfiltered logprob "
                "and the one under the filtered distribution the token was drawn from; sample without filters "
                "(top_p=1, top_k=-1, min_p=0) or use the sglang or torch backend"
            )
        if self.engine == "sglang":
            refused = sampling_mask_refusal(
                Version(self.release or NEWEST_SGLANG_READ), params.top_k, False, self.sampling_mask_max_tokens
            )
            if refused is not None:
                return (
                    f"SGLang {self.release or NEWEST_SGLANG_READ} refuses the sampling logprobs of {filters} "
                    f"(set top_k in [2, {self.sampling_mask_max_tokens}] with top_p < 1 or min_p > 0): {refused}"
                )
        return None


def _filters(params: SamplingParams) -> str:
    parts = [f"{name}={getattr(params, name)}" for name in ("top_p", "top_k", "min_p")]
    return ", ".join(p for p in parts if not p.endswith("=None"))


def installed_sglang() -> str | None:
    """The SGLang release installed here (its metadata; importing sglang
    would initialise CUDA), None if none is."""
    try:
        version = importlib.metadata.version("sglang")
        Version(version)
        return version
    except (importlib.metadata.PackageNotFoundError, InvalidVersion):
        return None


def sampling_mask_max_tokens(extra_args: Sequence[str]) -> int:
    """`--sampling-mask-max-tokens` among SGLang's extra arguments, else its default."""
    args = [str(a) for a in extra_args]
    for i, arg in enumerate(args):
        if arg.startswith("--sampling-mask-max-tokens="):
            return int(arg.split("=", 1)[1])
        if arg == "--sampling-mask-max-tokens" and i + 1 < len(args):
            return int(args[i + 1])
    return SAMPLING_MASK_MAX_TOKENS


def served_sampling(
    gen_backend: str, emulate_sglang: str = "", emulate_vllm: str = "", sglang_extra_args: Sequence[str] = ()
) -> ServedSampling:
    """The rule of a run's backend: SGLang's installed release (the newest
    read if none is installed here), or the release the torch server emulates."""
    if gen_backend == "vllm" or (gen_backend == "torch" and emulate_vllm):
        return ServedSampling("vllm", emulate_vllm or None)
    if gen_backend == "sglang":
        return ServedSampling("sglang", installed_sglang(), sampling_mask_max_tokens(sglang_extra_args))
    if gen_backend == "torch" and emulate_sglang:
        return ServedSampling("sglang", emulate_sglang)
    return ServedSampling("torch")
