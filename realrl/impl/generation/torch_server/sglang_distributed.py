"""SGLang's distributed weight update, reproduced by the torch server's SGLang
emulation (`--emulate-sglang`; docs/design.md §8, "Broadcast"), as its source
does it (v0.5.16 and v0.5.23: `entrypoints/http_server.py`,
`managers/tokenizer_control_mixin.py`, `managers/scheduler_components/
weight_updater.py`, `model_executor/model_runner_components/weight_updater.py`,
`weight_sync/tensor_bucket.py`, `utils/common.py` `init_custom_process_group`):

- `/init_weights_update_group {master_address, master_port, rank_offset,
  world_size, group_name, backend}`: joins the process group (torch's `tcp://`
  rendezvous at the master's store, the store under the group's name, then
  torch's `_new_process_group_helper`) as rank `rank_offset`; answered once
  the group formed: 200 `{"success": true, ...}`, or 400 `{"success": false,
  "message": "Failed to initialize custom process group: ..."}`.
- `/update_weights_from_distributed {names, dtypes, shapes, group_name,
  load_format, weight_version, abort_all_requests, flush_cache}`: one
  broadcast from rank 0 of the group: with `load_format: "flattened_bucket"`
  one uint8 tensor holding the named tensors back to back, else one
  broadcast per tensor; then the tensors are loaded and `weight_version`
  (when given) becomes the server's. From 0.5.23 only inside a session:
  `/begin_weight_update` opens it (400 if one is open), `/end_weight_update`
  closes it (400 if none is); outside one, 400 "update_weights_from_distributed
  must run between begin_weight_update() and end_weight_update()" (0.5.16 has
  neither route: 404).
- `/destroy_weights_update_group {group_name}`: 200, or 400 "The group to be
  destroyed does not exist.".

Not reproduced: SGLang's scheduler is blocked while it joins a group or
receives a broadcast (generation stalls; realrl's manager calls these routes
only once the trainer is there, and pauses generation around a version);
here the HTTP handler waits on a helper thread and the engine goes on. A
malformed body is 400 here, counted in `rejections`; SGLang's own answer to
one depends on where it fails (an unknown group in 0.5.16 kills its scheduler).
"""

from __future__ import annotations

import datetime
import os
import threading

import torch
import torch.distributed as dist

from realrl.api.sglang_api import (
    InitWeightsUpdateGroupRequest,
    UpdateWeightsFromDistributedRequest,
)
from realrl.base import faults, network
from realrl.base.logging import getLogger

logger = getLogger("torch_server.sglang_distributed")

DEFAULT_PG_TIMEOUT = datetime.timedelta(minutes=30)  # torch's default_pg_timeout, which SGLang passes on
SESSION_REQUIRED = "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()"


def init_custom_process_group(
    backend: str, master_address: str, master_port: int, world_size: int, rank: int, group_name: str
) -> dist.ProcessGroup:
    """SGLang's `init_custom_process_group(init_method="tcp://...")`, step by step."""
    from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, rendezvous

    store, rank, world_size = next(
        rendezvous(f"tcp://{master_address}:{master_port}", rank, world_size, timeout=DEFAULT_PG_TIMEOUT)
    )
    store.set_timeout(DEFAULT_PG_TIMEOUT)
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(
        world_size, rank, [], Backend(backend), store, group_name=group_name, timeout=DEFAULT_PG_TIMEOUT
    )
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


class DistributedWeightUpdates:
    """The groups one emulated SGLang server joined, and its weight-update
    session (0.5.23). The handlers run on helper threads."""

    def __init__(self, session_required: bool, device: str = "cpu", bind_host: str = "127.0.0.1"):
        self.session_required = session_required
        self.device = device
        self.bind_host = bind_host
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.session_open = False
        self._lock = threading.Lock()

    def init_group(self, req: InitWeightsUpdateGroupRequest) -> tuple[bool, str]:
        rank = req.rank_offset + 0  # + the TP rank: one rank here
        logger.info(
            "init custom process group: master_address=%s, master_port=%d, rank_offset=%d, rank=%d, "
            "world_size=%d, group_name=%s, backend=%s",
            req.master_address,
            req.master_port,
            req.rank_offset,
            rank,
            req.world_size,
            req.group_name,
            req.backend,
        )
        faults.point("weights.before_rendezvous")  # a test's member dying before the group forms
        try:
            # gloo listens where the server does (SGLang: where its hostname resolves), as realrl's
            # trainer tells its own gloo groups (model_worker): 127.0.0.1 in local mode and tests.
            os.environ.setdefault("GLOO_SOCKET_IFNAME", network.interface_of(self.bind_host))
        except ValueError:
            pass  # (a wildcard host: gloo's own default)
        try:
            group = init_custom_process_group(
                req.backend, req.master_address, req.master_port, req.world_size, rank, req.group_name
            )
        except Exception as e:
            message = f"Failed to initialize custom process group: {e}."
            logger.error(message)
            return False, message
        with self._lock:
            self.groups[req.group_name] = group
        return True, "Succeeded to initialize custom process group."

    def destroy_group(self, group_name: str) -> tuple[bool, str]:
        with self._lock:
            group = self.groups.pop(group_name, None)
        if group is None:
            return False, "The group to be destroyed does not exist."
        try:
            dist.destroy_process_group(group)
        except Exception as e:
            return False, f"Failed to destroy custom process group: {e}."
        return True, "Succeeded to destroy custom process group."

    def begin(self) -> tuple[bool, str]:
        faults.point("weights.before_first_bucket")  # a test's member dying once a version is announced
        with self._lock:
            if self.session_open:
                return False, "a weight-update session is already open; call end_weight_update() first"
            self.session_open = True
        return True, "Success"

    def end(self) -> tuple[bool, str]:
        with self._lock:
            if not self.session_open:
                return False, "no weight-update session is open; call begin_weight_update() first"
            self.session_open = False
        return True, "Success"

    def receive(self, req: UpdateWeightsFromDistributedRequest) -> dict[str, torch.Tensor]:
        """The broadcast of `req`'s tensors (raises as SGLang's receive does)."""
        group = self.groups.get(req.group_name)
        if group is None:
            raise RuntimeError(
                f"Group {req.group_name} not in {list(self.groups)}. Please call `init_weights_update_group` first."
            )
        if faults.point("weights.bucket_refused"):  # a test's member failing a bucket while it stays up
            raise RuntimeError("fault point weights.bucket_refused")
        specs = [(n, getattr(torch, d), torch.Size(s)) for n, d, s in zip(req.names, req.dtypes, req.shapes)]
        if req.load_format == "flattened_bucket":  # FlattenedTensorBucket.empty + reconstruct_tensors
            offsets, offset = [], 0
            for name, dtype, shape in specs:
                if offset % dtype.itemsize:
                    raise ValueError(f"Unaligned received tensor {name}: byte offset {offset}, dtype {dtype}")
                offsets.append(offset)
                offset += shape.numel() * dtype.itemsize
            flat = torch.empty(offset, dtype=torch.uint8, device=self.device)
            dist.broadcast(flat, src=0, group=group)
            faults.point("weights.bucket_received")  # a test's member dying mid-version
            faults.point("weights.member_stalls")  # a test's member up but answering nothing, mid-version
            return {
                name: flat[start : start + shape.numel() * dtype.itemsize].view(dtype).reshape(shape)
                for (name, dtype, shape), start in zip(specs, offsets)
            }
        tensors = {name: torch.empty(shape, dtype=dtype, device=self.device) for name, dtype, shape in specs}
        handles = [dist.broadcast(t, src=0, group=group, async_op=True) for t in tensors.values()]
        for handle in handles:
            handle.wait()
        return tensors
