"""Where a job's sockets listen: the coordination service (process 0's helper, shard.cluster.coordinator)
and gloo's cross-process collectives on CPU. Neither authenticates its peers, so they listen on the
loopback interface when every process of the job runs on this host, and otherwise where
`cluster.bind` says (`--bind`):

- `auto` (default): loopback when every process is local (a loopback --coordinator, srun on one node,
  mpiexec on one host), else every interface;
- `loopback`: 127.0.0.1 (::1 for an IPv6 loopback --coordinator);
- `all`: the service on every interface, gloo on the address this host's name resolves to (JAX's default);
- an interface name (`eth1`, `ib0`): the service on that interface's IPv4 address, gloo on that interface.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from shard.errors import ShardError

AUTO, LOOPBACK, ALL = "auto", "loopback", "all"
_INTERFACE = re.compile(r"[\w.:-]{1,15}")  # a Linux interface name (IFNAMSIZ 16)


def check_bind(bind: str) -> str | None:
    """Why `bind` is no cluster.bind value, or None."""
    if bind in (AUTO, LOOPBACK, ALL) or _INTERFACE.fullmatch(bind):
        return None
    return f"cluster.bind must be auto, loopback, all or a network interface's name (eth1, ib0), got {bind!r}"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True)
class Listen:
    """The coordinator address the processes dial, the address process 0's service binds, and where
    gloo listens (`gloo_host` or `gloo_interface`; neither: JAX's default)."""

    coordinator: str
    service: str
    gloo_host: str | None = None
    gloo_interface: str | None = None


def plan(bind: str, coordinator: str, local: bool, main: bool) -> Listen:
    """Where to listen, for a job whose process 0 serves at `coordinator` (HOST:PORT); `local`: every
    process runs on this host; `main`: this is process 0 (the one that binds the service)."""
    host, _, port = coordinator.rpartition(":")
    host = host.strip("[]")
    if bind == LOOPBACK or (bind == AUTO and local):
        ip = "::1" if host == "::1" else "127.0.0.1"
        address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
        return Listen(address, address, gloo_host=ip)
    if bind in (AUTO, ALL):
        return Listen(coordinator, f"[::]:{port}")
    service = f"{interface_address(bind)}:{port}" if main else f"[::]:{port}"  # only process 0 binds it
    return Listen(coordinator, service, gloo_interface=bind)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name` on this host."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            packed = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
    except OSError:
        known = ", ".join(n for _, n in socket.if_nameindex())
        raise ShardError(f"cluster.bind {name}: no network interface of that name with an IPv4 address on "
                         f"{socket.gethostname()} (it has: {known})") from None
    return socket.inet_ntoa(packed[20:24])
