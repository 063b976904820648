"""Addresses and ports.

`bind_address(mode)` / `advertise_address(mode)`: in local mode (and every
test) realrl binds and advertises 127.0.0.1 only. A multi-node run names the
interface (or address) to use in its config; realrl never guesses one from
the host name.

`find_free_ports(n, experiment_name, trial_name)` hands out ports that are
free on this host *and* that no other process of the trial has been given:
each candidate is claimed with a create-if-absent name_resolve key, so two
processes racing for a port cannot both get it.
"""

from __future__ import annotations

import random
import socket

from realrl.base import name_resolve, names

LOOPBACK = "127.0.0.1"
# Below Linux's default ephemeral range (32768-60999): a port picked there can be
# taken meanwhile by any outgoing connection's local end.
PORT_RANGE = (20000, 32000)


def bind_address(mode: str = "local", interface_address: str = "") -> str:
    """The address servers bind. Local mode: 127.0.0.1."""
    if mode == "local":
        return LOOPBACK
    if not interface_address:
        raise ValueError(f"mode={mode} needs an explicit network address to bind (cluster.bind_address)")
    return interface_address


def advertise_address(mode: str = "local", interface_address: str = "") -> str:
    """The address other processes use to reach this one (same rules)."""
    return bind_address(mode, interface_address)


def interface_of(address: str) -> str:
    """The name of the network interface that holds `address` (e.g. 'lo' for
    127.0.0.1); gloo and NCCL are told to use it."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return name
    raise ValueError(f"no network interface of this machine has the address {address}")


def is_port_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def find_free_ports(
    count: int = 1,
    experiment_name: str | None = None,
    trial_name: str | None = None,
    host: str = LOOPBACK,
    port_range: tuple[int, int] = PORT_RANGE,
    max_tries: int = 1000,
) -> list[int]:
    """`count` distinct free ports. With experiment and trial names, each port
    is also claimed in name_resolve so no two processes of the trial get it."""
    rng = random.SystemRandom()
    ports: list[int] = []
    for _ in range(max_tries):
        if len(ports) == count:
            return ports
        port = rng.randrange(*port_range)
        if port in ports or not is_port_free(port, host):
            continue
        if experiment_name is not None:
            key = f"{names.used_ports(experiment_name, trial_name, host)}/{port}"
            try:
                # Never deleted during the trial: a port is handed out once.
                name_resolve.add(key, "1", replace=False, delete_on_exit=False)
            except name_resolve.NameEntryExistsError:
                continue
        ports.append(port)
    raise RuntimeError(f"could not find {count} free ports in {port_range} after {max_tries} tries")


def find_free_port(experiment_name: str | None = None, trial_name: str | None = None, host: str = LOOPBACK) -> int:
    return find_free_ports(1, experiment_name, trial_name, host)[0]
