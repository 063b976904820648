"""The only place name_resolve keys are built (docs/design.md §3).

Every key of a trial lives under `<user>/<experiment>/<trial>/`, so clearing
one trial (`name_resolve.clear_subtree(names.trial_root(exp, trial))`) never
touches another. The user part comes from REALRL_USER, else the login name.
"""

from __future__ import annotations

import getpass
import os


def _user() -> str:
    user = os.environ.get("REALRL_USER")
    if user:
        return user
    try:
        return getpass.getuser()
    except Exception:  # no passwd entry (some containers)
        return f"uid{os.getuid()}"


def trial_root(experiment_name: str, trial_name: str) -> str:
    for part, what in ((experiment_name, "experiment_name"), (trial_name, "trial_name")):
        if not part or "/" in part or part in (".", ".."):
            raise ValueError(f"invalid {what} {part!r}: non-empty, no '/'")
    return f"{_user()}/{experiment_name}/{trial_name}"


# ---- trial lifecycle -------------------------------------------------------


def experiment_status(experiment_name: str, trial_name: str) -> str:
    """Value: RUNNING | COMPLETE | ABORTED. Workers exit on the last two."""
    return f"{trial_root(experiment_name, trial_name)}/experiment_status"


def launcher_keepalive(experiment_name: str, trial_name: str) -> str:
    """Held with a TTL by the launcher; workers exit when it disappears."""
    return f"{trial_root(experiment_name, trial_name)}/launcher_keepalive"


def worker_status_root(experiment_name: str, trial_name: str) -> str:
    return f"{trial_root(experiment_name, trial_name)}/worker_status"


def worker_status(experiment_name: str, trial_name: str, worker_type: str, worker_index: int) -> str:
    """Value: READY | RUNNING | PAUSED | COMPLETED | STOPPED | ERROR, refreshed with a TTL."""
    return f"{worker_status_root(experiment_name, trial_name)}/{worker_type}/{worker_index}"


def worker_error(experiment_name: str, trial_name: str, worker_type: str, worker_index: int) -> str:
    """Value: the traceback of the exception that stopped the worker."""
    return f"{trial_root(experiment_name, trial_name)}/worker_error/{worker_type}/{worker_index}"


def worker_progress_root(experiment_name: str, trial_name: str) -> str:
    return f"{trial_root(experiment_name, trial_name)}/worker_progress"


def worker_progress(experiment_name: str, trial_name: str, worker_type: str, worker_index: int) -> str:
    """Value: JSON `{"host", "pid", "state", "time", "progress", "doing", ...}`,
    rewritten by the worker every two seconds from its loop (no TTL: a dead
    worker's last record stays, and its `time` says since when it is silent)."""
    return f"{worker_progress_root(experiment_name, trial_name)}/{worker_type}/{worker_index}"


def stack_dump_request(experiment_name: str, trial_name: str) -> str:
    """Value: the id of the newest request for stack dumps; every worker then
    appends the stacks of all its threads to its stacks file (`realrl status
    --stacks`, the hang watchdog)."""
    return f"{trial_root(experiment_name, trial_name)}/stack_dump_request"


def used_ports(experiment_name: str, trial_name: str, host: str) -> str:
    """Subtree of `<port>` keys: ports already handed to a process of the trial."""
    return f"{trial_root(experiment_name, trial_name)}/used_ports/{host}"


# ---- streams ---------------------------------------------------------------


def push_pull_stream(experiment_name: str, trial_name: str, stream_name: str) -> str:
    """Value: `host:port` a puller bound, e.g. stream_name = `puller0`."""
    return f"{trial_root(experiment_name, trial_name)}/push_pull_stream/{stream_name}"


def push_pull_stream_root(experiment_name: str, trial_name: str) -> str:
    return f"{trial_root(experiment_name, trial_name)}/push_pull_stream"


def request_reply_stream(experiment_name: str, trial_name: str, stream_name: str) -> str:
    return f"{trial_root(experiment_name, trial_name)}/request_reply_stream/{stream_name}"


def request_reply_stream_root(experiment_name: str, trial_name: str) -> str:
    return f"{trial_root(experiment_name, trial_name)}/request_reply_stream"


def distributed_init(experiment_name: str, trial_name: str, group: str) -> str:
    """Value: `host:port` of a torch.distributed rendezvous for `group`."""
    return f"{trial_root(experiment_name, trial_name)}/distributed_init/{group}"


# ---- generation ------------------------------------------------------------


def gen_servers(experiment_name: str, trial_name: str) -> str:
    """Subtree: one `<server_index>` key per generation server, value its URL."""
    return f"{trial_root(experiment_name, trial_name)}/gen_servers"


def gen_server(experiment_name: str, trial_name: str, server_index: int) -> str:
    return f"{gen_servers(experiment_name, trial_name)}/{server_index}"


def judge_servers(experiment_name: str, trial_name: str) -> str:
    """Subtree: one `<server_index>` key per judge server (realrl/impl/judge.py),
    value its URL. The generation-server manager never reads it."""
    return f"{trial_root(experiment_name, trial_name)}/judge_servers"


def judge_server(experiment_name: str, trial_name: str, server_index: int) -> str:
    return f"{judge_servers(experiment_name, trial_name)}/{server_index}"


def gen_server_manager(experiment_name: str, trial_name: str) -> str:
    """Value: the GserverManager's base URL."""
    return f"{trial_root(experiment_name, trial_name)}/gen_server_manager"


def chat_endpoint(experiment_name: str, trial_name: str, worker_index: int) -> str:
    """Value: the base URL of rollout worker `worker_index`'s OpenAI-compatible
    endpoint (only while its agent uses one: agent functions, external agents)."""
    return f"{chat_endpoints(experiment_name, trial_name)}/{worker_index}"


def chat_endpoints(experiment_name: str, trial_name: str) -> str:
    """Subtree: one `<worker_index>` key per rollout worker's chat endpoint."""
    return f"{trial_root(experiment_name, trial_name)}/chat_endpoints"


# ---- training progress -----------------------------------------------------


def model_version(experiment_name: str, trial_name: str, role: str) -> str:
    """Value: the newest published weight version of `role` (an int as str)."""
    return f"{trial_root(experiment_name, trial_name)}/model_version/{role}"


def weights_group(experiment_name: str, trial_name: str, role: str) -> str:
    """Value: the current weight broadcast epoch of `role` (JSON: the group's spec, set by the manager)."""
    return f"{trial_root(experiment_name, trial_name)}/weights_group/{role}"


def weights_wanted(experiment_name: str, trial_name: str, role: str) -> str:
    """Value: a weight version of `role` (an int as str) the manager needs as a directory (broadcast
    transport: a version that went through every member is not written); the trainer's rank 0 then
    writes its newest version, at least this one (docs/design.md §8)."""
    return f"{trial_root(experiment_name, trial_name)}/weights_wanted/{role}"


def weights_sent(experiment_name: str, trial_name: str, role: str) -> str:
    """Value: JSON {"group", "version", "ok"}: the newest version of `role` the trainer's sender
    finished with, and whether every member of `group` received it (set before `model_version`)."""
    return f"{trial_root(experiment_name, trial_name)}/weights_sent/{role}"


def dropped_samples(experiment_name: str, trial_name: str) -> str:
    """Value: trajectories the trainer dropped (stale/invalid); their rollout budget is given back."""
    return f"{trial_root(experiment_name, trial_name)}/dropped_samples"


def training_start(experiment_name: str, trial_name: str) -> str:
    """Value: JSON `{"step", "version", "consumed", "dropped", "filtered"}`, written
    by the master once it knows where training starts (0s, or a recovered
    checkpoint's counts). The GserverManager admits no rollout before it."""
    return f"{trial_root(experiment_name, trial_name)}/training_start"


def rollout_cursor(experiment_name: str, trial_name: str, worker_index: int) -> str:
    """Value: JSON {"epoch", "position"}: how far rollout worker `worker_index`
    has issued its shard's prompts (written before each prompt is offered; the
    master stores it in recovery checkpoints)."""
    return f"{trial_root(experiment_name, trial_name)}/rollout_cursor/{worker_index}"
