"""Dropping a member from a weight group's epoch, both protocols (docs/design.md §8, "Broadcast"):
`Drops.drop`, the one place a member leaves an epoch while the others go on, and the lag rule, `Lag`."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Collection

from realrl.base.logging import getLogger
from realrl.impl.weights.broadcast import GroupSpec, SealedStore

logger = getLogger("weight_broadcast")


@dataclasses.dataclass
class Drops:
    """One epoch's dropped members. Its protocol says what the epoch's store
    is (a client), whether its groups formed and it goes on, which members
    it lost (those dropped included) and what else a drop does (SGLang's)."""

    spec: GroupSpec
    members: dict[str, int]
    straggler_s: float  # the lag rule's bound, and its verdict: `on_straggler(url, why)` (the manager: out of routing)
    on_straggler: Callable[[str, str], None] | None
    store: Callable[[], SealedStore]
    formed: Callable[[], bool]
    lost: Callable[[], Collection[str]] | None = None  # (None: those dropped)
    on_drop: Callable[[str, str], None] | None = None
    dropped: set[str] = dataclasses.field(default_factory=set)

    def drop(self, url: str, why: str) -> bool:
        """Drops member `url` from the epoch, the others going on in it: the
        sender, told through the store (`drop/<rank>`, sealed), leaves its
        group of two with it, mid-version too, and feeds it no more (a torch
        member leaves too: `Dropped`). False where the epoch cannot go on
        without it: its groups not formed yet, one group of all, it was lost
        already, or no other member is left."""
        if url in self.dropped:
            return True
        lost = self.lost() if self.lost is not None else self.dropped
        others = [u for u in self.members if u != url and u not in lost]
        if not self.spec.pairs or url in lost or not others:
            return False
        try:
            if not self.formed():
                return False
            self.store().set(f"drop/{self.members[url]}", b"dropped")
        except Exception:  # the store gone: the epoch is over anyway
            return False
        self.dropped.add(url)
        if self.on_drop is not None:
            self.on_drop(url, why)
        msg = "weight group %s: %s dropped (%s); its versions go by disk, %d members go on"
        logger.warning(msg, self.spec.name, url, why, len(others))
        return True

    def newer_waits(self, n: int) -> bool:
        """Whether the sender holds a version newer than announcement `n`'s (`next/<n>`) or announced one."""
        return self.store().check([f"next/{n}"]) or self.store().check([f"v/{n + 1}"])


@dataclasses.dataclass
class Lag:
    """The lag rule for one version, both protocols: once every other member
    not dropped holds it, a member still at it `straggler_s` later while a
    newer version waits holds the others back: it goes out of routing
    (`on_straggler`), as a server that does not answer a health check in
    that time counts as failing it, and is dropped. Its callers say what
    holding means where they watch: SGLang members, the version in place
    (`SGLangDriver._each_member`); torch members, the sender's mark of its
    last bucket to them (`WeightEpochs._watch`), and, once the trainer
    announced it, the version in place (`WeightEpochs._lags`)."""

    drops: Drops
    version: int
    stage: str = "not in place"
    since: float | None = None  # since when the others hold it

    async def check(self, peers_hold: bool, behind: list[str], newer_waits: Callable[[], bool]) -> bool:
        """`peers_hold`: every member not dropped but those `behind` holds the
        version. True once the rule dropped those behind."""
        now, s = asyncio.get_running_loop().time(), self.drops.straggler_s
        if not peers_hold or not behind:
            self.since = None
            return False
        self.since = self.since if self.since is not None else now
        if now - self.since < s or not await asyncio.to_thread(newer_waits):
            return False
        for url in behind:
            why = f"version {self.version} {self.stage} {s:g} s after its peers, a newer waits"
            if self.drops.on_straggler is not None:
                self.drops.on_straggler(url, why)
            self.drops.drop(url, why)
        return True
