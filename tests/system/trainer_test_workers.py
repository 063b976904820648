"""A synthetic rollout worker for training-side tests: pushes well-formed
trajectories (random tokens) through the real push-pull stream, paced by the
trainer's published version, with every `stale_every`-th one deliberately stale
every `invalid_every`-th one (if set) well-formed on the wire but breaking
the trajectory schema, and every `oov_every`-th one (if set) well-formed in
every respect but carrying a token id outside the vocabulary (`vocab`):
alternately `vocab` itself (the last completion token) and -1 (the first prompt
token), even-indexed pushers starting with `vocab`, odd ones with -1."""

from __future__ import annotations

import time

import numpy as np

from realrl.api.trajectory import Trajectory
from realrl.base import name_resolve, names
from realrl.system.push_pull_stream import NameResolvingZmqPusher
from realrl.system.worker_base import PollResult, Worker


class SyntheticRolloutWorker(Worker):
    def _configure(self, config):
        self.cfg = config
        self.rng = np.random.default_rng(config["seed"] + self.info.worker_index)
        self.pusher = NameResolvingZmqPusher(
            self.experiment_name, self.trial_name, self.info.worker_index, self.info.worker_count, config["n_pullers"]
        )
        self.produced = 0
        self.n_oov = 0
        self.stale_at: set[int] = set()  # versions at which an extra stale one went first (`stale_from`)

    def _version(self) -> int:
        try:
            return int(name_resolve.get(names.model_version(self.experiment_name, self.trial_name, "actor")))
        except name_resolve.NameEntryNotFoundError:
            return 0

    def _poll(self):
        version = self._version()
        # Stay about two batches ahead of the trainer, like admission control would.
        if self.produced >= (version + 2) * self.cfg["batch_per_worker"]:
            time.sleep(0.02)
            return PollResult()
        # Whether an every-k-th stale one is still buffered when it becomes stale depends on timing; so, from
        # version `stale_from` (the trainer's bound + 1) on, one extra version-0 trajectory, outside the budget
        # above, goes first at each version: it reaches the puller before that version's fresh ones.
        if self.cfg["stale_every"] and version >= self.cfg.get("stale_from", 2) and version not in self.stale_at:
            self.stale_at.add(version)
            self.pusher.push(self._trajectory(str(100_000 + version), 0).validate().to_wire(), timeout=30)
        self.produced += 1
        stale = self.cfg["stale_every"] and self.produced % self.cfg["stale_every"] == 0
        v = max(0, version - 100) if stale else version
        message = self._trajectory(str(self.produced), v).validate().to_wire()
        invalid_every = self.cfg.get("invalid_every", 0)
        if invalid_every and self.produced % invalid_every == 0:
            message["logprobs"] = message["logprobs"][:-1]  # one logprob short: rejected at the puller
        oov_every = self.cfg.get("oov_every", 0)
        if oov_every and self.produced % oov_every == 0:
            self.n_oov += 1
            ids = message["input_ids"]  # to_wire() made a new array: ours to change
            if (self.n_oov + self.info.worker_index) % 2:
                ids[-1] = self.cfg["vocab"]  # one past the last token id
            else:
                ids[0] = -1
        self.pusher.push(message, timeout=30)
        return PollResult(sample_count=1)

    def _trajectory(self, tag: str, v: int) -> Trajectory:
        g, P, G = self.cfg["group_size"], self.cfg["prompt_len"], self.cfg["gen_len"]
        prompt = self.rng.integers(3, self.cfg["vocab"], P).astype(np.int32)
        return Trajectory(
            qid=f"w{self.info.worker_index}-{tag}",
            task="math",
            birth_time=time.time(),
            input_ids=[
                np.concatenate([prompt, self.rng.integers(3, self.cfg["vocab"], G).astype(np.int32)]) for _ in range(g)
            ],
            prompt_len=[P] * g,
            logprobs=[(-self.rng.random(G) * 3).astype(np.float32) for _ in range(g)],
            versions=[np.full(G, v, dtype=np.int32) for _ in range(g)],
            version_start=[v] * g,
            version_end=[v] * g,
            reward=[float(x) for x in self.rng.choice([-1.0, 1.0], g)],
            no_eos=[False] * g,
            scores=[0.0] * g,
            rollout_id=f"{self.info.worker_index}:0:{tag}",  # one admitted rollout each
        )

    def _exit_hook(self):
        self.pusher.close()
