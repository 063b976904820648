"""The control plane at cluster scale, on one machine: N simulated generation servers, E episodes in flight.

    python benchmarks/control_plane.py [--quick] [--servers 8,64,256,512] [--episodes 1024,4096,16384]
        [--rate 200] [--window 30] [--saturation] [--profile] [--json PATH] [--plot PATH] [--root DIR]

For every point (N servers, E episodes) a whole trial runs through the real
LocalLauncher: a private etcd, the real master, GserverManager and rollout
workers, as processes, around three stand-ins for what needs a model
(`benchmarks/sim/`): `N` simulated generation servers, `--servers-per-host` of
them per process (`realrl.impl.generation.sim_server`: the torch server's
HTTP application over an engine that answers after `--token-latency-ms` per
token, `--output-tokens` tokens per answer), registered under the keys real
servers use; a trainer that takes the master's batches `--train-speedup`
(20) times as fast as they are produced and publishes a tiny real checkpoint
per version (so the manager's fan-out to N servers, each reading the files,
is real); and an agent making `--turns` generation calls per episode with a
tool wait between them, sized so that the E episodes together offer `--rate`
generation calls per second (most episodes wait on their tool at any
moment). A train batch is what the episodes produce in `--version-interval`
seconds, so a new version is published that often.

Once all E episodes run (the manager's running count) and a version or two
has passed, a `--window` of seconds is measured:

- `requests_per_s`: HTTP requests the manager answered per second
  (admission, routing, releases, `/servers`, ...: its progress record);
- the latency the control plane adds to a generation call:
  `added_p50_ms` / `added_p99_ms` = percentile of the agent's calls through
  the runtime (partial-rollout manager, routing, server) minus the same
  percentile of calls made from the same processes straight to a random
  simulated server with the same context and parameters, a direct twin
  started with each call through the runtime (`--probe-interval`: at a
  steady pace instead, which starts fewer calls while its event loop is
  stalled and so misses the slowest moments). A call a weight update
  interrupts counts with its resubmission either way: the runtime's partial
  rollout, or the direct caller sending it again to the same server as a
  plain client would (`added_resumed_*` compares those two alone). Each
  call is counted by its time outside the servers: its wall time minus the
  time the servers reported spending on it (`GenerationResult.server_s`, a
  direct call's `e2e_latency`), so that the simulated servers' own jitter
  does not swamp the control plane's milliseconds. `added_steady_*`: the
  same over the calls (both kinds) that overlapped no weight update (from a
  version's publication to its load on the last server; `steady_share`),
  the control plane's own cost apart from what an update makes calls wait
  for. `added_wall_*`: all calls by wall time alone;
- `version_fanout_s`: from the trainer setting `model_version` to the last of
  the N servers having loaded that version (median over the window's
  versions; `_max_s` the worst; versions the manager skipped because a newer
  one came are counted apart);
- health checks the manager sent per second (counted at the servers), etcd
  KV operations per second (range/put/txn/delete) and its key count, and CPU
  (cores) and memory (RSS) per process kind (psutil).

`--saturation` then runs the largest point at offered rates from
`--saturation-from` (x2 each time) until the calls served fall below 80 % of
those offered, the manager uses a whole core, or `--max-rate` is reached: the
manager's CPU against the rate gives its fixed cost for N servers (health
checks, registry reads) and its cost per call. `--profile` runs py-spy on the
manager and the master (`--profile-kinds`) during the window of the last grid
point (and of every saturation point) and prints their top functions.

The output: a table, `--json PATH` with a top-level `rows` list (one row per
point), and `--plot PATH` (PNG: each measure against N, one line per episode
count). `--quick`: the 256-server point with 1k and 16k episodes,
short windows (a few minutes). The machine's load average is recorded per
point: figures from a shared machine are noisy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import shutil
import sys
import threading
import time
import urllib.request
import uuid

import numpy as np
import psutil

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from benchmarks.sim.server_host import SimServerHostConfig  # noqa: E402
from benchmarks.sim.trainer import SimTrainerConfig  # noqa: E402
from benchmarks.step_cost import (  # noqa: E402
    SPEC_KIND,
    TreeSampler,
    find_py_spy,
    machine_busy_s,
    start_profilers,
    stop_profilers,
    summarize_profile,
    weight_sync_lags,
)
from realrl.api.agent_api import AgentSettings  # noqa: E402
from realrl.api.cli_args import AgentConfig, EnvConfig  # noqa: E402
from realrl.api.generation_api import GenerationHyperparameters  # noqa: E402
from realrl.api.system_api import GserverManagerConfig, MasterWorkerConfig, RolloutWorkerConfig  # noqa: E402
from realrl.base import name_resolve, names  # noqa: E402
from realrl.base.name_resolve import NameResolveConfig  # noqa: E402
from realrl.impl.generation.eos import eos_token_ids_in_dir  # noqa: E402
from realrl.impl.generation.sim_server import SimServerConfig  # noqa: E402
from realrl.launcher.local import LocalLauncher, WorkerGroup  # noqa: E402
from realrl.system import register_worker  # noqa: E402
from realrl.system.worker_base import ExperimentStatus  # noqa: E402

EXPERIMENT = "control-plane"
AGENT_PLUGIN = "benchmarks.sim.agent"
register_worker("sim_trainer", "benchmarks.sim.trainer:SimTrainer")
register_worker("sim_server_host", "benchmarks.sim.server_host:SimServerHostWorker")
SPEC_KIND.update({"sim_trainer": "trainer", "sim_server_host": "simulated servers"})
KINDS = ["manager", "master", "rollout worker", "simulated servers", "trainer", "etcd", "launcher"]
STARTUP_TIMEOUT_S = 600.0
SATURATION_SERVED = 0.8  # below this share of the offered calls served, the point is saturated


@dataclasses.dataclass
class Kit:
    """A tokenizer and a tiny model (what the trainer publishes), and prompts."""

    model_dir: str
    dataset_path: str
    vocab_size: int
    eos_token_ids: list[int]


def make_kit(root: str, n_prompts: int = 1024) -> Kit:
    from realrl.impl.tiny_model import TinyModelConfig, build_char_tokenizer, build_tiny_model

    model_dir = os.path.join(root, "model")
    tokenizer = build_char_tokenizer()
    if not os.path.isfile(os.path.join(model_dir, "model.safetensors")):
        shape = TinyModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32)
        build_tiny_model(tokenizer, shape).save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
    dataset_path = os.path.join(root, "prompts.jsonl")
    with open(dataset_path, "w") as f:
        for i in range(n_prompts):
            a, b = i % 97, i // 97
            f.write(json.dumps({"query_id": str(i), "prompt": f"Q: {a}+{b}=?\nA:", "answer": str(a + b)}) + "\n")
    return Kit(model_dir, dataset_path, len(tokenizer), sorted(eos_token_ids_in_dir(model_dir, tokenizer)))


# ---- one point -------------------------------------------------------------------------------


@dataclasses.dataclass
class Point:
    servers: int
    episodes: int
    rate: float  # generation calls per second the episodes offer
    series: str = "grid"
    routing: str = "client"  # rollout.routing: client (the rollout workers) | manager (per request)


@dataclasses.dataclass
class Plan:
    """What a point's configuration works out to."""

    gen_s: float  # one answer's generation time at the servers
    tool_latency_s: float  # mean wait between two calls of an episode
    offered_rate: float  # generation calls per second, all episodes together
    train_batch_size: int
    max_head_offpolicyness: int
    train_rate: float  # trajectories per second of a train step
    hosts: int
    rollout_workers: int


def make_plan(point: Point, args) -> Plan:
    gen_s = args.output_tokens * args.token_latency_ms / 1000
    # An episode: `turns` calls with a tool wait between two of them. E episodes offer
    # E * turns / ((turns - 1) * tool + turns * gen) calls per second.
    k = args.turns
    tool = max(0.0, (point.episodes * k / point.rate - k * gen_s) / (k - 1)) if k > 1 else 0.0
    offered = point.episodes * k / ((k - 1) * tool + k * gen_s)
    produced = offered / k  # trajectories per second (one per episode)
    batch = max(4, round(produced * args.version_interval))
    # Episodes last turns * E / rate seconds, E / B versions: admission and the trainer's drops must allow that.
    eta = 2 * math.ceil(point.episodes / batch) + 4
    return Plan(
        gen_s=gen_s,
        tool_latency_s=tool,
        offered_rate=offered,
        train_batch_size=batch,
        max_head_offpolicyness=eta,
        train_rate=args.train_speedup * produced,
        hosts=math.ceil(point.servers / args.servers_per_host),
        rollout_workers=min(args.rollout_workers, point.episodes),
    )


def build_groups(kit: Kit, point: Point, plan: Plan, args, trial: str, trial_dir: str) -> list[WorkerGroup]:
    def threads(n: int) -> dict[str, str]:
        # (PYTHONPATH: the workers import the benchmark's worker classes and agent from the repository.)
        path = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)
        return {
            "OMP_NUM_THREADS": str(n),
            "MKL_NUM_THREADS": str(n),
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONPATH": path,
        }

    sim_dir = os.path.join(trial_dir, "sim")
    weights_dir = os.path.join(trial_dir, "weights")
    per_worker = math.ceil(point.episodes / plan.rollout_workers)
    server = SimServerConfig(
        token_latency_s=args.token_latency_ms / 1000,
        output_tokens=args.output_tokens,
        vocab_size=kit.vocab_size,
        eos_token_ids=kit.eos_token_ids,
    )
    hosts = []
    for h in range(plan.hosts):
        first = h * args.servers_per_host
        n = min(args.servers_per_host, point.servers - first)
        hosts.append(SimServerHostConfig(first, n, server, os.path.join(sim_dir, f"host-{h}.json")))
    agent = AgentConfig(
        type="sim-tool",
        args={
            "turns": args.turns,
            "tool_latency_s": plan.tool_latency_s,
            "warm_episodes": per_worker,
            "latency_dir": os.path.join(trial_dir, "latency"),
            "experiment": EXPERIMENT,
            "trial": trial,
            # A direct twin of each call through the runtime, started at the same moment (unless
            # asked otherwise): the percentiles compared rest on as many samples each, taken at the
            # same moments of the trial.
            "probe_interval_s": args.probe_interval,
        },
    )
    settings = AgentSettings(
        tokenizer_path=kit.model_dir,
        group_size=1,
        # Answers of exactly output_tokens tokens: a call interrupted by a weight update and resubmitted
        # (with what it had) ends at the same length, as a real model's answer would.
        gconfig=GenerationHyperparameters(max_new_tokens=args.output_tokens),
    )
    master = MasterWorkerConfig(
        total_train_steps=10**9,  # the benchmark ends the trial
        train_batch_size=plan.train_batch_size,
        max_head_offpolicyness=plan.max_head_offpolicyness,
        use_decoupled_loss=False,
        evaluate=False,
        save_final_model=False,
        n_rollout_workers=plan.rollout_workers,
    )
    manager = GserverManagerConfig(
        n_servers=point.servers,
        train_batch_size=plan.train_batch_size,
        max_head_offpolicyness=plan.max_head_offpolicyness,
        max_concurrent_rollouts=point.episodes,
        weights_dir=weights_dir,
        n_rollout_workers=plan.rollout_workers,
    )
    rollout = RolloutWorkerConfig(
        dataset_path=kit.dataset_path,
        tokenizer_path=kit.model_dir,
        agent=agent,
        agent_settings=settings,
        env=EnvConfig(type="sim-null"),
        max_concurrent_rollouts=per_worker,
        sample_log_every=0,
        routing=point.routing,
    )
    trainer = SimTrainerConfig(
        model_path=kit.model_dir,
        weights_dir=weights_dir,
        train_rate=plan.train_rate,
        stats_path=os.path.join(sim_dir, "trainer.json"),
    )
    for d in (sim_dir, os.path.join(trial_dir, "latency")):
        os.makedirs(d, exist_ok=True)
    return [
        WorkerGroup("master_worker", 1, master, env=threads(1)),
        WorkerGroup("sim_trainer", 1, trainer, env=threads(1)),
        WorkerGroup("gserver_manager", 1, manager, env=threads(1)),
        WorkerGroup("rollout_worker", plan.rollout_workers, rollout, env=threads(1)),
        WorkerGroup("sim_server_host", plan.hosts, hosts, env=threads(1)),
    ]


class Trial:
    """A LocalLauncher running one point's trial in a background thread."""

    def __init__(self, root: str, groups_for, trial: str):
        self.trial = trial
        self.trial_dir = os.path.join(root, trial)
        self.launcher = LocalLauncher(
            EXPERIMENT,
            trial,
            root,
            NameResolveConfig(type="etcd3"),  # a private etcd, started by the launcher
            plugins=[AGENT_PLUGIN],
            stop_timeout=30,
        )
        self.groups = groups_for(self.trial_dir)
        self.code: int | None = None
        self.error: BaseException | None = None
        self.repo = None
        self._thread = threading.Thread(target=self._run, name="launcher", daemon=True)

    def _run(self) -> None:
        try:
            self.code = self.launcher.run(self.groups)
        except BaseException as e:  # reported by the caller
            self.error = e

    def start(self) -> Trial:
        self._thread.start()
        deadline = time.monotonic() + 120
        while not self.launcher.nr_config.etcd3_addr:
            self._check_running()
            if time.monotonic() > deadline:
                raise TimeoutError("the launcher did not start its etcd")
            time.sleep(0.1)
        self.etcd_addr = self.launcher.nr_config.etcd3_addr
        self.repo = name_resolve.make_repository(self.launcher.nr_config)  # (authenticated: §14)
        return self

    def _check_running(self) -> None:
        if not self._thread.is_alive():
            raise RuntimeError(f"the trial ended early (code {self.code}, {self.error!r}); logs in {self.trial_dir}")

    def progress(self, worker_type: str, index: int = 0) -> dict | None:
        """A worker's progress record (`doing` and `time`), or None before it published one."""
        self._check_running()
        try:
            return json.loads(self.repo.get(names.worker_progress(EXPERIMENT, self.trial, worker_type, index)))
        except name_resolve.NameEntryNotFoundError:
            return None

    def stop(self) -> None:
        if self._thread.is_alive() and self.repo is not None:
            key = names.experiment_status(EXPERIMENT, self.trial)
            self.repo.add(key, ExperimentStatus.COMPLETE, replace=True, delete_on_exit=False)
        self._thread.join(180)
        if self.repo is not None:
            self.repo.close()


def etcd_metrics(addr: str) -> dict[str, float]:
    """etcd's KV operation counters and key count (its Prometheus /metrics)."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for name in ("range", "put", "txn", "delete"):
        m = re.search(rf"^etcd_mvcc_{name}_total (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else 0.0
    m = re.search(r"^etcd_debugging_mvcc_keys_total (\S+)$", text, re.M)
    out["keys"] = float(m.group(1)) if m else float("nan")
    return out


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet
        return None


def host_stats(trial_dir: str, hosts: int) -> list[dict]:
    """Each server host's counters (`SimServerHost.stats`, with the time it wrote them)."""
    return [read_json(os.path.join(trial_dir, "sim", f"host-{h}.json")) or {} for h in range(hosts)]


def host_rates(before: list[dict], after: list[dict], part: str) -> dict[str, float]:
    """Per second, summed over the hosts (each over its own interval): requests per route or engine counters."""
    out: dict[str, float] = {}
    for b, a in zip(before, after):
        if not b or not a or a["time"] <= b["time"]:
            continue
        for key, value in a[part].items():
            out[key] = out.get(key, 0.0) + (value - b[part].get(key, 0)) / (a["time"] - b["time"])
    return out


def version_loads(hosts: list[dict]) -> dict[int, dict]:
    """Per weight version: how many servers loaded it and when the last one finished."""
    loads: dict[int, dict] = {}
    for host in hosts:
        for v, load in host.get("loads", {}).items():
            merged = loads.setdefault(int(v), {"servers": 0, "last": 0.0})
            merged["servers"] += load["servers"]
            merged["last"] = max(merged["last"], load["last"])
    return loads


def snapshot(trial: Trial, sampler: TreeSampler, hosts: int) -> dict:
    return {
        "wall": time.time(),
        "mono": time.monotonic(),
        "manager": trial.progress("gserver_manager"),
        "hosts": host_stats(trial.trial_dir, hosts),
        "etcd": etcd_metrics(trial.etcd_addr),
        "cpu": sampler.snapshot(),
        "rss_mb": rss_mb(sampler),
        "busy": machine_busy_s(),
    }


def rss_mb(sampler: TreeSampler) -> dict[int, float]:
    out = {}
    for pid, proc in sampler.procs.items():
        try:
            out[pid] = proc.memory_info().rss / 2**20
        except psutil.Error:
            pass  # ended
    return out


def latencies(trial_dir: str, t0: float, t1: float) -> dict[str, np.ndarray]:
    """Seconds of what ended in [t0, t1] in the rollout workers: calls through the runtime (`via`) and
    straight to a server (`direct`), each also apart when a weight update interrupted it
    (`*_resumed`), the event loop's lateness (`lag`, above 5 ms) and the collector's
    pauses (`gc0`..`gc2`, per generation)."""
    calls = tuple(f"{c}{x}" for c in ("via", "via_resumed", "direct", "direct_resumed") for x in ("", "_out", "_end"))
    out: dict[str, list[float]] = {k: [] for k in calls + ("lag", "gc0", "gc1", "gc2")}
    directory = os.path.join(trial_dir, "latency")
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as f:
            for line in f:
                kind, t, seconds, *outside = line.split()
                if t0 <= float(t) <= t1:
                    out.setdefault(kind, []).append(float(seconds))
                    if outside:  # a call: its time outside the servers, and when it ended
                        out.setdefault(f"{kind}_out", []).append(float(outside[0]))
                        out.setdefault(f"{kind}_end", []).append(float(t))
    return {k: np.asarray(v) for k, v in out.items()}


def wait_steady(trial: Trial, point: Point, timeout: float) -> float:
    """Waits until the manager runs (nearly) all E episodes and the trainer has
    published two versions; returns how long start-up took."""
    t0 = time.monotonic()
    while True:
        m = trial.progress("gserver_manager")
        doing = (m or {}).get("doing", {})
        if doing.get("running", 0) >= 0.95 * point.episodes and doing.get("trainer_version", 0) >= 2:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise TimeoutError(f"not steady after {timeout:.0f}s: manager {doing}; logs in {trial.trial_dir}")
        time.sleep(0.5)


def published_versions(trial_dir: str) -> list[tuple[int, float]]:
    """(version, wall clock of its publication), as the trainer stand-in recorded them."""
    return [tuple(p) for p in (read_json(os.path.join(trial_dir, "sim", "trainer.json")) or {}).get("published", [])]


def fanout(published: list[tuple[int, float]], servers: int, t0: float, t1: float, loads: dict[int, dict]) -> dict:
    """Seconds from publishing each version in [t0, t1] to its load on the last server."""
    in_window = [(v, t) for v, t in published if t0 <= t <= t1]
    newest = max((v for v, _ in published), default=0)
    done, skipped, pending = [], 0, 0
    for v, t in in_window:
        load = loads.get(v)
        if load is not None and load["servers"] >= servers:
            done.append(load["last"] - t)
        elif v < newest and load is None:
            skipped += 1  # a newer version was already published when the manager got to it
        else:
            pending += 1
    return {
        "version_fanout_s": float(np.median(done)) if done else None,
        "version_fanout_max_s": max(done) if done else None,
        "versions": len(in_window),
        "versions_skipped": skipped,
        "versions_incomplete": pending,
    }


def update_windows(
    published: list[tuple[int, float]], loads: dict[int, dict], grace_s: float
) -> list[tuple[float, float]]:
    """Wall-clock spans from publishing each version to its load on the last server that
    loaded it (a version no server loaded, skipped for a newer one: until that one's
    publication; the last one: `grace_s` after its own)."""
    by_time = sorted((t, v) for v, t in published)
    nexts = [t for t, _ in by_time[1:]] + [None]
    return [
        (t, loads[v]["last"] if v in loads else (t_next if t_next is not None else t + grace_s))
        for (t, v), t_next in zip(by_time, nexts)
    ]


def during_updates(starts: np.ndarray, ends: np.ndarray, windows: list[tuple[float, float]]) -> np.ndarray:
    """Which calls overlapped a weight update's span (a bool per call)."""
    hit = np.zeros(len(starts), dtype=bool)
    for w0, w1 in windows:
        hit |= (starts <= w1) & (ends >= w0)
    return hit


def rate(before: dict, after: dict, key: str, dt: float) -> float:
    return (after.get(key, 0) - before.get(key, 0)) / max(dt, 1e-9)


def run_point(kit: Kit, point: Point, args, profile: bool = False) -> dict:
    """Runs one point's trial and measures it (see the module docstring); returns its row."""
    plan = make_plan(point, args)
    trial_name = f"n{point.servers}-e{point.episodes}-r{int(point.rate)}-{point.routing}-{uuid.uuid4().hex[:6]}"
    print(
        f"\n== {point.servers} servers, {point.episodes} episodes, {plan.offered_rate:.0f} calls/s offered, "
        f"routing by the {point.routing} "
        f"(tool wait {plan.tool_latency_s:.2f}s, batch {plan.train_batch_size}, eta {plan.max_head_offpolicyness}, "
        f"{plan.hosts} server hosts, {plan.rollout_workers} rollout workers); trial {trial_name}",
        flush=True,
    )
    load_before = os.getloadavg()[0]
    t_launch = time.monotonic()
    trial = Trial(args.root, lambda d: build_groups(kit, point, plan, args, trial_name, d), trial_name).start()
    sampler = TreeSampler(os.getpid())
    profs: list[dict] = []
    try:
        startup_s = wait_steady(trial, point, STARTUP_TIMEOUT_S)
        time.sleep(args.settle)
        if profile:
            kinds = args.profile_kinds.split(",")
            profs = start_profiling(sampler, os.path.join(trial.trial_dir, "pyspy"), args.profile_rate, kinds)
        s0 = snapshot(trial, sampler, plan.hosts)
        time.sleep(args.window)
        s1 = snapshot(trial, sampler, plan.hosts)
        versions = [s["manager"]["doing"]["trainer_version"] for s in (s0, s1)]
        stop_profilers(profs)
        time.sleep(args.grace)  # for the last versions of the window to reach every server
        loads = version_loads(host_stats(trial.trial_dir, plan.hosts))
    finally:
        stop_profilers(profs)
        trial.stop()
    if trial.error is not None:
        raise trial.error
    published = published_versions(trial.trial_dir)
    row = {
        "trial": trial_name,
        "series": point.series,
        "routing": point.routing,
        "servers": point.servers,
        "episodes": point.episodes,
        "offered_calls_per_s": plan.offered_rate,
        **measure(trial.trial_dir, sampler, s0, s1, update_windows(published, loads, args.grace)),
        **fanout(published, point.servers, s0["wall"], s1["wall"], loads),
        # From the manager's log: noticing a version -> every server holds it, the update calls alone.
        "weight_sync": weight_sync_lags(trial.launcher.log_dir, range(versions[0] + 1, versions[1] + 1)),
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
        "startup_s": startup_s,
        "trial_s": time.monotonic() - t_launch,
        "train_batch_size": plan.train_batch_size,
        "tool_latency_s": plan.tool_latency_s,
        "generation_s": plan.gen_s,
    }
    if profs:
        row["profile"] = {
            p["label"]: summarize_profile(p["path"], p["threads_before"], p["threads_after"])
            for p in profs
            if os.path.isfile(p["path"]) and "threads_after" in p
        }
    print_row(row)
    if not args.keep:  # what the trial wrote: its files, the launcher's logs and run directory
        for d in (trial.trial_dir, trial.launcher.log_dir, trial.launcher.run_dir):
            shutil.rmtree(d, ignore_errors=True)
    return row


def start_profiling(sampler: TreeSampler, out_dir: str, rate_hz: int, kinds: list[str]) -> list[dict]:
    """py-spy on the processes of `kinds` (nothing without py-spy, which says so)."""
    py_spy = find_py_spy()
    sampler.sample()
    targets = {pid: label for pid, label in sampler.python_pids().items() if sampler.kind[pid] in kinds}
    if py_spy is None or not targets:
        print("no py-spy: no profile (pip install -e .[dev])", file=sys.stderr)
        return []
    os.makedirs(out_dir, exist_ok=True)
    return start_profilers(py_spy, targets, out_dir, rate_hz, False)


def measure(trial_dir: str, sampler: TreeSampler, s0: dict, s1: dict, windows: list[tuple[float, float]]) -> dict:
    """The window's figures from its two snapshots and the agents' latency files;
    `windows`: the weight updates' spans (wall clock)."""
    dt = s1["mono"] - s0["mono"]
    lat = latencies(trial_dir, s0["wall"], s1["wall"])
    # Every call, through the runtime and direct, and apart those a weight update interrupted (an
    # interrupted call waits for its server's update, through the runtime or not: the direct
    # caller sends it again to the same server, as a plain client would). Each call counts by
    # its time outside the servers (its wall time minus what the servers reported spending on
    # it): the simulated servers' own jitter (their hosts' busy event loops, up to ~100 ms on 2
    # cores) is not the control plane's and would swamp a few ms at p99.

    def with_resumed(kind: str, suffix: str = "") -> np.ndarray:
        return np.concatenate([lat[f"{kind}{suffix}"], lat[f"{kind}_resumed{suffix}"]])

    via_all, direct_all = with_resumed("via"), with_resumed("direct")
    out_all, out = with_resumed("via", "_out"), lat["via_out"]
    out_direct_all, out_direct = with_resumed("direct", "_out"), lat["direct_out"]
    out_resumed, out_direct_resumed = lat["via_resumed_out"], lat["direct_resumed_out"]
    # The calls that overlapped no weight update (from a version's publication to its load on
    # the last server), through the runtime and direct: the control plane's steady cost. A call
    # that overlaps one may wait for its server's update (interrupted, or sent to a server that
    # is loading), which is the update's cost; the simulation's versions come every few seconds,
    # a real run's every few minutes.
    ends_all, direct_ends = with_resumed("via", "_end"), with_resumed("direct", "_end")
    steady = ~during_updates(ends_all - via_all, ends_all, windows)
    steady_direct = ~during_updates(direct_ends - direct_all, direct_ends, windows)
    out_steady, out_direct_steady = out_all[steady], out_direct_all[steady_direct]
    calls_per_s = len(via_all) / dt
    m0, m1 = s0["manager"]["doing"], s1["manager"]["doing"]
    m_dt = s1["manager"]["time"] - s0["manager"]["time"]
    requests_per_s = rate(m0, m1, "requests", m_dt)
    server_requests = host_rates(s0["hosts"], s1["hosts"], "requests")
    etcd_ops = {k: rate(s0["etcd"], s1["etcd"], k, dt) for k in ("range", "put", "txn", "delete")}
    cpu, rss = dict.fromkeys(KINDS, 0.0), dict.fromkeys(KINDS, 0.0)
    for pid, kind in sampler.kind.items():
        if pid in s1["cpu"] and kind in cpu:
            cpu[kind] += (s1["cpu"][pid] - s0["cpu"].get(pid, s1["cpu"][pid])) / dt
            rss[kind] += s1["rss_mb"].get(pid, 0.0)

    def pct(a: np.ndarray, q: float) -> float | None:
        return float(np.percentile(a, q) * 1000) if len(a) else None

    def diff(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None else a - b

    def added_ci(q: float, via: np.ndarray, direct: np.ndarray, n: int = 400) -> list[float] | None:
        """A 90 % bootstrap interval of the added latency at percentile q (ms): the percentile
        of a few thousand calls with a long tail moves by more than the target itself."""
        if not len(via) or not len(direct):
            return None
        rng = np.random.default_rng(0)
        d = [
            np.percentile(rng.choice(via, len(via)), q) - np.percentile(rng.choice(direct, len(direct)), q)
            for _ in range(n)
        ]
        return [float(np.percentile(d, 5) * 1000), float(np.percentile(d, 95) * 1000)]

    return {
        "episodes_running": m1["running"],
        "calls_per_s": calls_per_s,
        "requests_per_s": requests_per_s,
        "trajectories_per_s": rate(m0, m1, "accepted", m_dt),
        "added_p50_ms": diff(pct(out_all, 50), pct(out_direct_all, 50)),
        "added_p99_ms": diff(pct(out_all, 99), pct(out_direct_all, 99)),
        "added_p50_ms_ci90": added_ci(50, out_all, out_direct_all),
        "added_p99_ms_ci90": added_ci(99, out_all, out_direct_all),
        # The same without the calls a weight update interrupted (and their share).
        "added_uninterrupted_p50_ms": diff(pct(out, 50), pct(out_direct, 50)),
        "added_uninterrupted_p99_ms": diff(pct(out, 99), pct(out_direct, 99)),
        "added_uninterrupted_p99_ms_ci90": added_ci(99, out, out_direct),
        "resumed_share": len(lat["via_resumed"]) / max(len(via_all), 1),
        "direct_resumed_share": len(lat["direct_resumed"]) / max(len(direct_all), 1),
        # The interrupted calls alone, through the runtime against direct.
        "added_resumed_p50_ms": diff(pct(out_resumed, 50), pct(out_direct_resumed, 50)),
        "added_resumed_p99_ms": diff(pct(out_resumed, 99), pct(out_direct_resumed, 99)),
        "resumed_outside_p50_ms": pct(out_resumed, 50),
        "direct_resumed_outside_p50_ms": pct(out_direct_resumed, 50),
        # The same over the calls that overlapped no weight update (and their share).
        "added_steady_p50_ms": diff(pct(out_steady, 50), pct(out_direct_steady, 50)),
        "added_steady_p99_ms": diff(pct(out_steady, 99), pct(out_direct_steady, 99)),
        "added_steady_p99_ms_ci90": added_ci(99, out_steady, out_direct_steady),
        "steady_share": float(steady.mean()) if len(steady) else 0.0,
        "outside_p50_ms": pct(out_all, 50),
        "outside_p99_ms": pct(out_all, 99),
        "direct_outside_p50_ms": pct(out_direct_all, 50),
        "direct_outside_p99_ms": pct(out_direct_all, 99),
        # By wall time alone (what this benchmark reported before it read the servers' own time).
        "added_wall_p50_ms": diff(pct(via_all, 50), pct(direct_all, 50)),
        "added_wall_p99_ms": diff(pct(via_all, 99), pct(direct_all, 99)),
        "added_wall_p99_ms_ci90": added_ci(99, via_all, direct_all),
        "via_p50_ms": pct(via_all, 50),
        "via_p99_ms": pct(via_all, 99),
        "direct_p50_ms": pct(direct_all, 50),
        "direct_p99_ms": pct(direct_all, 99),
        # The rollout workers' event loops: how late they woke (the worst, and summed over the
        # window), and the garbage collector's full collections (a pause for every episode there).
        "loop_lag_max_ms": float(lat["lag"].max() * 1000) if len(lat["lag"]) else 0.0,
        "loop_lag_s_per_s": float(lat["lag"].sum()) / dt,
        "gc2_pauses": len(lat["gc2"]),
        "gc2_pause_max_ms": float(lat["gc2"].max() * 1000) if len(lat["gc2"]) else 0.0,
        "gc_pause_s_per_s": float(sum(lat[k].sum() for k in ("gc0", "gc1", "gc2"))) / dt,
        "calls_measured": len(via_all),
        "direct_calls_measured": len(direct_all),
        "server_requests_per_s": server_requests,
        "health_checks_per_s": server_requests.get("/health", 0.0),
        "interrupted_per_s": host_rates(s0["hosts"], s1["hosts"], "engine").get("finish_abort", 0.0),
        "etcd_ops_per_s": sum(etcd_ops.values()),
        "etcd_ops_by_kind_per_s": etcd_ops,
        "etcd_keys": s1["etcd"]["keys"],
        "cpu_cores": cpu,
        "rss_mb": rss,
        "manager_cpu": cpu["manager"],
        "master_cpu": cpu["master"],
        # Per-request costs, steadier than latencies on a busy machine: CPU ms of each kind per
        # generation call served, and the manager's per request it answered.
        "cpu_ms_per_call": {k: 1000 * v / max(calls_per_s, 1e-9) for k, v in cpu.items()},
        "manager_cpu_ms_per_request": 1000 * cpu["manager"] / max(requests_per_s, 1e-9),
        "manager_requests_per_call": requests_per_s / max(calls_per_s, 1e-9),
        "machine_cores_busy": (s1["busy"] - s0["busy"]) / dt,
        "window_s": dt,
    }


# ---- the sweep and its output ----------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _ci(ci: list[float] | None) -> str:
    return "" if ci is None else f"[90% {ci[0]:.1f}..{ci[1]:.1f}]"


def print_row(r: dict) -> None:
    cpu, ws = r["cpu_cores"], r["weight_sync"]
    sync = (
        f"; manager: noticed -> all hold {ws['lag_s_mean']:.2f}s, update calls {ws['update_call_s_mean']:.2f}s, "
        f"{ws['requests_interrupted_per_update']:.0f} requests interrupted per update"
        if ws.get("versions")
        else ""
    )
    print(
        f"   {r['calls_per_s']:.0f}/{r['offered_calls_per_s']:.0f} calls/s served/offered, "
        f"{r['episodes_running']} episodes running; manager {r['requests_per_s']:.0f} requests/s; "
        f"added latency p50 {_ms(r['added_p50_ms'])} ms {_ci(r.get('added_p50_ms_ci90'))} "
        f"p99 {_ms(r['added_p99_ms'])} ms {_ci(r.get('added_p99_ms_ci90'))} "
        f"(outside the servers: via {_ms(r.get('outside_p50_ms'))}/{_ms(r.get('outside_p99_ms'))}, direct "
        f"{_ms(r.get('direct_outside_p50_ms'))}/{_ms(r.get('direct_outside_p99_ms'))}; by wall time: added p99 "
        f"{_ms(r.get('added_wall_p99_ms'))}, via {_ms(r['via_p50_ms'])}/{_ms(r['via_p99_ms'])}, direct "
        f"{_ms(r['direct_p50_ms'])}/{_ms(r['direct_p99_ms'])}); version to all servers {_ms(r['version_fanout_s'])} s "
        f"(max {_ms(r['version_fanout_max_s'])}, {r['versions']} versions, {r['versions_skipped']} skipped, "
        f"{r['versions_incomplete']} incomplete{sync})\n"
        f"   the {r['resumed_share']:.0%} of calls a weight update interrupted ({r['direct_resumed_share']:.0%} of "
        f"direct ones): outside the servers p50 {_ms(r['resumed_outside_p50_ms'])} ms (direct "
        f"{_ms(r['direct_resumed_outside_p50_ms'])}), added p50 {_ms(r['added_resumed_p50_ms'])} ms p99 "
        f"{_ms(r['added_resumed_p99_ms'])} ms; without them: added p50 "
        f"{_ms(r['added_uninterrupted_p50_ms'])} ms p99 {_ms(r['added_uninterrupted_p99_ms'])} ms "
        f"{_ci(r.get('added_uninterrupted_p99_ms_ci90'))}; over the {r['steady_share']:.0%} that overlapped no "
        f"weight update: added p50 {_ms(r['added_steady_p50_ms'])} ms p99 {_ms(r['added_steady_p99_ms'])} ms "
        f"{_ci(r.get('added_steady_p99_ms_ci90'))}\n"
        f"   rollout workers: event loop late by up to {r['loop_lag_max_ms']:.0f} ms "
        f"({r['loop_lag_s_per_s'] * 1000:.0f} ms/s); {r['gc2_pauses']} full collections, "
        f"up to {r['gc2_pause_max_ms']:.0f} ms; collector {r['gc_pause_s_per_s'] * 1000:.0f} ms/s\n"
        f"   manager {r['manager_cpu_ms_per_request']:.2f} CPU ms per request, {r['manager_requests_per_call']:.2f} "
        "requests per call; CPU ms per call: "
        + ", ".join(f"{k} {v:.2f}" for k, v in r["cpu_ms_per_call"].items())
        + "\n"
        f"   health checks {r['health_checks_per_s']:.0f}/s, etcd {r['etcd_ops_per_s']:.0f} ops/s "
        f"{r['etcd_keys']:.0f} keys; cores: "
        + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
        + f"; machine {r['machine_cores_busy']:.2f} busy, load avg {r['load_avg_before']:.1f}->"
        f"{r['load_avg_after']:.1f}",
        flush=True,
    )
    for label, prof in r.get("profile", {}).items():
        print(f"   py-spy {label}: {prof['cpu_s']:.1f} CPU s; top self time:")
        for row in prof["top_self"][:8]:
            print(f"     {row['seconds']:>6.2f}s {row['share']:>6.1%}  {row['function']}")
        print("   top inclusive:")
        for row in prof["top_inclusive"][:12]:
            print(f"     {row['seconds']:>6.2f}s {row['share']:>6.1%}  {row['function']}")


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'series':<11}{'routing':<8}{'N':>5}{'E':>7}{'calls/s':>9}{'offered':>9}{'mgr req/s':>10}"
        f"{'add p50':>9}{'add p99':>9}"
        f"{'fanout s':>9}{'health/s':>9}{'etcd op/s':>10}{'keys':>6}{'mgr cpu':>8}{'mgr MB':>7}{'master':>7}"
        f"{'load':>6}"
    )
    print("\n" + head)
    for r in rows:
        print(
            f"{r['series']:<11}{r.get('routing', 'manager'):<8}{r['servers']:>5}{r['episodes']:>7}"
            f"{r['calls_per_s']:>9.0f}"
            f"{r['offered_calls_per_s']:>9.0f}{r['requests_per_s']:>10.0f}{_ms(r['added_p50_ms']):>9}"
            f"{_ms(r['added_p99_ms']):>9}{_ms(r['version_fanout_s']):>9}{r['health_checks_per_s']:>9.0f}"
            f"{r['etcd_ops_per_s']:>10.0f}{r['etcd_keys']:>6.0f}{r['manager_cpu']:>8.2f}"
            f"{r['rss_mb']['manager']:>7.0f}{r['master_cpu']:>7.2f}{r['load_avg_before']:>6.1f}"
        )


PLOTTED = [
    ("added_p50_ms", "added latency p50 (ms)"),
    ("added_p99_ms", "added latency p99 (ms)"),
    ("version_fanout_s", "new version on all servers (s)"),
    ("requests_per_s", "manager requests/s"),
    ("health_checks_per_s", "health checks/s"),
    ("etcd_ops_per_s", "etcd KV ops/s"),
    ("manager_cpu", "manager CPU (cores)"),
    ("calls_per_s", "generation calls served/s"),
]


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    grid = [r for r in rows if r["series"] == "grid"]
    fig, axes = plt.subplots(2, 4, figsize=(18, 8))
    for ax, (key, title) in zip(axes.flat, PLOTTED):
        for routing, style in (("client", "-"), ("manager", "--")):
            for episodes in sorted({r["episodes"] for r in grid}):
                pts = sorted(
                    (r["servers"], r[key])
                    for r in grid
                    if r["episodes"] == episodes and r.get("routing") == routing and r[key] is not None
                )
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", label=f"{episodes} episodes, {routing} routing")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("servers (N)")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("realrl control plane, simulated servers")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)


def compare(rows: list[dict]) -> list[dict]:
    """Client-side routing against the manager's, point by point (the same
    run): the ratio manager / client of the added latency and the manager's
    requests and CPU (above 1: client-side routing is better by that factor)."""
    out = []
    by = {(r["servers"], r["episodes"], r.get("routing")): r for r in rows if r["series"] == "grid"}
    for (n, e, routing), client in sorted(by.items()):
        manager = by.get((n, e, "manager"))
        if routing != "client" or manager is None:
            continue
        ratio = {}
        for key in ("added_p50_ms", "added_p99_ms", "requests_per_s", "manager_cpu", "version_fanout_s"):
            a, b = manager.get(key), client.get(key)
            ratio[key] = a / b if a is not None and b not in (None, 0) and b > 0 else None
        out.append({"servers": n, "episodes": e, "manager_over_client": ratio})
    if out:
        print("\nmanager routing / client routing (above 1: client-side routing is better by that factor)")
        print(f"{'N':>5}{'E':>7}{'add p50':>9}{'add p99':>9}{'mgr req/s':>10}{'mgr cpu':>9}{'fanout':>8}")
        for c in out:
            r = c["manager_over_client"]
            cells = [
                r[k] for k in ("added_p50_ms", "added_p99_ms", "requests_per_s", "manager_cpu", "version_fanout_s")
            ]
            print(
                f"{c['servers']:>5}{c['episodes']:>7}"
                + "".join(f"{'-' if x is None else f'{x:.2f}':>{w}}" for x, w in zip(cells, (9, 9, 10, 9, 8)))
            )
    return out


def saturated(row: dict) -> bool:
    return row["calls_per_s"] < SATURATION_SERVED * row["offered_calls_per_s"] or row["manager_cpu"] >= 0.95


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 servers, 1k and 16k episodes, short windows")
    parser.add_argument("--servers", default="8,64,256,512", help="comma-separated server counts")
    parser.add_argument("--episodes", default="1024,4096,16384", help="comma-separated episodes in flight")
    parser.add_argument("--rate", type=float, default=200.0, help="generation calls per second offered")
    parser.add_argument("--turns", type=int, default=4, help="generation calls per episode")
    parser.add_argument("--output-tokens", type=int, default=32, help="tokens per simulated answer")
    parser.add_argument("--token-latency-ms", type=float, default=10.0, help="simulated time per token")
    parser.add_argument("--version-interval", type=float, default=2.5, help="seconds of production per train batch")
    parser.add_argument(
        "--train-speedup", type=float, default=20.0, help="the trainer takes batches this much faster than produced"
    )
    parser.add_argument("--window", type=float, default=30.0, help="seconds measured per point")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds between steady state and the window")
    parser.add_argument("--grace", type=float, default=5.0, help="seconds after the window for fan-outs to end")
    parser.add_argument("--servers-per-host", type=int, default=128)
    parser.add_argument("--rollout-workers", type=int, default=2)
    parser.add_argument(
        "--routing",
        default="client,manager",
        help="rollout.routing per point: client (the default; routed in the rollout workers), manager (per request, "
        "the baseline)",
    )
    parser.add_argument(
        "--probe-interval",
        type=float,
        default=0.0,
        help="seconds between direct calls per rollout worker (0: a direct twin of each call through the runtime, "
        "started at the same moment)",
    )
    parser.add_argument(
        "--saturation", action="store_true", help="raise the rate at the largest point until it saturates"
    )
    parser.add_argument("--saturation-from", type=float, default=25.0, help="the first rate of --saturation")
    parser.add_argument("--max-rate", type=float, default=3200.0, help="the last rate of --saturation")
    parser.add_argument("--profile", action="store_true", help="py-spy on the manager and master at the last point")
    parser.add_argument("--profile-rate", type=int, default=100, help="py-spy samples per second")
    parser.add_argument("--profile-kinds", default="manager,master", help=f"which processes to profile, of {KINDS}")
    parser.add_argument("--root", default=os.path.join("/tmp", "realrl_control_plane"))
    parser.add_argument("--keep", action="store_true", help="keep each trial's directory (logs, weights)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.servers, args.episodes = "256", "1024,16384"
        args.window, args.grace = min(args.window, 15.0), min(args.grace, 3.0)
    points = [
        Point(int(n), int(e), args.rate, routing=routing)
        for n in args.servers.split(",")
        for e in args.episodes.split(",")
        for routing in args.routing.split(",")
    ]
    os.makedirs(args.root, exist_ok=True)
    kit = make_kit(args.root)
    rows = []
    for i, point in enumerate(points):
        last = i == len(points) - 1 and not args.saturation
        rows.append(run_point(kit, point, args, profile=args.profile and last))
    if args.saturation:  # (with --profile, each of these points is profiled)
        top = max(points, key=lambda p: (p.servers, p.episodes))
        offered = args.saturation_from
        while offered <= args.max_rate:
            point = Point(top.servers, top.episodes, offered, "saturation", routing=points[0].routing)
            row = run_point(kit, point, args, profile=args.profile)
            rows.append(row)
            if saturated(row):
                break
            offered *= 2
    print_table(rows)
    comparison = compare(rows)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": {"cores": psutil.cpu_count(), "memory_gb": psutil.virtual_memory().total / 2**30},
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "plot")},
        "rows": rows,
        "comparison": comparison,
    }
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
