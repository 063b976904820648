"""A model worker without training: the trainer's side of the data flow, at a set pace.

It buffers trajectories from its puller (`PullerStreamDataset`, token ids
checked against the model's vocabulary) and answers the master's `spec`, `inventory`, `stats`,
`assemble` (the ModelWorker's own handlers), `inference` (nothing to do) and
`train_step`, which takes `1 / train_rate` seconds per trajectory of the batch
and then publishes the tiny model at `model_path` as the new version, exactly
as the real trainer does (`publish_weights` into `<weights_dir>/<v>/`, then
`model_version/actor`): the manager's weight-update fan-out to every server
is the real one. The wall-clock time of each publication is written to
`stats_path` (JSON), for the benchmark to time the fan-out against.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

from realrl.system.model_worker import ModelWorker, publish_weights
from realrl.system.request_reply_stream.reply_server import NameResolvingReplyServer
from realrl.system.stream_dataset import PullerStreamDataset


@dataclasses.dataclass
class SimTrainerConfig:
    model_path: str = ""  # a tiny HF model: what every version publishes
    weights_dir: str = ""
    train_rate: float = 1000.0  # trajectories per second of a train step
    stats_path: str = ""
    max_buffered_trajectories: int = 1_000_000


class SimTrainer(ModelWorker):
    config_cls = SimTrainerConfig

    def _configure(self, config: SimTrainerConfig) -> None:
        from transformers import AutoModelForCausalLM

        if self.info.worker_count != 1:
            raise ValueError("the simulated trainer runs as one rank")
        self.cfg = config
        self.dp_rank, self.dp_size, self.data_group = 0, 1, None
        self.model = AutoModelForCausalLM.from_pretrained(config.model_path)
        self.step_trajectories: list = []
        self.published: list[tuple[int, float]] = []  # (version, wall clock when model_version was set)
        self.dataset = PullerStreamDataset(
            self.experiment_name,
            self.trial_name,
            self.dp_rank,
            config.max_buffered_trajectories,
            vocab_size=self.model.get_input_embeddings().num_embeddings,
            host=self.bind_host,
        )
        self.server = NameResolvingReplyServer(
            self.experiment_name, self.trial_name, self.info.worker_index, interrupt=self.raise_if_exiting
        )
        for name in ("spec", "inventory", "stats"):
            self.server.register(name, getattr(self, f"_handle_{name}"))
        for name in ("assemble", "inference", "train_step"):
            self.server.register(name, getattr(self, f"_handle_{name}"), long_running=True)
        # The key is set on this thread, so `published` holds when each version was announced
        # (the real trainer hands the write to its VersionAnnouncer's thread).
        self._announcer = None
        self._set_version(0)

    def _handle_spec(self, data=None) -> dict:
        n_params = sum(p.numel() for p in self.model.parameters())
        return {
            "dp_rank": 0,
            "dp_size": 1,
            "version": self.version,
            "n_params": n_params,
            "checksum": None,
            **self.dataset.stats(),
        }

    def _handle_inference(self, data: dict) -> dict:
        return {"seconds": 0.0}

    def _handle_train_step(self, data: dict) -> dict:
        n = len(self.step_trajectories)
        self.step_trajectories = []
        time.sleep(n / self.cfg.train_rate)
        version = int(data["version"])
        t0 = time.monotonic()
        publish_weights(self.model, self.cfg.weights_dir, version)
        self._set_version(version)
        self.published.append((version, time.time()))
        self._write_stats()
        return {"trajectories": n, "publish_seconds": time.monotonic() - t0}

    def _write_stats(self) -> None:
        if not self.cfg.stats_path:
            return
        tmp = f"{self.cfg.stats_path}.tmp"
        with open(tmp, "w") as f:
            json.dump({"published": self.published}, f)
        os.replace(tmp, self.cfg.stats_path)
