"""The trial secret and the keys derived from it (docs/design.md §14).

The launcher creates 32 random bytes in `<fileroot>/run/<exp>/<trial>/secret`
(mode 0600, written atomically) before anything else of the trial; a resumed
trial keeps its file. Every worker reads the file its spec names
(`WorkerInfo.secret_path`) and installs the keys for its process
(`install`); the secret itself goes nowhere else: not in etcd, a command
line, a log or the stats.

Each use has its own key, derived with HKDF-SHA256 (RFC 5869) under its own
label, so a key that leaks (an HTTP API key in a server's config file, say)
gives nothing of the others.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import stat

SECRET_BYTES = 32
SECRET_FILE = "secret"


class SecretError(RuntimeError):
    """The secret file is missing, of the wrong size, or readable by others."""


def hkdf_sha256(secret: bytes, info: bytes, length: int = 32, salt: bytes = b"") -> bytes:
    """RFC 5869 HKDF with SHA-256: extract, then expand to `length` bytes."""
    prk = hmac.new(salt or bytes(hashlib.sha256().digest_size), secret, hashlib.sha256).digest()
    out, block, counter = b"", b"", 1
    while len(out) < length:
        block = hmac.new(prk, block + info + bytes([counter]), hashlib.sha256).digest()
        out += block
        counter += 1
    return out[:length]


@dataclasses.dataclass(frozen=True)
class TrialKeys:
    """The keys of one trial, one per use."""

    http_api_key: str  # `Authorization: Bearer <it>` on every HTTP hop (hex)
    stream_mac_key: bytes  # the trajectory stream's per-message seal
    control_key: bytes  # the master <-> worker request-reply stream
    etcd_password: str  # the private etcd's root user (hex)
    weights_group_key: bytes  # seals the store of a weight broadcast group (docs/design.md §8)

    @staticmethod
    def from_secret(secret: bytes) -> TrialKeys:
        def key(label: str) -> bytes:
            return hkdf_sha256(secret, b"realrl/" + label.encode())

        return TrialKeys(
            http_api_key=key("http-api-key").hex(),
            stream_mac_key=key("stream-mac"),
            control_key=key("control"),
            etcd_password=key("etcd-password").hex(),
            weights_group_key=key("weights-group"),
        )

    def __repr__(self) -> str:  # never print a key
        return "TrialKeys(<hidden>)"


def secret_path(run_dir: str) -> str:
    return os.path.join(run_dir, SECRET_FILE)


def ensure_secret(run_dir: str) -> str:
    """The trial's secret file under `run_dir`: kept when it exists (a resume),
    else created with fresh random bytes. Returns its path."""
    path = secret_path(run_dir)
    if os.path.exists(path):
        read_secret(path)  # a damaged or exposed file stops the launch here, not in every worker
        return path
    os.makedirs(run_dir, exist_ok=True)
    write_private(path, os.urandom(SECRET_BYTES))
    return path


def write_private(path: str, data: bytes) -> None:
    """Writes `path` atomically with mode 0600 from its creation: its bytes are
    never readable by others, not even for a moment, and a reader sees no file
    or the whole one."""
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_secret(path: str) -> bytes:
    """The secret's bytes; SecretError when the file is not a private 32-byte file."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError as e:
        raise SecretError(f"cannot read the trial secret {path}: {e.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise SecretError(f"the trial secret {path} is readable by others (mode {oct(mode & 0o777)}; want 0600)")
        data = f.read(SECRET_BYTES + 1)
    if len(data) != SECRET_BYTES:
        raise SecretError(f"the trial secret {path} holds {len(data)} bytes, not {SECRET_BYTES}")
    return data


def load_keys(path: str) -> TrialKeys:
    return TrialKeys.from_secret(read_secret(path))


# ---- this process's keys --------------------------------------------------------
_keys: TrialKeys | None = None
_path = ""


def install(path: str) -> TrialKeys | None:
    """Reads the secret at `path` and makes its keys this process's (every
    client and server here uses them); "" = security off, no keys."""
    global _keys, _path
    _keys = load_keys(path) if path else None
    _path = path
    return _keys


def current() -> TrialKeys | None:
    """This process's keys (None: security off, or none installed)."""
    return _keys


def installed_path() -> str:
    """The secret file this process's keys come from ("" when none)."""
    return _path


def http_api_key() -> str | None:
    """The key this process's HTTP servers demand and its clients send (None: security off)."""
    return _keys.http_api_key if _keys is not None else None


def http_headers() -> dict[str, str]:
    """What every HTTP request of this process carries (nothing when security is off)."""
    return {"Authorization": f"Bearer {_keys.http_api_key}"} if _keys is not None else {}
