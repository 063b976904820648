"""Weights over the wire: one trainer broadcasts each version to every member
of a standalone process group (docs/design.md §8, "Broadcast").

- The **tensor list** (`Manifest`): the names `save_pretrained` writes (tied
  tensors once, under the name it keeps: `published_tensors`), each with the
  dtype it is published in, its shape, and its byte offset in one flat buffer
  (each tensor starts at a multiple of `ALIGN` bytes, so every view of the
  buffer is aligned for its dtype). It goes to the members once per group,
  through the group's store.
- The **snapshot** (`Sender.publish`): the trainer copies its weights into a
  flat buffer (one memory copy, casting to the published dtype on the way) and
  goes on; a helper thread broadcasts the buffer in buckets of
  `bucket_bytes`. Two buffers: one on the wire, one for the next snapshot; a
  version still waiting when a newer one is snapshotted is replaced by it
  (intermediate versions are skipped, as on the disk path), so the trainer
  never waits for the network. Between versions the last one sent stays in
  its buffer (a snapshot goes to the other) and the helper thread offers it
  to `idle` every `idle_s` (the runtime writes it to disk on demand).
- The **receiver** (`Receiver`): a helper thread joins the group, checks the
  tensor list against the model once, receives each version's buckets into
  its own flat buffer and hands the whole version (tensors viewing that
  buffer) to `on_version`, which copies them into the model in place; only
  then does the next version's reception start.
- With `protocol: sglang` the members are SGLang servers (the manager drives
  them over SGLang's routes: realrl/system/weight_broadcast.py): the tensor
  list is packed as SGLang's `FlattenedTensorBucket` (`Manifest.packed`) and
  the process group's own keys are laid out as SGLang's
  `init_custom_process_group` lays them, unsealed (SGLang reads them plain).
- Both protocols: each member is in a group of two of its own with the
  sender (`GroupSpec.member_group`: no member relays another's buckets),
  fed on a thread of its own at its own pace, and each bucket sent to it
  is marked in the store (`b/<n>/<i>/<rank>`: the manager's cue). The
  manager can drop one member (`drop/<rank>`): the sender leaves its group,
  mid-version too, and the others go on; a torch member leaves too
  (`Dropped`), with no part of the version in place; `next/<n>` tells the
  manager a newer version waits.
- The **group** (`open_group`): its own TCPStore (hosted by whoever owns the
  epoch, `serve_store`) and its own gloo (CPU) or NCCL (GPU) process group,
  never the trainers' group. Every value in the store is sealed under a key
  derived from the trial secret (`SealedStore`: encrypted, authenticated, and
  bound to the group's name): a process without the secret can neither read
  the members' addresses nor put its own there, so it cannot join or feed a
  group; a forged value fails the rendezvous.

The sender announces itself in the store (`sender`) before the rendezvous; a
member waits for that with a poll that `stop` ends and the spec's
`join_timeout_s` bounds, then both take at most `timeout_s` to rendezvous.
A version is announced in the store (`v/<n>`: its number) before its buckets
go out, so a member waits for the announcement with a poll it can give up,
and every collective it then enters is one the sender has begun: a member
never sits in a collective with no end, and a collective's timeout
(`timeout_s`) bounds a wedged or dead peer, which fails its group of two
(the sender feeds that member no more; the owner drops it from the epoch
and it loads from disk). Sooner
than that, the owner closing the epoch's store (it found a member down, or
up but answering nothing) ends every wait in it, a collective's included
(`_broadcast` looks at the store between slices of its wait).

(Over 700 lines on purpose: the tensor list, the sealed store, the sender and
the receiver are the two ends of one wire protocol; apart, each would have to
restate the other's half.)
"""

from __future__ import annotations

import dataclasses
import datetime
import hmac
import json
import os
import socket
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from realrl.base import faults
from realrl.base.logging import getLogger

logger = getLogger("weights.broadcast")
ALIGN = 64  # bytes; a multiple of every dtype's size (and of a cache line)
_DTYPES = {
    str(t).removeprefix("torch."): t
    for t in (
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.float64,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
    )
}
_POLL_S = 0.01  # how often a member looks for the next announcement (a store request each)


class GroupError(RuntimeError):
    """The group failed (a member died or timed out, a forged store value, a
    tensor list that does not fit the model); its members load from disk."""


class Dropped(GroupError):
    """The group's owner dropped this member (`drop/<rank>`): the others go on."""


# ---- the tensor list -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # e.g. "float32": the dtype the tensor is published in
    shape: tuple[int, ...]
    offset: int  # bytes into the flat buffer, a multiple of ALIGN

    @property
    def nbytes(self) -> int:
        n = _DTYPES[self.dtype].itemsize
        for d in self.shape:
            n *= d
        return n


@dataclasses.dataclass(frozen=True)
class Manifest:
    """What each version of one group holds, and where in the flat buffer.
    `packed`: the tensors back to back, with no padding, and every bucket
    whole tensors (SGLang's `FlattenedTensorBucket`, `load_format:
    "flattened_bucket"`: each bucket is what one of its
    `/update_weights_from_distributed` calls receives); else each tensor at a
    multiple of `ALIGN` bytes and buckets cut anywhere."""

    entries: tuple[TensorEntry, ...]
    nbytes: int  # the flat buffer's size
    packed: bool = False

    @staticmethod
    def of(tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None, packed: bool = False) -> Manifest:
        """The layout of `tensors` (floating ones in `dtype`, when given), in their order."""
        entries, offset = [], 0
        for name, t in tensors.items():
            published = dtype if dtype is not None and t.is_floating_point() else t.dtype
            entry = TensorEntry(name, str(published).removeprefix("torch."), tuple(t.shape), offset)
            if entry.dtype not in _DTYPES:
                raise GroupError(f"{name}: dtype {entry.dtype} cannot be published over the wire")
            if packed and offset % _DTYPES[entry.dtype].itemsize:
                raise GroupError(f"{name}: at byte {offset} of a packed bucket, not aligned for {entry.dtype}")
            entries.append(entry)
            offset += entry.nbytes if packed else -(-entry.nbytes // ALIGN) * ALIGN
        return Manifest(tuple(entries), offset, packed)

    def to_bytes(self) -> bytes:
        return json.dumps(
            {
                "nbytes": self.nbytes,
                "packed": self.packed,
                "tensors": [[e.name, e.dtype, list(e.shape), e.offset] for e in self.entries],
            }
        ).encode()

    @staticmethod
    def from_bytes(data: bytes) -> Manifest:
        """The manifest in `data`; GroupError for anything malformed (its
        layout is checked: in bounds, aligned, no overlap)."""
        try:
            raw = json.loads(data)
            entries = tuple(
                TensorEntry(str(name), str(dtype), tuple(int(d) for d in shape), int(offset))
                for name, dtype, shape, offset in raw["tensors"]
            )
            manifest = Manifest(entries, int(raw["nbytes"]), bool(raw.get("packed", False)))
        except (ValueError, KeyError, TypeError) as e:
            raise GroupError(f"malformed tensor list: {e}") from None
        end = 0
        for e in manifest.entries:
            if e.dtype not in _DTYPES or any(d < 0 for d in e.shape) or e.offset < end:
                raise GroupError(f"malformed tensor list at {e.name!r}")
            if e.offset % _DTYPES[e.dtype].itemsize if manifest.packed else e.offset % ALIGN:
                raise GroupError(f"malformed tensor list at {e.name!r}: misaligned")
            if manifest.packed and e.offset != end:
                raise GroupError(f"malformed tensor list at {e.name!r}: a gap in a packed layout")
            end = e.offset + e.nbytes
        if end > manifest.nbytes or len({e.name for e in manifest.entries}) != len(manifest.entries):
            raise GroupError("malformed tensor list: out of bounds or a name twice")
        return manifest

    def buckets(self, bucket_bytes: int) -> list[tuple[int, int]]:
        """Byte ranges of the flat buffer, each at most `bucket_bytes`, in
        order (packed: whole tensors, so a tensor larger than that is a bucket
        of its own)."""
        if self.packed:
            return [
                (group[0].offset, group[-1].offset + group[-1].nbytes) for group in self.bucket_entries(bucket_bytes)
            ]
        step = max(ALIGN, bucket_bytes // ALIGN * ALIGN)
        return [(start, min(start + step, self.nbytes)) for start in range(0, self.nbytes, step)]

    def bucket_entries(self, bucket_bytes: int) -> list[tuple[TensorEntry, ...]]:
        """A packed layout's buckets, as the tensors each one holds."""
        if not self.packed:
            raise GroupError("only a packed tensor list has buckets of whole tensors")
        groups: list[list[TensorEntry]] = []
        size = 0
        for e in self.entries:
            if not groups or (size + e.nbytes > bucket_bytes and groups[-1]):
                groups.append([])
                size = 0
            groups[-1].append(e)
            size += e.nbytes
        return [tuple(g) for g in groups]

    def views(self, flat: torch.Tensor, separate: bool = False) -> dict[str, torch.Tensor]:
        """Each tensor as a view of the flat (uint8) buffer. `separate` (a CPU
        buffer): each view with a storage of its own over the same memory
        (`torch.frombuffer`): save_pretrained (safetensors) refuses tensors
        that share one storage, and would otherwise need a copy of each."""
        if not separate or flat.device.type != "cpu":
            return {
                e.name: flat[e.offset : e.offset + e.nbytes].view(_DTYPES[e.dtype]).view(e.shape) for e in self.entries
            }
        memory = flat.numpy()
        return {
            e.name: (
                torch.frombuffer(memory[e.offset : e.offset + e.nbytes], dtype=_DTYPES[e.dtype])
                if e.nbytes
                else torch.empty(0, dtype=_DTYPES[e.dtype])  # (frombuffer refuses an empty buffer)
            ).view(e.shape)
            for e in self.entries
        }

    def placeholders(self) -> dict[str, torch.Tensor]:
        """Each tensor's name, shape and dtype without its bytes (meta tensors),
        for a receiver to check against its model before anything arrives."""
        return {e.name: torch.empty(e.shape, dtype=_DTYPES[e.dtype], device="meta") for e in self.entries}


def published_tensors(model: torch.nn.Module, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """The tensors `model.save_pretrained` writes, by the names it writes them
    under: its own rule drops every alias of a tied tensor but the name a
    reload expects (transformers' `remove_tied_weights_from_state_dict`), and
    its `_keys_to_ignore_on_save` are left out. `state_dict`: the weights in
    the model's layout (the full one gathered under FSDP)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = dict(model.state_dict() if state_dict is None else state_dict)
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    return remove_tied_weights_from_state_dict(state, model)


# ---- the group's store ---------------------------------------------------------------------


class SealedStore(dist.Store):
    """A store whose values are sealed under `key`: AES-256-GCM under a fresh
    96-bit nonce, with the group's name and the value's name as associated
    data (so a value can be neither read, forged, nor replayed under another
    name or into another group). A value read without a valid seal raises, so
    the rendezvous of a group fails rather than connecting to an address an
    outsider wrote."""

    NONCE_BYTES = 12

    def __init__(self, inner: dist.Store, key: bytes, scope: str, client: dist.Store | None = None):
        super().__init__()
        self._client = client  # the store under the prefix (`unsealed`)
        # a 256-bit AES key from any key, as the stream seal derives its own
        self._aead = AESGCM(hmac.digest(key, b"realrl/weights-group-store", "sha256"))
        self._inner, self._scope = inner, scope.encode()

    def _bound_to(self, name: str) -> bytes:
        return self._scope + b"\0" + name.encode()

    def seal(self, name: str, value: bytes) -> bytes:
        nonce = os.urandom(self.NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, value, self._bound_to(name))

    def unseal(self, name: str, sealed: bytes) -> bytes:
        try:
            return self._aead.decrypt(sealed[: self.NONCE_BYTES], sealed[self.NONCE_BYTES :], self._bound_to(name))
        except (InvalidTag, ValueError):
            raise GroupError(
                f"weight group {self._scope.decode()}: store value {name!r} is not sealed by this trial"
            ) from None

    def set(self, key, value):
        self._inner.set(key, self.seal(key, value if isinstance(value, bytes) else str(value).encode()))

    def get(self, key):
        return self.unseal(key, self._inner.get(key))

    def unsealed(self, prefix: str) -> dist.Store:
        """The store's `prefix` without the seal (an SGLang group's own keys: SGLang reads them plain)."""
        return dist.PrefixStore(prefix, self._client)

    def wait(self, keys, timeout=None):
        return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)

    def check(self, keys):
        return self._inner.check(keys)

    def add(self, key, amount):  # counters carry no addresses
        return self._inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        raise GroupError("a weight group's store does not compare-and-set")

    def delete_key(self, key):
        return self._inner.delete_key(key)

    def num_keys(self):
        return self._inner.num_keys()

    def set_timeout(self, timeout):
        return self._inner.set_timeout(timeout)


class StoreServer:
    """A TCPStore server listening on `host` only, on a free port, for the
    groups of one owner (each group under its own prefix). `close` ends it:
    every client waiting on it (a rendezvous included) fails at once, so the
    owner can end a group that will not form without waiting out anyone's
    timeout. Only this object holds the server: its users connect as clients."""

    def __init__(self, host: str, timeout_s: float = 60.0):
        # TCPStore would listen on every interface; it serves on a socket bound here instead.
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind((host, 0))
        self._socket.listen(128)
        self.host, self.port = host, self._socket.getsockname()[1]
        self.store = dist.TCPStore(
            host,
            self.port,
            None,
            True,
            datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=self._socket.fileno(),
        )
        self._socket.detach()  # the store owns the descriptor now (it closes it when it ends)

    def close(self) -> None:
        self.store = None  # (the last reference: the server stops and drops its connections)


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    """One epoch's group, as its owner hands it to the sender and the members."""

    name: str  # `realrl-<trial>-e<n>`: the store's key prefix and the seals' scope
    store_host: str
    store_port: int
    world_size: int  # 1 (the sender, rank 0) + every member's ranks
    backend: str = "gloo"  # gloo (CPU tensors) | nccl (CUDA tensors)
    bucket_bytes: int = 64 << 20
    timeout_s: float = 60.0  # each collective, and the rendezvous: a peer slower than this fails the group
    # A member waits this long for the sender to announce itself (its first version of the
    # epoch); then its membership fails (it loads from disk). The manager sets it (§8).
    join_timeout_s: float = 600.0
    # realrl: members are torch servers (`Receiver`), the group's keys all sealed. sglang: members
    # are SGLang servers driven over HTTP by the manager (`/init_weights_update_group`, ...): the
    # process group's keys are laid out as SGLang lays them and cannot be sealed (it reads them
    # unsealed); the announcements and the tensor list stay sealed (only the manager reads them).
    protocol: str = "realrl"
    # Both protocols: `pairs`, each member in a process group of its own with the sender (it
    # waits for the sender alone, and the owner can drop it, `drop/<rank>`, the others going on);
    # `one`, a single group of all, whose broadcast relays along a tree (benchmarks only).
    member_groups: str = "pairs"

    @property
    def pairs(self) -> bool:
        return self.member_groups == "pairs"

    def member_group(self, rank: int) -> tuple[str, int, int]:
        """The process group the member at `rank` joins: its name, world size
        and the member's rank in it."""
        if self.pairs:
            return f"{self.name}-r{rank}", 2, 1
        return self.name, self.world_size, rank

    @property
    def device(self) -> str:
        """Where the flat buffers live: NCCL moves CUDA tensors, gloo CPU ones."""
        return "cuda" if self.backend == "nccl" else "cpu"

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict) -> GroupSpec:
        return GroupSpec(**{f.name: d[f.name] for f in dataclasses.fields(GroupSpec) if f.name in d})


CONNECT_TIMEOUT_S = 10.0  # a store that exists answers at once; a closed one is retried this long


def connect_store(spec: GroupSpec, key: bytes) -> SealedStore:
    """The group's sealed prefix of the epoch's store (GroupError if
    unreachable: its owner closed it, say, having abandoned the epoch)."""
    try:
        client = dist.TCPStore(
            spec.store_host,
            spec.store_port,
            None,
            False,
            datetime.timedelta(seconds=min(spec.timeout_s, CONNECT_TIMEOUT_S)),
        )
        client.set_timeout(datetime.timedelta(seconds=spec.timeout_s))
    except Exception as e:
        raise GroupError(f"weight group {spec.name}: its store is unreachable: {e}") from e
    return SealedStore(dist.PrefixStore(spec.name, client), key, spec.name, client)


def open_group(
    spec: GroupSpec, rank: int, key: bytes, bind_host: str, store: SealedStore | None = None, member: int = 0
):
    """This process's place (`rank`) in the group: its own process group over
    a sealed prefix of the epoch's store (`store`, when already connected);
    blocks until every rank joined, at most the spec's `timeout_s` (a member
    enters only once the sender announced itself: `Receiver`). gloo listens
    on `bind_host` only. The sender (rank 0) joins the group of the member
    at rank `member` (`GroupSpec.member_group`: with pairs, one per member);
    a member joins its own."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    name, world_size, group_rank = spec.member_group(member or rank)
    group_rank = group_rank if rank else 0
    try:
        if store is None:
            store = connect_store(spec, key)
        pg_store: dist.Store = store
        if spec.protocol == "sglang":
            # SGLang's `init_custom_process_group` (v0.5.16 and v0.5.23 `utils/common.py`): the
            # store under the group's name, then torch's `_new_process_group_helper` adds
            # "<name>/" and "<device>/" before the backend's own keys.
            pg_store = dist.PrefixStore(
                "cuda/" if spec.backend == "nccl" else "cpu/", dist.PrefixStore(f"{name}/", store.unsealed(name))
            )
        elif spec.pairs:  # (each member's group under a sealed prefix of its own)
            pg_store = dist.PrefixStore(name, store)
        if spec.backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group = dist.ProcessGroupNCCL(pg_store, group_rank, world_size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
            group = dist.ProcessGroupGloo(pg_store, group_rank, world_size, options)
    except GroupError:
        raise
    except Exception as e:  # a rank that never came, a forged address
        raise GroupError(f"weight group {spec.name}: rank {rank} cannot join: {e}") from e
    return group, store


_LOOK_S = 0.25  # how often a process waiting in a collective looks whether its epoch still exists


def _broadcast(
    groups: list, tensor: torch.Tensor, spec: GroupSpec, store: SealedStore, drop_key: str | None = None
) -> None:
    """One bucket's collective in each of `groups` (at once: SGLang's groups of
    two), waited for in slices of `_LOOK_S`: between
    two, the epoch's store must still answer. Its owner closes it to abandon
    the epoch (a member found down or unresponsive): the wait then ends with
    GroupError within a slice, not at the collective's `timeout_s`; or, for
    one member's group of two, sets `drop_key` to drop that member alone
    (`Dropped`; the owner's side: realrl/system/weight_drops.py). (gloo
    cannot be interrupted: once connected it no longer uses the store, its
    `abort` closes nothing, and a member that is up but stalled never closes
    its side). A collective left is left to end on its own (`_strand`)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    opts.timeout = datetime.timedelta(seconds=spec.timeout_s)
    works = [group.broadcast([tensor], opts) for group in groups]
    look = datetime.timedelta(seconds=_LOOK_S)
    try:
        for work in works:
            while True:
                try:
                    work.wait(look)
                    break
                except RuntimeError:
                    if work.is_completed():
                        # Done meanwhile (the slice ran out as it completed, a loaded machine's race):
                        # its own outcome; a failed collective (a peer died, its timeout) raises here.
                        work.wait()
                        break
                try:
                    store.check(["sender"])
                    dropped = drop_key is not None and store.check([drop_key])
                except Exception as e:
                    raise GroupError(f"weight group {spec.name} was abandoned by its owner (its store: {e})") from None
                if dropped:
                    store.get(drop_key)  # (its owner's: one not sealed by the trial fails the group)
                    raise Dropped(f"weight group {spec.name}: {drop_key} by its owner")
    except BaseException:
        for group, work in zip(groups, works):
            if not work.is_completed():
                _strand(group, work)
        raise


def _strand(group: dist.ProcessGroup, work: dist.Work) -> None:
    """Keeps `group` until its pending `work` ends (the peer answers, or the
    collective's timeout fails it), on a thread of its own: a process group
    let go with a collective in flight joins its worker threads, which would
    block the thread letting it go for the collective's whole timeout. The
    thread polls rather than waits in `work.wait()`: a daemon thread blocked
    in C++ when the process exits aborts it; one in `time.sleep` does not
    (and the group, still held, is never torn down)."""

    def let_it_end(group: dist.ProcessGroup, work: dist.Work) -> None:
        while not work.is_completed():
            time.sleep(_LOOK_S)

    threading.Thread(target=let_it_end, args=(group, work), name="weights-stranded", daemon=True).start()


def _flat(nbytes: int, device: str) -> torch.Tensor:
    flat = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    if flat.device.type == "cpu":  # its pages in now, not on the first copy into it (a publish's stall)
        flat.zero_()
    return flat


# ---- the sender --------------------------------------------------------------------------


class Sender:
    """Rank 0 of one group: `publish` snapshots a version and returns; a
    helper thread forms the group and broadcasts the newest snapshot, then
    calls `after_send(version, tensors)` with it (views of its buffer, on
    CPU each with a storage of its own, valid until it returns: the disk
    copy of the version may be written there). Once
    the group failed, versions still go to `after_send`, not to the wire.
    While nothing is pending, `idle(version, tensors)` is called every
    `idle_s` with the last version `after_send` had, still in its buffer (a
    snapshot meanwhile goes to the other one)."""

    def __init__(
        self,
        spec: GroupSpec,
        key: bytes,
        manifest: Manifest,
        bind_host: str,
        after_send: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        idle: Callable[[int, dict[str, torch.Tensor]], None] | None = None,
        idle_s: float = 0.25,
    ):
        self.spec, self.manifest = spec, manifest
        self._key, self._bind_host, self._device = key, bind_host, spec.device
        self.after_send, self.idle, self._idle_s = after_send, idle, idle_s
        self._buffers = [_flat(manifest.nbytes, spec.device), _flat(manifest.nbytes, spec.device)]
        self._views = [manifest.views(b, separate=True) for b in self._buffers]  # (written as they are: after_send)
        self._cond = threading.Condition()
        self._pending: tuple[int, int] | None = None  # (buffer, version) snapshotted, not yet on the wire
        self._sending: int | None = None  # the buffer on the wire (or being written to disk)
        self._last: tuple[int, int] | None = None  # (buffer, version) `after_send` had last, kept for `idle`
        self._closing = False
        self.sent_version: int | None = None  # the newest version every member received (but those dropped)
        # SGLang: the members' ranks fed no more (the owner dropped them, `drop/<rank>`, or their group failed)
        self.dropped: set[int] = set()
        self.skipped: list[int] = []  # versions replaced by a newer one before they went out
        self.error: str | None = None  # why the group failed
        self.after_send_error: str | None = None  # the last `after_send` failure
        self.seconds: dict[int, float] = {}  # version -> seconds on the wire
        self.wire_s = 0.0  # the version `after_send` is called with: seconds on the wire (or until it failed)
        self._thread = threading.Thread(target=self._run, name=f"weights-send-{spec.name}", daemon=True)
        self._thread.start()

    @property
    def failed(self) -> bool:
        return self.error is not None

    @torch.no_grad()
    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Copies `tensors` (every name of the manifest) into the free buffer
        and queues it: the trainer's one copy; it never waits for the wire."""
        with self._cond:
            busy = self._sending if self._sending is not None else self._last[0] if self._last else 1
            index = 1 - busy  # (the last version sent is overwritten only once a newer one is on the wire)
            if self._last is not None and self._last[0] == index:
                self._last = None
            if self._pending is not None and self._pending[0] == index:
                self.skipped.append(self._pending[1])
                self._pending = None  # the helper must not start on a buffer being overwritten
        views = self._views[index]
        for e in self.manifest.entries:
            views[e.name].copy_(tensors[e.name])  # (a cast when published in another dtype)
        if self._device != "cpu":
            torch.cuda.current_stream().synchronize()
        with self._cond:
            self._pending = (index, version)
            self._cond.notify_all()

    def wait_sent(self, version: int, timeout_s: float) -> bool:
        """Whether `version` (or a newer one) is on every member within `timeout_s` (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while not self.failed and (self.sent_version is None or self.sent_version < version):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return not self.failed

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether everything published went out (or to `after_send`) within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._pending is not None or self._sending is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout_s: float = 10.0) -> None:
        """Tells the members the group is over once what is pending went out
        (waits at most `timeout_s` for that; 0: not at all)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if timeout_s > 0:
            self._thread.join(timeout_s)

    def _call(self, fn: Callable | None, what: str, index: int, version: int) -> None:
        """`fn(version, tensors)` with buffer `index` (marked on the wire: a snapshot goes to the other one)."""
        try:
            if fn is not None:
                fn(version, self._views[index])
        except Exception as e:  # (the caller's; logged, and the next version is tried)
            self.after_send_error = f"version {version}: {type(e).__name__}: {e}"
            logger.exception("weight group %s: %s of version %d", self.spec.name, what, version)
        if what == "idle":
            with self._cond:
                self._sending = None
                self._cond.notify_all()

    def _is_dropped(self, store: SealedStore, rank: int) -> bool:
        """Whether the owner dropped the member at `rank` (`drop/<rank>`, sealed)."""
        if rank not in self.dropped and store.check([f"drop/{rank}"]):
            store.get(f"drop/{rank}")  # (its owner's: one not sealed by the trial fails the group)
            self.dropped.add(rank)
            logger.warning("weight group %s: member %d dropped by its owner; the others go on", self.spec.name, rank)
        return rank in self.dropped

    def _to_each(self, groups: list, flat: torch.Tensor, buckets: list, n: int, store: SealedStore) -> None:
        """Announcement `n`'s buckets into each member's group of two, each on
        a thread of its own at the member's own pace (`b/<n>/<i>/<rank>`:
        bucket i went to member `rank`, whose next is on its way): no member
        waits for another. A member the owner dropped (`drop/<rank>`: it
        stalled, say) is left, mid-version too, and fed no more; so is one
        whose group failed (it died, or the owner destroyed the group on it):
        the others go on (the owner learns of that member's failure from it,
        over its routes, and loads its versions from disk). While they are at
        it and a newer snapshot waits, `next/<n>` says so (the owner's cue to
        drop a member that holds it back). Raises once no member is left (the
        epoch abandoned: its store closed)."""
        errors: list[Exception] = []

        def to_member(rank: int, group: dist.ProcessGroup) -> None:
            try:
                for i, (start, end) in enumerate(buckets):
                    _broadcast([group], flat[start:end], self.spec, store, drop_key=f"drop/{rank}")
                    store.set(f"b/{n}/{i}/{rank}", b"sent")
                    faults.point("weights.bucket_sent")  # a test's trainer dying mid-version
                    faults.point(f"weights.bucket_sent.r{rank}")  # a test's sender held for one member
            except Exception as e:
                try:
                    if self._is_dropped(store, rank):  # (its connections closed by its owner, or left here)
                        return
                except Exception:
                    pass
                errors.append(e)
                self.dropped.add(rank)
                logger.warning("weight group %s: member %d fed no more: %s", self.spec.name, rank, e)

        live = [(rank, group) for rank, group in enumerate(groups, start=1) if not self._is_dropped(store, rank)]
        if not live:
            raise GroupError(f"weight group {self.spec.name}: every member was dropped")
        threads = [
            threading.Thread(target=to_member, args=(rank, group), name=f"weights-send-r{rank}", daemon=True)
            for rank, group in live
        ]
        for thread in threads:
            thread.start()
        newer_told = False
        for thread in threads:
            while thread.is_alive():
                thread.join(_LOOK_S / 5)
                if not newer_told and self._pending is not None:
                    newer_told = True
                    try:
                        store.set(f"next/{n}", b"waiting")
                    except Exception:  # (the store gone: the members' threads fail with it)
                        pass
        if all(rank in self.dropped for rank, _ in live):
            raise errors[0] if errors else GroupError(f"weight group {self.spec.name}: every member was dropped")

    def _fail(self, e: Exception) -> None:
        with self._cond:
            self.error = f"{type(e).__name__}: {e}"
            self._cond.notify_all()

    def _run(self) -> None:
        groups = store = None
        try:
            # The members wait for this key before they enter the rendezvous, so the rendezvous
            # takes at most a collective's timeout for everyone (a member that died meanwhile
            # must not hold versions back, and one whose sender never comes gives up: `Receiver`).
            store = connect_store(self.spec, self._key)
            store.set("sender", b"here")
            if self.spec.pairs:  # one group per member
                members = range(1, self.spec.world_size)
                groups = [open_group(self.spec, 0, self._key, self._bind_host, store, k)[0] for k in members]
            else:
                groups = [open_group(self.spec, 0, self._key, self._bind_host, store)[0]]
            store.set("manifest", self.manifest.to_bytes())
        except Exception as e:
            self._fail(e)
        n = 0
        while True:
            with self._cond:
                idle = False
                while self._pending is None and not self._closing and not idle:
                    idle = not self._cond.wait(self._idle_s if self.idle else None) and self._last is not None
                idle = idle and self._pending is None
                if idle:  # nothing pending for `idle_s`: the last version to `idle`
                    (index, version), self._sending = self._last, self._last[0]
                elif self._pending is None:
                    break
                else:
                    (index, version), self._pending, self._sending = self._pending, None, self._pending[0]
            if idle:
                self._call(self.idle, "idle", index, version)
                continue
            t0 = time.monotonic()
            if not self.failed:
                try:
                    store.set(f"v/{n}", str(version).encode())
                    announced, n = n, n + 1
                    flat, buckets = self._buffers[index], self.manifest.buckets(self.spec.bucket_bytes)
                    if self.spec.pairs:
                        self._to_each(groups, flat, buckets, announced, store)
                    else:
                        for i, (start, end) in enumerate(buckets):
                            _broadcast(groups, flat[start:end], self.spec, store)
                            if self.spec.protocol == "sglang":  # every member has bucket i: the next may go out
                                store.set(f"b/{announced}/{i}", b"sent")
                            faults.point("weights.bucket_sent")  # a test's trainer dying mid-version
                except Exception as e:  # a member died or timed out: the group is over
                    self._fail(e)
                    groups = None  # their connections close: the other members fail now, not at their timeout
            sent = not self.failed
            self.wire_s = time.monotonic() - t0
            self._call(self.after_send, "after_send", index, version)
            with self._cond:
                self._sending, self._last = None, (index, version)
                if sent:
                    self.sent_version = version
                    self.seconds[version] = self.wire_s
                self._cond.notify_all()
        if store is not None and not self.failed:
            try:
                store.set(f"v/{n}", b"close")
            except Exception:  # the store is gone: the members fail, as they would
                pass


# ---- the receiver ------------------------------------------------------------------------


class Receiver:
    """One member of a group at `rank`: a helper thread receives each version
    and calls `on_version(version, tensors)` with the whole version (views of
    its buffer, valid until `on_version` returns), which puts it in place; or
    keeps the buffer (the tensors became the model's own) and returns another
    flat buffer of the same size (uint8) for the next version.
    `check(manifest)` runs once before anything is received; raising there
    (a tensor list that does not fit) fails the membership, as does any
    error of the group: `error` says why and `on_failure` is called."""

    def __init__(
        self,
        spec: GroupSpec,
        rank: int,
        key: bytes,
        bind_host: str,
        check: Callable[[Manifest], None],
        on_version: Callable[[int, dict[str, torch.Tensor]], torch.Tensor | None],
        on_failure: Callable[[str], None] | None = None,
    ):
        self.spec, self.rank = spec, rank
        self._key, self._bind_host, self._device = key, bind_host, spec.device
        self._check, self._on_version, self._on_failure = check, on_version, on_failure
        self._stop = threading.Event()
        self.received: list[int] = []  # versions put in place, in order
        self.error: str | None = None
        self.closed = False  # the sender ended the group
        self._thread = threading.Thread(target=self._run, name=f"weights-recv-{spec.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Leaves the group at the next version boundary (a version being
        received is finished or fails first)."""
        self._stop.set()
        self._thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        self._thread.join(timeout_s)

    def _wait_key(self, store: SealedStore, key: str, timeout_s: float | None = None) -> bytes | None:
        """The value of `key` once the sender set it; None when told to stop.
        A store `check` per poll, not a blocking `wait`: a wait that times out
        logs a warning in c10d each time (and cannot be told to stop); the
        store's owner gone fails the check. GroupError after `timeout_s`."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._stop.is_set():
            if store.check([key]):
                return store.get(key)
            if deadline is not None and time.monotonic() > deadline:
                raise GroupError(f"weight group {self.spec.name}: no sender within {timeout_s:g} s")
            self._stop.wait(_POLL_S)
        return None

    def _run(self) -> None:
        try:
            # Until the sender comes the wait is a poll that `stop` ends and the spec's
            # `join_timeout_s` bounds (a rendezvous in c10d could be neither).
            store = connect_store(self.spec, self._key)
            if self._wait_key(store, "sender", self.spec.join_timeout_s) is None:
                return
            faults.point("weights.before_rendezvous")  # a test's member dying before the group forms
            group, store = open_group(self.spec, self.rank, self._key, self._bind_host, store)
            groups = [group]
            drop_key = f"drop/{self.rank}" if self.spec.pairs else None  # (the owner can drop it alone)
            data = self._wait_key(store, "manifest")
            if data is None:
                return
            manifest = Manifest.from_bytes(data)
            self._check(manifest)
            flat = _flat(manifest.nbytes, self._device)
            views = manifest.views(flat)
            buckets = manifest.buckets(self.spec.bucket_bytes)
            n = 0
            while True:
                announced = self._wait_key(store, f"v/{n}")
                if announced is None:
                    return
                if announced == b"close":
                    self.closed = True
                    return
                version = int(announced)
                for start, end in buckets:
                    _broadcast(groups, flat[start:end], self.spec, store, drop_key)
                    faults.point("weights.bucket_received")  # a test's member dying mid-version
                    faults.point("weights.member_stalls")  # a test's member up but answering nothing
                if self._device != "cpu":
                    torch.cuda.current_stream().synchronize()
                faults.point("weights.member_stalls_in_place")  # a test's member stalled with a whole version
                if drop_key is not None and store.check([drop_key]):  # (dropped meanwhile: its versions by disk)
                    store.get(drop_key)  # (its owner's: one not sealed by the trial fails the group)
                    raise Dropped(f"weight group {self.spec.name}: {drop_key} by its owner")
                kept = self._on_version(version, views)
                if kept is not None:  # (the buffer is the model's now: the next version goes to this one)
                    flat, views = kept, manifest.views(kept)
                self.received.append(version)
                faults.point("weights.version_in_place")
                n += 1
        except Exception as e:
            self.error = f"{type(e).__name__}: {e}"
            if self._on_failure is not None:
                self._on_failure(self.error)
