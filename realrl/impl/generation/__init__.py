"""Generation backends: the built-in torch server and the shared HTTP client.

Both speak the subset of SGLang's native HTTP API the runtime uses (docs/design.md §6),
so the same `GenerationClient` drives the torch server and a real SGLang server.
The server module is imported lazily (it pulls in torch and transformers); the
client is light and re-exported here.
"""

from realrl.impl.generation.client import (
    GenerateResult,
    GenerationClient,
    GenerationServerError,
    GenerationServerUnavailable,
)

__all__ = [
    "GenerateResult",
    "GenerationClient",
    "GenerationServerError",
    "GenerationServerUnavailable",
]
