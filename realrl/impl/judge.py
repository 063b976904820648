"""Rewards from a judge model (docs/design.md §11, "Judge model").

A reward function (`async def`) that takes a `judge` argument gets an
`openai.AsyncOpenAI` for the judge:

    async def reward(prompt, completion, answer, judge) -> float:
        reply = await judge.chat.completions.create(messages=[...], max_tokens=8, temperature=0)
        return 1.0 if reply.choices[0].message.content.startswith("yes") else 0.0

An environment class whose constructor takes `judge` gets a `JudgeAccess`
(`client = await judge()`), shared by the process's episodes.

The judge is a frozen model on its own generation server(s) (torch servers
started `--frozen`: every weight change is answered 400 and counted), which
the generation-server manager never routes rollouts to. Its client's base URL
is `<chat endpoint>/judge/v1`: `Judge.complete` renders the messages with the
judge's own chat template, generates on the judge servers in turn (round
robin) and answers in OpenAI's shape. It records nothing: judge calls never
become trajectories.

Failures: a judge call that gets no answer within `request_timeout_s` or
fails on the server raises in the reward function (the client never
retries); the runner then scores the answer 0, and a failed call of a
function that takes `judge` counts as a judge failure
(`RewardFunctionRunner.counts()["judge_failures"]`), as does a garbage
answer the function cannot read (it raises or returns no number).
"""

from __future__ import annotations

import asyncio
import collections
import time
import uuid
import weakref
from collections.abc import Callable
from typing import Any

from realrl.api.openai_api import ChatCompletion, ChatCompletionRequest, Choice, ReplyMessage, Usage
from realrl.base.http_body import BodyError
from realrl.base.logging import getLogger
from realrl.impl.generation.client import GenerationClient

logger = getLogger("judge")

JUDGE_PATH = "/judge/v1"  # under the chat endpoint's URL


def load_judge_tokenizer(model_path: str, key: str = "judge.model.path") -> Any:
    """The judge's tokenizer; ValueError naming `key` when it has no chat template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(model_path)
    except Exception as e:
        raise ValueError(f"{key}={model_path!r}: cannot load its tokenizer: {type(e).__name__}: {e}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{key}={model_path!r}: the judge's tokenizer has no chat template")
    return tokenizer


class Judge:
    """Serves `/judge/v1/chat/completions` for a `ChatEndpoint`: `urls()` gives
    the judge servers' URLs now (they may come and go)."""

    def __init__(
        self,
        tokenizer: Any,
        urls: Callable[[], list[str]],
        request_timeout_s: float = 60.0,
        max_new_tokens: int = 256,
    ):
        self.tokenizer = tokenizer
        self.urls = urls
        self.request_timeout_s = float(request_timeout_s)
        self.max_new_tokens = int(max_new_tokens)
        self.counters: collections.Counter = collections.Counter()  # calls, failures
        self._next = 0
        self._client: GenerationClient | None = None

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    def _url(self) -> str:
        urls = sorted(self.urls())
        if not urls:
            raise RuntimeError("no judge server is registered")
        self._next += 1
        return urls[self._next % len(urls)]

    async def complete(self, request: ChatCompletionRequest) -> ChatCompletion:
        """The judge's answer. BodyError for a request it cannot honour (400);
        anything else (no server, a server error, a timeout) is a failure."""
        if request.n != 1 or request.tools or request.stream:
            raise BodyError("the judge answers one plain completion: n=1, no tools, no stream", reason="unsupported")
        messages = [{"role": m.role, "content": m.content} for m in request.messages]
        try:
            prompt_ids = [
                int(t)
                for t in self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=False
                )
            ]
        except Exception as e:
            raise BodyError(f"the judge's chat template cannot render these messages: {e}") from None
        max_new = request.max_completion_tokens or request.max_tokens or self.max_new_tokens
        sampling = {"max_new_tokens": min(max_new, self.max_new_tokens), "temperature": request.temperature or 0.0}
        if request.top_p is not None:
            sampling["top_p"] = request.top_p
        if self._client is None:
            self._client = GenerationClient(timeout_s=self.request_timeout_s)
        result = await self._client.generate(self._url(), prompt_ids, sampling, return_logprob=False)
        if result.aborted:
            raise RuntimeError("the judge server aborted the request")
        text = self.tokenizer.decode(result.output_ids, skip_special_tokens=True)
        n_prompt, n_out = len(prompt_ids), len(result.output_ids)
        return ChatCompletion(
            id=f"judge-{uuid.uuid4().hex[:16]}",
            created=int(time.time()),
            model=request.model or "judge",
            choices=[Choice(0, ReplyMessage(content=text), "length" if result.finish_reason == "length" else "stop")],
            usage=Usage(n_prompt, n_out, n_prompt + n_out),
        )


class JudgeAccess:
    """The judge client factory a worker's reward functions use (the
    "reward-fn" environment's `judge` argument: `judge_settings` in
    realrl/experiment/config.py). On first use in an event loop it starts a
    loopback chat endpoint that serves only `/judge/v1`, reading the judge
    servers' URLs from name_resolve (`names.judge_servers`); it lives as long
    as the loop."""

    def __init__(self, settings: dict):
        self.settings = dict(settings)
        self._endpoints: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Any] = weakref.WeakKeyDictionary()
        self._lock: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = weakref.WeakKeyDictionary()
        self._tokenizer: Any = None

    def urls(self) -> list[str]:
        from realrl.base import name_resolve, names

        s = self.settings
        return name_resolve.get_subtree(names.judge_servers(s["experiment_name"], s["trial_name"]))

    async def __call__(self) -> Any:
        from realrl.impl.openai_compat.endpoint import ChatEndpoint

        loop = asyncio.get_running_loop()
        async with self._lock.setdefault(loop, asyncio.Lock()):
            endpoint = self._endpoints.get(loop)
            if endpoint is None:
                if self._tokenizer is None:
                    self._tokenizer = await asyncio.to_thread(load_judge_tokenizer, self.settings["model_path"])
                endpoint = ChatEndpoint()
                await endpoint.start()
                endpoint.judge = Judge(
                    self._tokenizer,
                    self.urls,
                    request_timeout_s=self.settings.get("request_timeout", 60.0),
                    max_new_tokens=self.settings.get("max_new_tokens", 256),
                )
                self._endpoints[loop] = endpoint
        return endpoint.judge_client()

    def stats(self) -> dict[str, int]:
        """Judge calls and failures, over every loop's endpoint."""
        total: collections.Counter = collections.Counter()
        for endpoint in list(self._endpoints.values()):
            total.update({k: v for k, v in endpoint.stats().items() if k.startswith("judge_")})
        return dict(total)


_ACCESS: dict[tuple, JudgeAccess] = {}


def judge_access(settings: dict) -> JudgeAccess:
    """The process's one `JudgeAccess` for the judge `settings` describe (the
    trial's `judge_settings`): every environment made per episode shares it,
    and with it one endpoint per event loop."""
    key = tuple(sorted(settings.items()))
    if key not in _ACCESS:
        _ACCESS[key] = JudgeAccess(settings)
    return _ACCESS[key]
