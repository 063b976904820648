"""Where one default run spends its CPU: per process kind, per stage, per function.

    python benchmarks/step_cost.py [--quick] [--steps N] [--json PATH] [--profile-out PATH]
                                   [--no-profile] [--rate HZ] [--native] [--lora R] [override ...]

Runs `training/main_async_ppo.py` once (the default config; `--steps` train
steps, 60 by default, 24 with `--quick`; periodic evaluation off so that it
does not land in the measured window; the tiny kit is built or found first,
by default under /tmp/kit when that exists, else `<fileroot>/cache`) as a
subprocess and watches its process tree with psutil:

- CPU: every process of the trial (launcher, etcd and its supervisor, master,
  trainer, generation server worker + its torch-server child, gserver manager,
  rollout worker; any other descendant counts for the worker above it) is
  sampled every 0.2 s. The CPU window opens at the first train step after a
  warm-up (~10% of the steps) and closes about half-way through (or at the
  last step with `--no-profile`); per kind the table shows CPU seconds in the
  window, CPU milliseconds per trained trajectory (trajectories consumed in
  the window, from stats.jsonl), cores busy on average and the share of the
  trial's CPU. The CPU that *other* processes on the machine used in the
  window is printed too: on a shared machine the numbers are noisy.
- Stages: means over the window's steps of the master's `time/*` stats
  (fetch, of which waiting for data; inference = proximal logprobs; train, of
  which publishing the weights) and the idle ratios; plus, from the manager
  log's ms timestamps, the weight-sync lag: from the manager noticing the
  trainer's new version to "all servers hold weight version v", and how many
  requests each update interrupted.
- Profile: in the second half of the run (so the sampler's own CPU stays out
  of the CPU window), `py-spy record --threads --nonblocking --format raw`
  samples every Python process of the trial at `--rate` Hz until the last
  step starts. Each thread's samples are weighted by the CPU seconds psutil
  saw that thread use meanwhile, so the profile is in CPU seconds and a
  thread blocked in a wait costs nothing (py-spy's own idle detection is
  unreliable here); threads with CPU but no Python frame (zmq and grpc I/O,
  torch's OpenMP pool) show as `[native thread NAME]`. Per process: the
  top-10 functions by self and by inclusive CPU time, self CPU per package,
  and the busiest threads. Python frames only (`--native` adds C frames; a
  torch op's time is charged to the Python line that called it). Needs py-spy
  (`pip install -e .[dev]` or `pip install py-spy`) and ptrace permission
  (root, or kernel.yama.ptrace_scope=0); without it the run still reports CPU
  and stages and says why there is no profile.

`--lora R` runs the trial a second time with `model.lora.rank=R` (and
`optimizer.lr=--lora-lr`, no profile) and prints a row per run: bytes
published per version (the newest version's directory), seconds publishing
per step, the weight-sync lag, the trainer's peak RSS (psutil, every 0.2 s)
and steps per minute.

Prints the tables; `--json PATH` writes everything with a top-level "ratio" =
CPU of the model processes (trainer + generation server) / CPU of the whole
trial in the window (1.0 would mean no orchestration cost at all);
`--profile-out PATH` (default benchmarks/results/step_cost_profile.txt) gets
the per-process function tables. Extra arguments are Hydra overrides of the
run (e.g. `allocation_mode=torch.d2p1m1+d1p1m1`). Nothing the script started
outlives it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import psutil

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, _REPO)

from realrl.base.process import stop_process_tree, with_parent_death_signal  # noqa: E402
from realrl.experiment.build import resolve_model_and_data  # noqa: E402
from realrl.experiment.config import load_config, trial_paths  # noqa: E402

KINDS = ["master", "trainer", "generation server", "manager", "rollout worker", "etcd", "launcher"]
MODEL_KINDS = ("trainer", "generation server")
# A spec file's worker type -> the kind its CPU counts for (benchmarks/control_plane.py adds its own).
SPEC_KIND = {
    "master_worker": "master",
    "model_worker": "trainer",
    "generation_server": "generation server",
    "gserver_manager": "manager",
    "rollout_worker": "rollout worker",
}
SAMPLE_S = 0.2
EXPERIMENT = "step-cost"
STAGE_KEYS = [
    ("time/step_s", "step"),
    ("time/fetch_s", "fetch"),
    ("time/wait_data_s", "  of which waiting for data"),
    ("time/inference_s", "inference (proximal logprobs)"),
    ("time/train_s", "train"),
    ("time/publish_s", "  of which publishing weights"),
    ("perf/trainer_idle_ratio", "trainer idle ratio"),
    ("perf/gen_idle_ratio", "generation idle ratio"),
]


# ---- the process tree ------------------------------------------------------------------


def classify(proc: psutil.Process, launcher_pid: int) -> tuple[str, str] | None:
    """(kind, process label) of a trial process we can tell from its command line; None if not."""
    if proc.pid == launcher_pid:
        return "launcher", "launcher"
    try:
        cmd = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None
    line = " ".join(cmd)
    if "realrl.impl.generation.torch_server" in line or "sglang.launch_server" in line:
        return "generation server", "generation server/server"
    if "realrl.base.etcd_server" in line:
        return "etcd", "etcd/supervisor"
    if cmd and os.path.basename(cmd[0]) == "etcd":
        return "etcd", "etcd/server"
    if "--spec" in cmd:
        spec = os.path.basename(cmd[cmd.index("--spec") + 1]) if cmd.index("--spec") + 1 < len(cmd) else ""
        m = re.fullmatch(r"(.+)-(\d+)\.json", spec)
        if m and m.group(1) in SPEC_KIND:
            kind = SPEC_KIND[m.group(1)]
            suffix = "/worker" if kind == "generation server" else ""
            return kind, f"{kind}{suffix}-{m.group(2)}"
    return None


class TreeSampler:
    """Last seen CPU seconds (user + system, own threads only) of every
    process in the launcher's tree, with its kind."""

    def __init__(self, launcher_pid: int):
        self.launcher_pid = launcher_pid
        self.procs: dict[int, psutil.Process] = {}
        self.kind: dict[int, str] = {}
        self.label: dict[int, str] = {}
        self.python: dict[int, bool] = {}
        self.cpu: dict[int, float] = {}
        self.peak_rss: dict[int, int] = {}  # bytes, the most seen in any sample

    def sample(self) -> None:
        try:
            root = psutil.Process(self.launcher_pid)
            tree = [root] + root.children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            if p.pid not in self.procs:
                self.procs[p.pid] = p
            if p.pid not in self.kind:
                found = classify(p, self.launcher_pid)
                if found is None:  # a helper: it counts for the nearest classified ancestor
                    try:
                        parents = p.parents()
                    except psutil.NoSuchProcess:
                        parents = []
                    owner = next((q.pid for q in parents if q.pid in self.kind), None)
                    if owner is None:
                        continue  # not yet classifiable (e.g. before exec); try again next sample
                    found = (self.kind[owner], f"{self.label[owner]}/child")
                self.kind[p.pid], self.label[p.pid] = found
                try:
                    exe = " ".join(p.cmdline()[:1])
                except psutil.Error:
                    exe = ""
                self.python[p.pid] = "python" in os.path.basename(exe)
        for pid, p in self.procs.items():
            try:
                t = p.cpu_times()
                self.cpu[pid] = t.user + t.system
                self.peak_rss[pid] = max(self.peak_rss.get(pid, 0), p.memory_info().rss)
            except (psutil.NoSuchProcess, psutil.ZombieProcess):
                pass  # keep its last value

    def snapshot(self) -> dict[int, float]:
        self.sample()
        return dict(self.cpu)

    def python_pids(self) -> dict[int, str]:
        """Live Python processes of the trial: pid -> label."""
        out = {}
        for pid, label in self.label.items():
            if self.python.get(pid) and self.procs[pid].is_running():
                out[pid] = label
        return out


def machine_busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.system + getattr(t, "nice", 0.0) + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


# ---- stats and logs ----------------------------------------------------------------------


class StatsTail:
    """Reads stats.jsonl as it grows; keeps the train-step records by step."""

    def __init__(self, path: str):
        self.path = path
        self.offset = 0
        self.partial = ""
        self.steps: dict[int, dict] = {}

    def poll(self) -> None:
        try:
            with open(self.path) as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        self.offset += len(chunk.encode())
        *lines, self.partial = (self.partial + chunk).split("\n")
        for line in lines:
            if not line.strip():
                continue
            rec = json.loads(line)
            if "train/actor_loss" in rec:
                self.steps[int(rec["step"])] = rec

    @property
    def last_step(self) -> int:
        return max(self.steps, default=0)


_TS = re.compile(r"^(\d\d):(\d\d):(\d\d)\.(\d{3}) ")


def _log_times(path: str, pattern: re.Pattern) -> dict[int, tuple[float, re.Match]]:
    """version -> (seconds of day, match) of the first log line matching `pattern` (group 'v')."""
    out: dict[int, tuple[float, re.Match]] = {}
    try:
        with open(path, errors="replace") as f:
            for line in f:
                ts, m = _TS.match(line), pattern.search(line)
                if ts and m:
                    h, mi, s, ms = (int(x) for x in ts.groups())
                    out.setdefault(int(m.group("v")), (h * 3600 + mi * 60 + s + ms / 1000, m))
    except FileNotFoundError:
        pass
    return out


def weight_sync_lags(log_dir: str, versions: range) -> dict:
    """From the manager noticing the trainer's version v ("trainer weight
    version u -> v": read from the name service every poll_interval) to "all
    servers hold weight version v", from the manager's log. The trainer's
    publishing time before that is time/publish_s."""
    path = os.path.join(log_dir, "gserver_manager-0.log")
    noticed = _log_times(path, re.compile(r"trainer weight version \d+ -> (?P<v>\d+)"))
    held = _log_times(
        path, re.compile(r"all servers hold weight version (?P<v>\d+) \((?P<s>[\d.]+)s, (?P<n>\d+) requests")
    )
    lags, update_s, interrupted = [], [], []
    for v in versions:
        if v in noticed and v in held:
            lags.append((held[v][0] - noticed[v][0]) % 86400)
            update_s.append(float(held[v][1].group("s")))
            interrupted.append(int(held[v][1].group("n")))
    if not lags:
        return {"versions": 0}
    return {
        "versions": len(lags),
        "lag_s_mean": sum(lags) / len(lags),
        "lag_s_max": max(lags),
        "update_call_s_mean": sum(update_s) / len(update_s),
        "requests_interrupted_per_update": sum(interrupted) / len(interrupted),
    }


# ---- py-spy ------------------------------------------------------------------------------


def find_py_spy() -> str | None:
    exe = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    return exe if os.path.isfile(exe) and os.access(exe, os.X_OK) else None


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (thread name, CPU seconds) of one process."""
    out = {}
    try:
        threads = psutil.Process(pid).threads()
    except psutil.Error:
        return out
    for t in threads:
        try:
            with open(f"/proc/{pid}/task/{t.id}/comm") as f:
                name = f.read().strip()
        except OSError:
            name = "?"
        out[t.id] = (name, t.user_time + t.system_time)
    return out


def start_profilers(py_spy: str, targets: dict[int, str], out_dir: str, rate: int, native: bool) -> list[dict]:
    """One `py-spy record` per process. --nonblocking: the blocking mode's
    pauses make py-spy report threads blocked in a wait as running."""
    profs = []
    for pid, label in sorted(targets.items(), key=lambda kv: kv[1]):
        path = os.path.join(out_dir, f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', label)}-{pid}.txt")
        cmd = [
            py_spy,
            "record",
            "--pid",
            str(pid),
            "--rate",
            str(rate),
            "--format",
            "raw",
            "--output",
            path,
            "--duration",
            "3600",
            "--full-filenames",
            "--nolineno",
            "--threads",
            "--nonblocking",
        ]
        if native:
            cmd.append("--native")
        with open(path + ".log", "wb") as log:  # (SIGKILLed with us, should we die)
            proc = subprocess.Popen(
                with_parent_death_signal(cmd, os.getpid()),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        profs.append(
            {
                "pid": pid,
                "label": label,
                "path": path,
                "proc": proc,
                "started": time.monotonic(),
                "threads_before": thread_cpu(pid),
            }
        )
    return profs


def stop_profilers(profs: list[dict]) -> None:
    for p in profs:
        if p["proc"].poll() is None:
            p["threads_after"] = thread_cpu(p["pid"])
            p["seconds"] = time.monotonic() - p["started"]
            p["proc"].send_signal(signal.SIGINT)  # py-spy writes its output on Ctrl-C
    for p in profs:
        try:
            p["proc"].wait(timeout=30)
        except subprocess.TimeoutExpired:
            p["proc"].kill()
            p["proc"].wait()


# Frames every stack of a thread passes through (entry points, event loops,
# the worker loop, torch's module-call wrappers): left out of the inclusive
# ranking, where they would fill the top 10 with ~100% each.
_PLUMBING = re.compile(
    r"^(_run_module_as_main|_run_code|<module>|Thread\._bootstrap(_inner)?|Thread\.run|run|Runner\.run|"
    r"BaseEventLoop\.(run_forever|run_until_complete|_run_once)|Handle\._run|main|run_worker|"
    r"Worker\.run|(Async)?Worker\._main_loop|Module\._(wrapped_)?call_impl) \("
)
_FRAME = re.compile(r"^(?P<func>.*) \((?P<file>.*?)(?::(?P<line>\d+))?\)$")
_THREAD = re.compile(r"^thread \((?P<tid>\d+)\)")


_STDLIB = re.compile(r"/lib/python3\.\d+/")


def _split_path(path: str) -> tuple[str, str]:
    """(where, short path): where is "site", "repo", "stdlib" or "other"."""
    if "site-packages/" in path:
        return "site", path.split("site-packages/", 1)[1]
    if path.startswith(_REPO + "/"):
        return "repo", path[len(_REPO) + 1 :]
    m = _STDLIB.search(path)
    if m:
        return "stdlib", path[m.end() :]
    return "other", path


def _package(path: str) -> str:
    """What a frame's self time is charged to: a third-party package, a stdlib
    module (asyncio, json, ...) or a realrl module."""
    where, short = _split_path(path)
    first = short.split("/", 1)[0].removesuffix(".py")
    if where == "repo":
        return short.removesuffix(".py")
    if where == "stdlib":
        return f"stdlib {first}"
    return first if where == "site" else os.path.basename(short) or short


def _function(frame: str) -> tuple[str, str]:
    m = _FRAME.match(frame)
    if not m:
        return frame, "?"
    return f"{m.group('func')} ({_split_path(m.group('file'))[1]})", m.group("file")


def summarize_profile(path: str, before: dict, after: dict, top: int = 10) -> dict:
    """Top functions by self and inclusive CPU time, and self CPU per package,
    of one raw py-spy file (recorded with --threads). Each thread's samples are
    weighted by the CPU seconds psutil saw that thread use while it was
    profiled, so seconds are CPU seconds; threads with CPU but no Python
    sample (zmq / grpc I/O threads, torch's OpenMP workers) appear as
    `[native thread NAME]`."""
    per_thread: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
    with open(path, errors="replace") as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = [fr for fr in stack.split(";") if fr]
            m = _THREAD.match(frames[0]) if frames else None
            if m is None:
                continue
            per_thread[int(m.group("tid"))][tuple(frames[1:])] += int(count)
    cpu = {tid: max(0.0, after[tid][1] - before.get(tid, ("", 0.0))[1]) for tid in after}
    self_s: collections.Counter = collections.Counter()
    incl_s: collections.Counter = collections.Counter()
    pkg_s: collections.Counter = collections.Counter()
    threads = []
    for tid, seconds in sorted(cpu.items(), key=lambda kv: -kv[1]):
        stacks = per_thread.get(tid)
        n = sum(stacks.values()) if stacks else 0
        name = after[tid][0]
        threads.append({"tid": tid, "name": name, "cpu_s": seconds, "python_samples": n})
        if seconds <= 0:
            continue
        if not n:
            self_s[f"[native thread {name}]"] += seconds
            pkg_s[f"[native thread {name}]"] += seconds
            continue
        for frames, k in stacks.items():
            w = seconds * k / n
            funcs = [_function(fr) for fr in frames] or [("[no frame]", "?")]
            self_s[funcs[-1][0]] += w
            pkg_s[_package(funcs[-1][1])] += w
            for name_ in {fn for fn, _ in funcs if not _PLUMBING.match(fn)}:
                incl_s[name_] += w
    total = sum(cpu.values())

    def rows(counter: collections.Counter, col: str) -> list[dict]:
        return [{col: k, "seconds": v, "share": v / max(total, 1e-9)} for k, v in counter.most_common(top)]

    return {
        "cpu_s": total,
        "top_self": rows(self_s, "function"),
        "top_inclusive": rows(incl_s, "function"),
        "packages": rows(pkg_s, "package"),
        "threads": threads[:top],
    }


# ---- the run -----------------------------------------------------------------------------


def newest_version_bytes(weights_dir: str) -> int | None:
    """Size of the newest published version (every file of `<weights_dir>/<v>/`)."""
    versions = [int(v) for v in os.listdir(weights_dir) if v.isdigit()] if os.path.isdir(weights_dir) else []
    if not versions:
        return None
    newest = os.path.join(weights_dir, str(max(versions)))
    return sum(os.path.getsize(os.path.join(newest, f)) for f in os.listdir(newest))


def default_cache_dir(overrides: list[str]) -> list[str]:
    if any(o.startswith("tiny_kit.cache_dir=") for o in overrides) or not os.path.isdir("/tmp/kit"):
        return []
    return ["tiny_kit.cache_dir=/tmp/kit"]


def run(args, overrides: list[str], profile: bool = True) -> dict:
    steps = args.steps
    run_overrides = [
        f"experiment_name={EXPERIMENT}",
        "trial_name=run0",
        f"fileroot={args.fileroot}",
        f"total_train_steps={steps}",
        "eval.every_n_steps=0",
        *default_cache_dir(overrides),
        *overrides,
    ]
    cfg = load_config(run_overrides)
    resolve_model_and_data(cfg, os.path.abspath(cfg.fileroot))  # build or find the kit before timing
    paths = trial_paths(cfg)
    shutil.rmtree(paths.log_dir, ignore_errors=True)  # a fresh stats.jsonl and logs
    warmup = max(2, steps // 10)
    profile = profile and not args.no_profile
    py_spy = find_py_spy() if profile else None
    profile_note = None
    if profile and py_spy is None:
        profile_note = "py-spy not found: no profile (pip install -e .[dev], or pip install py-spy)"
        print(f"step_cost: {profile_note}", file=sys.stderr)
        profile = False
    cpu_end_step = warmup + (steps - warmup) // 2 if profile else steps
    profile_end_step = steps - 1

    os.makedirs(paths.fileroot, exist_ok=True)
    console_path = os.path.join(paths.fileroot, f"{EXPERIMENT}-console.log")
    console = open(console_path, "wb")
    t_launch = time.monotonic()
    # With a parent-death signal: if this script is SIGKILLed, the launcher is too, and its workers
    # (and etcd) stop on their own when its keep-alive key expires.
    command = [sys.executable, os.path.join(_REPO, "training", "main_async_ppo.py"), *run_overrides]
    launcher = subprocess.Popen(
        with_parent_death_signal(command, os.getpid()),
        stdout=console,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        cwd=_REPO,
        start_new_session=True,
    )
    console.close()
    sampler = TreeSampler(launcher.pid)
    tail = StatsTail(os.path.join(paths.log_dir, "stats.jsonl"))
    start = end = None  # (step, monotonic, cpu per pid, machine busy s)
    first_step_s = None  # launch -> the first step's stats (start-up: processes, models, etcd, step-0 evaluation)
    profs: list[dict] = []
    prof_dir = os.path.join(paths.fileroot, f"{EXPERIMENT}-pyspy")
    deadline = time.monotonic() + args.timeout
    try:
        while launcher.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not finish within {args.timeout:.0f}s")
            sampler.sample()
            tail.poll()
            step = tail.last_step
            if first_step_s is None and step >= 1:
                first_step_s = time.monotonic() - t_launch
            if start is None and step >= warmup:
                start = (step, time.monotonic(), sampler.snapshot(), machine_busy_s())
            if start is not None and end is None and step >= cpu_end_step:
                end = (step, time.monotonic(), sampler.snapshot(), machine_busy_s())
                if profile and step < profile_end_step:
                    shutil.rmtree(prof_dir, ignore_errors=True)
                    os.makedirs(prof_dir)
                    profs = start_profilers(py_spy, sampler.python_pids(), prof_dir, args.rate, args.native)
            if profs and step >= profile_end_step and any(p["proc"].poll() is None for p in profs):
                stop_profilers(profs)
            time.sleep(SAMPLE_S)
        code = launcher.wait()
    except BaseException:
        stop_profilers(profs)
        launcher.send_signal(signal.SIGTERM)  # the launcher stops its workers (and etcd) itself
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        stop_process_tree(launcher, grace_s=5)
        for pid, p in sampler.procs.items():  # a worker in its own group that outlived the launcher
            if p.is_running():
                try:
                    p.kill()
                except psutil.Error:
                    pass
        raise
    finally:
        stop_profilers([p for p in profs if p["proc"].poll() is None])
    wall = time.monotonic() - t_launch
    tail.poll()
    if code != 0:
        raise SystemExit(f"the run failed with exit code {code}; see {console_path} and {paths.log_dir}")
    if start is None or end is None:
        raise SystemExit(f"the run ended before the measuring window closed (steps seen: {tail.last_step})")

    s0, s1 = start[0], end[0]
    window_s = end[1] - start[1]
    trajectories = tail.steps[s1]["consumed"] - tail.steps[s0]["consumed"]
    per_kind = {k: {"cpu_s": 0.0, "processes": 0} for k in KINDS}
    per_process = {}
    for pid, kind in sampler.kind.items():
        before, after = start[2].get(pid, 0.0), end[2].get(pid)
        if after is None:
            continue
        delta = after - before
        per_kind[kind]["cpu_s"] += delta
        per_kind[kind]["processes"] += 1
        per_process[f"{sampler.label[pid]} ({pid})"] = delta
    total_cpu = sum(v["cpu_s"] for v in per_kind.values())
    for v in per_kind.values():
        v["cpu_ms_per_trajectory"] = 1000 * v["cpu_s"] / max(trajectories, 1)
        v["cores"] = v["cpu_s"] / max(window_s, 1e-9)
        v["share"] = v["cpu_s"] / max(total_cpu, 1e-9)
    others_cores = max(0.0, (end[3] - start[3]) - total_cpu) / max(window_s, 1e-9)

    window = [tail.steps[s] for s in range(s0 + 1, s1 + 1) if s in tail.steps]
    stages = {}
    for key, _ in STAGE_KEYS:
        values = [r[key] for r in window if isinstance(r.get(key), (int, float))]
        if values:
            stages[key] = sum(values) / len(values)
    window_steps = s1 - s0
    result = {
        "steps": steps,
        "window": {
            "first_step": s0,
            "last_step": s1,
            "steps": window_steps,
            "trajectories": trajectories,
            "wall_s": window_s,
            "steps_per_min": 60 * window_steps / max(window_s, 1e-9),
            "cpu_s_total": total_cpu,
            "cores_busy": total_cpu / max(window_s, 1e-9),
            "machine_cores": psutil.cpu_count(),
            "other_processes_cores": others_cores,
        },
        "per_kind": per_kind,
        "per_process_cpu_s": per_process,
        "stages_s_per_step": stages,
        "weight_sync": weight_sync_lags(paths.log_dir, range(s0 + 1, s1 + 1)),
        "published_bytes_per_version": newest_version_bytes(paths.weights_dir),
        "trainer_peak_rss_mb": max(
            (rss / 2**20 for pid, rss in sampler.peak_rss.items() if sampler.kind.get(pid) == "trainer"), default=None
        ),
        "run_wall_s": wall,
        "launch_to_first_step_s": first_step_s,
        "log_dir": paths.log_dir,
        "ratio": sum(per_kind[k]["cpu_s"] for k in MODEL_KINDS) / max(total_cpu, 1e-9),
    }
    if profile_note:
        result["profile_note"] = profile_note
    if profs:
        profiles = {}
        for p in profs:
            name = f"{p['label']} ({p['pid']})"
            if os.path.isfile(p["path"]) and "threads_after" in p:  # (empty: no Python frame ever ran)
                summary = summarize_profile(p["path"], p["threads_before"], p["threads_after"])
                profiles[name] = {**summary, "seconds_profiled": p["seconds"]}
            else:
                with open(p["path"] + ".log", errors="replace") as f:
                    why = " ".join(f.read().split())[-300:]
                profiles[name] = {"error": f"py-spy wrote no profile: {why}"}
        result["profile"] = {
            "rate_hz": args.rate,
            "native": args.native,
            "from_step": s1,
            "to_step": profile_end_step,
            "processes": profiles,
        }
    return result


# ---- output ------------------------------------------------------------------------------


def print_tables(r: dict) -> None:
    w = r["window"]
    print(
        f"\nstep cost: steps {w['first_step']}->{w['last_step']} of {r['steps']} ({w['steps']} steps, "
        f"{w['trajectories']} trajectories, {w['wall_s']:.1f}s, {w['steps_per_min']:.1f} steps/min); "
        f"the trial kept {w['cores_busy']:.2f} of {w['machine_cores']} cores busy, "
        f"other processes {w['other_processes_cores']:.2f}"
    )
    print(f"{'process':<20}{'procs':>6}{'CPU s':>9}{'ms/traj':>9}{'cores':>7}{'share':>7}")
    for kind, v in r["per_kind"].items():
        print(
            f"{kind:<20}{v['processes']:>6}{v['cpu_s']:>9.2f}{v['cpu_ms_per_trajectory']:>9.1f}"
            f"{v['cores']:>7.2f}{v['share']:>7.1%}"
        )
    total = w["cpu_s_total"]
    print(f"{'total':<20}{'':>6}{total:>9.2f}{1000 * total / max(w['trajectories'], 1):>9.1f}{w['cores_busy']:>7.2f}")
    print("per process: " + ", ".join(f"{name} {cpu:.2f}" for name, cpu in r["per_process_cpu_s"].items()))
    print(f"model processes (trainer + generation server) / all: {r['ratio']:.2f}")
    if r.get("launch_to_first_step_s") is not None:
        print(
            f"whole command {r['run_wall_s']:.1f}s; launch -> first step done {r['launch_to_first_step_s']:.1f}s "
            "(start-up, step-0 evaluation, first batch)"
        )
    print("\nseconds per step (window mean)")
    for key, label in STAGE_KEYS:
        if key in r["stages_s_per_step"]:
            print(f"  {label:<32}{r['stages_s_per_step'][key]:>8.3f}")
    ws = r["weight_sync"]
    if ws.get("versions"):
        print(
            f"  {'new version noticed -> served':<32}{ws['lag_s_mean']:>8.3f}  (max {ws['lag_s_max']:.3f}; "
            f"update call {ws['update_call_s_mean']:.3f}s; {ws['requests_interrupted_per_update']:.1f} "
            f"requests interrupted per update)"
        )
    if "profile_note" in r:
        print(f"\nprofile: {r['profile_note']}")


def print_lora_rows(full: dict, lora: dict, rank: int) -> None:
    """Full fine-tuning against LoRA on the same run: what one version costs."""
    print(f"\nfull fine-tuning vs LoRA rank {rank} (same run otherwise)")
    print(
        f"{'':<6}{'bytes/version':>15}{'publish s':>11}{'noticed->served s':>19}{'trainer RSS MB':>16}{'steps/min':>11}"
    )
    nan = float("nan")
    for name, r in (("full", full), ("lora", lora)):
        ws = r["weight_sync"]
        publish = r["stages_s_per_step"].get("time/publish_s", nan)
        lag = ws["lag_s_mean"] if ws.get("versions") else nan
        rss = r["trainer_peak_rss_mb"] or nan
        size = r["published_bytes_per_version"] or 0
        print(f"{name:<6}{size:>15,}{publish:>11.3f}{lag:>19.3f}{rss:>16.0f}{r['window']['steps_per_min']:>11.1f}")


def profile_text(r: dict) -> str:
    prof = r.get("profile")
    if not prof:
        return r.get("profile_note", "no profile") + "\n"
    out = [
        f"py-spy record --threads --nonblocking at {prof['rate_hz']} Hz{' --native' if prof['native'] else ''}, "
        f"steps {prof['from_step']}->{prof['to_step']}; seconds = CPU seconds of each thread (psutil) "
        "spread over that thread's sampled stacks"
    ]
    for name, p in prof["processes"].items():
        out.append(f"\n== {name}")
        if "error" in p:
            out.append(f"   {p['error']}")
            continue
        out.append(
            f"   {p['cpu_s']:.2f} CPU s in {p['seconds_profiled']:.1f}s profiled; busiest threads: "
            + ", ".join(f"{t['name']} {t['cpu_s']:.2f}s" for t in p["threads"][:4])
        )
        for title, key, col in (
            ("self time", "top_self", "function"),
            ("inclusive time (entry points and event loops left out)", "top_inclusive", "function"),
            ("self time by package", "packages", "package"),
        ):
            out.append(f"   -- top {title}")
            for row in p[key]:
                out.append(f"   {row['seconds']:>8.2f}s {row['share']:>6.1%}  {row[col]}")
    return "\n".join(out) + "\n"


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (24 steps)")
    parser.add_argument("--steps", type=int, default=None, help="train steps of the run (default 60)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile-out", default=os.path.join(_REPO, "benchmarks", "results", "step_cost_profile.txt"))
    parser.add_argument("--no-profile", action="store_true", help="no py-spy; the CPU window runs to the last step")
    parser.add_argument("--rate", type=int, default=50, help="py-spy samples per second")
    parser.add_argument("--native", action="store_true", help="py-spy --native (C/C++ frames too; slower)")
    parser.add_argument("--timeout", type=float, default=1800.0)
    parser.add_argument("--fileroot", default=os.path.join(_REPO, "runs", "bench"))
    parser.add_argument(
        "--lora", type=int, default=0, help="then run again with model.lora.rank=R and print a LoRA-vs-full row"
    )
    parser.add_argument("--lora-lr", type=float, default=2e-3, help="optimizer.lr of the LoRA run")
    args, overrides = parser.parse_known_args()
    args.steps = args.steps or (24 if args.quick else 60)
    signal.signal(signal.SIGTERM, _interrupt)  # stop the trial and the profilers on the way out
    if args.steps < 8:
        parser.error("--steps must be >= 8 (warm-up, CPU window and profile window)")
    result = run(args, overrides)
    result["date"] = datetime.date.today().isoformat()
    print_tables(result)
    if args.lora:
        lora_overrides = [*overrides, f"model.lora.rank={args.lora}", f"optimizer.lr={args.lora_lr}"]
        result["lora"] = run(args, lora_overrides, profile=False)
        result["lora"]["rank"] = args.lora
        print_lora_rows(result, result["lora"], args.lora)
    text = profile_text(result)
    if args.profile_out:
        os.makedirs(os.path.dirname(os.path.abspath(args.profile_out)), exist_ok=True)
        with open(args.profile_out, "w") as f:
            f.write(text)
        print(f"profile: {args.profile_out}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt:
        print("interrupted; everything this script started is stopped", file=sys.stderr)
        sys.exit(130)
