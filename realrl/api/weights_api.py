"""The HTTP bodies of the torch server's weight-group routes (docs/design.md §8,
"Broadcast"): the manager puts a server into an epoch's group, waits for a
version to be in place there, and takes it out again. Parse with
`realrl.base.http_body.from_json`, write with `to_json`."""

from __future__ import annotations

import dataclasses

from realrl.base.http_body import rule


@dataclasses.dataclass
class JoinWeightsGroupRequest:
    """`POST /join_weights_group`: receive the versions of group `group_name`
    at `rank` (the server leaves the group it was in first). The answer is
    immediate; the group forms once every rank joined."""

    group_name: str = dataclasses.field(metadata=rule(nonempty=True))
    store_host: str = dataclasses.field(metadata=rule(nonempty=True))
    store_port: int = dataclasses.field(metadata=rule(min=1, max=65535))
    world_size: int = dataclasses.field(metadata=rule(min=2))
    rank: int = dataclasses.field(metadata=rule(min=1))
    backend: str = "gloo"
    bucket_bytes: int = dataclasses.field(default=64 << 20, metadata=rule(min=64))
    timeout_s: float = dataclasses.field(default=60.0, metadata=rule(min=0.1))
    # How long the server waits for the group's sender to come (its first version of the
    # epoch); then its membership fails and the manager loads versions from disk.
    join_timeout_s: float = dataclasses.field(default=600.0, metadata=rule(min=0.1))
    # `pairs`: the server is in a group of two of its own with the sender (`GroupSpec.member_group`);
    # `one`: a single group of all (benchmarks only).
    member_groups: str = "pairs"


@dataclasses.dataclass
class LeaveWeightsGroupRequest:
    """`POST /leave_weights_group`: end the membership of `group_name` (any, if null)."""

    group_name: str | None = None


@dataclasses.dataclass
class AwaitWeightVersionRequest:
    """`POST /await_weight_version`: answer once the server holds
    `weight_version` or a newer one, received through its group; `success:
    false` when the membership failed or ended first, or after `timeout_s`."""

    weight_version: int = dataclasses.field(metadata=rule(min=0))
    timeout_s: float = dataclasses.field(default=60.0, metadata=rule(min=0.0))


@dataclasses.dataclass
class WeightsGroupResponse:
    """The answer to the three routes (HTTP 200 on success, else 400)."""

    UNKNOWN_FIELDS = "ignore"

    success: bool
    message: str = ""
    weight_version: str | None = None
