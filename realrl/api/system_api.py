"""What every worker process is told about itself (the launcher writes it).

A worker process is started as `python -m realrl.system.worker_base --spec F`,
where F is a JSON `WorkerSpec`: which class to run, its `WorkerInfo`, and its
own config (a dataclass of the worker's `config_cls`, as plain JSON). No
pickle: a spec file is data, never code.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from realrl.base.name_resolve import NameResolveConfig


@dataclasses.dataclass
class WorkerInfo:
    experiment_name: str
    trial_name: str
    worker_type: str
    worker_index: int = 0
    worker_count: int = 1
    name_resolve: NameResolveConfig = dataclasses.field(default_factory=NameResolveConfig)
    log_dir: str = ""
    # The status key's TTL; a SIGKILLed worker's status vanishes within it.
    heartbeat_ttl: float = 5.0
    mode: str = "local"  # local | ray | slurm
    bind_address: str = ""  # multi-node only; local mode always binds 127.0.0.1
    plugins: list[str] = dataclasses.field(default_factory=list)
    # Exit when the launcher's keep-alive key disappears (the launcher died).
    watch_launcher: bool = True

    @property
    def tag(self) -> str:
        return f"{self.worker_type}/{self.worker_index}"


@dataclasses.dataclass
class WorkerSpec:
    worker_class: str  # "module.path:ClassName"
    info: WorkerInfo
    config: Any = None  # JSON-able: the worker's config dataclass as a dict

    def to_json(self) -> str:
        config = self.config
        if dataclasses.is_dataclass(config):
            config = to_plain(config)
        return json.dumps(
            {"worker_class": self.worker_class, "info": dataclasses.asdict(self.info), "config": config}, indent=1
        )

    @staticmethod
    def from_json(text: str) -> "WorkerSpec":
        raw = json.loads(text)
        info_raw = raw["info"]
        info_raw["name_resolve"] = NameResolveConfig(**info_raw["name_resolve"])
        return WorkerSpec(worker_class=raw["worker_class"], info=WorkerInfo(**info_raw), config=raw["config"])


def to_plain(config: Any) -> Any:
    """A config dataclass (possibly nested) as JSON-able containers."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(config), resolve=True)


def from_plain(config_cls: type, raw: Any) -> Any:
    """The inverse of `to_plain`, with type checking by OmegaConf: a wrong key
    or type raises an error naming the key."""
    from omegaconf import OmegaConf

    if raw is None:
        return config_cls()
    merged = OmegaConf.merge(OmegaConf.structured(config_cls), raw)
    return OmegaConf.to_object(merged)
