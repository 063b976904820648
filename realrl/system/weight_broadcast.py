"""`weights.transport=broadcast` in the runtime (docs/design.md §8, "Broadcast"):
the trainer's side (`BroadcastPublisher`, model worker rank 0) and the
manager's (`WeightEpochs`). The transport itself: realrl/impl/weights/broadcast.py.

The manager owns the epochs. At a version boundary (no update in flight),
when the servers up differ from the current epoch's members or the epoch
failed, it builds a new one: the up servers, each at its rank, are told to
join (`/join_weights_group`), then the group's spec goes to the name service
(`names.weights_group`). The trainer reads that key at each step end; on a
new epoch it ends its old sender and starts one for the new group (its
first version completes the rendezvous; the first epoch's sender is made
ahead, while the trainer waits for its first batch: `prepare`). A version that went through the
group to every member is not written to disk: the sender's thread writes a
version's HF directory from its snapshot only when the group failed, or
when the manager asks (`names.weights_wanted`: a server joining, restarted,
or dropped from a failed epoch needs one), also between versions, from the
last snapshot, which stays in its buffer (`Sender.idle`); so a trainer that
waits for a batch no server can make (every server restarted) still writes
the version they need. `model_version/actor` is set after the write (or
without one), so the key no longer means the directory exists: the manager
waits for the directory it asked for (`GserverManager._on_disk`). For a
member the manager only waits until it holds
the version (`/await_weight_version`); one that does not within
`weight_update_timeout` (its group failed) loads it from disk instead. SGLang servers (`protocol: sglang`)
are driven over SGLang's own routes instead (`SGLangDriver`,
realrl/system/weight_broadcast_sglang.py).

Each member is in a process group of two with the sender (both protocols),
so the manager can leave one alone: once the epoch's groups formed, a
member found down, one whose version failed, or one that lags its peers in
a version while a newer one waits (the lag rule) is *dropped*
(realrl/system/weight_drops.py), loads its versions from disk, and
re-enters at the next epoch; the others go on in the same epoch. Each
epoch has its own store, which the manager closes to abandon the epoch
(`WeightEpochs.abandon`) where it cannot drop: a member that goes down
while the groups still form, the last member left, or one that cannot
join (SGLang: its `/init_weights_update_group` fails, or the group has not
formed within `timeout_s`). Whoever waits in that epoch's rendezvous (the sender,
the members still up; SGLang would wait torch's 30 minutes) then fails at
once, the version goes by disk, and the next boundary builds a new epoch.
So do the sender and torch servers waiting in a version's collective (they
look at the store between slices of the wait, and at `drop/<rank>`).
SGLang members wait in a plain broadcast that looks at no store: each is
asked for a bucket only once the
sender finished the one before to it, so none waits for one the sender will
not send, nor for a stalled peer (the others take the version meanwhile,
and one a member took whole is not loaded again: `holds`); one that fails
after its first bucket (SGLang loads each as it comes) stays paused until a
version is loaded whole from disk (`WeightEpochs.left_paused`, `resume`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import threading
import time
from collections.abc import Callable

import torch

from realrl.api.system_api import WeightTransportConfig
from realrl.base import name_resolve, names, trial_secret
from realrl.base.logging import getLogger
from realrl.impl.generation.client import GenerationClient, GenerationServerError, GenerationServerUnavailable
from realrl.impl.weights.broadcast import (
    GroupSpec,
    Manifest,
    SealedStore,
    Sender,
    StoreServer,
    connect_store,
    published_tensors,
)
from realrl.system.weight_broadcast_sglang import SGLangDriver
from realrl.system.weight_drops import Drops, Lag

logger = getLogger("weight_broadcast")
ROLE = "actor"


def _group_key() -> bytes:
    keys = trial_secret.current()
    return keys.weights_group_key if keys is not None else b""  # security off: unsealed (§14, "Off")


class BroadcastPublisher:
    """Rank 0's publishing under `weights.transport=broadcast`. `publish`
    returns False when no epoch exists yet (the caller writes the version to
    disk itself, as on the disk path, and tells `written`). A version that
    went through the group is written to disk only if the manager wants one
    at least as new (`names.weights_wanted`; looked at after each version and
    every `idle_s` between versions) that is not on disk yet."""

    def __init__(
        self,
        cfg: WeightTransportConfig,
        model: torch.nn.Module,
        dtype: torch.dtype | None,
        write_to_disk: Callable[[int, dict[str, torch.Tensor]], None],
        experiment_name: str,
        trial_name: str,
        bind_host: str,
    ):
        self.cfg, self.model, self.dtype = cfg, model, dtype
        self._write_to_disk = write_to_disk
        self._key_name = names.weights_group(experiment_name, trial_name, ROLE)
        self._sent_name = names.weights_sent(experiment_name, trial_name, ROLE)
        self._wanted_name = names.weights_wanted(experiment_name, trial_name, ROLE)
        self._bind_host = bind_host
        self.written = -1  # the newest version written to disk (by the caller too: the disk path)
        self.sender: Sender | None = None
        self._announced = -1
        self._announce_lock = threading.Lock()
        self._announce: Callable[[int], None] | None = None
        self._sender_lock = threading.Lock()  # (`publish` and `prepare`'s thread make senders)
        self._closed = threading.Event()

    def _current_spec(self) -> GroupSpec | None:
        try:
            return GroupSpec.from_json(json.loads(name_resolve.get(self._key_name)))
        except name_resolve.NameEntryNotFoundError:
            return None

    def publish(self, version: int, state_dict: dict | None, announce: Callable[[int], None]) -> bool:
        """Snapshots `version` for the current epoch's group (one memory copy);
        `announce(version)` (and, if its group fails or the manager asks, its disk copy) follows on
        the sender's thread."""
        spec = self._current_spec()
        if spec is None:
            return False
        self._announce = announce
        tensors = published_tensors(self.model, state_dict)
        self._sender_for(spec, tensors).publish(version, tensors)
        return True

    def _sender_for(self, spec: GroupSpec, tensors: dict[str, torch.Tensor]) -> Sender:
        """The sender of `spec`'s group: the one there is, or a new one (the old one ends)."""
        with self._sender_lock:
            if self.sender is None or self.sender.spec.name != spec.name:
                if self.sender is not None:
                    self.sender.close(timeout_s=0)  # (it finishes what it holds, then tells its members)
                logger.info("weight group %s: sending to %d servers", spec.name, spec.world_size - 1)
                manifest = Manifest.of(tensors, self.dtype, packed=spec.protocol == "sglang")  # (SGLang's buckets)
                sender = Sender(spec, _group_key(), manifest, self._bind_host)
                sender.after_send = functools.partial(self._after_send, sender)
                sender.idle = functools.partial(self._write, sender, why=None)  # (between versions)
                self.sender = sender
            return self.sender

    def prepare(self, poll_s: float = 0.25) -> None:
        """Makes the first epoch's sender before the first version, on a thread
        of its own: once the manager's first group is named, its two buffers
        are allocated (and paged in) and the group forms while the trainer
        waits for its first batch, not in the first publishes' stalls nor on
        the first version's way to the servers. Only where `publish` is given
        no state dict (the model's own tensors: not under FSDP)."""

        def first_sender() -> None:
            while not self._closed.wait(poll_s) and self.sender is None:
                try:
                    spec = self._current_spec()
                    if spec is not None:
                        self._sender_for(spec, published_tensors(self.model))
                        return
                except Exception:  # (the name service going away at exit; publish makes one as before)
                    logger.warning("weight group: no sender made ahead of the first version", exc_info=True)
                    return

        threading.Thread(target=first_sender, name="weights-first-sender", daemon=True).start()

    def _after_send(self, sender: Sender, version: int, tensors: dict[str, torch.Tensor]) -> None:
        ok = not sender.failed
        if not ok:
            logger.warning(
                "weight group %s failed (%s): version %d goes by disk", sender.spec.name, sender.error, version
            )
        # Which versions went through which group: the manager waits for members only on those.
        sent = {"group": sender.spec.name, "version": version, "ok": ok}
        name_resolve.add(self._sent_name, json.dumps(sent), replace=True)
        logger.info("weight version %d: %.2f s on the wire (%s)", version, sender.wire_s, "sent" if ok else "failed")
        self._write(sender, version, tensors, "its group failed" if not ok else None)
        with self._announce_lock:  # two senders (an old epoch's, finishing) never move the key back
            if version > self._announced:
                self._announced = version
                self._announce(version)

    def _wanted(self, newest: int) -> bool:
        """Whether the manager wants a directory of a version up to `newest` that is not on disk yet.
        (One above `newest` is a previous launch's: this trainer resumed from an older checkpoint.)"""
        try:
            wanted = int(name_resolve.get(self._wanted_name))
        except (name_resolve.NameEntryNotFoundError, ValueError):
            return False
        return self.written < wanted <= newest

    def _write(self, sender: Sender, version: int, tensors: dict[str, torch.Tensor], why: str | None) -> None:
        """Writes `version`'s directory if `why` (its group failed) or the manager wants it."""
        if version <= self.written or (why is None and not self._wanted(version)):
            return
        t0 = time.monotonic()
        # On CPU each tensor has a storage of its own over the snapshot (`Manifest.views(separate=True)`),
        # which save_pretrained takes as it is: no copy of the version before it is written.
        # (a dict of its own: save_pretrained drops the entries it does not write from the one it is given)
        cpu = sender.spec.device == "cpu"
        self._write_to_disk(version, {name: t if cpu else t.cpu() for name, t in tensors.items()})
        self.written = max(self.written, version)
        logger.info(
            "weight version %d: %.2f s to disk (%s)", version, time.monotonic() - t0, why or "the manager asked"
        )

    def close(self, timeout_s: float = 60.0) -> None:
        """Waits for what is queued to go out (or to disk), then ends the group."""
        self._closed.set()
        if self.sender is not None:
            self.sender.wait_idle(timeout_s)
            self.sender.close(timeout_s=5.0)


class WeightEpochs:
    """The manager's side: the current epoch, its members (url -> rank) and
    its store (one per epoch, so abandoning one ends every wait in it)."""

    def __init__(
        self,
        cfg: WeightTransportConfig,
        client: GenerationClient,
        experiment_name: str,
        trial_name: str,
        bind_host: str,
        advertise_host: str,
        join_timeout_s: float,
        straggler_s: float = 5.0,
        on_straggler: Callable[[str, str], None] | None = None,
    ):
        self.cfg, self._client = cfg, client
        self.join_timeout_s = join_timeout_s
        self.straggler_s, self._on_straggler = straggler_s, on_straggler  # the lag rule's (`Drops`)
        self._trial, self._key_name = trial_name, names.weights_group(experiment_name, trial_name, ROLE)
        self._sent_name = names.weights_sent(experiment_name, trial_name, ROLE)
        self._bind_host, self._advertise_host = bind_host, advertise_host
        self._stores: dict[str, StoreServer] = {}  # group name -> its store: the current and the previous epoch
        self.epoch = 0
        self.spec: GroupSpec | None = None
        self.members: dict[str, int] = {}
        self.failed = False  # a member did not get a version through the group: rebuild at the next boundary
        self._driver: SGLangDriver | None = None  # protocol sglang: the current epoch's
        # SGLang members a failed version left paused with part of it in place: they serve again only
        # once a version is loaded whole from disk (`resume`), never a half-swapped model.
        self.left_paused: set[str] = set()
        # url -> the newest version an SGLang member took whole through a group, whatever became of
        # its epoch since (a peer that stalled later failed it): no disk load of that version then.
        self.through_group: dict[str, int] = {}
        self._awaiting: dict[str, asyncio.Event] = {}  # member -> set once it is found down (await_version)
        self._drops: Drops | None = None  # the epoch's drops (SGLang: its driver's)
        # Torch servers: the epoch's store as a client (`drop/<rank>`, the sender's announcements),
        # the versions the sender announced in it (`v/<n>`: n -> version) and the members took.
        self._store: SealedStore | None = None
        self._announced: dict[int, int] = {}
        self._held: dict[str, int] = {}
        self._buckets: int | None = None  # how many buckets a version has (the epoch's tensor list)
        self._watcher: asyncio.Task | None = None  # the lag rule while the sender is at a version (`_watch`)

    @property
    def _dropped(self) -> set[str]:
        return self._drops.dropped if self._drops is not None else set()

    def _epoch_store(self) -> SealedStore:
        """The current epoch's store, as a client (torch servers; connected on first use)."""
        if self._store is None:
            self._store = connect_store(self.spec, _group_key())
        return self._store

    def _in_version(self, trainer_version: int) -> bool:
        """Torch servers: whether the sender announced in the current epoch a
        version the trainer has not announced yet (the members are taking it,
        or took it and the trainer's announcement is on its way): a new epoch
        now would load it by disk for every member."""
        try:
            store, n = self._epoch_store(), len(self._announced)
            while store.check([f"v/{n}"]):
                value = store.get(f"v/{n}")
                if value == b"close":
                    break
                self._announced[n] = int(value)
                n += 1
        except Exception:  # (the store gone: the epoch is over, nothing in it)
            return False
        return bool(self._announced) and max(self._announced.values()) > trainer_version

    def needs_rebuild(self, up_urls: list[str], trainer_version: int) -> bool:
        failed = self.failed or (self._driver is not None and self._driver.failed)
        live = set(self.members) - self._dropped
        if not up_urls or not (failed or set(up_urls) != live):
            return False
        if not failed:
            # (the members go on with the version the sender is sending, and the manager loads it
            # as this epoch's before a new one: the trainer announces it after its send)
            if self._driver is not None:
                return not (self._driver.in_version or self._driver.taken_version > trainer_version)
            if self.spec is not None and self.spec.pairs and self.members:
                return not self._in_version(trainer_version)
        return True

    async def rebuild(self, up_urls: list[str]) -> None:
        """A new epoch of the servers `up_urls` (a version boundary: no update in flight)."""
        old = self.spec
        if self._driver is not None:
            self._driver.stop()  # (it destroys its group on the servers once its version is over)
            self._driver = None
        if self._watcher is not None:
            self._watcher.cancel()
        self.epoch += 1
        self._store, self._announced, self._held, self._buckets = None, {}, {}, None
        name = f"realrl-{self._trial}-e{self.epoch}"
        for older in list(self._stores)[:-1]:  # (the previous epoch's sender may still finish a version)
            self._stores.pop(older).close()
        store = self._stores[name] = StoreServer(self._bind_host)
        spec = GroupSpec(
            name,
            self._advertise_host,
            store.port,
            1 + len(up_urls),
            self.cfg.backend,
            self.cfg.bucket_bytes,
            self.cfg.timeout_s,
            self.join_timeout_s,
            self.cfg.protocol,
        )
        members = {url: rank for rank, url in enumerate(up_urls, start=1)}
        if spec.protocol == "sglang":  # the servers join once the sender is there (SGLangDriver)
            self.spec, self.members, self.failed = spec, members, False
            self._driver = SGLangDriver(
                spec,
                members,
                self._client,
                _group_key(),
                on_abandon=self.abandon,
                left_paused=self.left_paused,
                through_group=self.through_group,
                straggler_s=self.straggler_s,
                on_straggler=self._on_straggler,
            )
            self._drops = self._driver.drops
            await asyncio.to_thread(name_resolve.add, self._key_name, json.dumps(spec.to_json()), replace=True)
            logger.info(
                "weight group %s: %d servers (%s), SGLang's routes", spec.name, len(members), ", ".join(members)
            )
            return
        results = await asyncio.gather(
            *(self._client.join_weights_group(url, spec, rank, timeout_s=30) for url, rank in members.items()),
            return_exceptions=True,
        )
        refused = [f"{url}: {r}" for url, r in zip(members, results) if isinstance(r, BaseException)]
        self.spec, self.members, self.failed = spec, members, bool(refused)
        if refused:  # a group short of a member never forms: its members load from disk; rebuilt next boundary
            logger.warning("weight group %s: %d servers could not join: %s", spec.name, len(refused), refused)
            for url in members:
                await self._leave(url, spec.name)
            self.members = {}
            return
        # (the groups formed: the sender sets the tensor list after the last)
        formed = lambda: not self.failed and self._epoch_store().check(["manifest"])  # noqa: E731
        self._drops = Drops(spec, members, self.straggler_s, self._on_straggler, self._epoch_store, formed)
        await asyncio.to_thread(name_resolve.add, self._key_name, json.dumps(spec.to_json()), replace=True)
        if spec.pairs:
            self._watcher = asyncio.create_task(self._watch(spec))
        logger.info(
            "weight group %s: %d servers (%s)%s",
            spec.name,
            len(members),
            ", ".join(members),
            f"; {old.name} ends" if old is not None else "",
        )

    def abandon(self, name: str, why: str) -> None:
        """Ends epoch `name` now by closing its store: everyone waiting in its
        rendezvous (the sender, members still up) fails at once, its versions
        go by disk, and the next boundary builds a new epoch."""
        store = self._stores.pop(name, None)
        if store is None:
            return  # (already abandoned, or long over)
        store.close()
        if self.spec is not None and self.spec.name == name:
            self.failed = True
            if self._driver is not None:
                self._driver.stop()
        logger.warning("weight group %s abandoned: %s; its versions go by disk until a new group", name, why)

    def member_down(self, url: str, why: str) -> None:
        """The manager found `url` down: an epoch it is a member of cannot
        carry versions to it. Once the epoch's groups formed it is dropped
        (`Drops.drop`), the others go on in the epoch. Else the epoch is
        abandoned at once (one still forming would wait for it until the
        rendezvous times out). A wait for it to hold a version
        (`await_version`) ends now."""
        if (down := self._awaiting.get(url)) is not None:
            down.set()
        self.through_group.pop(url, None)  # (back, it reports its version again)
        if self.spec is None or url not in self.members:
            return
        if self._drops.drop(url, why):
            return
        self.abandon(self.spec.name, f"{url} is down ({why})")

    async def _leave(self, url: str, name: str) -> None:
        try:
            await self._client.leave_weights_group(url, name, timeout_s=10)
        except (GenerationServerError, GenerationServerUnavailable):
            pass

    def partly_updated(self, url: str) -> bool:
        """Whether `url` (SGLang) holds part of a version that failed: it must
        load a version whole from disk, even one it claims to hold."""
        return url in self.left_paused

    async def resume(self, url: str) -> None:
        """After a version was loaded whole from disk into `url`: a server a
        failed version left paused serves again (`/continue_generation`)."""
        if url not in self.left_paused:
            return
        try:
            await self._client.continue_generation(url)
        except (GenerationServerError, GenerationServerUnavailable) as e:  # (still paused: the next load retries)
            logger.warning("%s loaded a version from disk but did not continue generating: %s", url, e)
            return
        self.left_paused.discard(url)
        logger.info("%s holds a whole version again (from disk): generating again", url)

    def holds(self, url: str, version: int) -> bool:
        """Whether `url` took `version` (or a newer one) whole through a group."""
        return self.through_group.get(url, -1) >= version

    def is_member(self, url: str) -> bool:
        lost = self._driver.lost if self._driver is not None else self._dropped  # (SGLang: the failed too)
        return not self.failed and url in self.members and url not in lost

    def went_through_group(self, version: int) -> bool:
        """Whether the trainer sent `version` (or a newer one) through the
        current epoch's group to every member (`names.weights_sent`): only
        then are members asked for it; a failed send fails the epoch. A
        version the trainer published before it saw this epoch came by disk."""
        try:
            sent = json.loads(name_resolve.get(self._sent_name))
        except name_resolve.NameEntryNotFoundError:
            return False
        if self.spec is None or sent.get("group") != self.spec.name or int(sent.get("version", -1)) < version:
            return False
        if not sent.get("ok"):
            if not self.failed:
                logger.warning(
                    "weight group %s failed at version %s: loading from disk", self.spec.name, sent["version"]
                )
            self.failed = True
        return not self.failed

    async def await_version(self, url: str, version: int, timeout_s: float) -> bool:
        """Whether member `url` holds `version` through the group; False drops
        a torch member from the epoch (`Drops.drop`; SGLang: its driver, on
        the route that failed), or, where it cannot be dropped, marks the
        epoch failed. A member found down meanwhile (`member_down`: a
        stalled one's health checks fail), or one that lags its peers
        (`_lags`), ends the wait at once, not its `timeout_s`."""
        down = self._awaiting[url] = asyncio.Event()
        asked = asyncio.ensure_future(self._ask_version(url, version, timeout_s))
        gone = asyncio.ensure_future(down.wait())
        waits = {asked, gone}
        if self._driver is None and self.spec is not None and self.spec.pairs:  # (SGLang: `_each_member`'s)
            waits.add(asyncio.ensure_future(self._lags(url, version)))
        try:
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if self._awaiting.get(url) is down:
                del self._awaiting[url]
            for task in waits:
                task.cancel()  # (the one done stays as it is)
        if asked in done:
            ok, why = asked.result()
        else:
            await asyncio.gather(asked, return_exceptions=True)
            ok, why = False, "it went down while the manager waited for it"
        if ok:
            self._held[url] = max(version, self._held.get(url, -1))
            return True
        if url in self._dropped or (self._driver is None and self._drops.drop(url, why)):
            return False  # (dropped from the epoch: the others go on in it)
        if not self.failed:
            logger.warning(
                "weight group %s: %s did not get version %d through it (%s); loading from disk, "
                "a new group at the next version",
                self.spec.name if self.spec else "?",
                url,
                version,
                why,
            )
        self.failed = True
        return False

    async def _watch(self, spec: GroupSpec) -> None:
        """Torch servers, the lag rule (`Lag`) while the sender is at a
        version: a member holds announcement n once the sender finished it
        to it (its mark of the last bucket, `b/<n>/<last>/<rank>`; the
        trainer announces n once the sender is done with every member)."""
        n, lag = 0, None
        while self.spec is spec and not self.failed:
            await asyncio.sleep(0.1)
            try:
                progress = await asyncio.to_thread(self._progress, n)
            except Exception:  # (the store gone, the epoch closed: over)
                return
            if progress is None:
                continue
            version, done, lagging, over = progress
            if over:
                n, lag = n + 1, None
                continue
            lag = lag if lag is not None else Lag(self._drops, version, "not sent to it")
            await lag.check(bool(done), lagging, functools.partial(self._newer_waits, version))

    def _progress(self, n: int) -> tuple[int, list[str], list[str], bool] | None:
        """Announcement `n` of the current epoch: its version, the members the
        sender finished it to, those it has not, and whether it is over; None
        before it. Raises once the sender ended the epoch (`close`)."""
        store = self._epoch_store()
        if self._buckets is None:
            if not store.check(["manifest"]):
                return None
            self._buckets = len(Manifest.from_bytes(store.get("manifest")).buckets(self.spec.bucket_bytes))
        if not store.check([f"v/{n}"]):
            return None
        if (announced := store.get(f"v/{n}")) == b"close":
            raise EOFError("the sender closed the epoch")
        done, lagging = [], []
        for url, rank in self.members.items():
            if url not in self._dropped:
                finished = store.check([f"b/{n}/{self._buckets - 1}/{rank}"])
                (done if finished else lagging).append(url)
        return int(announced), done, lagging, not lagging or store.check([f"v/{n + 1}"])

    async def _lags(self, url: str, version: int) -> None:
        """Torch servers, the lag rule (`Lag`) once the trainer announced
        `version`: ends once it dropped member `url`, which has not taken it."""
        lag = Lag(self._drops, version)
        while True:
            await asyncio.sleep(0.1)
            peers = [u for u in self.members if u != url and u not in self._dropped]
            took = bool(peers) and all(self._held.get(u, -1) >= version for u in peers)
            if await lag.check(took, [url], functools.partial(self._newer_waits, version)):
                return

    def _newer_waits(self, version: int) -> bool:
        """`Drops.newer_waits` of the announcement of `version`."""
        self._in_version(version)  # (reads the announcements so far)
        try:
            return any(v == version and self._drops.newer_waits(n) for n, v in list(self._announced.items()))
        except Exception:
            return False

    async def _ask_version(self, url: str, version: int, timeout_s: float) -> tuple[bool, str]:
        if self._driver is not None:
            return await self._driver.await_version(url, version, timeout_s)
        try:
            answer = await self._client.await_weight_version(url, version, timeout_s)
        except (GenerationServerError, GenerationServerUnavailable) as e:
            return False, str(e)
        return answer.success, answer.message

    def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
        self._store = None
        if self._driver is not None:
            self._driver.stop()
        for store in self._stores.values():
            store.close()
        self._stores.clear()
