"""Which of this host's addresses reaches another host, and the interface that holds it.

Ranks on several hosts must each bind where the others can reach them: a worker binds
its plan inbox on the address it routes to the head through, and torch.distributed's
gloo binds on that address's interface (`GLOO_SOCKET_IFNAME`); gloo's own guess, the
address the hostname resolves to, is often one the other hosts cannot reach (a
container's, a second network's). IPv4, Linux.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """HOST:PORT (or tcp://HOST:PORT) as (host, port); ValueError naming `what`."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    if not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{what} must be HOST:PORT with a port in [1, 65535], got {address!r}")
    return host, int(port)


def address_towards(host: str, port: int) -> str:
    """This host's IPv4 address on the route to `host` (connecting a UDP socket only
    picks the route: no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((socket.gethostbyname(host), port))
        return probe.getsockname()[0]


def interface_with(address: str) -> str | None:
    """The name of the network interface holding IPv4 `address`, None if none does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                answer = fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(answer[20:24]) == address:
                return name
    return None


def gloo_environment(host: str, port: int) -> dict[str, str]:
    """GLOO_SOCKET_IFNAME for reaching `host` from here, unless the user set it (or the
    interface cannot be found: then gloo guesses, as it would anyway)."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return {}
    interface = interface_with(address_towards(host, port))
    return {} if interface is None else {"GLOO_SOCKET_IFNAME": interface}
