"""A real two-node Ray cluster on this machine, for tests: each "node" is a
network namespace of its own (a veth pair between them, addresses from
TEST-NET-1 that exist only inside these namespaces), with `ray start` run in
each. Ray listens on its node's address, never on the machine's own.

Needs root (`ip netns`). Everything it started is ended by namespace (`ip
netns pids`): the processes in a namespace this test made are its own, so
nothing else on the machine is touched."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid

HEAD_IP, WORKER_IP = "192.0.2.1", "192.0.2.2"
RAY_PORT = 6379
RAY = os.path.join(os.path.dirname(sys.executable), "ray")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


class TwoNodeRayCluster:
    def __init__(self, log_dir: str, cpus: tuple[int, int] = (2, 2)):
        """`cpus`: the CPUs Ray counts on the head and on the other node."""
        tag = uuid.uuid4().hex[:6]
        self.namespaces = {HEAD_IP: f"rrh{tag}", WORKER_IP: f"rrw{tag}"}
        self.veths = (f"vh{tag}", f"vw{tag}")
        self.temp_dirs = {ip: f"/tmp/rr{tag}{i}" for i, ip in enumerate(self.namespaces)}  # short: unix socket paths
        self.log_dir = log_dir
        self.cpus = dict(zip((HEAD_IP, WORKER_IP), cpus))
        self.address = f"{HEAD_IP}:{RAY_PORT}"
        self._starters: list[subprocess.Popen] = []
        self.lost_nodes: set[str] = set()  # nodes kill_raylet dropped (the cluster is not whole any more)

    # ---- life cycle ------------------------------------------------------------
    def __enter__(self) -> TwoNodeRayCluster:
        try:
            self._make_network()
            self._start_node(HEAD_IP, ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"])
            self._wait_for_nodes(1)
            self._start_node(WORKER_IP, [f"--address={self.address}"])
            self._wait_for_nodes(2)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _make_network(self) -> None:
        head_ns, worker_ns = self.namespaces[HEAD_IP], self.namespaces[WORKER_IP]
        _ip("netns", "add", head_ns)
        _ip("netns", "add", worker_ns)
        _ip("link", "add", self.veths[0], "type", "veth", "peer", "name", self.veths[1])
        for veth, ns, ip in ((self.veths[0], head_ns, HEAD_IP), (self.veths[1], worker_ns, WORKER_IP)):
            _ip("link", "set", veth, "netns", ns)
            _ip("-n", ns, "addr", "add", f"{ip}/24", "dev", veth)
            _ip("-n", ns, "link", "set", veth, "up")
            _ip("-n", ns, "link", "set", "lo", "up")

    def _start_node(self, ip: str, args: list[str]) -> None:
        os.makedirs(self.log_dir, exist_ok=True)
        with open(os.path.join(self.log_dir, f"ray-{ip}.log"), "ab") as log:
            self._starters.append(
                subprocess.Popen(
                    [
                        "ip",
                        "netns",
                        "exec",
                        self.namespaces[ip],
                        RAY,
                        "start",
                        *args,
                        f"--node-ip-address={ip}",
                        f"--num-cpus={self.cpus[ip]}",
                        "--num-gpus=0",
                        "--object-store-memory=100000000",
                        f"--temp-dir={self.temp_dirs[ip]}",
                        "--disable-usage-stats",
                        "--block",
                    ],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )

    def _wait_for_nodes(self, n: int, timeout: float = 120.0) -> None:
        check = (
            f"import ray; ray.init(address={self.address!r}, logging_level='ERROR'); "
            "print(sum(1 for x in ray.nodes() if x['Alive']))"
        )
        deadline = time.monotonic() + timeout
        while True:
            out = self.run_on_head([sys.executable, "-c", check], capture_output=True, text=True, timeout=60)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(n)]:
                return
            if time.monotonic() > deadline:  # a hang guard
                raise TimeoutError(f"the Ray cluster did not reach {n} nodes: {out.stderr[-2000:]}")
            for starter in self._starters:
                if starter.poll() is not None:
                    raise RuntimeError(f"`ray start` exited with {starter.returncode}; see {self.log_dir}")
            time.sleep(1.0)

    def root_pids(self) -> list[int]:
        """The `ray start` processes: every process of the cluster descends from one of them."""
        return [starter.pid for starter in self._starters]

    def run_on_head(self, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        """Runs `cmd` inside the head node's namespace (as a user on that node)."""
        return subprocess.run(["ip", "netns", "exec", self.namespaces[HEAD_IP], *cmd], **kwargs)

    def popen_on_head(self, cmd: list[str], **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespaces[HEAD_IP], *cmd], **kwargs)

    def processes(self, ip: str) -> list[tuple[int, str]]:
        """(pid, command line) of every process in that node's namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[ip]], capture_output=True, text=True)
        found = []
        for pid in out.stdout.split():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found.append((int(pid), f.read().replace(b"\0", b" ").decode(errors="replace")))
            except OSError:
                pass
        return found

    def kill_raylet(self, ip: str) -> None:
        """SIGKILLs the raylet of a node: Ray loses the node, as when its
        machine drops off the network, while the node's other processes are
        left to notice by themselves."""
        (pid,) = [pid for pid, cmd in self.processes(ip) if cmd.split(" ", 1)[0].endswith("/raylet")]
        self.lost_nodes.add(ip)
        os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for ip in self.namespaces:
                for pid, _ in self.processes(ip):
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(self.processes(ip) for ip in self.namespaces):
                time.sleep(0.1)
        for starter in self._starters:
            try:
                starter.wait(timeout=5)
            except subprocess.TimeoutExpired:
                starter.kill()
                starter.wait()
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # also removes the veth pair
        for d in self.temp_dirs.values():
            shutil.rmtree(d, ignore_errors=True)
