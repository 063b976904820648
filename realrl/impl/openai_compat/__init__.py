"""realrl's OpenAI-compatible chat endpoint (docs/design.md §11).

Agents written against the `openai` client's `chat.completions` API train
unchanged: each call is rendered with the model's chat template, generated
through realrl's generation path, recorded token for token, and answered in
OpenAI's shape. One module per layer:

- `messages.py`: messages as the chat template gets them and as turns are matched;
- `tool_calls.py`: tool calls out of the model's text (pluggable parsers);
- `rendering.py`: chat-template rendering and the bridge tokens that continue
  a conversation without rendering its earlier turns again;
- `turns.py`: the per-episode record of turns and its export as sequences
  (maximal token-for-token chains, or one per turn);
- `chat.py`: one episode's calls: request in, turns and OpenAI's answer out;
- `endpoint.py`: the aiohttp server (one per process and event loop, one
  base URL per episode) and the external-agent protocol.

The HTTP bodies are in realrl/api/openai_api.py; the agents that use it in
realrl/impl/agents/function_agent.py.
"""
