"""TickBatcher: calls ready in the same few event-loop iterations go as one."""

from __future__ import annotations

import asyncio

import pytest

from realrl.base.tick_batch import TickBatcher


class Recorder:
    def __init__(self, fail_on: str | None = None, raise_on: str | None = None):
        self.sent: list[tuple[object, list]] = []
        self.fail_on, self.raise_on = fail_on, raise_on

    async def send(self, key, items: list) -> list:
        self.sent.append((key, list(items)))
        await asyncio.sleep(0.01)  # in flight for a while (callers may be cancelled meanwhile)
        if self.raise_on in items:
            raise ConnectionError(f"lost while sending {self.raise_on}")
        return [ValueError(f"bad {x}") if x == self.fail_on else f"{key}:{x}" for x in items]


def test_calls_ready_together_go_as_one_per_key():
    rec = Recorder()

    async def main():
        batcher = TickBatcher(rec.send)

        async def caller(key, x, hops: int = 0):
            for _ in range(hops):  # reaches submit a tick or two after the others
                await asyncio.sleep(0)
            return await batcher.submit(key, x)

        first = await asyncio.gather(caller("a", 1), caller("a", 2, hops=2), caller("b", 3), caller("a", 4, hops=1))
        later = await caller("a", 5)  # after the batch went: a batch of its own
        return first, later

    first, later = asyncio.run(main())
    assert first == ["a:1", "a:2", "b:3", "a:4"] and later == "a:5"
    assert sorted(rec.sent, key=str) == sorted([("a", [1, 4, 2]), ("b", [3]), ("a", [5])], key=str)  # in arrival order


def test_errors_reach_their_callers_and_cancelled_callers_are_left_out():
    rec = Recorder(fail_on="x", raise_on="boom")

    async def main():
        batcher = TickBatcher(rec.send)
        ok, bad = batcher.submit(0, "ok"), batcher.submit(0, "x")
        gone = asyncio.ensure_future(batcher.submit(0, "gone"))
        await asyncio.sleep(0)
        gone.cancel()  # before its batch is sent: left out
        results = await asyncio.gather(ok, bad, gone, return_exceptions=True)
        # An error of the whole send reaches every caller of that batch.
        whole = await asyncio.gather(batcher.submit(1, "boom"), batcher.submit(1, "fine"), return_exceptions=True)
        # A caller cancelled while its batch is in flight does not stop the others.
        late = asyncio.ensure_future(batcher.submit(2, "late"))
        other = asyncio.ensure_future(batcher.submit(2, "other"))
        for _ in range(5):
            await asyncio.sleep(0)
        late.cancel()
        return results, whole, await other, late

    (ok, bad, gone), whole, other, late = asyncio.run(main())
    assert ok == "0:ok" and isinstance(bad, ValueError) and isinstance(gone, asyncio.CancelledError)
    assert rec.sent[0] == (0, ["ok", "x"])
    assert all(isinstance(e, ConnectionError) for e in whole)
    assert other == "2:other" and late.cancelled() and (2, ["late", "other"]) in rec.sent


def test_close_cancels_the_batches_not_answered():
    async def main():
        async def never(key, items):
            await asyncio.sleep(3600)

        batcher = TickBatcher(never)
        waiting = asyncio.ensure_future(batcher.submit("k", 1))
        for _ in range(5):
            await asyncio.sleep(0)
        await batcher.close()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(main())
