"""The data ledger: which rollouts of which epoch are done (docs/design.md §12).

A rollout worker's rollout id is `<worker>:<epoch>:<row>`, `row` the prompt's
position in the dataset file; the id names one prompt of one epoch, so a
rollout generated again (after a crash) carries the same id. A rollout is
*done* once the trainers took all of its trajectories (each carries its
rollout's size; trained, buffered or dropped since), or the manager saw its
finish, or the agent rejected it; a resumed trial, and a restarted rollout
worker, generate again exactly the issued rollouts that are not done. A
puller's `KeyLedger` (the keys it took, a bitmap per trajectory index) is in
the checkpoint too: a copy of one after a resume is `restored`.

`Ledger` keeps one bitmap over dataset rows per epoch, so 200k prompts cost
25 kB per epoch on disk (`save`: numpy's npz, bits packed), whatever the
qids look like. Checkpoints hold it as `ledger.npz`; the name service only
ever carries its path.
"""

from __future__ import annotations

import base64
import os
import re

import numpy as np

LEDGER_FILE = "ledger.npz"
_ROLLOUT_ID = re.compile(r"(\d{1,9}):(\d{1,9}):(\d{1,12})")


def rollout_id(worker: int, epoch: int, row: int) -> str:
    return f"{worker}:{epoch}:{row}"


def parse_rollout_id(rollout_id: str) -> tuple[int, int, int] | None:
    """(worker, epoch, row) of a rollout worker's id; None for anything else."""
    match = _ROLLOUT_ID.fullmatch(rollout_id) if isinstance(rollout_id, str) else None
    return tuple(int(g) for g in match.groups()) if match else None  # type: ignore[return-value]


class Ledger:
    """Per-epoch bitmaps of done rows. Not thread-safe."""

    def __init__(self) -> None:
        self._epochs: dict[int, np.ndarray] = {}  # epoch -> bool per row (grown as needed)

    def mark(self, epoch: int, row: int) -> None:
        bits = self._epochs.get(epoch)
        if bits is None or row >= len(bits):
            grown = np.zeros(max(row + 1, 2 * (0 if bits is None else len(bits))), dtype=bool)
            if bits is not None:
                grown[: len(bits)] = bits
            self._epochs[epoch] = bits = grown
        bits[row] = True

    def mark_ids(self, rollout_ids) -> int:
        """Marks every parseable rollout id; how many were not (foreign ids are never done)."""
        foreign = 0
        for rid in rollout_ids:
            parsed = parse_rollout_id(rid)
            if parsed is None:
                foreign += 1
            else:
                self.mark(parsed[1], parsed[2])
        return foreign

    def done(self, epoch: int, rows) -> np.ndarray:
        """For each of `rows` (an int array) of `epoch`: is it done?"""
        rows = np.asarray(rows, dtype=np.int64)
        bits = self._epochs.get(epoch)
        if bits is None:
            return np.zeros(len(rows), dtype=bool)
        inside = rows < len(bits)
        out = np.zeros(len(rows), dtype=bool)
        out[inside] = bits[rows[inside]]
        return out

    def is_done(self, rollout_id: str) -> bool:
        parsed = parse_rollout_id(rollout_id)
        return parsed is not None and bool(self.done(parsed[1], [parsed[2]])[0])

    def update(self, other: Ledger) -> Ledger:
        """Adds everything `other` holds; returns self."""
        for epoch, bits in other._epochs.items():
            mine = self._epochs.get(epoch)
            if mine is None or len(mine) < len(bits):
                grown = np.zeros(len(bits), dtype=bool)
                if mine is not None:
                    grown[: len(mine)] = mine
                self._epochs[epoch] = mine = grown
            mine[: len(bits)] |= bits
        return self

    def copy(self) -> Ledger:
        out = Ledger()
        out._epochs = {e: b.copy() for e, b in self._epochs.items()}
        return out

    def count(self) -> int:
        return int(sum(b.sum() for b in self._epochs.values()))

    @property
    def epochs(self) -> list[int]:
        return sorted(self._epochs)

    def to_wire(self) -> dict[str, dict]:
        """A JSON- and msgpack-safe form: per epoch its row count and bits
        (packed, base64): the size of the bitmaps, whatever the ids."""
        return {
            str(epoch): {"rows": len(bits), "bits": base64.b64encode(np.packbits(bits)).decode("ascii")}
            for epoch, bits in self._epochs.items()
        }

    @classmethod
    def from_wire(cls, wire: dict) -> Ledger:
        """ValueError for anything `to_wire` does not write."""
        out = cls()
        if not isinstance(wire, dict):
            raise ValueError(f"a ledger is a JSON object, got {type(wire).__name__}")
        for epoch, part in wire.items():
            if not str(epoch).isdigit() or not isinstance(part, dict):
                raise ValueError(f"ledger epoch {epoch!r}: not <epoch>: {{rows, bits}}")
            rows, bits = part.get("rows"), part.get("bits")
            if not isinstance(rows, int) or isinstance(rows, bool) or rows < 0 or not isinstance(bits, str):
                raise ValueError(f"ledger epoch {epoch!r}: rows must be a count and bits a base64 string")
            packed = np.frombuffer(base64.b64decode(bits, validate=True), dtype=np.uint8)
            if len(packed) != (rows + 7) // 8:
                raise ValueError(f"ledger epoch {epoch!r}: {len(packed)} bytes for {rows} rows")
            out._epochs[int(epoch)] = np.unpackbits(packed, count=rows).astype(bool)
        return out

    def nbytes(self) -> int:
        """Memory the bitmaps hold."""
        return int(sum(b.nbytes for b in self._epochs.values()))

    def save(self, path: str) -> None:
        """Written to a temporary name and renamed: a reader never sees half a ledger."""
        arrays = {}
        for epoch, bits in self._epochs.items():
            arrays[f"bits_{epoch}"] = np.packbits(bits)
            arrays[f"rows_{epoch}"] = np.asarray(len(bits), dtype=np.int64)
        tmp = f"{path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str) -> Ledger:
        out = cls()
        with np.load(path, allow_pickle=False) as data:
            for name in data.files:
                if name.startswith("bits_"):
                    epoch = int(name[5:])
                    n = int(data[f"rows_{epoch}"])
                    out._epochs[epoch] = np.unpackbits(data[name], count=n).astype(bool)
        return out


class KeyLedger:
    """The trajectory keys `(rollout_id, index)` a puller took, as one
    `Ledger` per index: a set of ids would grow by ~150 bytes per
    trajectory for the whole trial, these bitmaps by one bit per dataset
    row and epoch. Ids that are not a rollout worker's are never held."""

    def __init__(self) -> None:
        self.by_index: dict[int, Ledger] = {}

    def add(self, key: tuple[str, int]) -> None:
        rollout_id, index = key
        parsed = parse_rollout_id(rollout_id)
        if parsed is None or not isinstance(index, int) or index < 0:
            raise ValueError(f"not a trajectory key of a rollout worker: {key!r}")
        self.by_index.setdefault(index, Ledger()).mark(parsed[1], parsed[2])

    def __contains__(self, key: tuple[str, int]) -> bool:
        rollout_id, index = key
        ledger = self.by_index.get(index)
        return ledger is not None and ledger.is_done(rollout_id)

    def update(self, other: KeyLedger) -> KeyLedger:
        for index, ledger in other.by_index.items():
            self.by_index.setdefault(index, Ledger()).update(ledger)
        return self

    def nbytes(self) -> int:
        return sum(ledger.nbytes() for ledger in self.by_index.values())

    def to_wire(self) -> dict[str, dict]:
        return {str(index): ledger.to_wire() for index, ledger in self.by_index.items()}

    @classmethod
    def from_wire(cls, wire: dict) -> KeyLedger:
        out = cls()
        if not isinstance(wire, dict) or not all(str(k).isdigit() for k in wire):
            raise ValueError("a key ledger is {<index>: <ledger>}")
        out.by_index = {int(index): Ledger.from_wire(part) for index, part in wire.items()}
        return out


RESUMED_LEDGER_FILE = "ledger-resumed.npz"  # under checkpoint_dir: the ledger the running attempt resumed from


def resume_info(checkpoint: str, state: dict, restored: int, checkpoint_dir: str) -> tuple[Ledger, dict]:
    """What a resumed trial starts from: the checkpoint's ledger (the rollouts
    complete at its pullers, or rejected), and the part of
    `training_start` that tells the rollout workers where to go on. The
    ledger is copied to `<checkpoint_dir>/ledger-resumed.npz`, where the
    pruning of old checkpoints cannot take it from a rollout worker that
    restarts later; the name service carries only that path."""
    ledger = Ledger.load(os.path.join(checkpoint, state.get("ledger", LEDGER_FILE)))
    pointer = os.path.join(checkpoint_dir, RESUMED_LEDGER_FILE)
    ledger.save(pointer)
    return ledger, {"buffered": restored, "rollout_cursors": state.get("rollout_cursors", {}), "ledger": pointer}


def undone(ledger: Ledger, order_of, rows: np.ndarray, epoch: int, position: int) -> list[tuple[int, int]]:
    """The (epoch, prompt index) a rollout worker issued up to its cursor
    (`position` prompts into `epoch`) that `ledger` does not hold, in the
    order they were issued: what it generates again. `order_of(e)` is the
    worker's prompt order in epoch e, `rows[i]` prompt i's dataset row.
    Every epoch is scanned: the ledger keeps them all."""
    out: list[tuple[int, int]] = []
    for e in range(epoch + 1):
        order = np.asarray(order_of(e))
        issued = order[: len(order) if e < epoch else position]
        out += [(e, int(i)) for i in issued[~ledger.done(e, rows[issued])]]
    return out
