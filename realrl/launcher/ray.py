"""Ray launcher: the same trial on a Ray cluster (`mode=ray`).

The user starts a cluster the usual way (`ray start --head` on one node,
`ray start --address=HEAD:PORT` on the others, or an existing one named by
`RAY_ADDRESS` / `ray.address`) and runs the usual command with `mode=ray` on
a node of it. `RayLauncher` is the local launcher with three things changed;
everything else (one launcher per trial, the keep-alive key, watching,
reporting a failed worker with its traceback tail, teardown) is shared:

1. **Placement, before anything starts.** Every worker gets an explicit node
   (`plan_placement`): trainers first, packed onto the nodes with the most
   free GPUs; generation servers next, each with its tensor-parallel GPUs on
   one node, on nodes without trainers while there are any; the light
   workers (master, manager, rollout workers) on the launcher's own node when
   it has room. A cluster too small for `allocation_mode` is a one-line
   ConfigError naming what does not fit.
2. **Processes on other nodes.** Each worker runs as the same subprocess as
   locally (`python -m realrl.system.worker_base --spec F`), started by a
   small Ray actor (`WorkerHost`) pinned to its node that holds the worker's
   CPUs and GPUs (Ray sets the visible GPUs). The worker binds its node's
   address (or `bind_address`) and dies with its actor (parent-death
   signal), so a lost actor, a lost node or a SIGKILLed launcher (Ray
   removes the actors of a dead driver) leaves no worker behind. A worker
   whose actor or node is gone counts as failed, and the report names the
   node.
3. **Discovery and files.** With no `name_resolve.etcd3_addr`, the private
   etcd listens on the launcher node's cluster address; workers everywhere
   reach it. Weights, specs and logs live under `fileroot`, which every node
   must see: each node writes and reads a probe there before the trial
   starts, and a node that cannot is a one-line ConfigError naming it.

Ray itself is left running (other users' processes live in it too): the
launcher ends only the actors it made, by handle, and disconnects.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
import uuid

from realrl.api.cli_args import ConfigError
from realrl.api.system_api import WorkerInfo
from realrl.base.logging import getLogger
from realrl.base.process import signal_tree, with_parent_death_signal
from realrl.launcher.local import LocalLauncher, WorkerGroup, WorkerProcess, worker_command

logger = getLogger("launcher.ray")

LIGHT_WORKERS = ("master_worker", "gserver_manager")  # orchestration only: no CPU reserved
_CALL_TIMEOUT_S = 30.0  # a worker's actor that does not answer a poll for this long counts as lost


@dataclasses.dataclass
class Node:
    node_id: str
    address: str
    cpus: float
    gpus: float


@dataclasses.dataclass(frozen=True)
class Demand:
    worker_type: str
    index: int
    cpus: float
    gpus: int


def demands_of(groups: list[WorkerGroup]) -> list[Demand]:
    out = []
    for group in groups:
        for index in range(group.count):
            out.append(Demand(group.name, index, group.cpus_per_worker, group.gpus_per_worker))
    return out


def plan_placement(nodes: list[Node], demands: list[Demand], home: str) -> dict[tuple[str, int], Node]:
    """The node of every worker, keyed by (worker_type, index); `home` is the
    launcher's node address. Raises ConfigError when something does not fit."""
    free = {n.node_id: [n.cpus, n.gpus] for n in nodes}
    by_id = {n.node_id: n for n in nodes}
    plan: dict[tuple[str, int], Node] = {}
    trainer_nodes: set[str] = set()

    def fits(node: Node, d: Demand) -> bool:
        cpus, gpus = free[node.node_id]
        return cpus + 1e-9 >= d.cpus and gpus + 1e-9 >= d.gpus

    def take(node: Node, d: Demand) -> None:
        free[node.node_id][0] -= d.cpus
        free[node.node_id][1] -= d.gpus
        plan[(d.worker_type, d.index)] = node

    def order(d: Demand) -> int:
        return {"model_worker": 0, "generation_server": 1}.get(d.worker_type, 2)

    for d in sorted(demands, key=order):
        candidates = [n for n in nodes if fits(n, d)]
        if not candidates:
            free_text = ", ".join(f"{by_id[i].address}: {c:g} CPU {g:g} GPU" for i, (c, g) in free.items())
            raise ConfigError(
                f"allocation_mode: the Ray cluster has no room for {d.worker_type} {d.index} "
                f"({d.cpus:g} CPU, {d.gpus} GPU); free: {free_text}"
            )
        if d.worker_type == "model_worker":
            # Pack ranks: the node with the fewest free GPUs that still fits, home first.
            node = (
                min(candidates, key=lambda n: (free[n.node_id][1], n.address != home))
                if d.gpus
                else min(candidates, key=lambda n: n.address != home)
            )
            trainer_nodes.add(node.node_id)
        elif d.worker_type == "generation_server":
            # Away from the trainers while there is a node without them.
            node = min(candidates, key=lambda n: (n.node_id in trainer_nodes, -free[n.node_id][1], n.address == home))
        else:
            node = min(candidates, key=lambda n: n.address != home)
        take(node, d)
    return plan


def _host_class():
    import ray

    @ray.remote(max_restarts=0, max_concurrency=4)
    class WorkerHost:
        """Runs one worker process on this actor's node."""

        def start(self, spec_path: str, env: dict, log_path: str) -> int:
            gpus = [str(int(g)) for g in ray.get_gpu_ids()]
            env = dict(env)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
            else:
                env.pop("CUDA_VISIBLE_DEVICES", None)
            with open(log_path, "ab") as log:
                # Dies with this actor (node lost, actor killed): it cannot outlive it.
                self.popen = subprocess.Popen(
                    with_parent_death_signal(worker_command(spec_path), os.getpid()),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=env,
                    start_new_session=True,
                )
            return self.popen.pid

        def poll(self):
            return self.popen.poll()

        def signal(self, sig: int) -> None:
            signal_tree(self.popen.pid, sig)

        def wait(self, timeout: float):
            try:
                return self.popen.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                return None

    return WorkerHost


@dataclasses.dataclass
class RayWorkerProcess(WorkerProcess):
    actor: object = None
    remote_pid: int = 0
    lost: str = ""  # why the actor stopped answering, once it has

    @property
    def pid(self) -> int:
        return self.remote_pid

    def _call(self, method: str, *args, timeout: float = _CALL_TIMEOUT_S):
        import ray

        return ray.get(getattr(self.actor, method).remote(*args), timeout=timeout)

    def poll(self) -> int | None:
        if self.lost:
            return -signal.SIGKILL
        try:
            return self._call("poll")
        except Exception as e:  # the actor is gone: its node was lost or it was killed
            self.lost = f"{type(e).__name__}"
            return -signal.SIGKILL

    def signal(self, sig: int) -> None:
        if self.lost:
            return
        try:
            self._call("signal", int(sig))
        except Exception as e:
            self.lost = type(e).__name__

    def wait(self, timeout: float) -> None:
        if self.lost:
            return
        try:
            if self._call("wait", timeout, timeout=timeout + _CALL_TIMEOUT_S) is None:
                raise TimeoutError(f"{self.tag} still running after {timeout}s")
        except TimeoutError:
            raise
        except Exception as e:
            self.lost = type(e).__name__

    def describe_exit(self, code: int) -> str:
        if self.lost:
            return f"its Ray actor on node {self.node} is gone ({self.lost}): node lost or actor killed"
        return f"{super().describe_exit(code)} on node {self.node}"


def connect(address: str = "") -> None:
    """Joins the Ray cluster at `address` ("" = RAY_ADDRESS, else the cluster
    this node belongs to); a missing Ray or cluster is a one-line ConfigError."""
    try:
        import ray
    except ImportError:
        raise ConfigError("mode: ray needs Ray on every node: pip install 'realrl[ray]'") from None
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS", "") or "auto"
    try:
        ray.init(
            address=address, log_to_driver=False, logging_level="ERROR", namespace=f"realrl-{uuid.uuid4().hex[:8]}"
        )
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"ray.address: no Ray cluster at {address!r} ({first}); start one with `ray start --head` "
            "on this node, or set ray.address / RAY_ADDRESS"
        ) from None


class RayLauncher(LocalLauncher):
    mode = "ray"

    def __init__(self, *args, ray_address: str = "", bind_address: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        self.ray_address = ray_address or os.environ.get("RAY_ADDRESS", "") or "auto"
        self.bind_address = bind_address
        self._plan: dict[tuple[str, int], Node] = {}
        self._demands: dict[tuple[str, int], Demand] = {}
        self._home = ""
        self._actors: list = []
        self._last_node_check = 0.0

    def run(self, groups: list[WorkerGroup], timeout: float | None = None) -> int:
        import ray

        connect(self.ray_address)
        try:
            self._home = self.bind_address or ray.util.get_node_ip_address()
            nodes = [
                Node(
                    n["NodeID"], n["NodeManagerAddress"], n["Resources"].get("CPU", 0.0), n["Resources"].get("GPU", 0.0)
                )
                for n in ray.nodes()
                if n["Alive"]
            ]
            demands = demands_of(groups)
            self._demands = {(d.worker_type, d.index): d for d in demands}
            self._plan = plan_placement(nodes, demands, self._home)
            self.acquire_trial()
            self._probe_fileroot(self._planned_nodes())
            logger.info("placement: %s", {f"{t}/{i}": n.address for (t, i), n in sorted(self._plan.items())})
            return super().run(groups, timeout)
        finally:
            for actor in self._actors:
                try:
                    ray.kill(actor)
                except Exception as e:  # already gone with its node
                    logger.debug("could not kill an actor: %s", e)
            self._actors.clear()
            ray.shutdown()

    def _cluster_problem(self, force: bool = False) -> str | None:
        """A node of the plan that Ray no longer counts alive (checked once a second)."""
        import ray

        now = time.monotonic()
        if now - self._last_node_check < 1.0 and not force:
            return None
        self._last_node_check = now
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        for node in self._planned_nodes():
            if node.node_id not in alive:
                tags = sorted(f"{t}/{i}" for (t, i), n in self._plan.items() if n.node_id == node.node_id)
                return f"Ray node {node.address} was lost (it ran {', '.join(tags)})"
        return None

    def _planned_nodes(self) -> list[Node]:
        return sorted({n.node_id: n for n in self._plan.values()}.values(), key=lambda n: n.address)

    def _etcd_host(self) -> str:
        return self._home  # workers on every node reach the private etcd here

    def _probe_fileroot(self, nodes: list[Node]) -> None:
        """Every node must see `fileroot` (weights, specs and logs live there)."""
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        probe_dir = os.path.join(self.run_dir, "fileroot-probe")
        os.makedirs(probe_dir, exist_ok=True)
        token = uuid.uuid4().hex
        with open(os.path.join(probe_dir, "launcher"), "w") as f:
            f.write(token)

        @ray.remote(num_cpus=0)
        def probe(directory: str, expected: str, address: str) -> str:
            try:
                with open(os.path.join(directory, "launcher")) as f:
                    if f.read() != expected:
                        return "sees a different file"
                with open(os.path.join(directory, address), "w") as f:
                    f.write(expected)
            except OSError as e:
                return f"{type(e).__name__}: {e}"
            return ""

        refs = [
            probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n.node_id, soft=False)).remote(
                probe_dir, token, n.address
            )
            for n in nodes
        ]
        for node, problem in zip(nodes, ray.get(refs, timeout=120)):
            if not problem and not os.path.exists(os.path.join(probe_dir, node.address)):
                problem = "its probe did not reach this node"
            if problem:
                raise ConfigError(
                    f"fileroot: node {node.address} cannot share {self.fileroot} ({problem}); "
                    "weights and logs need a fileroot that every node sees"
                )

    def _worker_info(self, info: WorkerInfo) -> WorkerInfo:
        node = self._plan[(info.worker_type, info.worker_index)]
        return dataclasses.replace(info, bind_address=self.bind_address or node.address)

    def _spawn(self, info: WorkerInfo, spec_path: str, env: dict[str, str], log_path: str) -> WorkerProcess:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = self._plan[(info.worker_type, info.worker_index)]
        demand = self._demands[(info.worker_type, info.worker_index)]
        actor = (
            _host_class()
            .options(
                num_cpus=demand.cpus,
                num_gpus=demand.gpus,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
            )
            .remote()
        )
        self._actors.append(actor)
        proc = RayWorkerProcess(info.tag, info.worker_type, info.worker_index, log_path, node=node.address, actor=actor)
        proc.remote_pid = proc._call("start", spec_path, env, log_path, timeout=300)
        return proc
