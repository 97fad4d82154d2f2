"""Transports: frames go through in order, bytes in and bytes out, over ipc, tcp and
in-process channels; closing an ipc inbox leaves no socket file behind."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
from collections.abc import Iterator

import pytest

from actors.transport import (
    MAX_IPC_PATH,
    Inbox,
    Outbox,
    TransportClosed,
    inproc_pair,
    ipc_address,
    new_run_dir,
    zmq_inbox,
    zmq_outbox,
)

RECV_TIMEOUT = 5.0


def free_tcp_port() -> int:
    """A port nothing listens on right now (bind to 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def run_dir() -> Iterator[str]:
    path = new_run_dir()
    yield path
    shutil.rmtree(path, ignore_errors=True)


async def recv(inbox: Inbox) -> bytes:
    return await asyncio.wait_for(inbox.recv(), RECV_TIMEOUT)


async def round_trip(outbox: Outbox, inbox: Inbox, frames: list[bytes]) -> list[bytes]:
    for frame in frames:
        await outbox.send(frame)
    async with asyncio.timeout(RECV_TIMEOUT):
        return [await inbox.recv() for _ in frames]


FRAMES = [i.to_bytes(4, "little") * (i % 7 + 1) for i in range(2000)]


async def test_ipc_round_trip_in_order(ctx, run_dir):
    address = ipc_address(run_dir, "worker0")
    inbox = zmq_inbox(ctx, address)
    outbox = zmq_outbox(ctx, address)
    received = await round_trip(outbox, inbox, FRAMES)
    assert received == FRAMES
    assert all(type(frame) is bytes for frame in received)
    outbox.close()
    inbox.close()


async def test_outbox_may_connect_before_the_inbox_binds(ctx, run_dir):
    address = ipc_address(run_dir, "late")
    outbox = zmq_outbox(ctx, address)
    await outbox.send(b"early")
    inbox = zmq_inbox(ctx, address)
    assert await round_trip(outbox, inbox, [b"later"]) == [b"early"]
    assert await recv(inbox) == b"later"
    outbox.close()
    inbox.close()


async def test_tcp_round_trip_on_loopback(ctx):
    address = f"tcp://127.0.0.1:{free_tcp_port()}"
    inbox = zmq_inbox(ctx, address)
    outbox = zmq_outbox(ctx, address)
    assert await round_trip(outbox, inbox, FRAMES) == FRAMES
    outbox.close()
    inbox.close()


async def test_inproc_pair_round_trip():
    outbox, inbox = inproc_pair()
    received = await round_trip(outbox, inbox, FRAMES)
    assert received == FRAMES
    assert all(type(frame) is bytes for frame in received)


async def test_bounded_inproc_pair_waits_while_full():
    outbox, inbox = inproc_pair(maxsize=2)
    await outbox.send(b"a")
    await outbox.send(b"b")
    blocked = asyncio.create_task(outbox.send(b"c"))
    await asyncio.sleep(0.01)  # the behaviour under test: the send stays blocked meanwhile
    assert not blocked.done()
    assert await recv(inbox) == b"a"
    await asyncio.wait_for(blocked, RECV_TIMEOUT)
    assert [await recv(inbox), await recv(inbox)] == [b"b", b"c"]


@pytest.mark.parametrize("kind", ["ipc", "tcp", "inproc"])
async def test_large_frames_go_through(ctx, run_dir, kind):
    if kind == "inproc":
        outbox, inbox = inproc_pair()
    else:
        address = (
            ipc_address(run_dir, "big") if kind == "ipc" else f"tcp://127.0.0.1:{free_tcp_port()}"
        )
        inbox = zmq_inbox(ctx, address)
        outbox = zmq_outbox(ctx, address)
    frames = [os.urandom(1 << 20), b"small", bytes(range(256)) * 4096]
    assert await round_trip(outbox, inbox, frames) == frames
    outbox.close()
    inbox.close()


async def test_only_bytes_are_frames(ctx, run_dir):
    address = ipc_address(run_dir, "typed")
    inbox = zmq_inbox(ctx, address)
    zmq_out = zmq_outbox(ctx, address)
    queue_out, _ = inproc_pair()
    for outbox in (zmq_out, queue_out):
        for not_bytes in ("text", bytearray(b"x"), memoryview(b"x"), 3):
            with pytest.raises(TypeError, match="must be bytes"):
                await outbox.send(not_bytes)  # type: ignore[arg-type]
    zmq_out.close()
    inbox.close()


async def test_close_removes_the_ipc_socket_file_and_is_idempotent(ctx, run_dir):
    address = ipc_address(run_dir, "sched")
    path = address.removeprefix("ipc://")
    inbox = zmq_inbox(ctx, address)
    outbox = zmq_outbox(ctx, address)
    assert os.path.exists(path)
    outbox.close()
    inbox.close()
    inbox.close()
    outbox.close()
    assert os.listdir(run_dir) == []


async def test_a_stale_socket_file_is_replaced(ctx, run_dir):
    address = ipc_address(run_dir, "stale")
    path = address.removeprefix("ipc://")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as dead:
        dead.bind(path)  # a crashed run leaves its socket file behind
    assert os.path.exists(path)
    inbox = zmq_inbox(ctx, address)
    outbox = zmq_outbox(ctx, address)
    assert await round_trip(outbox, inbox, [b"fresh"]) == [b"fresh"]
    outbox.close()
    inbox.close()
    assert not os.path.exists(path)


async def test_a_regular_file_is_never_deleted(ctx, run_dir):
    path = os.path.join(run_dir, "precious.sock")
    with open(path, "w") as f:
        f.write("data")
    with pytest.raises(FileExistsError, match="not a socket"):
        zmq_inbox(ctx, f"ipc://{path}")
    assert os.path.exists(path)


async def test_use_after_close_raises(ctx, run_dir):
    address = ipc_address(run_dir, "closed")
    pairs = [(zmq_outbox(ctx, address), zmq_inbox(ctx, address)), inproc_pair()]
    for outbox, inbox in pairs:
        outbox.close()
        inbox.close()
        with pytest.raises(TransportClosed):
            await outbox.send(b"x")
        with pytest.raises(TransportClosed):
            await recv(inbox)


async def test_inproc_frames_to_a_closed_inbox_are_discarded():
    outbox, inbox = inproc_pair(maxsize=1)
    inbox.close()
    for _ in range(3):  # never blocks on the full queue of a receiver that is gone
        await outbox.send(b"lost")


def test_ipc_address_and_run_dir():
    run_dir = new_run_dir()
    try:
        assert os.path.isdir(run_dir)
        assert os.path.basename(run_dir).startswith("pagedserve-")
        assert ipc_address(run_dir, "worker0") == f"ipc://{run_dir}/worker0.sock"
        other = new_run_dir()
        shutil.rmtree(other)
        assert other != run_dir
        with pytest.raises(ValueError, match="unix sockets allow 107"):
            ipc_address(run_dir, "w" * MAX_IPC_PATH)
    finally:
        shutil.rmtree(run_dir)


async def test_too_long_ipc_path_is_refused_at_bind(ctx):
    with pytest.raises(ValueError, match="characters"):
        zmq_inbox(ctx, "ipc:///tmp/" + "x" * 200)
