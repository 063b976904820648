"""Slurm launcher: the whole trial as one batch job (`mode=slurm`).

(Over 700 lines on purpose: one job's two ends, submitting it from
outside and launching the workers inside, share its names, paths and config
file, and read best as the one story below; its sections are placement, the
batch script, submitting and following, and the launcher inside.)

Outside the allocation (a login node), `submit_trial` is what
`realrl train mode=slurm slurm.nodes=N ...` runs after the config checks:

1. checks that `allocation_mode` fits `slurm.nodes` x `slurm.gpus_per_node`
   (`plan_placement` on placeholder nodes), that `sbatch` exists and that the
   trial is not already queued or running (a job of the same name, or a
   launcher holding the trial's lock): each a one-line error, exit 2, before
   anything is submitted;
2. writes the resolved config (`<log_dir>/slurm/trial.yaml`) and ONE batch
   script (`<log_dir>/slurm/trial.sbatch`, see `batch_script`); with
   `slurm.dry_run=true` it prints the script and stops there;
3. submits it with `sbatch --parsable`, prints the job id and follows the job:
   it copies the job's output (`<log_dir>/slurm/job-<id>.out`: the launcher's
   messages and the master's progress) to the console until the job ends,
   and returns the trial's exit code (`job-<id>.exit`, written by the
   launcher inside; else the job's state and ExitCode from `scontrol`).
   Ctrl-C (or SIGTERM) cancels the job with `scancel` and follows it to its
   end; exit 130. A job cancelled from outside (`scancel`) also ends it, 130.

Inside the allocation the batch script runs
`python -m realrl train --slurm-job <trial.yaml>` on the first node, which
runs the usual `run_experiment` with `SlurmLauncher`: the local launcher
(one launcher per trial, private etcd, keep-alive key, watching, a failed
worker's traceback tail, teardown) with these hooks changed:

* **Placement** (`plan_placement`), before anything starts: trainers on the
  first nodes, one GPU per rank; generation servers (tensor-parallel GPUs on
  one node) on the nodes after them when the allocation has enough nodes for
  both, otherwise on the GPUs left over, then sharing GPUs round-robin (a
  warning says so) as local mode does; CPU workers round-robin over their
  side's nodes; the master and the manager on the first node, rollout workers
  round-robin over the generation nodes.
* **One `srun` step per worker**: `srun --nodes=1 --ntasks=1
  --nodelist=<node> --overlap --mem=0 --cpus-per-task=<node's CPUs>
  --output=<worker log> python -m realrl.system.worker_base --spec F`. A
  per-worker step maps one-to-one onto `WorkerProcess`: the step's srun is a
  local child whose exit status is the worker's, so watching, failure
  reports (srun's "task 0: Killed" line names the node) and teardown are the
  local launcher's. Steps overlap (`--overlap`): every worker of a node shares
  the node's CPUs and memory as processes of one machine do. A step gets the
  job's GPUs on its node (Slurm's default for a step that asks for no GRES;
  `--overlap` shares them), and a worker with GPUs runs through
  `exec-worker`, which keeps only its own positions among the GPUs Slurm made
  visible (`CUDA_VISIBLE_DEVICES`) and execs the worker. A graceful stop signals the
  step's task (`scancel --signal=TERM <job>.<step>`; a signal to srun itself
  would kill the step at once); SIGKILL ends the step (`scancel
  --signal=KILL`) and its srun.
* **Addresses and files**: every worker binds its node's `NodeAddr`
  (`bind_address` overrides); the private etcd listens on the first node's.
  Before the trial, one step per node writes and reads a probe under
  `fileroot`; a node that cannot is a one-line config error naming it.

`scancel` (or Ctrl-C outside) sends SIGTERM to every process of the job: the
launcher sets ABORTED and stops the workers, and Slurm SIGKILLs whatever is
left after its KillWait, so no process of the trial outlives the job on any
node. A SIGKILLed launcher ends the batch step and with it the job (and the
workers see its keep-alive key expire). With `recover=auto` the job is
submitted with `--requeue`: when Slurm requeues it (node failure,
preemption), the trial resumes from its last checkpoint; re-running the same
command with `recover=auto` resumes as in local mode.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable

from realrl.api.cli_args import AsyncPPOConfig, ConfigError
from realrl.api.system_api import WorkerInfo
from realrl.base.logging import getLogger
from realrl.base.process import log_tail, signal_tree
from realrl.launcher.local import LocalLauncher, TrialAlreadyRunning, WorkerGroup, WorkerProcess, worker_command
from realrl.launcher.ray import Demand, demands_of

logger = getLogger("launcher.slurm")

INSIDE_ENV = "REALRL_SLURM_INSIDE"  # set (to the job id) by run_inside_job: run_experiment launches, not submits
# The directory holding this realrl package: the job imports the same copy (a
# checkout, a virtualenv's site-packages or a `pip install --target` folder).
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_TERMINAL_STATES = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
    "REVOKED",
    "SPECIAL_EXIT",
}
_REQUEUED_STATES = {"NODE_FAIL", "PREEMPTED"}  # with --requeue, Slurm starts these again
_CMD_TIMEOUT_S = 60.0  # one squeue/scontrol/scancel call
_EXIT_FILE_GRACE_S = 5.0  # how long a job's exit file may take to appear after it ends (shared file systems)


# ---- placement ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Slot:
    node: str
    gpus: tuple[int, ...] = ()  # positions among the node's GPUs in the job


def plan_placement(
    nodes: list[str], gpus_per_node: int, demands: list[Demand]
) -> tuple[dict[tuple[str, int], Slot], list[str]]:
    """The node (and GPU positions) of every worker, keyed by (worker_type,
    index), and warnings to show. `nodes` in allocation order: the first one
    runs the batch script. Raises ConfigError when something cannot fit."""
    if not nodes:
        raise ConfigError("slurm.nodes: the allocation has no node")
    n_nodes, per_node = len(nodes), gpus_per_node
    trainers = [d for d in demands if d.worker_type == "model_worker"]
    servers = [d for d in demands if d.worker_type == "generation_server"]
    for d in trainers + servers:
        if d.gpus and not per_node:
            key = "train.device" if d.worker_type == "model_worker" else "allocation_mode"
            raise ConfigError(
                f"slurm.gpus_per_node: {d.worker_type} needs {d.gpus} GPU(s) ({key}) and the job "
                "requests none; set slurm.gpus_per_node"
            )
        if d.gpus > per_node:
            raise ConfigError(
                f"allocation_mode: a generation server needs {d.gpus} GPUs on one node (tensor "
                f"parallelism), slurm.gpus_per_node={per_node}"
            )
    train_gpus = sum(d.gpus for d in trainers)
    if train_gpus > n_nodes * per_node:
        raise ConfigError(
            f"allocation_mode: {len(trainers)} trainer ranks need {train_gpus} GPUs (one each for NCCL), "
            f"the job has {n_nodes * per_node} (slurm.nodes={n_nodes} x slurm.gpus_per_node={per_node})"
        )

    def nodes_needed(ds: list[Demand]) -> int:
        if not ds:
            return 0
        g = max(d.gpus for d in ds)
        return 1 if g == 0 else -(-len(ds) // (per_node // g))

    n_train, n_gen = nodes_needed(trainers), nodes_needed(servers)
    separate = n_train > 0 and n_gen > 0 and n_train + n_gen <= n_nodes
    train_nodes = nodes[:n_train] if separate else nodes
    gen_nodes = nodes[n_train:] if separate else nodes
    plan: dict[tuple[str, int], Slot] = {}
    free = {n: list(range(per_node)) for n in nodes}
    notes: list[str] = []

    def take(d: Demand, candidates: list[str], pool: dict[str, list[int]]) -> Slot | None:
        for n in candidates:
            if len(pool[n]) >= d.gpus:
                got = tuple(pool[n][: d.gpus])
                del pool[n][: d.gpus]
                return Slot(n, got)
        return None

    for i, d in enumerate(trainers):
        slot = take(d, train_nodes, free) if d.gpus else Slot(train_nodes[i % len(train_nodes)])
        assert slot is not None  # checked above: every rank has a GPU of its own
        plan[(d.worker_type, d.index)] = slot
    shared = False
    for i, d in enumerate(servers):
        if not d.gpus:
            plan[(d.worker_type, d.index)] = Slot(gen_nodes[i % len(gen_nodes)])
            continue
        slot = take(d, gen_nodes, free)
        if slot is None:  # no free GPUs left: start again from the first ones (shared)
            shared = True
            free = {n: list(range(per_node)) for n in nodes}
            slot = take(d, gen_nodes, free)
        plan[(d.worker_type, d.index)] = slot
    if shared:
        notes.append(
            f"{len(nodes) * per_node} GPUs for {sum(d.gpus for d in servers)} generation GPUs + {train_gpus} "
            "trainer GPUs: generation servers share GPUs"
        )
    rollout_index = 0
    for d in demands:
        key = (d.worker_type, d.index)
        if key in plan:
            continue
        if d.worker_type == "rollout_worker":
            plan[key] = Slot(gen_nodes[rollout_index % len(gen_nodes)])
            rollout_index += 1
        else:  # master, manager, other light workers: on the batch script's node
            plan[key] = Slot(nodes[0])
    return plan, notes


# ---- the batch script (outside) -----------------------------------------------------


def job_name(cfg: AsyncPPOConfig) -> str:
    return cfg.slurm.job_name or f"realrl-{cfg.experiment_name}-{cfg.trial_name}"


def slurm_dir(log_dir: str) -> str:
    """Where the script, the resolved config and the job's output live."""
    return os.path.join(log_dir, "slurm")


def _directive_value(value: str) -> str:
    """A value on an #SBATCH line: quoted when it has spaces (sbatch reads
    quotes there; the shell does not see these lines)."""
    if re.fullmatch(r"[A-Za-z0-9_./:%@+=,\-]+", value):
        return value
    if '"' in value or "\n" in value:
        raise ConfigError(f"fileroot: {value!r} cannot be written on an #SBATCH line")
    return f'"{value}"'


def sbatch_options(cfg: AsyncPPOConfig, log_dir: str, workdir: str) -> list[str]:
    """The script's #SBATCH options, in order (docs/slurm.md maps each to its key)."""
    s = cfg.slurm
    opts = [f"--job-name={job_name(cfg)}", f"--nodes={s.nodes}", "--ntasks-per-node=1"]
    opts.append(f"--cpus-per-task={s.cpus_per_node}" if s.cpus_per_node else "--exclusive")
    if s.gpus_per_node:
        opts.append(f"--gpus-per-node={s.gpus_per_node}")
    for flag, value in (
        ("--mem", s.mem),
        ("--time", s.time),
        ("--partition", s.partition),
        ("--account", s.account),
        ("--qos", s.qos),
        ("--constraint", s.constraint),
    ):
        if value:
            opts.append(f"{flag}={value}")
    opts += [
        f"--output={_directive_value(os.path.join(slurm_dir(log_dir), 'job-%j.out'))}",
        "--open-mode=append",  # a requeued job keeps its first attempt's output
        f"--chdir={_directive_value(workdir)}",
        "--requeue" if cfg.recover == "auto" else "--no-requeue",
    ]
    return opts + list(s.sbatch_args)


def batch_script(
    cfg: AsyncPPOConfig,
    log_dir: str,
    config_path: str,
    workdir: str,
    python: str = sys.executable,
    package_parent: str = PACKAGE_PARENT,
) -> str:
    """The one batch script of a trial: #SBATCH options, the user's
    `slurm.setup` lines, then the launcher on the first node of the job
    (`realrl train` on the resolved config, from the package itself)."""
    lines = [
        "#!/bin/bash",
        f"# realrl trial {cfg.experiment_name}/{cfg.trial_name} (mode=slurm): runs the launcher on the first node;",
        "# it starts every worker as an srun step on its node (docs/slurm.md).",
        *(f"#SBATCH {opt}" for opt in sbatch_options(cfg, log_dir, workdir)),
        "",
        "export PYTHONUNBUFFERED=1",
        f"export PYTHONPATH={shlex.quote(package_parent)}${{PYTHONPATH:+:$PYTHONPATH}}",
        *cfg.slurm.setup,
        f"exec {shlex.quote(python)} -m realrl train --slurm-job {shlex.quote(config_path)}",
        "",
    ]
    return "\n".join(lines)


def dump_config(cfg: AsyncPPOConfig) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def load_config(path: str) -> AsyncPPOConfig:
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(AsyncPPOConfig), OmegaConf.load(path)))


# ---- submitting and following (outside) -----------------------------------------------


class TrialJobQueued(TrialAlreadyRunning):
    """A job of this trial is already queued or running; nothing was submitted."""

    def __init__(self, experiment_name: str, trial_name: str, job_id: str) -> None:
        RuntimeError.__init__(
            self,
            f"trial {experiment_name}/{trial_name} already queued or running as slurm job {job_id}; leaving it alone",
        )
        self.pid = job_id


def _run(cmd: list[str], timeout: float = _CMD_TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def submit_trial(cfg: AsyncPPOConfig, log_dir: str, summary_path: str) -> tuple[int, str]:
    """Submits the trial as one batch job and (with slurm.follow) follows it.
    Returns (exit code, summary path or "" when nothing ran here)."""
    from realrl.api.cli_args import parse_allocation_mode

    s = cfg.slurm
    alloc = parse_allocation_mode(cfg.allocation_mode)
    gen_on_gpu = alloc.gen_backend in ("sglang", "vllm") or cfg.server.torch.device == "cuda"
    groups = [
        WorkerGroup("model_worker", alloc.train.dp, gpus_per_worker=int(cfg.train.device == "cuda")),
        WorkerGroup("generation_server", alloc.gen.dp, gpus_per_worker=alloc.gen.tp if gen_on_gpu else 0),
    ]
    plan_placement(
        [f"node{i}" for i in range(s.nodes)], s.gpus_per_node, demands_of(groups)
    )  # raises when it cannot fit
    if not s.dry_run:
        for tool in ("sbatch", "squeue", "scontrol", "scancel"):
            if shutil.which(tool) is None:
                raise ConfigError(
                    f"mode: slurm submits the trial with Slurm's {tool}, which is not on PATH; run this on "
                    "a node of the Slurm cluster (slurm.dry_run=true prints the batch script)"
                )
        _check_not_queued(cfg)
    directory = slurm_dir(log_dir)
    os.makedirs(directory, exist_ok=True)
    config_path = os.path.join(directory, "trial.yaml")
    script_path = os.path.join(directory, "trial.sbatch")
    script = batch_script(cfg, log_dir, config_path, os.getcwd())
    resolved = dataclasses.replace(
        cfg, fileroot=os.path.abspath(cfg.fileroot), slurm=dataclasses.replace(s, dry_run=False)
    )
    with open(config_path, "w") as f:
        f.write(dump_config(resolved))
    with open(script_path, "w") as f:
        f.write(script)
    if s.dry_run:
        sys.stdout.write(script)
        sys.stdout.flush()
        _say(f"realrl: dry run: wrote {script_path} (submit it with `sbatch {script_path}`)")
        return 0, ""
    # One launcher per trial: a local one holding the lock is found here too.
    probe = LocalLauncher(
        cfg.experiment_name, cfg.trial_name, cfg.fileroot, cfg.name_resolve, security=cfg.security.enabled
    )
    probe.acquire_trial()
    probe.release_trial()
    out = _run(["sbatch", "--parsable", script_path])
    if out.returncode != 0:
        raise ConfigError(
            f"slurm: sbatch refused the job: {_first_line(out.stderr) or out.returncode} (script: {script_path})"
        )
    job_id = out.stdout.strip().split(";")[0]
    output = os.path.join(directory, f"job-{job_id}.out")
    _say(f"realrl: submitted slurm job {job_id} ({job_name(cfg)}); output: {output}")
    if not s.follow:
        _say(f"realrl: not following it (slurm.follow=false); `scancel {job_id}` cancels it")
        return 0, ""
    code = follow_job(job_id, output, os.path.join(directory, f"job-{job_id}.exit"), requeue=cfg.recover == "auto")
    return code, summary_path


def _check_not_queued(cfg: AsyncPPOConfig) -> None:
    import getpass

    try:
        user = getpass.getuser()
    except Exception:
        user = str(os.getuid())
    out = _run(["squeue", "-h", "-u", user, f"--name={job_name(cfg)}", "-o", "%i"])
    if out.returncode != 0:
        raise ConfigError(f"slurm: squeue failed: {_first_line(out.stderr) or out.returncode}")
    jobs = out.stdout.split()
    if jobs:
        raise TrialJobQueued(cfg.experiment_name, cfg.trial_name, jobs[0])


def job_state(job_id: str) -> dict[str, str] | None:
    """The job's fields from `scontrol show job -o` (JobState, Reason,
    ExitCode, NodeList, ...), or None once Slurm no longer knows it."""
    try:
        out = _run(["scontrol", "show", "job", "-o", job_id])
    except subprocess.TimeoutExpired:
        return {"JobState": "UNKNOWN"}
    if out.returncode != 0:
        if "Invalid job id" in out.stderr:
            return None
        return {"JobState": "UNKNOWN"}
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def follow_job(job_id: str, output: str, exit_file: str, requeue: bool = False, poll_interval: float = 0.5) -> int:
    """Streams the job's output to stdout until the job ends; its exit code."""
    follower = _OutputFollower(output)
    previous = signal.getsignal(signal.SIGTERM)
    in_main = _in_main_thread()
    if in_main:
        signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    cancelled = False
    try:
        try:
            info = _wait_for_end(job_id, follower, requeue, poll_interval)
        except KeyboardInterrupt:
            cancelled = True
            _say(f"realrl: interrupted; cancelling slurm job {job_id}")
            _run(["scancel", job_id])
            try:
                info = _wait_for_end(job_id, follower, False, poll_interval, quiet=True)
            except KeyboardInterrupt:  # a second Ctrl-C: stop following (the job is cancelled)
                return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
    # The last lines may reach a shared file system a moment after the job ends.
    deadline = time.monotonic() + _EXIT_FILE_GRACE_S
    while not os.path.exists(exit_file) and time.monotonic() < deadline and (info or {}).get("JobState") != "CANCELLED":
        follower.copy()
        time.sleep(0.2)
    follower.copy()
    follower.finish()
    state = (info or {}).get("JobState", "")
    if cancelled or state == "CANCELLED":
        _say(f"realrl: slurm job {job_id} was cancelled")
        return 130
    try:
        with open(exit_file) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        pass
    exit_code = (info or {}).get("ExitCode", "")
    code = int(exit_code.split(":")[0]) if re.fullmatch(r"\d+:\d+", exit_code) else 1
    if state != "COMPLETED" or code != 0:
        reason = (info or {}).get("Reason", "")
        _say(
            f"realrl: slurm job {job_id} ended {state or 'without a state'} (exit code {exit_code or '?'}"
            f"{', ' + reason if reason and reason != 'None' else ''}) before the launcher said how the trial ended"
        )
        return code or 1
    return 0


def _wait_for_end(
    job_id: str, follower: _OutputFollower, requeue: bool, poll_interval: float, quiet: bool = False
) -> dict[str, str] | None:
    """Polls the job until it is over; its last known fields."""
    last: dict[str, str] | None = {}
    said = ""
    requeue_deadline = None
    while True:
        follower.copy()
        info = job_state(job_id)
        if info is None:
            return last
        last = info
        state = info.get("JobState", "")
        if state != said and not quiet:
            if state == "PENDING":
                reason = info.get("Reason", "None")
                _say(f"realrl: slurm job {job_id} is pending" + (f" ({reason})" if reason not in ("None", "") else ""))
            elif state == "RUNNING":
                _say(f"realrl: slurm job {job_id} is running on {info.get('NodeList', '?')}")
            said = state
        if state in _TERMINAL_STATES:
            if not (requeue and state in _REQUEUED_STATES):
                return info
            requeue_deadline = requeue_deadline or time.monotonic() + 120  # Slurm requeues it shortly
            if time.monotonic() > requeue_deadline:
                return info
        else:
            requeue_deadline = None
        time.sleep(poll_interval)


class _OutputFollower:
    """Copies what a file gains to stdout (it may not exist yet, and a
    requeued job may start it again)."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.open_line = False

    def copy(self) -> None:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < self.offset:
                    self.offset = 0
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        if chunk:
            self.offset += len(chunk)
            sys.stdout.write(chunk.decode(errors="replace"))
            sys.stdout.flush()
            self.open_line = not chunk.endswith(b"\n")

    def finish(self) -> None:
        if self.open_line:
            sys.stdout.write("\n")
            sys.stdout.flush()
            self.open_line = False


# ---- inside the allocation ----------------------------------------------------------


@dataclasses.dataclass
class SlurmNode:
    name: str
    address: str
    cpus: int = 0  # the job's CPUs on it (0 = unknown)


def expand_cpus_per_node(text: str) -> list[int]:
    """SLURM_JOB_CPUS_PER_NODE ("72(x2),36") as one count per node."""
    counts: list[int] = []
    for part in filter(None, (text or "").split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return []
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def allocation_nodes() -> list[SlurmNode]:
    """The job's nodes, the batch script's node first, with each one's address."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    out = _run(["scontrol", "show", "hostnames", nodelist])
    names = out.stdout.split()
    if out.returncode != 0 or not names:
        raise RuntimeError(f"cannot list the job's nodes ({nodelist!r}): {_first_line(out.stderr)}")
    cpus = expand_cpus_per_node(os.environ.get("SLURM_JOB_CPUS_PER_NODE", ""))
    cpus = cpus if len(cpus) == len(names) else [0] * len(names)
    info = _run(["scontrol", "show", "node", "-o", ",".join(names)])
    addrs = {}
    for line in info.stdout.splitlines():
        fields = dict(re.findall(r"(\w+)=(\S*)", line))
        if fields.get("NodeName"):
            addrs[fields["NodeName"]] = fields.get("NodeAddr") or fields["NodeName"]
    nodes = [SlurmNode(n, _ip_of(addrs.get(n, n)), c) for n, c in zip(names, cpus)]
    home = os.environ.get("SLURMD_NODENAME", "")
    return sorted(nodes, key=lambda n: n.name != home)  # stable: the rest keep Slurm's order


def _ip_of(address: str) -> str:
    try:
        return socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError):
        return address


_SIGNAL_BY_TEXT = {signal.strsignal(s): s.name for s in signal.Signals if signal.strsignal(s)}
_SRUN_TASK_LINE = re.compile(r"srun: error: (\S+): task \d+: (.+?)\s*$")


@dataclasses.dataclass
class SlurmStep(WorkerProcess):
    """A worker run as its own srun step; `popen` is the local srun."""

    job_id: str = ""
    step_name: str = ""
    step_id: Callable[[str], str | None] = lambda name: None

    def signal(self, sig: int) -> None:
        code = self.popen.poll()
        if code is not None and code >= 0:
            return  # srun saw its step end: nothing of it runs any more
        step = self.step_id(self.step_name)
        if step is not None:
            _run(["scancel", "--quiet", f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", step])
        if step is None or sig == signal.SIGKILL or code is not None:
            # Without a step id (not registered yet), signalling srun ends its step.
            signal_tree(self.popen.pid, sig)

    def describe_exit(self, code: int) -> str:
        for line in reversed(log_tail(self.log_path, 20).splitlines()):
            m = _SRUN_TASK_LINE.search(line)
            if m is None:
                continue
            node, what = m.groups()
            exited = re.fullmatch(r"Exited with exit code (\d+)", what)
            if exited:
                return f"exit code {exited.group(1)} on node {node}"
            name = _SIGNAL_BY_TEXT.get(what.split(" (")[0])
            return f"signal {name} on node {node}" if name else f"{what} on node {node}"
        if code < 0:
            return f"its srun ended by signal {signal.Signals(-code).name}, node {self.node}"
        return f"exit code {code} of its srun step on node {self.node}"


class SlurmLauncher(LocalLauncher):
    """The local launcher inside a Slurm allocation: one srun step per worker."""

    mode = "slurm"

    def __init__(
        self, *args, bind_address: str = "", gpus_per_node: int = 0, srun_args: list[str] | tuple = (), **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.job_id = os.environ.get("SLURM_JOB_ID", "")
        if not self.job_id:
            raise RuntimeError("SlurmLauncher runs inside a Slurm job (no SLURM_JOB_ID)")
        self.bind_address = bind_address
        self.gpus_per_node = gpus_per_node
        self.srun_args = list(srun_args)
        self.nodes: dict[str, SlurmNode] = {}
        self._home: SlurmNode | None = None
        self._plan: dict[tuple[str, int], Slot] = {}
        self._step_ids: dict[str, str] = {}

    def run(self, groups: list[WorkerGroup], timeout: float | None = None) -> int:
        nodes = allocation_nodes()
        self.nodes = {n.name: n for n in nodes}
        self._home = nodes[0]
        self._plan, notes = plan_placement([n.name for n in nodes], self.gpus_per_node, demands_of(groups))
        for note in notes:
            logger.warning("%s", note)
        self.acquire_trial()
        self._probe_fileroot(nodes)
        logger.info("placement: %s", {f"{t}/{i}": s.node for (t, i), s in sorted(self._plan.items())})
        return super().run(groups, timeout)

    def _etcd_host(self) -> str:
        return self.bind_address or self._home.address  # workers on every node reach the private etcd here

    def _set_experiment_status(self, status: str) -> None:
        if self._etcd_supervisor is not None and self._etcd_supervisor.poll() is not None:
            return  # scancel signals every process of the job, the private etcd too: nothing to tell
        super()._set_experiment_status(status)

    def _worker_info(self, info: WorkerInfo) -> WorkerInfo:
        node = self.nodes[self._plan[(info.worker_type, info.worker_index)].node]
        return dataclasses.replace(info, bind_address=self.bind_address or node.address)

    def _srun(self, node_names: list[str], step_name: str) -> list[str]:
        cmd = [
            "srun",
            f"--nodes={len(node_names)}",
            f"--ntasks={len(node_names)}",
            "--ntasks-per-node=1",
            f"--nodelist={','.join(node_names)}",
            "--overlap",
            "--mem=0",
            f"--job-name={step_name}",
        ]
        cpus = min((self.nodes[n].cpus for n in node_names), default=0)
        if cpus:
            cmd.append(f"--cpus-per-task={cpus}")  # every CPU of the node: steps overlap, as processes of one machine
        return cmd + self.srun_args

    def _spawn(self, info: WorkerInfo, spec_path: str, env: dict[str, str], log_path: str) -> WorkerProcess:
        slot = self._plan[(info.worker_type, info.worker_index)]
        step_name = f"{info.worker_type}-{info.worker_index}"
        if slot.gpus:
            command = [
                sys.executable,
                "-m",
                "realrl.launcher.slurm",
                "exec-worker",
                "--gpus",
                ",".join(map(str, slot.gpus)),
                spec_path,
            ]
            env = {k: v for k, v in env.items() if k != "CUDA_VISIBLE_DEVICES"}
        else:
            command = worker_command(spec_path)
        cmd = self._srun([slot.node], step_name) + [
            f"--output={log_path}",
            "--open-mode=append",
            "--input=none",
            *command,
        ]
        with open(log_path, "ab") as log:  # srun's own lines ("task 0: Killed") go there too
            popen = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        return SlurmStep(
            info.tag,
            info.worker_type,
            info.worker_index,
            log_path,
            popen,
            node=slot.node,
            job_id=self.job_id,
            step_name=step_name,
            step_id=self._step_id,
        )

    def _step_id(self, step_name: str) -> str | None:
        """`<job>.<step>` of the worker's step, from squeue (cached)."""
        if step_name not in self._step_ids:
            try:
                out = _run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"])
            except subprocess.TimeoutExpired:
                return None
            for line in out.stdout.splitlines():
                parts = line.split(None, 1)
                if len(parts) == 2:
                    self._step_ids.setdefault(parts[1].strip(), parts[0])
        return self._step_ids.get(step_name)

    def _probe_fileroot(self, nodes: list[SlurmNode]) -> None:
        """Every node must see `fileroot` (weights, specs and logs live there):
        one step per node reads the launcher's token and writes its own."""
        probe_dir = os.path.join(self.run_dir, "fileroot-probe")
        shutil.rmtree(probe_dir, ignore_errors=True)
        os.makedirs(probe_dir, exist_ok=True)
        token = uuid.uuid4().hex
        with open(os.path.join(probe_dir, "launcher"), "w") as f:
            f.write(token)
        cmd = self._srun([n.name for n in nodes], "fileroot-probe") + [
            "--input=none",
            sys.executable,
            "-m",
            "realrl.launcher.slurm",
            "probe",
            probe_dir,
            token,
        ]
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            raise ConfigError(
                f"fileroot: the probe of {self.fileroot} on the job's nodes did not finish in 300s"
            ) from None
        said = dict(re.findall(r"^probe (\S+): (.+)$", out.stdout, re.MULTILINE))
        for node in nodes:
            problem = said.get(node.name, "")
            if not problem and not os.path.exists(os.path.join(probe_dir, node.name)):
                problem = f"its probe did not reach this node ({_first_line(out.stderr) or 'no file'})"
            if problem:
                raise ConfigError(
                    f"fileroot: node {node.name} cannot share {self.fileroot} ({problem}); "
                    "weights and logs need a fileroot that every node sees"
                )


def inside_job() -> bool:
    """Whether this process is the launcher inside its own batch job."""
    job = os.environ.get("SLURM_JOB_ID")
    return bool(job) and os.environ.get(INSIDE_ENV) == job


# ---- entry points run by Slurm ------------------------------------------------------


def run_inside_job(config_path: str, run: Callable[[AsyncPPOConfig], int]) -> int:
    """The batch script's command (`realrl train --slurm-job <trial.yaml>`):
    marks this process as the job's launcher, runs the resolved config with
    `run` (the experiment's `run_experiment`: the caller passes it, launchers
    do not import the layer above them) and writes the exit code next to the
    job's output for the submitting command."""
    job = os.environ.get("SLURM_JOB_ID", "")
    os.environ[INSIDE_ENV] = job
    code = 1
    exit_dir = os.path.dirname(config_path)
    try:
        code = run(load_config(config_path))
    except ConfigError as e:
        print(f"realrl: config error: {e}", file=sys.stderr, flush=True)
        code = 2
    except TrialAlreadyRunning as e:
        print(f"realrl: {e}", file=sys.stderr, flush=True)
        code = 2
    except KeyboardInterrupt:  # SIGTERM (scancel) before the launcher ran
        code = 130
    finally:
        if job:
            tmp = os.path.join(exit_dir, f".job-{job}.exit.tmp")
            with open(tmp, "w") as f:
                f.write(f"{code}\n")
            os.replace(tmp, os.path.join(exit_dir, f"job-{job}.exit"))
    return code


def _probe(directory: str, token: str) -> int:
    node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()
    try:
        with open(os.path.join(directory, "launcher")) as f:
            if f.read() != token:
                print(f"probe {node}: sees a different file", flush=True)
                return 0
        with open(os.path.join(directory, node), "w") as f:
            f.write(token)
    except OSError as e:
        print(f"probe {node}: {type(e).__name__}: {e}", flush=True)
    return 0


def _exec_worker(gpus: str, spec_path: str) -> None:
    """Runs the worker on its GPUs: positions among the GPUs Slurm made
    visible to this step (or the node's, when Slurm set none)."""
    positions = [int(p) for p in gpus.split(",") if p.strip()]
    visible = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    chosen = [visible[p % len(visible)] for p in positions] if visible else [str(p) for p in positions]
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)
    cmd = worker_command(spec_path)
    os.execv(cmd[0], cmd)


def _in_main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m realrl.launcher.slurm", description="realrl's steps inside a Slurm job"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    probe = sub.add_parser("probe", help="check that this node sees fileroot")
    probe.add_argument("directory")
    probe.add_argument("token")
    exec_worker = sub.add_parser("exec-worker", help="run a worker on its GPUs")
    exec_worker.add_argument("--gpus", required=True)
    exec_worker.add_argument("spec")
    args = parser.parse_args(argv)
    if args.command == "probe":
        return _probe(args.directory, args.token)
    _exec_worker(args.gpus, args.spec)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main())
