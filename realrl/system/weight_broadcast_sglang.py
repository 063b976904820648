"""`weights.transport=broadcast` with SGLang servers (`protocol: sglang`;
docs/design.md §8, "SGLang servers"): the manager drives each epoch's
members over SGLang's own routes (`SGLangDriver`), as its source shows them.
The manager's epochs: realrl/system/weight_broadcast.py (`WeightEpochs`)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable

from packaging.version import InvalidVersion, Version

from realrl.base.logging import getLogger
from realrl.impl.generation.client import GenerationClient, GenerationServerError, GenerationServerUnavailable
from realrl.impl.weights.broadcast import _POLL_S, GroupError, GroupSpec, Manifest, SealedStore, connect_store
from realrl.system.weight_drops import Drops, Lag

logger = getLogger("weight_broadcast")


class SGLangDriver:
    """One epoch of SGLang servers (`protocol: sglang`), driven over SGLang's
    own routes as its source shows them (v0.5.16, v0.5.23): once the sender
    announced itself in the store, every member `/init_weights_update_group`
    (answered once the group formed); then for each version the sender
    announces (`v/<n>`), every member concurrently: `/pause_generation`
    (abort: requests in flight end and resume as for a disk update; new ones
    wait), from 0.5.23 `/begin_weight_update`, one
    `/update_weights_from_distributed` per bucket of the tensor list (packed:
    `load_format: flattened_bucket`; the version's number with its last
    bucket only, so the server's version changes when the whole version is
    in place), `/end_weight_update`, `/continue_generation`; each bucket
    after the first once the sender finished the one before (`_bucket_sent`).
    A member whose call fails, or whose wait for the sender's bucket ends with
    the epoch, is lost to the epoch (the manager loads its versions from
    disk; the next boundary builds a new epoch), paused until then if part
    of the version went in (`left_paused`). One that cannot join, or a
    group not formed within the spec's `timeout_s`, has the epoch abandoned
    at once (`on_abandon(name, why)`: SGLang gives the members waiting in
    the rendezvous no bound of their own but torch's 30 minutes). `stop`
    ends it at a version boundary and destroys the group on its members."""

    def __init__(
        self,
        spec: GroupSpec,
        members: dict[str, int],
        client: GenerationClient,
        key: bytes,
        on_abandon: Callable[[str, str], None] | None = None,
        left_paused: set[str] | None = None,
        through_group: dict[str, int] | None = None,
        straggler_s: float = 5.0,
        on_straggler: Callable[[str, str], None] | None = None,
    ):
        self.spec, self.members, self._client = spec, dict(members), client
        self._seal_key, self._on_abandon = key, on_abandon
        self.left_paused = left_paused if left_paused is not None else set()
        self._sent: dict[str, asyncio.Task] = {}  # `b/<n>/<i>` -> its wait, shared by the members
        self._store: SealedStore | None = None  # the epoch's store, as a client (connected in `_run`)
        self.held: dict[str, int] = {}  # url -> the newest version in place through the group
        # the same, kept by the manager beyond the epoch (`WeightEpochs.holds`)
        self.through_group = through_group if through_group is not None else {}
        self.lost: dict[str, str] = {}  # url -> why it left the epoch
        self.drops = Drops(spec, self.members, straggler_s, on_straggler, lambda: self._store, lambda: self.formed)
        self.drops.lost, self.drops.on_drop = lambda: self.lost, self._dropped
        self.dropped = self.drops.dropped  # the lost the epoch goes on without
        self.formed = False  # every member joined: a member can be dropped from here on
        self.in_version = False  # the members are taking a version the sender announced
        self.taken_version = -1  # the last version the members took (those not dropped)
        self._partial: set[str] = set()  # members with part of the version in flight in place
        self._left: set[asyncio.Task] = set()  # dropped members' versions, left to end on their own
        self.failed = False
        self._stopping = False
        self._sessions: dict[str, bool] = {}
        self._changed = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    def stop(self) -> None:
        self._stopping = True

    async def await_version(self, url: str, version: int, timeout_s: float) -> tuple[bool, str]:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self.held.get(url, -1) < version:
            if url in self.lost:
                return False, self.lost[url]
            if self._task.done():
                return False, f"weight group {self.spec.name} is over"
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                return False, f"version {version} did not arrive within {timeout_s} s"
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), min(left, 0.5))
            except asyncio.TimeoutError:
                pass
        return True, ""

    def _abandon(self, why: str) -> None:
        if self._on_abandon is not None:
            self._on_abandon(self.spec.name, why)

    def _dropped(self, url: str, why: str) -> None:
        """SGLang's part of a drop (`Drops.drop`): it is lost to the epoch (the
        manager loads its versions), paused until then if part of one went in."""
        if url in self._partial:  # (SGLang loads each bucket as it comes)
            self.left_paused.add(url)
        self.lost[url] = f"dropped ({why})"
        self._changed.set()

    async def _each_member(self, urls: list[str], n: int, version: int, buckets: list) -> None:
        """Announcement `n` into each member not lost, until each took it, or
        failed, or was dropped (its version left to end on its own; the lag
        rule, `Lag`, drops one that holds the others back)."""
        lag = Lag(self.drops, version)
        tasks = {u: asyncio.ensure_future(self._version(u, n, version, buckets)) for u in urls if u not in self.lost}
        while waiting := {u: t for u, t in tasks.items() if not t.done() and u not in self.dropped}:
            peers = [u for u in tasks if u not in waiting and u not in self.dropped]
            if not self._stopping:
                took = bool(peers) and all(self.held.get(u, -1) >= version for u in peers)
                await lag.check(took, list(waiting), functools.partial(self.drops.newer_waits, n))
            await asyncio.wait(waiting.values(), timeout=0.1)
        for url, task in tasks.items():
            if not task.done():
                self._left.add(task)
                task.add_done_callback(self._left.discard)

    def _lose(self, url: str, why: str) -> None:
        if url not in self.lost:
            logger.warning("weight group %s: %s left it: %s", self.spec.name, url, why)
        self.lost[url] = why
        self.failed = True
        self._changed.set()

    async def _key(self, key: str, timeout_s: float | None = None) -> bytes | None:
        """The value of `key` once the sender set it (None: stopped, or `timeout_s` passed)."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self._stopping and (deadline is None or loop.time() < deadline):
            if await asyncio.to_thread(self._store.check, [key]):
                return await asyncio.to_thread(self._store.get, key)
            await asyncio.sleep(_POLL_S)
        return None

    async def _join(self, url: str, rank: int, joined: set[str]) -> None:
        try:
            await self._client.init_weights_update_group(url, self.spec, rank, timeout_s=self.spec.timeout_s + 30)
        except (GenerationServerError, GenerationServerUnavailable) as e:
            self._lose(url, f"could not join: {e}")
            # The others wait in the rendezvous for its rank: end the epoch now.
            self._abandon(f"{url} could not join")
        else:
            joined.add(url)

    async def _run(self) -> None:
        urls = list(self.members)
        try:
            self._store = await asyncio.to_thread(connect_store, self.spec, self._seal_key)
            if await self._key("sender", self.spec.join_timeout_s) is None:
                if not self._stopping:
                    for url in urls:
                        self._lose(url, f"no sender within {self.spec.join_timeout_s:g} s")
                return
            joined: set[str] = set()
            try:  # the rendezvous's bound, as the sender's (SGLang's own is torch's 30 minutes)
                await asyncio.wait_for(
                    asyncio.gather(*(self._join(url, rank, joined) for url, rank in self.members.items())),
                    self.spec.timeout_s,
                )
            except asyncio.TimeoutError:
                for url in set(urls) - joined:
                    self._lose(url, f"not in the group within {self.spec.timeout_s:g} s")
                self._abandon(f"the group did not form within {self.spec.timeout_s:g} s")
            if self.lost:
                return  # (the sender's rendezvous failed with the epoch's store: the version goes by disk)
            manifest_bytes = await self._key("manifest")
            if manifest_bytes is None:
                return
            buckets = Manifest.from_bytes(manifest_bytes).bucket_entries(self.spec.bucket_bytes)
            self.formed = True
            n = 0
            while set(self.lost) <= self.dropped and len(self.dropped) < len(urls):
                announced = await self._key(f"v/{n}")
                if announced is None or announced == b"close":
                    return
                version = int(announced)
                self._sent.clear()
                self.in_version = True
                try:
                    await self._each_member(urls, n, version, buckets)
                    self.taken_version = version
                finally:
                    self.in_version = False
                self._changed.set()
                n += 1
        except Exception as e:  # the store gone, a malformed tensor list: the epoch is over
            for url in urls:
                self._lose(url, f"{type(e).__name__}: {e}")
            self._abandon(f"{type(e).__name__}: {e}")
        finally:
            await asyncio.gather(*(self._destroy(url) for url in urls))

    async def _version(self, url: str, n: int, version: int, buckets: list) -> None:
        """Version `version` (announcement `n`) into member `url`. Bucket i + 1
        is asked for only once the sender finished bucket i (`_bucket_sent`):
        SGLang waits in a plain broadcast that looks at no store, and one
        asked for a bucket the sender never sends (it leaves every
        collective once the epoch is abandoned) would wait for it until the
        collective's timeout, paused.
        SGLang loads each bucket as it arrives (v0.5.6 `model_executor/
        model_runner.py` `_update_bucketed_weights_from_distributed`; on a
        failure: "partially updated. Please discard the whole weights."), so
        a member that fails after its first bucket stays paused
        (`left_paused`) until a version is loaded whole from disk
        (`WeightEpochs.resume`): it never serves a half-swapped model."""
        client, timeout = self._client, self.spec.timeout_s + 30
        session = partial = False
        failure: Exception | None = None
        try:
            await client.pause_generation(url, mode="abort")
            try:
                if await self._has_sessions(url):
                    await client.begin_weight_update(url, timeout_s=timeout)
                    session = True
                for i, entries in enumerate(buckets):
                    if i:
                        await self._bucket_sent(n, i - 1, self.members[url])
                    partial = True
                    self._partial.add(url)
                    last = i == len(buckets) - 1
                    await client.update_weights_from_distributed(
                        url, self._group_name(url), entries, str(version) if last else None, timeout_s=timeout
                    )
                partial = False  # (the whole version is in place)
            finally:
                if session:  # also after a failure: a session left open refuses the next epoch's begin
                    await client.end_weight_update(url, timeout_s=timeout)
        except (GenerationServerError, GenerationServerUnavailable, GroupError) as e:
            failure = e
        self._partial.discard(url)
        if not partial:
            try:
                await client.continue_generation(url)
            except (GenerationServerError, GenerationServerUnavailable) as e:
                failure = failure or e
        if failure is None:
            self.held[url] = self.through_group[url] = version
            if url in self.dropped:  # (whole after all: not paused)
                self.left_paused.discard(url)
            return
        if partial:
            self.left_paused.add(url)
        why = f"version {version}: {failure}" + (" (paused until loaded from disk)" if partial else "")
        if self.drops.drop(url, why):
            # The epoch goes on without it. Alive, it takes part in none of the epoch's collectives
            # from here on: destroying its group closes its connections, which ends the sender's
            # collective in that group at once (gloo does not use the store once connected).
            await self._destroy(url)
            return
        self._lose(url, why)
        # Alive, it takes part in none of the epoch's collectives from here on, and the sender
        # (and the members it relays to) would wait for it until the collective's timeout:
        # gloo does not use the store once connected, so closing the store ends no such wait.
        # Destroying its group closes its connections, which fails theirs at once; then the
        # epoch is abandoned (the version goes by disk, the next boundary builds a new one).
        await self._destroy(url)
        self._abandon(f"{url} failed version {version}")

    def _bucket_sent(self, n: int, i: int, rank: int) -> asyncio.Task:
        """Ends once the sender finished bucket `i` of announcement `n` for
        the member at `rank` (`b/<n>/<i>/<rank>`: in its group of two; one
        group of all: `b/<n>/<i>`, every member has it); GroupError once the
        epoch's store is gone (abandoned) or after a collective's timeout.
        One wait per key, shared by the members."""
        key = f"b/{n}/{i}/{rank}" if self.spec.member_groups == "pairs" else f"b/{n}/{i}"
        if (task := self._sent.get(key)) is None:
            task = self._sent[key] = asyncio.ensure_future(self._wait_sent(key, rank))
        return task

    async def _wait_sent(self, key: str, rank: int) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.spec.timeout_s
        while True:
            if any(self.members[u] == rank for u in self.dropped):  # (the sender feeds it no more)
                raise GroupError(f"weight group {self.spec.name}: member {rank} was dropped")
            try:
                if await asyncio.to_thread(self._store.check, [key]):
                    return
            except Exception as e:  # the epoch's store closed: abandoned
                raise GroupError(f"weight group {self.spec.name} was abandoned (its store: {e})") from None
            if loop.time() > deadline:
                raise GroupError(f"weight group {self.spec.name}: {key} not sent within {self.spec.timeout_s:g} s")
            await asyncio.sleep(_POLL_S)

    async def _has_sessions(self, url: str) -> bool:
        """Whether the server needs a weight-update session: SGLang 0.5.23 on
        (`/get_server_info`'s `version`; v0.5.23 `managers/scheduler_components/
        weight_updater.py`), not 0.5.16, which has no such routes."""
        if url not in self._sessions:
            release = (await self._client.server_info(url)).get("version", "0")
            try:
                self._sessions[url] = Version(str(release)) >= Version("0.5.23")
            except InvalidVersion:
                self._sessions[url] = True  # (a development build: the newest behaviour)
        return self._sessions[url]

    def _group_name(self, url: str) -> str:
        return self.spec.member_group(self.members[url])[0]

    async def _destroy(self, url: str) -> None:
        try:
            await self._client.destroy_weights_update_group(url, self._group_name(url), timeout_s=10)
        except (GenerationServerError, GenerationServerUnavailable):
            pass
