"""The torch server's place in a weight broadcast group (docs/design.md §8,
"Broadcast"; the transport: realrl/impl/weights/broadcast.py).

`/join_weights_group` starts a `Receiver` on a helper thread: it receives
each version while the engine goes on serving the one before, then hands
the whole version to the engine as a weight update (between two decode
steps: the requests in flight go back to be prefilled again under the new
weights, the parameters take the received buffer as their storage, or on a
GPU or in another dtype the tensors are copied in, `weight_version`
switches), and waits for it to be in place before the next version's
buckets, which go to the buffer the parameters left. `/await_weight_version`
answers once the server holds a version (or the group failed: the caller
loads that version from disk), `/leave_weights_group` ends the membership.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import torch

from realrl.base.logging import getLogger
from realrl.impl.generation.torch_server.weights import WeightLoadError
from realrl.impl.weights.broadcast import GroupSpec, Manifest, Receiver

logger = getLogger("torch_server.weights_group")


def _version_number(version: str) -> int | None:
    try:
        return int(version)
    except ValueError:
        return None


class GroupMembership:
    """At most one group at a time for one engine."""

    def __init__(self, engine: Any, key: bytes, bind_host: str):
        self.engine = engine
        self._key, self._bind_host = key, bind_host
        self.receiver: Receiver | None = None
        self._changed = threading.Condition()  # a version in place, or the membership failed or ended
        # The receiver's buffer that the engine's parameters took last (their storage): the next
        # version after that goes to the one they left.
        self._model_buffer: torch.Tensor | None = None

    def join(self, spec: GroupSpec, rank: int) -> None:
        """Leaves the group it is in (if any) and joins `spec` at `rank`."""
        self.leave()
        logger.info("joining weight group %s as rank %d of %d", spec.name, rank, spec.world_size)
        self.receiver = Receiver(
            spec,
            rank,
            self._key,
            self._bind_host,
            check=self._check,
            on_version=self._put_in_place,
            on_failure=self._failed,
        )

    def leave(self, name: str | None = None) -> bool:
        """Ends the membership (of group `name`, when given); whether there was one."""
        receiver = self.receiver
        if receiver is None or (name is not None and receiver.spec.name != name):
            return False
        receiver.stop()
        self.receiver = None
        with self._changed:
            self._changed.notify_all()
        return True

    def status(self) -> dict:
        r = self.receiver
        if r is None:
            return {"group_name": None}
        return {"group_name": r.spec.name, "rank": r.rank, "received": list(r.received), "error": r.error}

    async def await_version(self, version: int, timeout_s: float) -> tuple[bool, str]:
        """(True, "") once the engine holds `version` or a newer one; (False,
        why) when the membership failed or ended first, or after `timeout_s`."""
        return await asyncio.to_thread(self._await_version, version, timeout_s)

    def _await_version(self, version: int, timeout_s: float) -> tuple[bool, str]:
        deadline = time.monotonic() + timeout_s
        with self._changed:  # (woken by a version in place or a failure; a close is seen at the next look)
            while not self._holds(version) and self._broken() is None and time.monotonic() < deadline:
                self._changed.wait(min(0.5, max(0.0, deadline - time.monotonic())))
        if self._holds(version):
            return True, ""
        return False, self._broken() or f"version {version} did not arrive within {timeout_s} s"

    def _holds(self, version: int) -> bool:
        held = _version_number(self.engine.weight_version)
        return held is not None and held >= version

    def _broken(self) -> str | None:
        r = self.receiver
        if r is None:
            return "not a member of a weight group"
        if r.error is not None:
            return f"weight group {r.spec.name} failed: {r.error}"
        if r.closed:
            return f"weight group {r.spec.name} was closed by its sender"
        return None

    # ---- on the receiver's thread

    def _check(self, manifest: Manifest) -> None:
        try:
            self.engine.check_weights(manifest.placeholders())
        except WeightLoadError as e:
            raise WeightLoadError(f"the group's tensor list does not fit this model: {e}") from None

    def _put_in_place(self, version: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """The engine takes the version between two decode steps: on the CPU
        the parameters take the receiver's buffer as their storage (a swap by
        pointer, no copy), and the buffer they leave is returned to the
        receiver for the next version; else the tensors are copied in."""
        received = time.monotonic()
        timing: dict[str, Any] = {}  # the engine's: when its loop took the update, swapped or the copy's seconds
        done = threading.Event()
        answer: list[Any] = []

        def reply(result: Any) -> None:
            answer.append(result)
            done.set()

        args = {
            "tensors": tensors,
            "swap": True,
            "weight_version": str(version),
            "abort_all_requests": True,
            "model_path": f"weight group {self.receiver.spec.name if self.receiver else '?'}",
            "timing": timing,
        }
        self.engine.command("update", args, reply)
        done.wait()  # the tensors view the receiver's buffer: the next version waits for the swap or the copy
        if not getattr(answer[0], "success", False):
            raise WeightLoadError(f"version {version} could not be put in place: {getattr(answer[0], 'message', '')}")
        with self._changed:
            self._changed.notify_all()
        logger.info(
            "version %d in place %.3f s after its last bucket (the loop took it after %.3f s, %s)",
            version,
            time.monotonic() - received,
            timing.get("taken", received) - received,
            "swapped by pointer" if timing.get("swapped") else f"copied in {timing.get('copy_s', 0.0):.3f} s",
        )
        if not timing.get("swapped"):
            return None
        buffer = next(iter(tensors.values())).untyped_storage()
        left, self._model_buffer = self._model_buffer, torch.empty(0, dtype=torch.uint8).set_(buffer)
        if left is None or left.numel() != self._model_buffer.numel():
            # (the first swap: what the parameters left was not a buffer of this layout; the new one's
            # pages in now, not in the next version's reception)
            left = torch.empty(self._model_buffer.numel(), dtype=torch.uint8).zero_()
        return left

    def _failed(self, error: str) -> None:
        logger.warning("weight group membership failed (the manager loads versions from disk): %s", error)
        with self._changed:
            self._changed.notify_all()
