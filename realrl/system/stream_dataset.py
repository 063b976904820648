"""The trainer's end of the trajectory stream (docs/design.md §4–§5, §7).

`PullerStreamDataset` owns one data-parallel rank's puller. A background thread
pulls, decodes and validates trajectories into a buffer, so the trainer never
waits on the network. Each buffered trajectory has a key (unique on this
rank). The master builds a step's batch from what all ranks hold together:
`inventory(min_version, limit)` drops (and counts) the trajectories staler
than the bound and describes the oldest ones left; `take(keys)` removes the
chosen ones (to train on here or to send to another rank).

A trajectory is invalid if it breaks the schema (`Trajectory.from_wire`) or
what the trainer relies on (`Trajectory.check_trainable`): a token id outside
`0..vocab_size-1` (it would index past the embedding table and kill the
trainer), a sequence longer than the model's `max_positions` (it would stall a
step or exhaust memory), a weight version outside 0..the trainer's newest (a
later one would never go stale), a positive logprob. Invalid ones are dropped,
counted in `n_invalid` (the master reports them as `dropped_invalid`, apart
from the ledger: they were never accepted, so no budget comes back) and
logged, rate-limited.

Exactly once (docs/design.md §12): a trajectory's key is `(rollout_id,
index)`. One without a rollout id of the form `<worker>:<epoch>:<row>` belongs
to no admitted rollout: it is dropped and counted `foreign`. A second copy of
a key this puller already took (a rollout generated again after its worker
died between delivery and finish) is dropped and counted
`duplicates_dropped`: its verdict is `duplicate`, or `restored` when the key
came from the checkpoint this trial resumed from (the resumed trial counted
it already: the rollout's finish must not). A rollout is *complete* once
this puller took all of its trajectories (each says how many its rollout
has: `rollout_size`); a checkpoint holds the complete ones as done, never a
partly delivered one. Every decoded message is acknowledged to its sender
with its verdict (`taken`, `duplicate`, `invalid`, `foreign`), and a frame
that does not decode with `rejected` and no key, in the order received (one
acknowledgement message per sender per pull, the list of its verdicts): a rollout
worker reports a rollout finished only once all of its trajectories were
acknowledged `taken` or `duplicate`, i.e. are in the trainer's hands. A
rollout generated again asks `{"held_of": rollout_id}` and is answered
`{"rollout_id", "index": null, "verdict": "held", "held": n}` (the keys taken
since the resume, not those restored; answered once nothing else waits at the
socket, so a dead predecessor's frames still queued there are taken first):
what its predecessor delivered counts even if the new run delivers less.

Accounting (docs/design.md §5): every message that reaches the puller, and
every trajectory restored from a checkpoint, is either rejected (wire format),
invalid (schema or vocabulary), foreign, a duplicate, taken (consumed),
dropped as stale, or still buffered: `received_total + restored ==
n_wire_rejected + n_invalid + n_foreign + n_duplicates + n_taken +
n_dropped_stale + buffered`. A message without the trial's seal (§14) never
reaches this account: it is refused by the puller and counted
`n_seal_refused` alone. `checkpoint()` / `restore()` carry the buffer and
the keys taken (`KeyLedger`: bitmaps, so memory stays flat over a trial)
across a recovery checkpoint, with the complete rollouts (a `Ledger`) for
the data ledger, all three read at one moment.
"""

from __future__ import annotations

import heapq
import itertools
import re
import threading
from collections.abc import Callable

from realrl.api.trajectory import Trajectory, TrajectoryError
from realrl.base.logging import getLogger
from realrl.system.ledger import KeyLedger, Ledger
from realrl.system.push_pull_stream import NameResolvingZmqPuller, RateLimitedLog, RejectedFrame

logger = getLogger("stream_dataset")

# {"held_of": rollout_id}: a rollout worker asks how many of a rollout's trajectories were taken.
HELD_QUERY = "held_of"
HELD_GAP_SCAN = 16  # indices scanned past the last taken one (refused trajectories leave gaps)
# A rollout worker's rollout id (docs/design.md §12): worker index, epoch, dataset row.
ROLLOUT_ID = re.compile(r"\d{1,9}:\d{1,9}:\d{1,12}")


class PullerStreamDataset:
    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        puller_index: int,
        max_buffered: int = 100000,
        vocab_size: int | None = None,
        host: str | None = None,
        max_positions: int | None = None,
        newest_version: Callable[[], int] | None = None,
    ):
        """`vocab_size`: token ids must lie in 0..vocab_size-1 (the size of the
        model's input embedding); None checks no ids. `max_positions`: the
        longest sequence the model takes (None: unchecked). `newest_version`:
        the trainer's newest weight version, asked per trajectory (None:
        unchecked). `host`: the address the puller binds (None: 127.0.0.1)."""
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.max_buffered = max_buffered
        self.vocab_size = vocab_size
        self.max_positions = max_positions
        self._newest_version = newest_version
        self._invalid_log = RateLimitedLog(log=logger)
        self._lock = threading.Lock()
        self._heap: list[tuple[int, float, int, Trajectory]] = []  # (version_start, birth_time, key, traj)
        self._seq = itertools.count()
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.n_received = 0  # decoded messages (valid or not)
        self.n_wire_rejected = 0
        self.n_seal_refused = 0  # not from this trial (docs/design.md §14): apart from every count below
        self.n_invalid = 0
        self.n_taken = 0
        self.n_dropped_stale = 0
        self.n_foreign = 0  # no rollout id of ours: never buffered, never in the ledger
        self.n_duplicates = 0  # a second copy of a key already taken
        self._seen = KeyLedger()  # every key taken (buffered, trained or dropped since): bits, not a set of ids
        self._restored = KeyLedger()  # those of them that came from the checkpoint resumed from
        self.complete = Ledger()  # rollouts all of whose trajectories were taken: done (docs/design.md §12)
        self.n_restored = 0  # put back from a checkpoint (recovery)
        self.address = ""
        # zmq sockets are not thread-safe: the puller lives entirely in the thread.
        self._thread = threading.Thread(
            target=self._run, args=(experiment_name, trial_name, puller_index, host), name="stream-dataset", daemon=True
        )
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise RuntimeError(f"puller {puller_index} could not start: {self._error}") from self._error

    def _run(self, experiment_name: str, trial_name: str, puller_index: int, host: str | None) -> None:
        try:
            puller = NameResolvingZmqPuller(
                experiment_name,
                trial_name,
                puller_index,
                host=host,
                hwm=self.max_buffered,
                report_rejects=True,  # answered `rejected`, in order: the sender takes it as its oldest unanswered
            )
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self.address = puller.address
        self._ready.set()
        held_queries: list[tuple[bytes, str]] = []  # (sender, rollout id) of `held_of` questions not yet answered
        try:
            while not self._stop.is_set():
                self._invalid_log.maybe_flush()
                if len(self) >= self.max_buffered:  # back-pressure: stop reading, pushers block
                    self._stop.wait(0.05)
                    continue
                messages = puller.pull_with_senders(timeout=0.05)
                self.n_wire_rejected = puller.n_rejected
                self.n_seal_refused = puller.n_seal_refused
                # One acknowledgement message per sender per pull, its verdicts in the order received.
                acks: dict[bytes, list[dict]] = {}
                for sender, msg in messages:
                    if _held_query(msg):
                        held_queries.append((sender, msg[HELD_QUERY]))
                        continue
                    ack = _ack((None, None), "rejected") if isinstance(msg, RejectedFrame) else self._add(msg)
                    acks.setdefault(sender, []).append(ack)
                for sender, verdicts in acks.items():
                    puller.acknowledge(sender, verdicts)
                # A `held_of` is answered once nothing else waits at the socket: the frames of a
                # dead predecessor (another connection, read in turn with this one) are taken first.
                if held_queries and not puller.has_queued():
                    for sender, rollout_id in held_queries:
                        puller.acknowledge(sender, [self._held_of(rollout_id)])
                    held_queries.clear()
        except BaseException as e:  # surfaced on the next take()
            self._error = e
            logger.error("stream dataset thread failed: %s", e)
        finally:
            self._invalid_log.flush()
            puller.close()

    def _add(self, msg) -> dict:
        """Buffers one decoded message if it is a new trajectory of an admitted
        rollout; its acknowledgement: {"rollout_id", "index", "verdict"}."""
        try:
            newest = self._newest_version() if self._newest_version is not None else None
            traj = Trajectory.from_wire(msg).check_trainable(self.vocab_size, self.max_positions, newest)
        except TrajectoryError as e:
            with self._lock:
                self.n_received += 1
                self.n_invalid += 1
                n_invalid = self.n_invalid
            self._invalid_log.warning("dropped an invalid trajectory (%d so far): %s", n_invalid, e)
            key = (msg.get("rollout_id"), msg.get("index")) if isinstance(msg, dict) else (None, None)
            return _ack(key, "invalid")
        with self._lock:
            self.n_received += 1
            if not ROLLOUT_ID.fullmatch(traj.rollout_id):
                self.n_foreign += 1
                verdict = "foreign"
            elif traj.key in self._seen:
                self.n_duplicates += 1
                verdict = "restored" if traj.key in self._restored else "duplicate"
            else:
                self._seen.add(traj.key)
                if all((traj.rollout_id, i) in self._seen for i in range(traj.rollout_size)):
                    self.complete.mark_ids([traj.rollout_id])
                heapq.heappush(self._heap, (traj.min_version_start, traj.birth_time, next(self._seq), traj))
                verdict = "taken"
        if verdict not in ("taken", "restored"):
            self._invalid_log.warning("dropped a %s trajectory %s %s", verdict, traj.qid, traj.key)
        return _ack(traj.key, verdict)

    def _held_of(self, rollout_id: str) -> dict:
        """How many trajectories of `rollout_id` this puller took (trained,
        buffered or dropped since) since the resume: a rollout generated
        again after its worker died asks, so that what its predecessor
        delivered counts even when the new run delivers less (docs/design.md
        §12); what the checkpoint holds the resumed trial counted already. A
        rollout's trajectories are pushed in index order, so its taken
        indices run from 0, with a gap only where one was refused."""
        with self._lock:
            held = index = misses = 0
            while misses < HELD_GAP_SCAN:
                if (rollout_id, index) in self._seen:
                    held += (rollout_id, index) not in self._restored
                    misses = 0
                else:
                    misses += 1
                index += 1
        return {"rollout_id": rollout_id, "index": None, "verdict": "held", "held": held}

    def __len__(self) -> int:
        with self._lock:
            return len(self._heap)

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"stream dataset failed: {self._error}") from self._error

    def inventory(self, min_version: int, limit: int) -> tuple[list[tuple[int, int, float, int]], int]:
        """Drops every trajectory whose version_start is below `min_version`
        and describes the `limit` oldest ones left: ([(key, version_start,
        birth_time, n_tokens)], number dropped now)."""
        self._check()
        dropped = 0
        with self._lock:  # the heap is ordered by version_start: the stale ones are on top
            while self._heap and self._heap[0][0] < min_version:
                heapq.heappop(self._heap)
                dropped += 1
            self.n_dropped_stale += dropped
            oldest = heapq.nsmallest(limit, self._heap)
        return [(key, version, birth, traj.n_tokens) for version, birth, key, traj in oldest], dropped

    def take(self, keys: list[int]) -> list[Trajectory]:
        """Removes the trajectories with these keys (in this order); KeyError
        names a key that is not buffered (nothing is removed then)."""
        self._check()
        wanted = set(keys)
        with self._lock:
            found = {item[2]: item[3] for item in self._heap if item[2] in wanted}
            if len(found) != len(keys):
                raise KeyError(f"not buffered (or repeated): {sorted(wanted - found.keys()) or keys}")
            self._heap = [item for item in self._heap if item[2] not in wanted]
            heapq.heapify(self._heap)
            self.n_taken += len(keys)
        return [found[k] for k in keys]

    def checkpoint(self) -> tuple[list[Trajectory], KeyLedger, Ledger]:
        """This puller's part of a recovery checkpoint, read at one moment:
        every buffered trajectory (oldest first), a copy of the keys taken so
        far, and a copy of the complete rollouts (done, for the data ledger).
        (Read apart, a trajectory taken in between would be in the keys and
        not in the buffer: its copy after the resume a duplicate, never trained.)"""
        self._check()
        with self._lock:
            buffered = [item[3] for item in sorted(self._heap)]
            return buffered, KeyLedger().update(self._seen), self.complete.copy()

    def restore(self, trajectories: list[Trajectory], seen: KeyLedger | None = None) -> None:
        """Buffers trajectories saved by `checkpoint` and knows the keys `seen`
        (resuming a trial): a rollout generated again gets `restored` for
        what was taken before the checkpoint."""
        restored = KeyLedger() if seen is None else KeyLedger().update(seen)
        for traj in trajectories:
            restored.add(traj.key)
        with self._lock:
            self._seen.update(restored)
            self._restored.update(restored)
            for traj in trajectories:
                heapq.heappush(self._heap, (traj.min_version_start, traj.birth_time, next(self._seq), traj))
            self.n_restored += len(trajectories)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "restored": self.n_restored,
                "received": self.n_received + self.n_wire_rejected,
                "wire_rejected": self.n_wire_rejected,
                "seal_refused": self.n_seal_refused,
                "invalid": self.n_invalid,
                "foreign": self.n_foreign,
                "duplicates_dropped": self.n_duplicates,
                "taken": self.n_taken,
                "dropped_stale": self.n_dropped_stale,
                "buffered": len(self._heap),
            }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def _held_query(msg) -> bool:
    return isinstance(msg, dict) and set(msg) == {HELD_QUERY} and isinstance(msg[HELD_QUERY], str)


def _ack(key: tuple, verdict: str) -> dict:
    rollout_id, index = key
    return {
        "rollout_id": rollout_id if isinstance(rollout_id, str) else None,
        "index": index if isinstance(index, int) and not isinstance(index, bool) else None,
        "verdict": verdict,
    }
