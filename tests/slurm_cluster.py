"""A real one-node Slurm cluster on this machine, for tests.

Debian's `slurm-wlm` and `munge` packages (installed by `ensure_installed`
when missing, as root with apt-get) run from a temporary directory of the
test's own: a munged with its own key and socket, a slurmctld and a slurmd
in the foreground (`-D`) with their own config (`SLURM_CONF`), state, spool,
pid and log files, on 127.0.0.1 and free ports. Clients (sbatch, srun,
scontrol, ...) find this cluster through `SLURM_CONF` in `env`.

What works in a container (gVisor, no systemd, no usable cgroups) and why:
* `ProctrackType=proctrack/linuxproc`: tracks a job's processes by parent
  pid, so `scancel` and the end of a job reach every descendant (workers run
  in sessions of their own; proctrack/pgid would lose them); no cgroup.
* `TaskPlugin=task/none`, `JobAcctGatherType=jobacct_gather/none`,
  `AccountingStorageType=accounting_storage/none` (no slurmdbd: `sacct` has
  nothing; the launcher reads the exit code from its file and `scontrol`).
* `SelectType=select/cons_tres` with `CR_Core_Memory`, as on real clusters
  (memory is a consumable: the launcher's `--overlap --mem=0` steps must
  still start side by side).
* `CommunicationParameters=NoInAddrAny,NoCtldInAddrAny`: slurmctld, slurmd and
  srun bind the node's address (127.0.0.1, "localhost"), not every interface.
  `SlurmctldHost` and the node are both named `localhost`, which slurmctld
  and slurmd (`-N localhost`) accept whatever the machine's hostname is.
* `SlurmUser=root`, `SlurmdUser=root`, `ReturnToService=2`, `MpiDefault=none`
  (the pmix plugin's load errors in the logs are harmless), `KillWait=5`.
* munged runs with `--force` (as root) and a key, socket, pid and seed file
  under the cluster's directory (0711, so clients reach the socket);
  `AuthInfo=socket=...` points Slurm at it.

Everything the cluster ran is ended by PID: the three daemons (its own
children), then any process whose environment names this cluster's
`SLURM_CONF` (slurmstepd and job processes, which Slurm detaches) - nothing
else on the machine is touched. Needs root (slurmd runs jobs as root here).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

NODE = "localhost"
PARTITION = "debug"
_PACKAGES = ("slurm-wlm", "munge")
_DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun")


def missing_tools() -> list[str]:
    return [t for t in _DAEMONS if shutil.which(t) is None and not os.path.exists(f"/usr/sbin/{t}")]


def ensure_installed() -> str | None:
    """Installs slurm-wlm and munge when missing; None when ready, else why not."""
    if not missing_tools():
        return None
    if os.geteuid() != 0:
        return f"Slurm is not installed ({', '.join(missing_tools())} missing) and only root can apt-get install it"
    if shutil.which("apt-get") is None:
        return "Slurm is not installed and this machine has no apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *_PACKAGES]
    out = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:  # the package lists may be missing or stale
        subprocess.run(["apt-get", "update", "-q"], capture_output=True, text=True, env=env, timeout=900)
        out = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0 or missing_tools():
        raise RuntimeError(f"apt-get install {' '.join(_PACKAGES)} failed: {out.stderr[-2000:]}")
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    def __init__(self, root: str, cpus: int | None = None, memory_mb: int = 8000):
        self.root = os.path.abspath(root)
        self.cpus = cpus or os.cpu_count() or 1
        self.memory_mb = memory_mb
        self.conf = os.path.join(self.root, "slurm.conf")
        self.munge_dir = os.path.join(self.root, "munge")
        self.munge_socket = os.path.join(self.munge_dir, "munge.sock")
        self.spool = os.path.join(self.root, "spool")
        self.log_dir = os.path.join(self.root, "log")
        self.env = dict(os.environ, SLURM_CONF=self.conf)
        self._daemons: list[tuple[str, subprocess.Popen]] = []

    # ---- life cycle ------------------------------------------------------------
    def __enter__(self) -> SlurmCluster:
        try:
            self._write_config()
            self._start_munge()
            self._start("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", self.conf])
            self._start("slurmd", [_sbin("slurmd"), "-D", "-N", NODE, "-f", self.conf])
            self._wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _write_config(self) -> None:
        for d in (self.root, self.spool, self.log_dir, os.path.join(self.root, "state")):
            os.makedirs(d, exist_ok=True)
        os.makedirs(self.munge_dir, mode=0o711, exist_ok=True)
        os.chmod(self.munge_dir, 0o711)
        key = os.path.join(self.munge_dir, "munge.key")
        with open(key, "wb") as f:
            f.write(os.urandom(1024))
        os.chmod(key, 0o400)
        r = self.root
        lines = [
            "ClusterName=realrltest",
            f"SlurmctldHost={NODE}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "CredType=cred/munge",
            "CommunicationParameters=NoInAddrAny,NoCtldInAddrAny",
            f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={self.spool}",
            f"SlurmctldPidFile={r}/slurmctld.pid",
            f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={self.log_dir}/slurmctld.log",
            f"SlurmdLogFile={self.log_dir}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "KillWait=5",
            "MinJobAge=600",
            "MailProg=/bin/true",
            f"NodeName={NODE} NodeAddr=127.0.0.1 CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN",
            f"PartitionName={PARTITION} Nodes={NODE} Default=YES MaxTime=INFINITE State=UP",
        ]
        with open(self.conf, "w") as f:
            f.write("\n".join(lines) + "\n")

    def _start_munge(self) -> None:
        d = self.munge_dir
        self._start(
            "munged",
            [
                _sbin("munged"),
                "--foreground",
                "--force",
                f"--socket={self.munge_socket}",
                f"--key-file={d}/munge.key",
                f"--log-file={d}/munged.log",
                f"--pid-file={d}/munged.pid",
                f"--seed-file={d}/munged.seed",
            ],
        )
        deadline = time.monotonic() + 30
        while not os.path.exists(self.munge_socket):
            self._check_daemons()
            if time.monotonic() > deadline:  # a hang guard
                raise TimeoutError(f"munged did not create {self.munge_socket}")
            time.sleep(0.05)

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(os.path.join(self.log_dir, f"{name}.out"), "ab")
        with log:
            self._daemons.append(
                (
                    name,
                    subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=self.env),
                )
            )

    def _check_daemons(self) -> None:
        for name, proc in self._daemons:
            if proc.poll() is not None:
                tail = open(os.path.join(self.log_dir, f"{name}.out"), errors="replace").read()[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}: {tail}")

    def _wait_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            out = self.run(["sinfo", "-h", "-n", NODE, "-o", "%t"])
            if out.returncode == 0 and out.stdout.strip() == "idle":
                return
            self._check_daemons()
            if time.monotonic() > deadline:  # a hang guard
                raise TimeoutError(f"the Slurm node never became idle: {out.stdout} {out.stderr}")
            time.sleep(0.2)

    # ---- use -----------------------------------------------------------------
    def run(self, cmd: list[str], timeout: float = 60, **kwargs) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(
            cmd, capture_output=True, text=True, env=self.env, timeout=timeout, stdin=subprocess.DEVNULL, **kwargs
        )

    def jobs(self) -> list[str]:
        """Ids of the jobs this cluster still has queued, running or completing."""
        out = self.run(["squeue", "-h", "-o", "%i"])
        return out.stdout.split()

    def job_processes(self) -> list[tuple[int, str]]:
        """(pid, command line) of every process this cluster started for jobs:
        those whose environment names its SLURM_CONF, less its daemons."""
        daemons = {p.pid for _, p in self._daemons}
        marker = f"SLURM_CONF={self.conf}".encode()
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in daemons or int(entry) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if marker not in f.read().split(b"\0"):
                        continue
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
                with open(f"/proc/{entry}/stat") as f:
                    state, ppid = f.read().rsplit(") ", 1)[1].split()[:2]
                if state == "Z" or int(ppid) in daemons:  # (slurmctld's own helper, slurmscriptd)
                    continue
            except (OSError, IndexError):
                continue
            found.append((int(entry), cmd))
        return found

    def stop(self) -> None:
        # Jobs first (Slurm ends their processes), then the daemons, then
        # whatever of ours Slurm left (by PID, found by this cluster's SLURM_CONF).
        if any(name == "slurmctld" and p.poll() is None for name, p in self._daemons):
            self.run(["scancel", "--quiet", "--full", "--user", str(os.getuid())], timeout=30)
            deadline = time.monotonic() + 30
            while self.jobs() and time.monotonic() < deadline:
                time.sleep(0.2)
        for name, proc in reversed(self._daemons):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid, _ in self.job_processes():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + 5
            while self.job_processes() and time.monotonic() < deadline:
                time.sleep(0.1)
