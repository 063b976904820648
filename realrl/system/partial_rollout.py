"""Partial rollouts: one agent `GenerationRequest` -> `group_size` server requests.

Every `await agent.generate(...)` of an episode in the rollout worker becomes a `GenerationRequest` for
`PartialRolloutManager.generate`, which returns one `GenerationResult` (docs/design.md §5-§6).

A group's answers are generated together first (`_generate_group`): each round is one batched `/generate` (one
prompt per unfinished answer) on one server, scheduled and released through the manager once for the round, so a
group costs one request per round instead of one per answer, and the server prefills the shared prompt once. Rounds
of several groups that are ready in the same few event-loop iterations (the rollout worker starts a batch of
admitted episodes at once) go out together (`_send_rounds`): one schedule, and one `/generate` and one release per
server, instead of one of each per group; one per episode priority (`EPISODE_PRIORITY`, set by the rollout worker:
the server admits lower first), so the episodes started first are answered first, not with the last of the batch.
Unfinished answers (interrupted by a weight update, or a chunk ended by length) go on together in the next round,
sticky to the server. When a round fails, generates nothing, or leaves answers on different weight versions, each
unfinished answer goes on in its own loop, with what it has, all answers concurrently:

1. ask the routing for a server (`realrl/system/client_routing.py`: picked here from the manager's routing table, or
   asked of the manager); after the first chunk the request is sticky: it names the server and the weight version
   that produced the previous chunk, so it stays on the server holding its KV cache unless its weights changed;
2. `/generate` with `input_ids = prompt + output so far`, `max_new_tokens = min(new_tokens_per_chunk, remaining
   budget)` and `min_new_tokens` reduced by what is already generated, `return_logprob` (a LoRA run: `lora_path`, the
   adapter name of the scheduled version);
3. append the new tokens with their logprobs, sampling logprobs (under the filtered distribution they were drawn from;
   else the logprobs) and the `weight_version` the server reported (per token on vLLM; a LoRA run: at most the
   scheduled version, `_token_version`). An interrupted response whose sampling filters but without sampling logprobs
   (SGLang's answer for a request aborted in its queue) adds nothing: its tokens are generated again (`dropped_tokens`);
4. release the request, then stop when the answer is finished: `stop`, or its last token is EOS (`eos_token_ids`) or a
   stop token, at or past `min_new_tokens`, whatever finish_reason says (SGLang checks the length limit first, so a
   chunk ending on EOS reports `length`); or when the total `max_new_tokens` is reached (`no_eos`: ended by the
   length budget); resubmit when the response was interrupted (`abort`, e.g. by a weight update; it may hold 0
   tokens) or when a chunk ended by length below the total budget.

Tokens are never lost or duplicated across resubmissions: a response's tokens are appended exactly once, and the
next request continues after them. `version_start` is the version of the first generated token (or the version the
manager reported when the answer was first scheduled, if it has no token) and `version_end` that of the last.

Failures: a server that cannot be reached, times out or answers 5xx is retried (rescheduled through the manager,
exponential backoff) up to `request_retries` times in a row (a columnar answer that does not decode, too:
`MalformedAnswer`, counted in `malformed_answers`); then `PartialRolloutError` names the server, qid,
answer index and cause. A 4xx answer (e.g. prompt + budget longer than the model's context) fails at once: resending
the same request cannot help; except, in a LoRA run, a refusal of an adapter the server no longer holds
(`lora_not_loaded`: it moved on since the request was scheduled), retried like a 5xx, scheduled again and so naming
the adapter of the server's version then (counted, `stale_adapters`). The manager itself is reached through
`GserverManagerClient` with the same retry rule.

Servers that come and go (docs/architecture.md): the reschedule after a failure names the servers that failed in a
row (`avoid_urls`), so the manager picks another one while any is up. A failure on a server that the manager reports
taken out of routing (`down`), when it routes the retry to another server, does not count against `request_retries`
(at most MAX_UNCOUNTED_FAILURES such in a row): a dead server cannot use up the retries while healthy ones exist. A
schedule without a server (none is up, e.g. the only one is being restarted by its launcher) does not count either:
the answer waits, asking again every NO_SERVER_POLL_S at most, for up to `no_server_timeout` seconds in a row, then
fails naming `rollout.no_server_timeout`. The tokens, logprobs and versions an answer already has are kept across
all of this; only the chunk that was being generated on the lost server is generated again. A request in flight on a
server that the manager takes out of routing (it stopped answering) is abandoned and resubmitted at once instead of
waiting for `request_timeout` (the routing's `left_routing` future)."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import time
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from realrl.api.generation_api import (
    GenerationHyperparameters,
    GenerationRequest,
    GenerationResult,
    needs_sampling_logprobs,
)
from realrl.api.manager_api import ScheduledServer, ScheduleReply
from realrl.api.sglang_api import SamplingParams
from realrl.base.datapack import ffd_allocate
from realrl.base.logging import getLogger
from realrl.base.tick_batch import TickBatcher
from realrl.impl.generation.client import (
    GenerateResult,
    GenerationClient,
    GenerationServerError,
    GenerationServerUnavailable,
    MalformedAnswer,
    lora_adapter_name,
    new_rid,
)
from realrl.system.client_routing import ClientRouting, ManagerRouting
from realrl.system.manager_client import ManagerError, backoff, retryable_status

logger = getLogger(__name__)
_T = TypeVar("_T")

# Interrupted responses with no new token in a row before we give up: a server
# that aborts everything it is sent (e.g. shutting down) must not loop forever.
MAX_EMPTY_ABORTS = 50
# Failures on servers the manager took out of routing that are not counted,
# in a row: servers that keep dying and coming back must not loop forever.
MAX_UNCOUNTED_FAILURES = 20
MAX_ANSWERS_PER_REQUEST = 256  # answers of several groups' rounds sent as one /generate, at most
NO_SERVER_POLL_S = 2.0  # while no server is up, an answer asks the manager again at least this often

# Set in each episode's task by the rollout worker: its /generate's `priority` (lower admitted first); None: not sent.
EPISODE_PRIORITY: contextvars.ContextVar[int | None] = contextvars.ContextVar("episode_priority", default=None)


class PartialRolloutError(RuntimeError):
    """Generation for one answer failed after all retries (or cannot succeed)."""


@dataclasses.dataclass
class _Answer:
    """One answer being generated, across chunks and interruptions."""

    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sampling_logprobs: list[float] = dataclasses.field(default_factory=list)  # under the filtered distribution
    versions: list[int] = dataclasses.field(default_factory=list)
    scheduled_version: int | None = None  # the manager's version when first scheduled
    no_eos: bool = True
    server_s: float = 0.0  # what its servers reported spending on it (e2e_latency), over all its requests


@dataclasses.dataclass
class _Round:
    """One round of a group: a prompt (+ output so far), sampling parameters
    and request id per unfinished answer."""

    qid: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    rids: list[str]


@dataclasses.dataclass
class _Resume:
    """Where an answer's own loop starts after the group request: its tokens
    so far and the server that made them, or the server where the group
    request failed."""

    answer: _Answer
    previous_url: str | None = None
    previous_version: int | None = None
    failed_url: str | None = None
    last_error: str = ""
    failures: int = 0  # counted failures in a row so far


@dataclasses.dataclass
class PartialRolloutStats:
    """Counters since the last `pop()` (the rollout worker logs them)."""

    server_requests: int = 0  # /generate calls
    interruptions: int = 0  # responses that ended with finish_reason abort
    chunk_continuations: int = 0  # resubmissions after a chunk ended by length
    retries: int = 0  # server errors retried
    server_losses: int = 0  # failures on servers the manager took out of routing (not counted against the retries)
    no_server_waits: int = 0  # schedules answered "no server is up" (waited for, not counted)
    stale_adapters: int = 0  # LoRA requests whose server had unloaded the adapter they named (rescheduled)
    generated_tokens: int = 0
    dropped_tokens: int = 0  # tokens of aborted responses without their sampling logprobs, generated again
    malformed_answers: int = 0  # columnar /generate answers that did not decode (`MalformedAnswer`: retried)

    def pop(self) -> dict[str, int]:
        out = dataclasses.asdict(self)
        for f in dataclasses.fields(self):
            setattr(self, f.name, 0)
        return out


class PartialRolloutManager:
    """Serves agents' generation requests; see the module docstring."""

    def __init__(
        self,
        routing: ClientRouting | ManagerRouting,
        client: GenerationClient,
        new_tokens_per_chunk: int = 1 << 30,
        request_timeout: float = 600.0,
        request_retries: int = 3,
        retry_backoff_s: float = 0.5,
        no_server_timeout: float = 300.0,
        eos_token_ids: Iterable[int] = (),
        lora: bool = False,
    ):
        if new_tokens_per_chunk < 1:
            raise ValueError(f"new_tokens_per_chunk must be >= 1, got {new_tokens_per_chunk}")
        if request_retries < 0:
            raise ValueError(f"request_retries must be >= 0, got {request_retries}")
        self.routing = routing
        self.client = client
        self.new_tokens_per_chunk = new_tokens_per_chunk
        self.request_timeout = request_timeout
        self.request_retries = request_retries
        self.no_server_timeout = no_server_timeout
        self.retry_backoff_s = retry_backoff_s
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.stats = PartialRolloutStats()
        self.lora = lora  # a LoRA run: each request names the adapter of its scheduled version
        # Group rounds ready together (same stickiness) go as one request; see `_send_rounds`.
        self._rounds: TickBatcher[_Round] = TickBatcher(self._send_rounds)

    async def close(self) -> None:
        await self._rounds.close()
        await self.routing.close()

    async def generate(self, request: GenerationRequest) -> GenerationResult:
        """All `group_size` answers of `request`, generated concurrently. If one
        answer fails, the others are cancelled and the error is raised."""
        if not request.prompt_ids:
            raise ValueError(f"generation request {request.qid}: empty prompt")
        if request.group_size < 1:
            raise ValueError(f"generation request {request.qid}: group_size must be >= 1")
        request.gconfig.validate()
        if request.group_size == 1:  # one answer: in this task (no task to hop through)
            return self._result(request, [await self._generate_answer(request, 0)])
        starts = await self._generate_group(request)
        tasks = [
            asyncio.create_task(
                self._finished(start) if isinstance(start, _Answer) else self._generate_answer(request, i, start)
            )
            for i, start in enumerate(starts)
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        finally:  # on failure or cancellation: stop the other answers, release their servers
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                raise task.exception()
        return self._result(request, [task.result() for task in tasks])

    @staticmethod
    def _result(request: GenerationRequest, answers: list[_Answer]) -> GenerationResult:
        return GenerationResult(
            qid=request.qid,
            prompt_ids=list(request.prompt_ids),
            output_ids=[a.output_ids for a in answers],
            output_logprobs=[a.logprobs for a in answers],
            output_versions=[a.versions for a in answers],
            no_eos=[a.no_eos for a in answers],
            version_start=[a.versions[0] if a.versions else a.scheduled_version for a in answers],
            version_end=[a.versions[-1] if a.versions else a.scheduled_version for a in answers],
            output_sampling_logprobs=[a.sampling_logprobs for a in answers],
            sampling=request.gconfig.sampling(),
            server_s=[a.server_s for a in answers],
        )

    async def _generate_group(self, request: GenerationRequest) -> list[_Answer | _Resume]:
        """The answers of a group, generated together: each round is one batched `/generate` on one server for
        every answer not finished yet (one schedule, one request, one release instead of one of each per answer;
        the server prefills the shared prompt once). After an interruption or a chunk ended by length, the
        unfinished answers go on together, sticky to the server. Returns each answer finished, or how its own loop
        (`_generate_answer`) goes on: after a failed round or no server up (counted once per answer, as if each had
        failed alone, after one backoff), a round that generated no token (after a short pause), a server that
        answered the batch with something else, or answers that ended up on different weight versions."""
        gconfig = request.gconfig
        answers = [_Answer() for _ in range(request.group_size)]
        out: list[_Answer | _Resume | None] = [None] * request.group_size
        live = list(range(request.group_size))
        priority = EPISODE_PRIORITY.get()  # rounds of one priority share a /generate (SGLang's is one per body)
        previous_url: str | None = None
        previous_version: int | None = None
        while live:
            round_ = _Round(
                request.qid,
                [list(request.prompt_ids) + answers[i].output_ids for i in live],
                [self._chunk_params(gconfig, answers[i]) for i in live],
                [new_rid(request.qid, i) for i in live],
            )
            scheduled, outcome = await self._rounds.submit((previous_url, previous_version, priority), round_)
            if scheduled.url is None:  # no server is up: counted, as in an answer's loop, which retries
                reason = scheduled.reason or "no generation server is up"
                logger.warning("qid %s: %s; each answer retries", request.qid, reason)
                await asyncio.sleep(backoff(1, self.retry_backoff_s))
                for i in live:  # (not counted: each answer waits for a server in its own loop)
                    out[i] = _Resume(answers[i], last_error=reason)
                return out  # type: ignore[return-value]
            url, scheduled_version = scheduled.url, scheduled.version
            for i in live:
                if answers[i].scheduled_version is None:
                    answers[i].scheduled_version = scheduled_version
            if isinstance(outcome, (GenerationServerUnavailable, GenerationServerError)):
                e = outcome
                if isinstance(e, GenerationServerError) and e.status == 200:  # a server that cannot batch
                    logger.warning(
                        "qid %s: server %s answered a batched /generate with something else (%s); "
                        "its answers go one by one",
                        request.qid,
                        url,
                        e,
                    )
                    break
                self._raise_if_final(e, request.qid, f"answers {live}", url)
                self.stats.retries += len(live)  # each answer retries
                logger.warning(
                    "qid %s: batched request of %d answers on server %s failed (%s); each answer retries",
                    request.qid,
                    len(live),
                    url,
                    e,
                )
                await asyncio.sleep(backoff(1, self.retry_backoff_s))
                failed_url = None if self._stale_adapter(e) else url
                for i in live:
                    out[i] = _Resume(
                        answers[i], failed_url=failed_url, last_error=f"last server {url}: {e}", failures=1
                    )
                return out  # type: ignore[return-value]
            versions, new_tokens, still = set(), 0, []
            for i, response in zip(live, outcome):
                version = self._token_version(response, scheduled_version)
                new_tokens += self._append(answers[i], response, version, request.qid, url, request.gconfig)
                if self._take(answers[i], response, request, url):
                    out[i] = answers[i]
                else:
                    still.append(i)
                    versions.add(version)
            live = still
            previous_url, previous_version = url, (versions.pop() if len(versions) == 1 else None)
            if live and new_tokens == 0:  # e.g. a weight update in progress: do not hammer the server
                await asyncio.sleep(0.02)
                break
            if live and previous_version is None:
                break
        for i in live:  # each goes on alone, sticky to the server that made its tokens
            last = answers[i].versions[-1] if answers[i].versions else None
            out[i] = _Resume(answers[i], previous_url=previous_url if last is not None else None, previous_version=last)
        return out  # type: ignore[return-value]

    async def _send_rounds(
        self, key: tuple[str | None, int | None, int | None], rounds: list[_Round]
    ) -> list[tuple[ScheduleReply, Any]]:
        """Rounds of several groups with the same stickiness and priority `key` (previous server, its version, the
        episodes' EPISODE_PRIORITY), ready in the same few event-loop iterations, sent together: one schedule_request
        whose `parts` route each group as if alone (so they spread over the servers), then per server one batched
        /generate of its groups' answers (MAX_ANSWERS_PER_REQUEST at most, unless one group alone has more) and one
        release. Each round gets (its server and version as the manager replied, its responses or the error of its
        request)."""
        sizes = [len(r.prompts) for r in rounds]
        scheduled = await self._schedule(rounds[0].qid, key[0], key[1], n=sum(sizes), parts=sizes)
        if scheduled.url is None:
            return [(scheduled, None)] * len(rounds)
        # (a manager without parts: all on one server)
        picks = scheduled.parts or [ScheduledServer(scheduled.url, scheduled.version)] * len(rounds)
        results: list[Any] = [None] * len(rounds)

        async def send(url: str, part: list[int]) -> None:
            chunk = [rounds[k] for k in part]
            n = sum(sizes[k] for k in part)
            self.stats.server_requests += 1
            responses = outcome = None
            try:
                responses = outcome = await self._generate_on(
                    url,
                    self.client.generate_batch(
                        url,
                        [p for r in chunk for p in r.prompts],
                        [q for r in chunk for q in r.params],
                        return_logprob=True,
                        rids=[i for r in chunk for i in r.rids],
                        timeout_s=self.request_timeout,
                        lora_path=self._adapter(picks[part[0]].version),
                        priority=key[2],
                    ),
                )
            except (GenerationServerUnavailable, GenerationServerError) as e:
                outcome = e
            finally:
                generated = sum(len(r.output_ids) for r in responses) if responses is not None else 0
                await self._release(url, scheduled.ticket, generated, n=n)
            offset = 0
            for k in part:
                mine = outcome[offset : offset + sizes[k]] if isinstance(outcome, list) else outcome
                results[k] = (ScheduleReply(url=url, version=picks[k].version), mine)
                offset += sizes[k]

        requests = []
        for url, part in _per_server(picks, list(range(len(rounds)))).items():
            for b in ffd_allocate([sizes[k] for k in part], MAX_ANSWERS_PER_REQUEST):
                requests.append(send(url, [part[j] for j in b]))
        await asyncio.gather(*requests)
        return results

    def _token_version(self, response: GenerateResult, scheduled: int) -> int:
        """The version a response's tokens are labelled with: the server's. A LoRA request runs on the adapter of
        its scheduled version, but a server that switched adapters meanwhile reports the new version for tokens the
        old adapter sampled (SGLang): the lower of the two, so staleness is never understated (docs/design.md §8)."""
        version = _parse_version(response.weight_version, scheduled)
        return min(version, scheduled) if self.lora else version

    def _adapter(self, version: int) -> str | None:
        """`lora_path` of a request scheduled on `version` (docs/design.md §8)."""
        return lora_adapter_name(version) if self.lora else None

    def _chunk_params(self, gconfig: GenerationHyperparameters, answer: _Answer) -> SamplingParams:
        """The sampling parameters of an answer's next request: at most one
        chunk of what its budget has left, and the rest of min_new_tokens."""
        chunk = min(self.new_tokens_per_chunk, gconfig.max_new_tokens - len(answer.output_ids))
        params = gconfig.sampling_params(max_new_tokens=chunk)
        params.min_new_tokens = min(chunk, max(0, gconfig.min_new_tokens - len(answer.output_ids)))
        return params

    @staticmethod
    async def _finished(answer: _Answer) -> _Answer:
        return answer

    def _stale_adapter(self, e: Exception) -> bool:
        """A LoRA request refused because its server no longer holds the adapter it names: the server moved on (two
        versions, say) since the request was scheduled. Scheduled again, the request names the adapter of the server's
        version now (docs/design.md §8)."""
        return self.lora and isinstance(e, GenerationServerError) and e.status == 400 and "not loaded" in e.message

    def _raise_if_final(self, e: Exception, qid: str, which: str, url: str) -> None:
        """A 4xx answer: resending the same request cannot help (except
        naming a newer adapter, `_stale_adapter`)."""
        self.stats.malformed_answers += isinstance(e, MalformedAnswer)  # (a 502: retried)
        if self._stale_adapter(e):
            self.stats.stale_adapters += 1
            return
        if isinstance(e, GenerationServerError) and not retryable_status(e.status):
            raise PartialRolloutError(
                f"generation for qid {qid!r} ({which}) was refused by server {url} "
                f"(HTTP {e.status}; resending cannot help): {e.message}"
            ) from e

    def _take(self, answer: _Answer, response: GenerateResult, request: GenerationRequest, url: str) -> bool:
        """After a response's tokens were appended: whether the answer is
        finished (and whether it ended by EOS); counts why it goes on."""
        gconfig = request.gconfig
        if response.finish_reason == "stop" or self._ends_with_eos(answer, gconfig):
            answer.no_eos = False
            return True
        if len(answer.output_ids) >= gconfig.max_new_tokens:
            answer.no_eos = True
            return True
        if response.aborted:
            self.stats.interruptions += 1
        elif response.finish_reason == "length":
            self.stats.chunk_continuations += 1
        else:
            raise PartialRolloutError(
                f"generation for qid {request.qid!r} on server {url}: unknown finish_reason {response.finish_reason!r}"
            )
        return False

    async def _generate_answer(self, request: GenerationRequest, index: int, start: _Resume | None = None) -> _Answer:
        gconfig = request.gconfig
        start = start or _Resume(_Answer())
        answer = start.answer
        previous_url, previous_version = start.previous_url, start.previous_version
        failed_url = start.failed_url  # where the previous attempt failed
        failures = start.failures
        empty_aborts = uncounted = 0
        no_server_since: float | None = None  # since when no server has been up for this answer
        waits = 0  # schedules answered "no server is up" since then
        avoid: list[str] = [failed_url] if failed_url else []  # servers that failed in the current run of failures
        last_error = last_server_error = start.last_error  # why the last attempt failed; the last failure on a server
        while True:
            params = self._chunk_params(gconfig, answer)
            scheduled = await self._schedule(request.qid, previous_url, previous_version, avoid)
            if failed_url is not None:
                if (
                    scheduled.url is not None
                    and failed_url in (scheduled.down or ())
                    and uncounted < MAX_UNCOUNTED_FAILURES
                ):
                    # The server that failed is out of routing and another one took over: not counted.
                    failures -= 1
                    uncounted += 1
                    self.stats.server_losses += 1
                failed_url = None
            if scheduled.url is None:  # no server is up: wait for one (not counted), up to no_server_timeout
                now = time.monotonic()
                reason = scheduled.reason or "no generation server is up"
                if no_server_since is None:
                    no_server_since, waits = now, 0
                    logger.warning(
                        "qid %s answer %d: %s; waiting up to %.0f s (rollout.no_server_timeout) for one",
                        request.qid,
                        index,
                        reason,
                        self.no_server_timeout,
                    )
                if now - no_server_since >= self.no_server_timeout:
                    raise PartialRolloutError(
                        f"generation for qid {request.qid!r} (answer {index}): no generation server was up for "
                        f"{now - no_server_since:.0f} s (rollout.no_server_timeout={self.no_server_timeout:g}); "
                        f"{reason}" + (f"; {last_server_error}" if last_server_error else "")
                    )
                self.stats.no_server_waits += 1
                waits += 1
                await asyncio.sleep(min(NO_SERVER_POLL_S, backoff(waits, self.retry_backoff_s)))
                continue
            no_server_since = None
            if failures > self.request_retries:
                if scheduled.url is not None:
                    await self._release(scheduled.url, scheduled.ticket)
                raise PartialRolloutError(
                    f"generation for qid {request.qid!r} (answer {index}) failed {failures} times in a row; "
                    f"{last_error}"
                )
            url, scheduled_version = scheduled.url, scheduled.version
            if answer.scheduled_version is None:
                answer.scheduled_version = scheduled_version
            rid = new_rid(request.qid, index)
            self.stats.server_requests += 1
            response = None
            try:
                try:
                    response = await self._generate_on(
                        url,
                        self.client.generate(
                            url,
                            list(request.prompt_ids) + answer.output_ids,
                            params,
                            return_logprob=True,
                            rid=rid,
                            timeout_s=self.request_timeout,
                            lora_path=self._adapter(scheduled_version),
                            priority=EPISODE_PRIORITY.get(),
                        ),
                    )
                finally:
                    await self._release(url, scheduled.ticket, len(response.output_ids) if response is not None else 0)
            except (GenerationServerUnavailable, GenerationServerError) as e:
                self._raise_if_final(e, request.qid, f"answer {index}", url)
                # Counted now; not counted after all if the manager reports the server
                # out of routing when it reschedules (see the module docstring).
                failures += 1
                last_error = last_server_error = f"last server {url}: {e}"
                if not self._stale_adapter(e):  # (a stale adapter is no fault of the server's)
                    failed_url = url
                    if url not in avoid:
                        avoid.append(url)
                self.stats.retries += 1
                logger.warning(
                    "qid %s answer %d: server %s failed (%s); retry %d/%d (%d tokens kept)",
                    request.qid,
                    index,
                    url,
                    e,
                    failures,
                    self.request_retries,
                    len(answer.output_ids),
                )
                previous_url = previous_version = None  # let the manager route elsewhere
                await asyncio.sleep(backoff(failures, self.retry_backoff_s))
                continue
            failures = uncounted = 0
            avoid.clear()
            last_error = last_server_error = ""

            version = self._token_version(response, scheduled_version)
            n_new = self._append(answer, response, version, request.qid, url, gconfig)
            # Sticky next time: this server, as long as it still holds these weights.
            previous_url, previous_version = url, version
            if self._take(answer, response, request, url):
                return answer
            if response.aborted:
                empty_aborts = 0 if n_new else empty_aborts + 1
                if empty_aborts > MAX_EMPTY_ABORTS:
                    raise PartialRolloutError(
                        f"generation for qid {request.qid!r} (answer {index}): server {url} aborted "
                        f"{empty_aborts} requests in a row without generating a token" + _abort_message(response)
                    )
                if empty_aborts:  # e.g. a weight update in progress: do not hammer the server
                    await asyncio.sleep(min(1.0, 0.01 * 2**empty_aborts))

    def _ends_with_eos(self, answer: _Answer, gconfig: GenerationHyperparameters) -> bool:
        """Whether the answer's last token finishes it (the servers ban EOS and
        stop tokens before `min_new_tokens`, so one there does not)."""
        if not answer.output_ids or len(answer.output_ids) < gconfig.min_new_tokens:
            return False
        last = answer.output_ids[-1]
        return last in self.eos_token_ids or last in gconfig.stop_token_ids

    def _append(
        self,
        answer: _Answer,
        response: GenerateResult,
        version: int,
        qid: str,
        url: str,
        gconfig: GenerationHyperparameters,
    ) -> int:
        """Appends a response's tokens (exactly once) with their logprobs,
        sampling logprobs and version."""
        n = len(response.output_ids)
        if len(response.output_logprobs) != n:
            raise PartialRolloutError(
                f"server {url} returned {n} tokens but {len(response.output_logprobs)} logprobs for qid {qid!r}"
            )
        sampling_logprobs = response.output_sampling_logprobs
        if sampling_logprobs is None:
            # Only a request whose sampling filters asks for them (the client): without filters
            # the tokens were drawn from the distribution the plain logprobs are of.
            filtered = n > 0 and needs_sampling_logprobs(gconfig.sampling_params())
            if filtered and response.aborted:  # SGLang's abort in its waiting queue (design §6): generate again
                self.stats.dropped_tokens += n
                return 0
            if filtered:
                raise PartialRolloutError(
                    f"server {url} reported no sampling logprobs (output_token_sampling_logprobs) for qid {qid!r}, "
                    "though its sampling filters (SGLang >= 0.5.16 reports them with return_sampling_mask)"
                )
            sampling_logprobs = response.output_logprobs
        if len(sampling_logprobs) != n:
            raise PartialRolloutError(
                f"server {url} returned {n} tokens but {len(sampling_logprobs)} sampling logprobs for qid {qid!r}"
            )
        answer.output_ids.extend(response.output_ids)
        answer.logprobs.extend(response.output_logprobs)
        answer.sampling_logprobs.extend(sampling_logprobs)
        if response.output_versions is not None:  # per token (vLLM's weight_versions spans), at most `version`
            answer.versions.extend(min(_parse_version(v, version), version) for v in response.output_versions)
        else:
            answer.versions.extend([version] * n)
        answer.server_s += response.meta_info.e2e_latency or 0.0
        self.stats.generated_tokens += n
        return n

    async def _schedule(
        self,
        qid: str,
        previous_url: str | None,
        previous_version: int | None,
        avoid: list[str] | None = None,
        n: int = 1,
        parts: list[int] | None = None,
    ) -> ScheduleReply:
        """The manager's `schedule_request`, safe against cancellation: once the manager may have counted the request,
        the slot is released even if this answer is cancelled meanwhile (e.g. because a sibling answer failed). Routed
        in this process without waiting (the client routing has its table and nothing to report), it is picked at once:
        nothing to cancel."""
        if not avoid:
            picked = self.routing.schedule_now(qid, n, previous_url, previous_version, parts=parts)
            if picked is not None:
                return picked
        kwargs = {"avoid_urls": list(avoid)} if avoid else {}
        call = asyncio.ensure_future(
            self.routing.schedule_request(qid, n, previous_url, previous_version, parts=parts, **kwargs)
        )
        try:
            return await asyncio.shield(call)
        except asyncio.CancelledError:
            try:
                scheduled = await call
                if scheduled.url is not None:
                    counts = _per_server(scheduled.parts, parts) if scheduled.parts else {scheduled.url: [n]}
                    for url, count in counts.items():
                        await self._release(url, scheduled.ticket, n=sum(count))
            except Exception:  # the manager never answered: nothing was counted for us
                pass
            raise

    async def _generate_on(self, url: str, call: Coroutine[Any, Any, _T]) -> _T:
        """A `/generate` `call` on `url`, abandoned (GenerationServerUnavailable) as soon as the routing says the server
        left it, e.g. because it stopped answering: its answers are then resubmitted elsewhere. The call runs in this
        task (no task per call to hop through); the server's leaving cancels it, as `asyncio.timeout` cancels on its
        deadline."""
        left = self.routing.left_routing(url)  # (shared by every request on url: never cancelled here)
        if left.done():
            call.close()
            raise GenerationServerUnavailable(url, "the manager took it out of routing (failed health checks)")
        task = asyncio.current_task()
        abandoned = False

        def abandon(_: asyncio.Future) -> None:
            nonlocal abandoned
            abandoned = True
            task.cancel()

        left.add_done_callback(abandon)
        try:
            return await call
        except asyncio.CancelledError:
            # Ours (the server left) unless someone else cancelled this task too.
            if abandoned and task.uncancel() == 0:
                raise GenerationServerUnavailable(
                    url, "the manager took it out of routing (failed health checks)"
                ) from None
            raise
        finally:
            left.remove_done_callback(abandon)

    async def _release(self, url: str, ticket: int | None, n_tokens: int = 0, n: int = 1) -> None:
        # One quick attempt: an in-flight count that is off by a few only skews
        # routing until the rollout ends (the manager then gives back what its
        # tickets still hold), and teardown (cancellation) must not wait on retries.
        if ticket is None:  # nothing was scheduled
            return
        try:
            await self.routing.release_request(url, ticket, n, retries=0, n_tokens=n_tokens)
        except ManagerError as e:
            logger.warning("could not release a request on %s: %s", url, e)


def _per_server(picks: list[ScheduledServer], values: list[_T]) -> dict[str, list[_T]]:
    """`values` (one per part of a schedule_request) grouped by the part's server."""
    out: dict[str, list[_T]] = {}
    for pick, value in zip(picks, values):
        out.setdefault(pick.url, []).append(value)
    return out


def _abort_message(response: GenerateResult) -> str:
    """The server's reason for an abort, if it gave one (SGLang: e.g. a request it refuses)."""
    reason = response.meta_info.finish_reason if response.meta_info is not None else None
    message = getattr(reason, "message", None)
    return f" (the last: {message})" if message else ""


def _parse_version(reported: str, fallback: int) -> int:
    """The server's weight_version as an int (SGLang reports "default" when
    none was set: then the version the manager reported is the best we know)."""
    try:
        return int(reported)
    except (TypeError, ValueError):
        return fallback
