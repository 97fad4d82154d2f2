"""Authenticated frames: sealed frames open only for a holder of the secret on the same
channel, once; over real tcp sockets an inbox and a heartbeat monitor drop (count, log)
what does not open and go on serving; the secret shows up in no log and no repr."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import logging
import socket
import struct
import threading
import time

import pytest
import zmq
import zmq.asyncio

from actors.frame_auth import (
    OVERHEAD,
    FrameAuth,
    FrameRefused,
    Refusal,
    RefusalLog,
)
from actors.transport import zmq_inbox, zmq_outbox
from actors.worker_actor import Heartbeat
from actors.worker_monitor import WorkerMonitor
from engine.codec import encode
from engine.messages import WorkerHeartbeat
from tests.eventually import eventually, eventually_sync

SECRET = b"correct horse battery staple 42!"
OTHER_SECRET = b"a different secret, same length"
RECV_TIMEOUT = 5.0


def free_tcp_port() -> int:
    """A port nothing listens on right now (bind to 0, read it back, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def tcp_address() -> str:
    return f"tcp://127.0.0.1:{free_tcp_port()}"


def flipped(frame: bytes, index: int) -> bytes:
    return frame[:index] + bytes([frame[index] ^ 0x01]) + frame[index + 1 :]


def reason_of(auth: FrameAuth, sealed: bytes) -> Refusal:
    with pytest.raises(FrameRefused) as refused:
        auth.open(sealed)
    return refused.value.reason


# ---------------------------------------------------------------- seal / open


def test_a_sealed_frame_opens_to_its_payload():
    sender, receiver = FrameAuth(SECRET, "worker-0"), FrameAuth(SECRET, "worker-0")
    for payload in (b"", b"x", bytes(range(256)) * 100):
        sealed = sender.seal(payload)
        assert len(sealed) == len(payload) + OVERHEAD
        assert receiver.open(sealed) == payload


def test_the_wire_layout_is_the_documented_one():
    auth = FrameAuth(SECRET, "sched")
    first, second = auth.seal(b"abc"), auth.seal(b"abc")
    version, nonce, counter = struct.unpack_from(">B16sQ", first)
    assert (version, counter) == (1, 1)
    assert struct.unpack_from(">B16sQ", second) == (1, nonce, 2)
    assert first[25:-32] == b"abc"
    label = b"pagedserve-frame-v1\0" + struct.pack(">H", 5) + b"sched"
    assert first[-32:] == hmac.new(SECRET, label + first[:-32], hashlib.sha256).digest()


@pytest.mark.parametrize(
    "sender",
    [FrameAuth(OTHER_SECRET, "worker-0"), FrameAuth(SECRET, "worker-1")],
    ids=["other secret", "other channel"],
)
def test_a_frame_sealed_with_another_secret_or_for_another_channel_is_refused(sender):
    receiver = FrameAuth(SECRET, "worker-0")
    assert reason_of(receiver, sender.seal(b"plan")) is Refusal.BAD_TAG


def test_any_flipped_byte_is_refused_and_does_not_use_up_the_frame():
    sender, receiver = FrameAuth(SECRET), FrameAuth(SECRET)
    sealed = sender.seal(b"step plan 7")
    for index in range(len(sealed)):
        reason = reason_of(receiver, flipped(sealed, index))
        assert reason is (Refusal.UNSUPPORTED_VERSION if index == 0 else Refusal.BAD_TAG)
    assert receiver.open(sealed) == b"step plan 7"


def test_too_short_frames_are_refused():
    receiver = FrameAuth(SECRET)
    for frame in (b"", b"plain msgpack", FrameAuth(SECRET).seal(b"")[:-1]):
        assert reason_of(receiver, frame) is Refusal.TOO_SHORT


def test_a_frame_opens_once_and_an_older_one_never_after_a_newer():
    sender, receiver = FrameAuth(SECRET), FrameAuth(SECRET)
    first, second = sender.seal(b"1"), sender.seal(b"2")
    assert receiver.open(first) == b"1"
    assert reason_of(receiver, first) is Refusal.REPLAYED
    assert receiver.open(second) == b"2"
    assert reason_of(receiver, first) is Refusal.REPLAYED
    assert reason_of(receiver, second) is Refusal.REPLAYED


def test_senders_have_counters_of_their_own():
    receiver = FrameAuth(SECRET, "sched")
    a = FrameAuth(SECRET, "sched")
    b = a.for_channel("sched")
    frames = [a.seal(b"a1"), b.seal(b"b1"), b.seal(b"b2"), a.seal(b"a2")]
    assert [receiver.open(f) for f in frames] == [b"a1", b"b1", b"b2", b"a2"]
    assert receiver.num_senders_remembered == 2


def test_for_channel_keeps_the_secret_and_binds_the_new_channel():
    base = FrameAuth(SECRET, "")
    to_worker_1 = base.for_channel("worker-1")
    assert FrameAuth(SECRET, "worker-1").open(to_worker_1.seal(b"x")) == b"x"
    assert reason_of(FrameAuth(SECRET, "worker-0"), to_worker_1.seal(b"x")) is Refusal.BAD_TAG


def test_the_replay_memory_is_bounded_and_keeps_the_recent_senders():
    receiver = FrameAuth(SECRET, max_senders=2)
    senders = [FrameAuth(SECRET) for _ in range(3)]
    sealed = [s.seal(b"hello") for s in senders]
    for frame in sealed:
        receiver.open(frame)
    assert receiver.num_senders_remembered == 2
    for frame in sealed[1:]:
        assert reason_of(receiver, frame) is Refusal.REPLAYED


def test_concurrent_seals_never_reuse_a_counter():
    auth = FrameAuth(SECRET)
    sealed: list[bytes] = []
    lock = threading.Lock()

    def seal_many() -> None:
        mine = [auth.seal(b"beat") for _ in range(500)]
        with lock:
            sealed.extend(mine)

    threads = [threading.Thread(target=seal_many) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    counters = {struct.unpack_from(">B16sQ", s)[2] for s in sealed}
    assert counters == set(range(1, 2001))


def test_refused_is_a_value_error_naming_its_reason():
    error = FrameRefused(Refusal.REPLAYED)
    assert isinstance(error, ValueError)
    assert str(error) == "replayed frame"
    assert str(FrameRefused(Refusal.BAD_TAG)) == "bad tag: wrong secret or tampered"


@pytest.mark.parametrize("secret", [b"", b"fifteen bytes!!", "a str is not bytes at all"])
def test_a_short_or_textual_secret_is_refused(secret):
    with pytest.raises(ValueError, match="at least 16|must be bytes"):
        FrameAuth(secret)  # type: ignore[arg-type]


def test_repr_never_shows_the_secret():
    auth = FrameAuth(SECRET, "worker-0")
    for text in (repr(auth), str(auth), repr(auth.for_channel("x"))):
        assert SECRET.decode() not in text
        assert SECRET.hex() not in text
        assert "hidden" in text


def test_refusals_are_logged_once_per_reason_per_interval(caplog):
    now = [100.0]
    log = RefusalLog("inbox tcp://x", interval_s=10.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="actors.frame_auth"):
        for _ in range(3):
            log.note(Refusal.BAD_TAG, "10.0.0.9")
        log.note(Refusal.REPLAYED)
        now[0] += 10.0
        log.note(Refusal.BAD_TAG, "10.0.0.9")
    messages = [r.getMessage() for r in caplog.records]
    assert log.count == 5
    assert len(messages) == 3
    assert "10.0.0.9" in messages[0] and "bad tag" in messages[0] and "(1 refused" in messages[0]
    assert "an unknown peer" in messages[1] and "replayed frame" in messages[1]
    assert "(3 refused" in messages[2]  # the two held back, and this one


# ---------------------------------------------------------------- over tcp


@pytest.fixture
def stranger(ctx):
    """A raw PUSH socket, connected by `stranger(address)`: a sender on the network that
    sends whatever bytes it likes."""
    sockets = []

    def connect(address: str) -> zmq.asyncio.Socket:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        sockets.append(sock)
        return sock

    yield connect
    for sock in sockets:
        sock.close(linger=0)


async def refused_then_served(inbox, send_bad, good: bytes, send_good) -> None:
    """`recv` refuses what `send_bad` sends, keeps waiting, then returns `good`."""
    received = asyncio.create_task(inbox.recv())
    await send_bad()
    await eventually(lambda: inbox.num_refused == 1, RECV_TIMEOUT, "the bad frame refused")
    assert not received.done()
    await send_good()
    assert await asyncio.wait_for(received, RECV_TIMEOUT) == good


@pytest.mark.timeout(30)
async def test_sealed_frames_round_trip_over_tcp_in_order(ctx):
    address = tcp_address()
    inbox = zmq_inbox(ctx, address, FrameAuth(SECRET, "worker-0"))
    outbox = zmq_outbox(ctx, address, FrameAuth(SECRET, "worker-0"))
    frames = [i.to_bytes(4, "little") * (i % 7 + 1) for i in range(500)] + [bytes(1 << 20)]
    for frame in frames:
        await outbox.send(frame)
    async with asyncio.timeout(RECV_TIMEOUT):
        assert [await inbox.recv() for _ in frames] == frames
    assert inbox.num_refused == 0
    outbox.close()
    inbox.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sender_auth", [None, FrameAuth(OTHER_SECRET, "worker-0")])
async def test_a_sender_without_the_secret_is_refused_and_logged_and_the_inbox_goes_on(
    ctx, caplog, sender_auth
):
    address = tcp_address()
    inbox = zmq_inbox(ctx, address, FrameAuth(SECRET, "worker-0"))
    good = zmq_outbox(ctx, address, FrameAuth(SECRET, "worker-0"))
    bad = zmq_outbox(ctx, address, sender_auth)
    with caplog.at_level(logging.DEBUG):
        await refused_then_served(
            inbox, lambda: bad.send(b"forged plan"), b"real plan", lambda: good.send(b"real plan")
        )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert address in warnings[0] and "127.0.0.1" in warnings[0]
    expected = "too short" if sender_auth is None else "bad tag: wrong secret or tampered"
    assert expected in warnings[0]
    assert "forged plan" not in caplog.text
    assert SECRET.decode() not in caplog.text and SECRET.hex() not in caplog.text
    for end in (good, bad, inbox):
        end.close()


@pytest.mark.timeout(30)
async def test_a_tampered_frame_is_refused_and_the_original_still_opens(ctx, stranger):
    address = tcp_address()
    inbox = zmq_inbox(ctx, address, FrameAuth(SECRET))
    wire = stranger(address)
    sealed = FrameAuth(SECRET).seal(b"sample token 42")
    tampered = flipped(sealed, 25 + 3)  # a payload byte
    await refused_then_served(
        inbox, lambda: wire.send(tampered), b"sample token 42", lambda: wire.send(sealed)
    )
    inbox.close()


@pytest.mark.timeout(30)
async def test_a_replayed_frame_is_refused(ctx, stranger):
    address = tcp_address()
    inbox = zmq_inbox(ctx, address, FrameAuth(SECRET))
    sender = FrameAuth(SECRET)
    captured, later = sender.seal(b"plan 1"), sender.seal(b"plan 2")
    wire = stranger(address)
    await wire.send(captured)
    assert await asyncio.wait_for(inbox.recv(), RECV_TIMEOUT) == b"plan 1"
    await refused_then_served(
        inbox, lambda: wire.send(captured), b"plan 2", lambda: wire.send(later)
    )
    inbox.close()


@pytest.mark.timeout(30)
async def test_ipc_channels_authenticate_too(ctx, stranger, tmp_path, caplog):
    address = f"ipc://{tmp_path}/w.sock"
    inbox = zmq_inbox(ctx, address, FrameAuth(SECRET))
    good = zmq_outbox(ctx, address, FrameAuth(SECRET))
    wire = stranger(address)
    with caplog.at_level(logging.WARNING, logger="actors.frame_auth"):
        await refused_then_served(
            inbox, lambda: wire.send(b"\x01" + b"x" * 99), b"ok", lambda: good.send(b"ok")
        )
    assert "bad tag" in caplog.records[0].getMessage()
    good.close()
    inbox.close()


# ---------------------------------------------------------------- heartbeats


class RunningProcess:
    """Stands in for the worker's Popen: still running."""

    def poll(self) -> None:
        return None


def drained_refusals(monitor: WorkerMonitor) -> int:
    monitor.check()
    return monitor.num_refused


@pytest.mark.timeout(30)
def test_a_forged_heartbeat_is_no_sign_of_life_and_a_sealed_one_is():
    address = tcp_address()
    monitor = WorkerMonitor(RunningProcess(), address, FrameAuth(SECRET, "heartbeat-0"))
    ctx = zmq.Context()
    wire = ctx.socket(zmq.PUSH)
    wire.setsockopt(zmq.LINGER, 0)
    wire.connect(address)
    try:
        beat = encode(WorkerHeartbeat(0, time.monotonic() + 3600))  # "heard an hour ahead"
        wire.send(beat)
        wire.send(FrameAuth(OTHER_SECRET, "heartbeat-0").seal(beat))
        eventually_sync(lambda: drained_refusals(monitor) == 2, RECV_TIMEOUT)
        assert monitor.check().silent_s > 0
        wire.send(FrameAuth(SECRET, "heartbeat-0").seal(beat))
        eventually_sync(lambda: monitor.check().silent_s == 0, RECV_TIMEOUT)
        assert monitor.num_refused == 2
    finally:
        wire.close(linger=0)
        ctx.term()
        monitor.close()


@pytest.mark.timeout(30)
def test_the_heartbeat_thread_seals_what_the_monitor_opens():
    address = tcp_address()
    monitor = WorkerMonitor(RunningProcess(), address, FrameAuth(SECRET, "heartbeat-0"))
    eventually_sync(lambda: monitor.check().silent_s > 0.3, RECV_TIMEOUT)  # no beats yet
    heartbeat = Heartbeat(0, address, 0.01, FrameAuth(SECRET, "heartbeat-0"))
    heartbeat.start()
    try:
        eventually_sync(lambda: monitor.check().silent_s < 0.1, RECV_TIMEOUT)
        assert monitor.num_refused == 0
    finally:
        heartbeat.stop()
        monitor.close()
