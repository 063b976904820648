"""name_resolve: how realrl's processes find one another (docs/design.md §3).

One API, three backends:

- `memory`: a dict in this process (unit tests, single-process tools);
- `file`: a directory shared by the processes (one machine, or NFS). A key
  `a/b` is stored as the file `<root>/a/b/ENTRY`. Writes go to a temp file that
  is then renamed (replace) or hard-linked (create-if-absent, atomic even when
  processes race and over NFS);
- `etcd3`: a real etcd server (the default for runs). Create-if-absent is an
  etcd transaction; TTLs are etcd leases.

Values are strings. `keepalive_ttl` keeps a key alive while its process lives:
a background thread refreshes it (etcd: lease keep-alive; file: touching the
entry's mtime), so the key vanishes within about TTL after the process dies,
even by SIGKILL. Keys this process added with `delete_on_exit=True` are
deleted by `reset()`, which also runs at interpreter exit.

Module-level functions (`add`, `get`, ...) use a process-wide repository that
`reconfigure(NameResolveConfig(...))` replaces at run time; worker processes
configure it from their worker info, and REALRL_NAME_RESOLVE_* environment
variables give a default (see `config_from_env`).

(Over 700 lines on purpose: one API and its three backends, each the same
few primitives against another store, and the watch of values
(`ValueWatch`) that the etcd backend answers with a watch of its own.)
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import os
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

from realrl.base.etcd_keepalive import LeaseKeepAliveStream
from realrl.base.logging import getLogger

logger = getLogger("name_resolve")


class NameEntryExistsError(Exception):
    """add(..., replace=False) found the key already present."""


class NameEntryNotFoundError(Exception):
    """get/delete of a key that is not present (or whose TTL ran out)."""


@dataclasses.dataclass
class NameResolveConfig:
    """Where workers find each other (docs/name_resolve.md)."""

    type: str = "memory"
    """memory (one process only) | file | etcd3."""
    etcd3_addr: str = ""
    """host:port of an etcd server; "" with etcd3 = the launcher starts a private etcd."""
    etcd3_user: str = ""
    """etcd with authentication: the user; "" = none. Its password comes from REALRL_ETCD3_PASSWORD (never a
    config file), or for the launcher's private etcd (which sets both keys) from the trial secret."""
    etcd3_secret: str = ""
    """Set by the launcher: the trial secret whose derived etcd password the private etcd's root user has."""
    file_root: str = ""
    """Directory of the file backend (shared by every node)."""

    def validate(self) -> None:
        if self.type not in ("memory", "file", "etcd3"):
            raise ValueError(f"name_resolve.type must be one of memory|file|etcd3, got {self.type!r}")
        if self.type == "file" and not self.file_root:
            raise ValueError("name_resolve.file_root must be set when name_resolve.type=file")
        if self.type == "etcd3" and self.etcd3_addr:
            host, _, port = self.etcd3_addr.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"name_resolve.etcd3_addr must be host:port, got {self.etcd3_addr!r}")


def validate_name(name: object) -> str:
    """Keys are '/'-separated, non-empty components, no '.' or '..' parts."""
    if not isinstance(name, str):
        raise ValueError(f"name_resolve key must be a str, got {type(name).__name__}")
    stripped = name.strip("/")
    if not stripped:
        raise ValueError(f"name_resolve key must be non-empty, got {name!r}")
    for part in stripped.split("/"):
        if part in ("", ".", ".."):
            raise ValueError(f"invalid name_resolve key {name!r}: empty, '.' or '..' component")
        if any(ord(c) < 32 for c in part):
            raise ValueError(f"invalid name_resolve key {name!r}: control character")
    return stripped


def _check_value(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"name_resolve values are strings, got {type(value).__name__}")
    return value


def _unique_suffix() -> str:
    # Time-ordered prefix first so subentries of one writer sort by creation.
    return f"{time.time_ns():x}{uuid.uuid4().hex[:12]}"


class NameRecordRepository(ABC):
    """The backend interface. All methods are thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._to_delete: set[str] = set()  # keys to remove at reset()/exit
        self._keepalive: dict[str, float] = {}  # key -> ttl, refreshed while we live
        self._keepalive_thread: threading.Thread | None = None
        self._closed = threading.Event()
        atexit.register(self.reset)

    # -- backend primitives ------------------------------------------------
    @abstractmethod
    def _add(self, name: str, value: str, ttl: float | None, replace: bool) -> None: ...

    @abstractmethod
    def _get(self, name: str) -> str: ...

    @abstractmethod
    def _delete(self, name: str) -> None: ...

    @abstractmethod
    def _find_subtree(self, prefix: str) -> list[str]: ...

    @abstractmethod
    def _refresh(self, name: str, ttl: float) -> bool:
        """Keep a TTL key alive; False when it is no longer ours."""

    def _owned(self, name: str) -> bool:
        """Whether the key still holds what this process wrote (for reset)."""
        return True

    # -- public API --------------------------------------------------------
    def add(
        self,
        name: str,
        value: str,
        keepalive_ttl: float | None = None,
        replace: bool = False,
        delete_on_exit: bool = True,
    ) -> None:
        name = validate_name(name)
        value = _check_value(value)
        if keepalive_ttl is not None and keepalive_ttl <= 0:
            raise ValueError(f"keepalive_ttl must be positive, got {keepalive_ttl}")
        with self._lock:
            self._add(name, value, keepalive_ttl, replace)
            if delete_on_exit:
                self._to_delete.add(name)
            if keepalive_ttl is not None:
                self._keepalive[name] = keepalive_ttl
                self._start_keepalive_thread()
            else:
                self._keepalive.pop(name, None)

    def add_subentry(self, name: str, value: str, **kwargs) -> str:
        """Adds `name/<unique>` and returns that key."""
        key = f"{validate_name(name)}/{_unique_suffix()}"
        self.add(key, value, **kwargs)
        return key

    def get(self, name: str) -> str:
        return self._get(validate_name(name))

    def delete(self, name: str) -> None:
        name = validate_name(name)
        with self._lock:
            self._to_delete.discard(name)
            self._keepalive.pop(name, None)
            self._delete(name)

    def find_subtree(self, name_root: str) -> list[str]:
        """Keys equal to or below `name_root`, sorted."""
        return sorted(self._find_subtree(validate_name(name_root)))

    def get_subtree(self, name_root: str) -> list[str]:
        """Values of `find_subtree(name_root)`, in key order."""
        return list(self.items_subtree(name_root).values())

    def items_subtree(self, name_root: str) -> dict[str, str]:
        """{key: value} of `find_subtree(name_root)`, in key order: one read
        of the name service where the backend can (etcd: a range), not one per
        key (a manager reads its 512 servers' keys every second)."""
        return dict(sorted(self._items_subtree(validate_name(name_root)).items()))

    def _items_subtree(self, prefix: str) -> dict[str, str]:
        out = {}
        for key in self._find_subtree(prefix):
            try:
                out[key] = self._get(key)
            except NameEntryNotFoundError:
                pass  # deleted between listing and reading
        return out

    def clear_subtree(self, name_root: str) -> None:
        for key in self.find_subtree(name_root):
            with self._lock:
                self._to_delete.discard(key)
                self._keepalive.pop(key, None)
            try:
                self._delete(key)
            except NameEntryNotFoundError:
                pass

    def wait(self, name: str, timeout: float | None = None, poll_frequency: float = 0.05) -> str:
        """Blocks until `name` exists; returns its value or raises TimeoutError."""
        name = validate_name(name)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                return self._get(name)
            except NameEntryNotFoundError:
                pass
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"name_resolve: {name!r} did not appear within {timeout}s")
            time.sleep(poll_frequency)

    def watch_values(self, names: Iterable[str], poll_interval: float = 0.5) -> ValueWatch:
        """The values of a few keys for a reader that looks often (a loop's
        checks): `ValueWatch.get` costs the name service nothing where the
        backend pushes changes (etcd: one watch), else it reads through.
        Listeners hear of a change at once (etcd) or within `poll_interval`."""
        return ValueWatch(self, [validate_name(n) for n in names], poll_interval)

    def reset(self) -> None:
        """Deletes the keys this process added with delete_on_exit=True."""
        with self._lock:
            keys, self._to_delete = list(self._to_delete), set()
            self._keepalive.clear()
        for key in keys:
            try:
                if self._owned(key):
                    self._delete(key)
            except NameEntryNotFoundError:
                pass
            except Exception as e:  # backend gone at exit: nothing left to clean
                logger.debug("reset: could not delete %s: %s", key, e)

    def close(self) -> None:
        self.reset()
        self._closed.set()
        atexit.unregister(self.reset)

    # -- keep-alive --------------------------------------------------------
    def _start_keepalive_thread(self) -> None:
        if self._keepalive_thread is not None and self._keepalive_thread.is_alive():
            return
        self._keepalive_thread = threading.Thread(
            target=self._keepalive_loop, name="name_resolve-keepalive", daemon=True
        )
        self._keepalive_thread.start()

    def _keepalive_loop(self) -> None:
        last: dict[str, float] = {}
        failures: dict[str, int] = {}  # consecutive failed refreshes per key
        while not self._closed.is_set():
            with self._lock:
                items = list(self._keepalive.items())
            now = time.monotonic()
            for key, ttl in items:
                if now - last.get(key, 0.0) < ttl / 3:
                    continue
                last[key] = now
                try:
                    alive = self._refresh(key, ttl)
                except Exception as e:
                    # One miss leaves the key alive (the TTL allows three); a
                    # second in a row is worth saying. (When the name service is
                    # gone for good, the process notices and says so itself.)
                    failures[key] = failures.get(key, 0) + 1
                    (logger.warning if failures[key] >= 2 else logger.debug)("keep-alive of %s failed: %s", key, e)
                    continue
                failures.pop(key, None)
                if not alive:
                    logger.warning("keep-alive key %s was lost (replaced, deleted or expired)", key)
                    with self._lock:
                        self._keepalive.pop(key, None)
            wait = min((ttl for _, ttl in items), default=1.0) / 6
            self._closed.wait(max(0.02, min(wait, 1.0)))


class ValueWatch:
    """A few keys' values as the name service last said (docs/design.md §3).

    `get(name)` answers as `NameRecordRepository.get` does (the value, or
    NameEntryNotFoundError); this base class reads through to the backend
    each time, so a failing backend raises there as it would. `live` says
    whether `get` is answered from pushed values instead (etcd). Listeners
    (`add_listener`) are called from a thread of the watch after any of the
    keys changed: here a thread polls every `poll_interval` while there are
    listeners; etcd's subclass calls them on each event.
    """

    live = False

    def __init__(self, repo: NameRecordRepository, names: list[str], poll_interval: float):
        self._repo = repo
        self.repository = repo  # (whose keys: a process that switches its name service makes a new watch)
        self.names = list(names)
        self.poll_interval = poll_interval
        self._listeners: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._polling = False

    def get(self, name: str) -> str:
        return self._repo._get(validate_name(name))

    def add_listener(self, callback: Callable[[], None]) -> None:
        with self._lock:
            self._listeners.append(callback)
        self._start_polling()

    def close(self) -> None:
        self._closed.set()

    def _notify(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback()
            except Exception:  # a listener's bug must not stop the watch
                logger.exception("name_resolve watch listener failed")

    def _start_polling(self) -> None:
        with self._lock:
            if self.live or not self._listeners or self._polling or self._closed.is_set():
                return
            self._polling = True
        try:  # what a change is measured from: the values now, before the caller goes on
            first = self._read_all()
        except Exception:
            first = None
        threading.Thread(target=self._poll_loop, args=(first,), name="name_resolve-values", daemon=True).start()

    def _read_all(self) -> dict[str, str | None]:
        out: dict[str, str | None] = {}
        for name in self.names:
            try:
                out[name] = self._repo._get(name)
            except NameEntryNotFoundError:
                out[name] = None
        return out

    def _poll_loop(self, last: dict[str, str | None] | None) -> None:
        while not self._closed.wait(self.poll_interval) and not self._repo._closed.is_set():
            try:
                now = self._read_all()
            except Exception as e:  # the readers' own get() says so; keep polling
                logger.debug("name_resolve watch: read failed: %s", e)
                continue
            if last is not None and now != last:
                self._notify()
            last = now


class _EtcdValueWatch(ValueWatch):
    """etcd: one watch per key from the revision its first read saw, so no
    change between the read and the watch is missed; `get` answers from the
    pushed values. If the watch stream ends (etcd gone, the client closed),
    `get` reads through from then on (and fails as a read would) and a
    polling thread serves the listeners."""

    def __init__(self, repo: Etcd3NameRecordRepository, names: list[str], poll_interval: float):
        super().__init__(repo, names, poll_interval)
        self._values: dict[str, str | None] = {}
        self._ids: list[int] = []
        client = repo._client
        for name in self.names:
            response = client.get_response(name)
            self._values[name] = response.kvs[0].value.decode() if response.count else None
            self._ids.append(
                client.add_watch_callback(name, self._on_response, start_revision=response.header.revision + 1)
            )
        self.live = True

    def get(self, name: str) -> str:
        if not self.live:
            return super().get(name)
        try:
            value = self._values[name]
        except KeyError:  # (the name as the caller spelled it: a leading or trailing '/')
            value = self._values[validate_name(name)]
        if value is None:
            raise NameEntryNotFoundError(name)
        return value

    def _on_response(self, response) -> None:
        if response is None or isinstance(response, Exception):  # the stream ended
            if self.live and not self._closed.is_set() and not self._repo._closed.is_set():  # (not at the end)
                why = "closed" if response is None else type(response).__name__
                logger.info("name_resolve watch of %s ended (%s): reading through", self.names, why)
            self.live = False
            self._notify()  # (readers look again, and see what a read says)
            self._start_polling()
            return
        from pyetcd.events import PutEvent

        for event in response.events:
            self._values[event.key.decode()] = event.value.decode() if isinstance(event, PutEvent) else None
        self._notify()

    def close(self) -> None:
        super().close()
        if self.live:
            self.live = False
            for watch_id in self._ids:
                try:
                    self._repo._client.cancel_watch(watch_id)
                except Exception as e:  # the client or etcd already gone
                    logger.debug("name_resolve watch: cancel failed: %s", e)


class MemoryNameRecordRepository(NameRecordRepository):
    """One process only. TTL keys stay while the process lives (they die with it)."""

    def __init__(self) -> None:
        super().__init__()
        self._store: dict[str, str] = {}

    def _add(self, name, value, ttl, replace):
        if not replace and name in self._store:
            raise NameEntryExistsError(name)
        self._store[name] = value

    def _get(self, name):
        try:
            return self._store[name]
        except KeyError:
            raise NameEntryNotFoundError(name) from None

    def _delete(self, name):
        with self._lock:
            if self._store.pop(name, None) is None:
                raise NameEntryNotFoundError(name)

    def _find_subtree(self, prefix):
        with self._lock:
            return [k for k in self._store if k == prefix or k.startswith(prefix + "/")]

    def _refresh(self, name, ttl):
        return name in self._store


class FileNameRecordRepository(NameRecordRepository):
    """A shared directory. Entry files hold JSON {"value": ..., "ttl": ...}.

    A TTL entry is alive while its mtime is within `ttl` of now; its owner
    touches it every ttl/3. Hosts sharing the directory over NFS need roughly
    synchronised clocks (NTP), as TTLs compare mtimes with the reader's clock.
    """

    ENTRY = "ENTRY"

    def __init__(self, root: str) -> None:
        super().__init__()
        self.root = os.path.abspath(root)
        os.makedirs(self.root, exist_ok=True)
        self._inodes: dict[str, int] = {}  # key -> inode we wrote (ownership)

    def _dir(self, name: str) -> str:
        return os.path.join(self.root, *name.split("/"))

    def _entry(self, name: str) -> str:
        return os.path.join(self._dir(name), self.ENTRY)

    def _read(self, path: str) -> tuple[str, float | None, os.stat_result] | None:
        """(value, ttl, stat) of a live entry, None if absent or expired."""
        try:
            with open(path) as f:
                st = os.fstat(f.fileno())
                record = json.load(f)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            logger.warning("unreadable name_resolve entry %s: %s", path, e)
            return None
        ttl = record.get("ttl")
        if ttl is not None and time.time() - st.st_mtime > ttl:
            return None
        return record["value"], ttl, st

    def _write_temp(self, name: str, value: str, ttl: float | None) -> str:
        directory = self._dir(name)
        for _ in range(10):
            try:
                os.makedirs(directory, exist_ok=True)
                tmp = os.path.join(directory, f".{self.ENTRY}.{uuid.uuid4().hex}.tmp")
                with open(tmp, "w") as f:
                    json.dump({"value": value, "ttl": ttl, "pid": os.getpid()}, f)
                return tmp
            except FileNotFoundError:
                continue  # a concurrent delete pruned the directory; retry
        raise OSError(f"could not create {directory}")

    def _add(self, name, value, ttl, replace):
        path = self._entry(name)
        tmp = self._write_temp(name, value, ttl)
        try:
            if replace:
                os.replace(tmp, path)
                tmp = None
            else:
                try:
                    os.link(tmp, path)  # atomic create-if-absent
                except FileExistsError:
                    if self._read(path) is not None:
                        raise NameEntryExistsError(name) from None
                    self._replace_expired(name, path, tmp)
            self._inodes[name] = os.stat(path).st_ino
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass

    def _replace_expired(self, name: str, path: str, tmp: str) -> None:
        # Only the slow path (an expired entry in the way) takes a lock, so two
        # processes cannot both decide the entry is stale and both win.
        import fcntl

        lock_path = os.path.join(self._dir(name), ".lock")
        with open(lock_path, "a") as lock:
            fcntl.lockf(lock, fcntl.LOCK_EX)
            try:
                if self._read(path) is not None:
                    raise NameEntryExistsError(name)
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                os.link(tmp, path)
            finally:
                fcntl.lockf(lock, fcntl.LOCK_UN)

    def _get(self, name):
        rec = self._read(self._entry(name))
        if rec is None:
            raise NameEntryNotFoundError(name)
        return rec[0]

    def _delete(self, name):
        path = self._entry(name)
        if self._read(path) is None:
            try:  # remove an expired leftover, but report it as absent
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise NameEntryNotFoundError(name)
        try:
            os.unlink(path)
        except FileNotFoundError:
            raise NameEntryNotFoundError(name) from None
        self._inodes.pop(name, None)
        self._prune(self._dir(name))

    def _prune(self, directory: str) -> None:
        # Remove now-empty directories up to the root (best effort; a
        # concurrent add may recreate them, which _write_temp tolerates).
        while directory.startswith(self.root + os.sep):
            try:
                for leftover in os.listdir(directory):
                    if leftover == ".lock":
                        os.unlink(os.path.join(directory, leftover))
                os.rmdir(directory)
            except OSError:
                return
            directory = os.path.dirname(directory)

    def _find_subtree(self, prefix):
        top = self._dir(prefix)
        keys = []
        for dirpath, _, filenames in os.walk(top):
            if self.ENTRY in filenames and self._read(os.path.join(dirpath, self.ENTRY)) is not None:
                rel = os.path.relpath(dirpath, self.root)
                keys.append(rel.replace(os.sep, "/"))
        return keys

    def _refresh(self, name, ttl):
        path = self._entry(name)
        try:
            if os.stat(path).st_ino != self._inodes.get(name):
                return False
            os.utime(path)
            return True
        except FileNotFoundError:
            return False

    def _owned(self, name):
        try:
            return os.stat(self._entry(name)).st_ino == self._inodes.get(name)
        except FileNotFoundError:
            return False


# grpc waits for a stream's next message in slices of `grpc._common.MAXIMUM_WAIT_TIMEOUT` (0.1 s,
# so that a main thread blocked there still runs its signal handlers): the watch thread of every
# process woke 10 times a second with nothing to read. Our streams (the watch, the lease
# keep-alive) are read by daemon threads only; a message or the stream's end still wakes them at once.
GRPC_STREAM_WAIT_S = 1.0


def _relax_grpc_stream_wait() -> None:
    try:
        from grpc import _common
    except ImportError:  # (a grpc without it: its own default stays)
        return
    if getattr(_common, "MAXIMUM_WAIT_TIMEOUT", GRPC_STREAM_WAIT_S) < GRPC_STREAM_WAIT_S:
        _common.MAXIMUM_WAIT_TIMEOUT = GRPC_STREAM_WAIT_S


class Etcd3NameRecordRepository(NameRecordRepository):
    """A real etcd (v3 API) through the `pyetcd` client (etcd-sdk-python),
    authenticated as `user` when one is given."""

    def __init__(self, addr: str, user: str = "", password: str | None = None) -> None:
        import pyetcd  # heavy (grpc); imported only when etcd is used

        _relax_grpc_stream_wait()
        super().__init__()
        host, _, port = addr.rpartition(":")
        self.addr = addr
        credentials = {"user": user, "password": password} if user else {}
        self._client = pyetcd.client(host=host, port=int(port), timeout=10, **credentials)
        # The token travels as call metadata; pyetcd also attaches it as call credentials, which
        # grpc refuses on a plaintext channel ("insufficient security level"): keep the metadata only.
        self._client.call_credentials = None
        self._leases: dict[str, object] = {}  # key -> lease
        self._values: dict[str, str] = {}  # key -> value we wrote (ownership)
        self._keepalive_stream = LeaseKeepAliveStream(self._client)  # (opened at the first refresh)

    def _add(self, name, value, ttl, replace):
        lease = self._client.lease(max(1, int(round(ttl)))) if ttl is not None else None
        tx = self._client.transactions
        if replace:
            self._client.put(name, value, lease=lease)
        else:
            ok, _ = self._client.transaction(
                compare=[tx.create(name) == 0], success=[tx.put(name, value, lease=lease)], failure=[]
            )
            if not ok:
                if lease is not None:
                    lease.revoke()
                raise NameEntryExistsError(name)
        old = self._leases.pop(name, None)
        if old is not None:
            try:
                old.revoke()
            except Exception:
                pass
        if lease is not None:
            self._leases[name] = lease
        self._values[name] = value

    def _get(self, name):
        value, _ = self._client.get(name)
        if value is None:
            raise NameEntryNotFoundError(name)
        return value.decode()

    def _delete(self, name):
        lease = self._leases.pop(name, None)
        self._values.pop(name, None)
        deleted = self._client.delete(name)
        if lease is not None:
            try:
                lease.revoke()
            except Exception:
                pass
        if not deleted:
            raise NameEntryNotFoundError(name)

    def _find_subtree(self, prefix):
        keys = [meta.key.decode() for _, meta in self._client.get_prefix(prefix + "/", keys_only=True)]
        value, _ = self._client.get(prefix)
        if value is not None:
            keys.append(prefix)
        return keys

    def _items_subtree(self, prefix):
        out = {meta.key.decode(): value.decode() for value, meta in self._client.get_prefix(prefix + "/")}
        value, _ = self._client.get(prefix)
        if value is not None:
            out[prefix] = value.decode()
        return out

    def _refresh(self, name, ttl):
        lease = self._leases.get(name)
        if lease is None:
            return False
        # One stream for every refresh (etcd_keepalive.py); an answer within a third of the TTL, so
        # that a stalled one leaves time for the next try before the lease runs out.
        return self._keepalive_stream.refresh(lease.id, timeout=max(0.5, ttl / 3)) > 0

    def _owned(self, name):
        value, _ = self._client.get(name)
        return value is not None and value.decode() == self._values.get(name)

    def watch_values(self, names: Iterable[str], poll_interval: float = 0.5) -> ValueWatch:
        return _EtcdValueWatch(self, [validate_name(n) for n in names], poll_interval)

    def close(self):
        super().close()
        self._keepalive_stream.close()
        self._client.close()


ETCD3_PASSWORD_ENV = "REALRL_ETCD3_PASSWORD"


def etcd3_password(config: NameResolveConfig) -> str | None:
    """The password of `config.etcd3_user` (None without a user): derived from
    the trial secret `etcd3_secret` (the private etcd, docs/design.md §14), else
    REALRL_ETCD3_PASSWORD (a shared etcd)."""
    if not config.etcd3_user:
        return None
    if config.etcd3_secret:
        from realrl.base import trial_secret

        return trial_secret.load_keys(config.etcd3_secret).etcd_password
    password = os.environ.get(ETCD3_PASSWORD_ENV)
    if not password:
        raise ValueError(f"name_resolve.etcd3_user={config.etcd3_user!r} needs a password: set {ETCD3_PASSWORD_ENV}")
    return password


def make_repository(config: NameResolveConfig) -> NameRecordRepository:
    config.validate()
    if config.type == "memory":
        return MemoryNameRecordRepository()
    if config.type == "file":
        return FileNameRecordRepository(config.file_root)
    if not config.etcd3_addr:
        raise ValueError("name_resolve.etcd3_addr is empty: start etcd first (the local launcher does)")
    return Etcd3NameRecordRepository(config.etcd3_addr, config.etcd3_user, etcd3_password(config))


def config_from_env() -> NameResolveConfig:
    """REALRL_NAME_RESOLVE_TYPE / _ETCD3_ADDR / _FILE_ROOT, default memory."""
    return NameResolveConfig(
        type=os.environ.get("REALRL_NAME_RESOLVE_TYPE", "memory"),
        etcd3_addr=os.environ.get("REALRL_NAME_RESOLVE_ETCD3_ADDR", ""),
        etcd3_user=os.environ.get("REALRL_NAME_RESOLVE_ETCD3_USER", ""),
        etcd3_secret=os.environ.get("REALRL_NAME_RESOLVE_ETCD3_SECRET", ""),
        file_root=os.environ.get("REALRL_NAME_RESOLVE_FILE_ROOT", ""),
    )


def config_to_env(config: NameResolveConfig) -> dict[str, str]:
    """The environment that makes a child process's default repository `config`."""
    return {
        "REALRL_NAME_RESOLVE_TYPE": config.type,
        "REALRL_NAME_RESOLVE_ETCD3_ADDR": config.etcd3_addr,
        "REALRL_NAME_RESOLVE_ETCD3_USER": config.etcd3_user,
        "REALRL_NAME_RESOLVE_ETCD3_SECRET": config.etcd3_secret,
        "REALRL_NAME_RESOLVE_FILE_ROOT": config.file_root,
    }


_default: NameRecordRepository | None = None
_default_lock = threading.Lock()


def default_repository() -> NameRecordRepository:
    global _default
    with _default_lock:
        if _default is None:
            _default = make_repository(config_from_env())
        return _default


def reconfigure(config: NameResolveConfig, close_old: bool = True) -> NameRecordRepository:
    """Switch this process's repository (the old one is reset and closed,
    unless `close_old` is false: its owner closes it)."""
    global _default
    new = make_repository(config)
    with _default_lock:
        old, _default = _default, new
    if old is not None and close_old:
        old.close()
    return new


def release(repository: NameRecordRepository) -> None:
    """Closes `repository` (its keys with delete_on_exit go), and if it is
    still this process's default, makes an empty in-memory one the default."""
    global _default
    with _default_lock:
        if _default is repository:
            _default = MemoryNameRecordRepository()
    repository.close()


def add(
    name: str, value: str, keepalive_ttl: float | None = None, replace: bool = False, delete_on_exit: bool = True
) -> None:
    default_repository().add(name, value, keepalive_ttl=keepalive_ttl, replace=replace, delete_on_exit=delete_on_exit)


def add_subentry(name: str, value: str, **kwargs) -> str:
    return default_repository().add_subentry(name, value, **kwargs)


def get(name: str) -> str:
    return default_repository().get(name)


def delete(name: str) -> None:
    default_repository().delete(name)


def find_subtree(name_root: str) -> list[str]:
    return default_repository().find_subtree(name_root)


def get_subtree(name_root: str) -> list[str]:
    return default_repository().get_subtree(name_root)


def items_subtree(name_root: str) -> dict[str, str]:
    return default_repository().items_subtree(name_root)


def clear_subtree(name_root: str) -> None:
    default_repository().clear_subtree(name_root)


def wait(name: str, timeout: float | None = None, poll_frequency: float = 0.05) -> str:
    return default_repository().wait(name, timeout=timeout, poll_frequency=poll_frequency)


def watch_values(names: Iterable[str], poll_interval: float = 0.5) -> ValueWatch:
    return default_repository().watch_values(names, poll_interval)


def reset() -> None:
    default_repository().reset()


def watch_names(
    names: str | Iterable[str],
    call_back: Callable[[], None],
    poll_frequency: float = 0.5,
    repository: NameRecordRepository | None = None,
) -> threading.Thread:
    """Calls `call_back()` once, from a daemon thread, when every key in
    `names` has disappeared (e.g. workers exit when the launcher's keep-alive
    key expires). Backend errors count as "still there" for a grace period of
    10 polls, then as gone: an unreachable name service means the trial is over.
    """
    keys = [validate_name(n) for n in ([names] if isinstance(names, str) else names)]
    repo = repository or default_repository()

    def loop() -> None:
        failures = 0
        reader: NameRecordRepository | ValueWatch = repo
        try:  # (etcd: the keys' changes pushed, so a poll reads nothing)
            reader = repo.watch_values(keys, poll_frequency)
        except Exception as e:  # the name service not answering now: read each poll, as the loop says
            logger.debug("watch_names: no watch (%s): reading", e)
        while True:
            present = False
            try:
                for key in keys:
                    try:
                        reader.get(key)
                        present = True
                        break
                    except NameEntryNotFoundError:
                        pass
                failures = 0
            except Exception as e:
                failures += 1
                present = failures < 10
                logger.warning("watch_names: backend error (%d): %s", failures, e)
            if not present:
                if isinstance(reader, ValueWatch):
                    reader.close()
                call_back()
                return
            time.sleep(poll_frequency)

    thread = threading.Thread(target=loop, name="name_resolve-watch", daemon=True)
    thread.start()
    return thread
