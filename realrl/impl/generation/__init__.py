"""Generation backends: the built-in torch server and the HTTP clients.

SGLang and the torch server speak the subset of SGLang's native HTTP API the runtime uses (docs/design.md §6), driven
by `GenerationClient`; vLLM (and the torch server emulating it) speaks vLLM's, driven by `VLLMClient`, a
`GenerationClient` with the same calls (`make_client` picks one). The server module is imported lazily (it pulls in
torch and transformers); the clients are light and re-exported here.
"""

from typing import Any

from realrl.impl.generation.client import (
    GenerateResult,
    GenerationClient,
    GenerationServerError,
    GenerationServerUnavailable,
)
from realrl.impl.generation.vllm_client import VLLMClient


def make_client(api: str = "sglang", **kwargs: Any) -> GenerationClient:
    """The client of servers speaking `api` (`realrl.api.system_api.server_api`): "sglang" (SGLang and the torch
    server) or "vllm" (vLLM, or the torch server emulating it)."""
    if api == "sglang":
        return GenerationClient(**kwargs)
    if api == "vllm":
        return VLLMClient(**kwargs)
    raise ValueError(f"unknown generation server API {api!r} (sglang | vllm)")


__all__ = [
    "GenerateResult",
    "GenerationClient",
    "GenerationServerError",
    "GenerationServerUnavailable",
    "VLLMClient",
    "make_client",
]
