"""Admission of rollouts under the staleness bound (docs/design.md §7).

A rollout is admitted iff training has started, rollouts are not stopped,
`running < max_concurrent_rollouts`, and

    (accepted - dropped + running) // train_batch_size <= η + version

(`within_staleness_bound`), where `version` is the weight version every
generation server holds (not merely the one the trainer published: rollouts
admitted for v+1 must be generated with v+1). With version v, at most
`(η + v + 1) * train_batch_size` trajectories are ever admitted, counting the
finished-and-accepted ones; agent-rejected rollouts and trainer drops give
their budget back. The unit counted everywhere is one trajectory. With a
trial budget (`max_trajectories`: total_train_steps * train_batch_size),
nothing is admitted once `accepted - dropped + running` reaches it: rollouts
past the last step's batch would be generated for nothing, on cores the
trainer needs (a 10-step run with η = 4 generated 40% more than it trained).

`StalenessController` is plain synchronous state: the GserverManager worker
feeds it what it reads (the trainer's version, drops, the training start) and
what clients report, and answers them with what it decides.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable
from typing import Any

from realrl.system.ledger import Ledger

# Finished rollout ids remembered for idempotent retries; a retry arrives within
# seconds, so the newest ones suffice and memory stays bounded.
FINISHED_IDS_KEPT = 100_000


def within_staleness_bound(
    accepted: int, dropped: int, running: int, train_batch_size: int, max_head_offpolicyness: int, version: int
) -> bool:
    """docs/design.md §7: may one more rollout start? `accepted` counts every trajectory
    finished and accepted so far (consumed or still buffered), `dropped` the
    ones the trainer threw away (their budget is given back), `version` the
    weight version every generation server holds."""
    return (accepted - dropped + running) // train_batch_size <= max_head_offpolicyness + version


class StalenessController:
    """Admission state: which rollouts run, how many trajectories were
    accepted, how many episodes the agent rejected, and what the trainer
    reported. Not thread-safe (one event loop owns it).

    Every rollout has a caller-chosen `rollout_id`; allocate and finish are
    idempotent per id, so a client may retry a call whose reply it lost (a
    timed-out-but-applied allocate must not leak a running slot, a repeated
    finish must not fail or count twice).

    Nothing is admitted before `start()`: the master tells where training
    starts (fresh, or recovered at a checkpoint with some trajectories already
    consumed and dropped), so a resumed trial admits exactly what an
    uninterrupted one would."""

    def __init__(
        self,
        train_batch_size: int,
        max_head_offpolicyness: int,
        max_concurrent_rollouts: int,
        max_trajectories: int | None = None,
    ):
        if train_batch_size < 1:
            raise ValueError(f"train_batch_size must be >= 1, got {train_batch_size}")
        if max_head_offpolicyness < 0:
            raise ValueError(f"max_head_offpolicyness must be >= 0, got {max_head_offpolicyness}")
        if max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts must be >= 1, got {max_concurrent_rollouts}")
        self.train_batch_size = train_batch_size
        self.max_head_offpolicyness = max_head_offpolicyness
        self.max_concurrent_rollouts = max_concurrent_rollouts
        if max_trajectories is not None and max_trajectories < 1:
            raise ValueError(f"max_trajectories must be >= 1 (or None), got {max_trajectories}")
        self.max_trajectories = max_trajectories  # the trial's: total_train_steps x train_batch_size
        self.started = False
        self.version = 0  # the weight version every server holds (admission opens per version only then)
        self.trainer_version = 0  # the newest version the trainer published (for the stats)
        self.dropped = 0  # trajectories the trainer dropped (whole trial, from the master)
        self.accepted = 0  # trajectories finished and accepted (whole trial)
        self.rejected = 0  # episodes the agent rejected (whole trial)
        # The rollouts finished in this process, accepted or rejected (done: never generated again,
        # docs/design.md §12), and those rejected: bits per dataset row and epoch, so memory stays
        # flat over a trial.
        self.done = Ledger()
        self.rejected_done = Ledger()
        self.admitted = 0  # episodes admitted by this process
        self.n_tokens = 0
        self.stopped = False
        self._running: dict[str, str] = {}  # rollout_id -> qid
        self._finished: collections.OrderedDict[str, int] = collections.OrderedDict()  # rollout_id -> trajectories

    @property
    def running(self) -> int:
        return len(self._running)

    def start(self, accepted: int = 0, rejected: int = 0) -> None:
        """Opens admission with the trial's counts so far (a recovered trial
        starts with what it had consumed and dropped at its checkpoint)."""
        self.accepted, self.rejected, self.started = accepted, rejected, True

    def _closed(self) -> tuple[str, str] | None:
        """Why one more rollout would be refused now, as (state, reason); None if it would be admitted."""
        if not self.started:
            return "not started", "waiting for the trainer: training has not started"
        if self.stopped:
            return "stopped", "rollouts stopped"
        if self.running >= self.max_concurrent_rollouts:
            return "full", f"max_concurrent_rollouts reached ({self.max_concurrent_rollouts})"
        if not within_staleness_bound(
            self.accepted, self.dropped, self.running, self.train_batch_size, self.max_head_offpolicyness, self.version
        ):
            return "staleness bound", (
                f"staleness bound: (accepted {self.accepted} - dropped {self.dropped} + running {self.running})"
                f" // train_batch_size {self.train_batch_size} > max_head_offpolicyness"
                f" {self.max_head_offpolicyness} + version {self.version}"
            )
        budget = self.accepted - self.dropped + self.running
        if self.max_trajectories is not None and budget >= self.max_trajectories:
            return "trial budget", (
                f"trial budget: accepted {self.accepted} - dropped {self.dropped} + running {self.running}"
                f" >= total_train_steps x train_batch_size = {self.max_trajectories}"
            )
        return None

    def admission(self) -> str:
        """ "open", or why it is closed: "not started", "stopped", "full", "staleness bound" or "trial budget"."""
        closed = self._closed()
        return closed[0] if closed else "open"

    def allocate(self, rollout_id: str, qid: str = "") -> tuple[bool, str | None]:
        """Admit rollout `rollout_id` (of prompt `qid`) if the rules allow:
        (admitted, refusal reason). A repeated call for an admitted id admits
        nothing new and answers True."""
        if rollout_id in self._running or rollout_id in self._finished:
            return True, None
        closed = self._closed()
        if closed:
            return False, closed[1]
        self._running[rollout_id] = qid
        self.admitted += 1
        return True, None

    def allocate_many(self, rollouts: Iterable[tuple[str, str]]) -> tuple[int, str | None]:
        """How many of `rollouts` ((rollout_id, qid) pairs) admission takes, in
        order, stopping at the first refusal; that refusal's reason (None: all taken)."""
        admitted = 0
        for rollout_id, qid in rollouts:
            ok, reason = self.allocate(rollout_id, qid)
            if not ok:
                return admitted, reason
            admitted += 1
        return admitted, None

    def qid_of(self, rollout_id: str) -> str | None:
        """The qid of running rollout `rollout_id` (None if it is not running)."""
        return self._running.get(rollout_id)

    def runs_qid(self, qid: str) -> bool:
        """Whether some running rollout is of prompt `qid`."""
        return qid in self._running.values()

    def is_known(self, rollout_id: str) -> bool:
        """Running, or finished recently enough for a repeated finish to be a no-op."""
        return rollout_id in self._running or rollout_id in self._finished

    def finish(self, rollout_id: str, n_trajectories: int, n_tokens: int = 0) -> None:
        """Rollout `rollout_id` ended with `n_trajectories` accepted
        trajectories (0: the agent rejected the prompt, which gives its budget
        back). KeyError if it was never admitted; a repeated call is a no-op."""
        if rollout_id in self._finished:
            return
        if rollout_id not in self._running:
            raise KeyError(f"no running rollout with id {rollout_id!r}")
        self._running.pop(rollout_id)
        self._finished[rollout_id] = n_trajectories
        self.done.mark_ids([rollout_id])  # (an id not of a rollout worker's form is never generated again anyway)
        if len(self._finished) > FINISHED_IDS_KEPT:
            self._finished.popitem(last=False)
        if n_trajectories:
            self.accepted += n_trajectories
        else:
            self.rejected += 1
            self.rejected_done.mark_ids([rollout_id])
        self.n_tokens += n_tokens

    def finish_many(self, rollouts: list[tuple[str, int, int]]) -> None:
        """`finish` of each (rollout_id, n_trajectories, n_tokens), all or none:
        KeyError naming the first unknown id before any is finished."""
        unknown = [rollout_id for rollout_id, _, _ in rollouts if not self.is_known(rollout_id)]
        if unknown:
            raise KeyError(f"no running rollout with id {unknown[0]!r}")
        for rollout_id, n_trajectories, n_tokens in rollouts:
            self.finish(rollout_id, n_trajectories, n_tokens)

    def release_worker(self, worker_index: int) -> tuple[list[str], list[str]]:
        """Forgets the running rollouts of rollout worker `worker_index` (rollout
        ids start with `<index>:`): (their ids, their qids). A restarted worker
        generates them again, under the same ids, and never those in `done`
        (docs/design.md §12)."""
        gone = [rid for rid in self._running if rid.split(":", 1)[0] == str(worker_index)]
        qids = [self._running.pop(rid) for rid in gone]
        return gone, qids

    def stop(self) -> None:
        self.stopped = True

    def stats(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "accepted": self.accepted,
            "rejected": self.rejected,
            "dropped": self.dropped,
            "admitted": self.admitted,
            "version": self.version,
            "trainer_version": self.trainer_version,
            "n_tokens": self.n_tokens,
            "started": self.started,
            "stopped": self.stopped,
        }
