"""Try an agent against one generation server, without a trial.

    python -m realrl.impl.generation.torch_server --model-path MODEL --port 30000   # or an SGLang server

    generator = ServerGenerator("http://127.0.0.1:30000")
    trajectories = await agent.run_episode(prompt, env, generator)
    await generator.close()

Each answer of a request is one `/generate` call (all of a request's answers
concurrently), with the request's sampling parameters and the whole
`max_new_tokens` at once: no manager, no chunking, no weight updates. Weight
versions are what the server reports (0 if it reports none). Good for
developing and unit-testing an agent; training goes through the rollout
worker's partial rollouts instead.
"""

from __future__ import annotations

import asyncio

from realrl.api.generation_api import GenerationRequest, GenerationResult
from realrl.impl.generation import make_client
from realrl.impl.generation.client import new_rid


class ServerGenerator:
    def __init__(self, url: str, timeout_s: float = 120.0, api: str = "sglang"):
        """`api`: what the server at `url` speaks, "sglang" (SGLang, the torch server) or "vllm"."""
        self.url = url.rstrip("/")
        self.client = make_client(api, timeout_s=timeout_s)

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        params = request.gconfig.sampling_params()
        responses = await asyncio.gather(
            *(
                self.client.generate(self.url, list(request.prompt_ids), params, rid=new_rid(request.qid, i))
                for i in range(request.group_size)
            )
        )
        # Per token: an answer that went on across a weight update has the versions of its spans.
        token_versions = [
            [_version(v) for v in r.output_versions or [r.weight_version] * len(r.output_ids)] for r in responses
        ]
        last = [_version(r.weight_version) for r in responses]
        return GenerationResult(
            qid=request.qid,
            prompt_ids=list(request.prompt_ids),
            output_ids=[list(r.output_ids) for r in responses],
            output_logprobs=[list(r.output_logprobs) for r in responses],
            output_versions=token_versions,
            no_eos=[r.finish_reason != "stop" for r in responses],
            version_start=[v[0] if v else x for v, x in zip(token_versions, last)],
            version_end=[v[-1] if v else x for v, x in zip(token_versions, last)],
            output_sampling_logprobs=[
                list(r.output_logprobs if r.output_sampling_logprobs is None else r.output_sampling_logprobs)
                for r in responses
            ],
            sampling=request.gconfig.sampling(),
        )

    async def close(self) -> None:
        await self.client.close()


def _version(reported: str | None) -> int:
    try:
        return int(reported)
    except (TypeError, ValueError):
        return 0
