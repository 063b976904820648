"""The runtime: worker base, streams, and one file per worker.

Worker kinds are found through this registry, so a launcher never imports a
worker by name and tests (or plugins) can register their own kinds.
"""

from __future__ import annotations

import importlib

WORKER_CLASSES: dict[str, str] = {
    "master_worker": "realrl.system.master_worker:MasterWorker",
    "model_worker": "realrl.system.model_worker:ModelWorker",
    "generation_server": "realrl.system.generation_server:GenerationServer",
    "judge_server": "realrl.system.generation_server:GenerationServer",
    "gserver_manager": "realrl.system.gserver_manager:GserverManager",
    "rollout_worker": "realrl.system.rollout_worker:RolloutWorker",
}


def register_worker(worker_type: str, class_path: str) -> None:
    """Register a worker kind as `"module.path:ClassName"`."""
    if ":" not in class_path:
        raise ValueError(f"worker class path must be 'module:Class', got {class_path!r}")
    existing = WORKER_CLASSES.get(worker_type)
    if existing is not None and existing != class_path:
        raise ValueError(f"worker type {worker_type!r} is already registered as {existing}")
    WORKER_CLASSES[worker_type] = class_path


def worker_class_path(worker_type: str) -> str:
    if ":" in worker_type:
        return worker_type
    try:
        return WORKER_CLASSES[worker_type]
    except KeyError:
        raise KeyError(f"unknown worker type {worker_type!r}; registered: {sorted(WORKER_CLASSES)}") from None


def load_worker_class(worker_type_or_path: str) -> type:
    module_name, _, class_name = worker_class_path(worker_type_or_path).partition(":")
    return getattr(importlib.import_module(module_name), class_name)
