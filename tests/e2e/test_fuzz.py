"""Junk sent to a live trial (issue 33): to a trainer's puller, to the
master's request and reply sockets, and to the manager's and the torch
server's HTTP APIs. The trial completes, every piece of junk is refused and
counted apart from the trajectory ledger, and the ledger stays exact.

`run_trial(..., junk=False)` runs the same trial without the junk (the
baseline the stale-drop count is compared with)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import numpy as np
import zmq

from realrl.api.trajectory import Trajectory
from realrl.base import name_resolve, names, trial_secret, wire
from realrl.cli.trial import connect
from realrl.system.push_pull_stream import StreamSeal
from tests.e2e.test_faults import Trial

EXP = "async-ppo-tiny"
STEPS, ETA = 10, 2


def _repository(tmp_path, trial: str):
    """The trial's private etcd, found as `realrl status` finds it."""
    repo, problem = connect(name_resolve.NameResolveConfig("etcd3"), os.path.join(tmp_path, "run", EXP, trial))
    assert repo is not None, problem
    return repo


def _trajectory(
    qid: str, prompt_len: int, gen_len: int, version: int = 0, logprob: float = -1.0, rollout_id: str = ""
) -> dict:
    ids = np.full(prompt_len + gen_len, 5, dtype=np.int32)
    return Trajectory(
        qid=qid,
        task="math",
        birth_time=time.time(),
        input_ids=[ids],
        prompt_len=[prompt_len],
        logprobs=[np.full(gen_len, logprob, np.float32)],
        versions=[np.full(gen_len, version, np.int32)],
        version_start=[version],
        version_end=[version],
        reward=[1.0],
        no_eos=[False],
        rollout_id=rollout_id,
    ).to_wire()


def _http(url: str, body=None, raw: bytes | None = None) -> int:
    """A request from the insider: it holds the trial's key (`_send_junk` installs it)."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"Content-Type": "application/json", **trial_secret.http_headers()}
    request = urllib.request.Request(url, data=data, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as e:
        return e.code


# What goes to the puller: decodable non-trajectories and unfit trajectories
# (invalid), and frames that are no realrl message at all (rejected).
INVALID = [
    {"hello": "world"},
    [1, 2, 3],
    42,
    _trajectory("fuzz-long@0", 5000, 3000),  # longer than the model's 256 positions
    _trajectory("fuzz-future@0", 4, 3, version=10**6),  # a weight version the trainer never had
    _trajectory("fuzz-positive@0", 4, 3, logprob=0.5),
]
# (A frame holding a list is a batch of messages, as AckedPusher sends them: [1, 2, 3] is three invalid ones.)
N_INVALID = sum(len(m) if isinstance(m, list) else 1 for m in INVALID)
REJECTED_FRAMES = [b"not a realrl message", b"RJ" + bytes(30)]  # sealed, but no wire message
# A well-formed trajectory of no admitted rollout (no rollout id): foreign.
FOREIGN = [_trajectory("fuzz-foreign@0", 4, 3)]
# From outside the trial (docs/design.md §14): a trainable trajectory of a rollout id of the trial's
# form, unsealed, sealed with another trial's key, and sealed then tampered with. Were one taken, it
# would be trained and the ledger would not balance.
OUTSIDER = wire.dumps(_trajectory("fuzz-outsider@0", 4, 3, rollout_id="0:0:99999"))


def _send_junk(tmp_path, trial: str, context: zmq.Context, strays: list) -> dict[str, list[int]]:
    repo = _repository(tmp_path, trial)
    trial_secret.install(os.path.join(tmp_path, "run", EXP, trial, "secret"))  # an insider: it holds the secret
    key = lambda stream: names.request_reply_stream(EXP, trial, stream)  # noqa: E731
    puller = repo.get(names.push_pull_stream(EXP, trial, "puller0"))
    push = context.socket(zmq.DEALER)  # the puller is a ROUTER that acknowledges (docs/design.md §4)
    push.setsockopt(zmq.LINGER, 5000)
    push.connect(f"tcp://{puller}")
    seal = StreamSeal(trial_secret.current().stream_mac_key, "push")  # the insider's: the trial's own
    for frame in [wire.dumps(m) for m in INVALID + FOREIGN] + REJECTED_FRAMES:
        push.send_multipart([frame, seal.tag(frame)])
    other_trial = StreamSeal(os.urandom(32), "push")
    tampered = bytearray(OUTSIDER)
    tampered[-1] ^= 1
    for frames in ([OUTSIDER], [OUTSIDER, other_trial.tag(OUTSIDER)], [bytes(tampered), seal.tag(OUTSIDER)]):
        push.send_multipart(frames)
    push.close()  # (lingers until delivered)

    # The master's request socket: a stray PULL (refused at the handshake) and a
    # stray DEALER (never addressed) stay connected for the rest of the trial.
    for kind in (zmq.PULL, zmq.DEALER):
        stray = context.socket(kind)
        stray.setsockopt(zmq.LINGER, 0)
        stray.connect(f"tcp://{repo.get(key('master_send_0'))}")
        strays.append(stray)
    # The master's reply socket: junk replies.
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 5000)
    replies.connect(f"tcp://{repo.get(key('master_recv'))}")
    replies.send(b"junk")
    replies.send(wire.dumps({"kind": "reply", "id": "nobody-asked", "handler": 0, "name": "train_step"}))
    replies.close()

    manager = repo.get(names.gen_server_manager(EXP, trial))
    server = repo.get(names.gen_server(EXP, trial, 0))
    statuses = {
        "manager": [
            _http(f"{manager}/schedule_request", {"qid": "fuzz", "n": 2**62}),
            _http(f"{manager}/schedule_request", {"qid": "fuzz", "n": 10_000, "parts": [1] * 10_000}),
            _http(f"{manager}/schedule_request", {"qid": "never-admitted", "n": 1}),
            _http(f"{manager}/release_request", {"url": server, "ticket": 10**9, "n": 10**3}),
            _http(f"{manager}/release_request", {"url": server, "n": 5}),
            _http(f"{manager}/reset_rollout_worker", {"worker_index": 999}),
            _http(f"{manager}/reset_rollout_worker", {"worker_index": 2**70}),
            _http(f"{manager}/finish_rollout", {"rollout_id": "never-admitted", "n_trajectories": 9}),
            _http(f"{manager}/allocate_rollout", raw=b"{not json"),
        ],
        "server": [
            _http(f"{server}/generate", {"input_ids": "x"}),
            _http(f"{server}/generate", raw=b"{"),
            _http(f"{server}/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2**70}}),
            _http(f"{server}/generate", {"input_ids": [10**9], "sampling_params": {"max_new_tokens": 1}}),
        ],
    }
    return statuses


def run_trial(tmp_path, kit_cache, junk: bool) -> tuple[dict, dict]:
    """The trial (with or without the junk, sent once step 1 is done): (summary, HTTP statuses of the junk)."""
    name = "fuzz" if junk else "calm"
    trial = Trial(
        tmp_path,
        kit_cache,
        name,
        f"total_train_steps={STEPS}",
        f"rollout.max_head_offpolicyness={ETA}",
        "rollout.max_restarts=0",
    )
    context, strays, statuses = zmq.Context(), [], {}
    try:
        trial.wait_for_step(1)
        if junk:
            statuses = _send_junk(tmp_path, name, context, strays)
        code = trial.wait(timeout=900)
        assert code == 0, trial.console()[-4000:]
        assert all(not stray.poll(0) for stray in strays)  # no request went to a stray
    finally:
        for stray in strays:
            stray.close()
        context.term()
        trial.kill()
    return trial.summary(), statuses


def test_junk_to_a_live_trial_is_counted_apart_and_bends_nothing(tmp_path, kit_cache):
    summary, statuses = run_trial(tmp_path, kit_cache, junk=True)
    assert statuses["manager"] == [400, 400, 409, 400, 400, 400, 400, 400, 400], statuses
    assert all(400 <= s < 500 for s in statuses["server"]), statuses
    t = summary["trajectories"]
    assert summary["steps"] == STEPS
    # The junk is refused and counted: invalid trajectories, rejected frames, bad requests; no
    # request of a stray was left in flight on a server.
    assert t["dropped_invalid"] == N_INVALID and t["rejected_frames"] == len(REJECTED_FRAMES), t
    assert t["seal_refused_frames"] == 3, t  # the outsider's three: refused, never trained
    assert t["foreign"] == len(FOREIGN), t
    assert summary["rollouts"]["bad_requests"] == len(statuses["manager"]), summary["rollouts"]
    assert set(summary["rollouts"]["server_in_flight"].values()) == {0}, summary["rollouts"]
    # Exact accounting, and no budget handed back for what the manager never admitted (issue 33
    # item 1: needs budget returned only for admitted rollouts; without it the junk's invalid
    # trajectories count as dropped, their budget admits extra rollouts, and these go stale).
    assert t["produced"] == t["consumed"] + t["dropped"] + t["buffered"], t
    assert t["dropped_stale"] == 0, t
