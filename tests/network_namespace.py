"""A second host simulated with a network namespace joined to this one by a veth pair,
so every byte between them crosses a network link. The `two_hosts` fixture creates
them and removes them; without root and iproute2 it skips and says why."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass

import pytest


@dataclass(frozen=True)
class TwoHosts:
    """This namespace's end of the link (`head_ip`) and the other one's (`netns`,
    reached at `worker_ip`)."""

    netns: str
    head_ip: str
    worker_ip: str

    @property
    def exec_prefix(self) -> tuple[str, ...]:
        """Runs a command in the other namespace."""
        return ("ip", "netns", "exec", self.netns)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=20)


@pytest.fixture
def two_hosts() -> Iterator[TwoHosts]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 (`ip netns`) to simulate a second host")
    tag = os.getpid() % 100_000
    netns, veth, peer = f"pstest{tag}", f"psh{tag}", f"psw{tag}"
    subnet = f"10.213.{tag % 250}"
    hosts = TwoHosts(netns, f"{subnet}.1", f"{subnet}.2")
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
        _ip("link", "set", peer, "netns", netns)
        _ip("addr", "add", f"{hosts.head_ip}/24", "dev", veth)
        _ip("link", "set", veth, "up")
        _ip("-n", netns, "addr", "add", f"{hosts.worker_ip}/24", "dev", peer)
        _ip("-n", netns, "link", "set", peer, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        _remove(netns, veth)
        pytest.skip(f"cannot create a network namespace here: {exc.stderr.strip()}")
    try:
        yield hosts
    finally:
        _remove(netns, veth)


def _remove(netns: str, veth: str) -> None:
    subprocess.run(["ip", "link", "del", veth], capture_output=True, timeout=20)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True, timeout=20)
    assert (
        netns not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )
