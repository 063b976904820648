"""The engine thread's answers into the HTTP server's event loop, in batches
(`Answers`): the torch server's engine runs on a thread of its own and hands
each finished request to a `reply` callback; waking the loop once per answer
(a self-pipe write and a select each) cost ~13% of the server's CPU on the
default run's 128 answers a step."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any


class Answers:
    """The engine thread's answers into the event loop, in batches.

    `setter(fut)` is a `reply` callback that sets `fut`; `all_of(fut, n)` gives n
    callbacks that set `fut` to the list of their n answers (in order) once the
    last one came. Answers made while the loop has not yet run the previous
    batch join it: the loop is woken once per batch (a self-pipe write and a
    select each), not once per answer; a batched /generate of 128 prompts is
    one wake-up when all of its answers come in the same engine step. A
    callback may be called from any thread, once; a second call is ignored.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Future, Any]] = []

    def _deliver(self, fut: asyncio.Future, result: Any) -> None:
        with self._lock:
            self._pending.append((fut, result))
            if len(self._pending) > 1:
                return  # a batch is already due in the loop: this one goes with it
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:  # the event loop is already closed (shutdown)
            pass

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
        for fut, result in batch:
            if not fut.done():
                fut.set_result(result)

    def setter(self, fut: asyncio.Future) -> Callable[[Any], None]:
        return self.all_of(fut, 1, single=True)[0]

    def all_of(self, fut: asyncio.Future, n: int, single: bool = False) -> list[Callable[[Any], None]]:
        results: list[Any] = [None] * n
        answered = [False] * n
        left = [n]
        lock = threading.Lock()

        def reply_for(i: int) -> Callable[[Any], None]:
            def reply(result: Any) -> None:
                with lock:
                    if answered[i]:
                        return
                    answered[i] = True
                    results[i] = result
                    left[0] -= 1
                    if left[0]:
                        return
                self._deliver(fut, results[0] if single else results)

            return reply

        return [reply_for(i) for i in range(n)]
