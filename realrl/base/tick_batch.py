"""Coalescing calls that become ready together into one.

Many episodes of a rollout worker reach the same point at about the same
moment: a batch of them is admitted in one call, so their first generation
rounds are ready in the same event-loop iteration, and episodes whose answers
came back in one response finish together. `TickBatcher` sends such calls as
one request: the first `submit` of a key opens a batch, which stays open for
a few event-loop iterations (no wall-clock wait: it only lets the other
coroutines that are ready run up to their own `submit`), then `send(key,
items)` runs once for all of them.

`send` returns one result per item, in order; an `Exception` instance in
that list is raised to that item's caller alone. If `send` raises, every
caller of the batch gets the exception. A caller cancelled before its batch
is sent is left out of it; one cancelled later does not stop the batch (the
others still get their results).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, Generic, TypeVar

T = TypeVar("T")

OPEN_TICKS = 3  # event-loop iterations a batch waits for more items


@dataclasses.dataclass
class _Item(Generic[T]):
    value: T
    future: asyncio.Future


class TickBatcher(Generic[T]):
    def __init__(self, send: Callable[[Hashable, list[T]], Awaitable[list[Any]]], open_ticks: int = OPEN_TICKS):
        self._send = send
        self._open_ticks = open_ticks
        self._open: dict[Hashable, list[_Item[T]]] = {}
        self._flushes: set[asyncio.Task] = set()

    async def submit(self, key: Hashable, value: T) -> Any:
        loop = asyncio.get_running_loop()
        item = _Item(value, loop.create_future())
        batch = self._open.get(key)
        if batch is None:
            batch = self._open[key] = []
            task = loop.create_task(self._flush(key))
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)
        batch.append(item)
        return await item.future

    async def _flush(self, key: Hashable) -> None:
        items: list[_Item[T]] | None = None
        try:
            for _ in range(self._open_ticks):
                await asyncio.sleep(0)
            items = [item for item in self._open.pop(key) if not item.future.done()]
            if not items:
                return
            try:
                results = await self._send(key, [item.value for item in items])
                if len(results) != len(items):
                    raise RuntimeError(f"TickBatcher: send returned {len(results)} results for {len(items)} items")
            except Exception as e:
                results = [e] * len(items)
            for item, result in zip(items, results):
                if item.future.done():
                    continue
                if isinstance(result, Exception):
                    item.future.set_exception(result)
                else:
                    item.future.set_result(result)
        finally:  # cancelled (teardown): nobody waits forever
            for item in self._open.pop(key, []) if items is None else items:
                if not item.future.done():
                    item.future.cancel()

    async def close(self) -> None:
        """Cancels the batches not sent yet or in flight."""
        for task in list(self._flushes):
            task.cancel()
        await asyncio.gather(*self._flushes, return_exceptions=True)
