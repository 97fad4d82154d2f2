"""The actor base: dispatch by type; the failure rule (an error about one request fails
that request and the loop goes on; any other error ends the loop); bad frames are
dropped; Shutdown and stop() end it cleanly (no task, no ipc file left); the ready
handshake."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio

from actors.actor import Actor, ActorStartupError, await_ready, send_message
from actors.transport import (
    Inbox,
    Outbox,
    inproc_pair,
    ipc_address,
    new_run_dir,
    zmq_inbox,
    zmq_outbox,
)
from engine.codec import InboxDecoder, encode
from engine.messages import (
    AbortRequest,
    BlockOp,
    Shutdown,
    StepResult,
    WorkerReady,
)
from tests.eventually import eventually

TIMEOUT = 5.0
EMPTY_RESULT = StepResult.empty(1, 0)


class EchoActor(Actor):
    """Echoes AbortRequest back (async handler); records BlockOp (sync handler) and the
    requests it failed.

    The request id "boom" makes the echo handler raise; a BlockOp of kind "boom" too."""

    def __init__(self, inbox: Inbox, reply: Outbox, **handler_overrides: Any) -> None:
        handlers = {AbortRequest: self.on_abort, BlockOp: self.on_token}
        handlers.update({k: v for k, v in handler_overrides.items() if isinstance(k, type)})
        super().__init__("echo", inbox, handlers, outboxes=[reply])
        self.reply = reply
        self.tokens: list[int] = []
        self.failed: list[tuple[str, str]] = []
        self.after = 0

    async def on_abort(self, message: AbortRequest) -> None:
        if message.request_id == "boom":
            raise RuntimeError("handler failed on purpose")
        await send_message(self.reply, message)

    def on_token(self, message: BlockOp) -> None:
        if message.kind == "boom":
            raise RuntimeError("no single request to blame")
        self.tokens.append(message.num)

    async def fail_request(self, request_id: str, error: str, message: Any) -> None:
        self.failed.append((request_id, error))

    async def after_message(self) -> None:
        self.after += 1


@dataclass
class Rig:
    """An actor under test plus the test's ends of its two channels."""

    actor: EchoActor
    to_actor: Outbox
    replies: Inbox
    run_dir: str | None

    async def send(self, message: Any) -> None:
        await send_message(self.to_actor, message)

    async def reply(self) -> Any:
        frame = await asyncio.wait_for(self.replies.recv(), TIMEOUT)
        return InboxDecoder([AbortRequest]).decode(frame)


def make_channels(kind: str, ctx: zmq.asyncio.Context, run_dir: str | None, name: str):
    if kind == "inproc":
        return inproc_pair()
    address = ipc_address(run_dir, name)
    return zmq_outbox(ctx, address), zmq_inbox(ctx, address)


@pytest.fixture(params=["inproc", "ipc"])
async def rig(request, ctx) -> AsyncIterator[Rig]:
    run_dir = new_run_dir() if request.param == "ipc" else None
    to_actor, actor_inbox = make_channels(request.param, ctx, run_dir, "actor")
    actor_reply, replies = make_channels(request.param, ctx, run_dir, "reply")
    actor = EchoActor(actor_inbox, actor_reply)
    await actor.start()
    yield Rig(actor, to_actor, replies, run_dir)
    await actor.stop(timeout=1.0)
    to_actor.close()
    replies.close()
    if run_dir is not None:
        shutil.rmtree(run_dir)


def socket_files(run_dir: str | None) -> list[str]:
    return [] if run_dir is None else sorted(f for f in os.listdir(run_dir) if f.endswith(".sock"))


async def test_messages_are_dispatched_by_type(rig):
    for i in range(50):
        await rig.send(BlockOp("grow", "r", i))
        await rig.send(AbortRequest(f"r{i}"))
    assert [(await rig.reply()).request_id for _ in range(50)] == [f"r{i}" for i in range(50)]
    assert rig.actor.tokens == list(range(50))
    assert rig.actor.num_received == 100
    assert (rig.actor.num_dropped, rig.actor.num_errors) == (0, 0)
    assert rig.actor.after == 100  # after_message ran after each


def bad_frames() -> list[bytes]:
    valid = encode(AbortRequest("x"))
    return [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"not msgpack at all",
        valid[:-1],  # truncated
        valid[: len(valid) // 2],
        msgpack.packb(["AbortRequest", [123]]),  # wrong-typed field
        msgpack.packb(["AbortRequest", []]),  # missing field
        msgpack.packb(["AbortRequest", ["x", "extra"]]),  # extra field
        msgpack.packb(["BlockOp", ["grow", "r", "not an int", "", []]]),
        msgpack.packb(["BlockOp", ["grow", "r", True, "", []]]),  # bool is not an int
        msgpack.packb(["WorkerReady", [0, 1, 2, 3, 4]]),  # not accepted by this inbox
        msgpack.packb(["NoSuchMessage", []]),
        msgpack.packb({"type": "AbortRequest"}),
        msgpack.packb([1, 2, 3]),
        msgpack.packb(None),
    ]


async def test_bad_frames_are_dropped_and_counted_and_the_actor_keeps_going(rig):
    frames = bad_frames()
    for frame in frames:
        await rig.to_actor.send(frame)
        await rig.send(AbortRequest("after"))
    for _ in frames:
        assert (await rig.reply()).request_id == "after"
    assert rig.actor.num_dropped == len(frames)
    assert rig.actor.num_errors == 0
    assert rig.actor.is_alive
    # The frame that names a request (an AbortRequest of "x" with a field too many) fails it.
    assert [rid for rid, _ in rig.actor.failed] == ["x"]
    assert all("could not be decoded" in error for _, error in rig.actor.failed)


async def test_a_failing_handler_fails_its_request_and_the_loop_continues(rig):
    await rig.send(AbortRequest("boom"))
    await rig.send(AbortRequest("boom"))
    await rig.send(AbortRequest("still here"))
    assert (await rig.reply()).request_id == "still here"
    assert rig.actor.num_errors == 2
    assert rig.actor.failed == [("boom", "RuntimeError: handler failed on purpose")] * 2
    assert rig.actor.is_alive and rig.actor.crash is None


async def test_shutdown_stops_the_actor_and_closes_its_transports(rig):
    before = rig.actor.last_activity
    await rig.send(AbortRequest("a"))
    await rig.reply()
    assert rig.actor.last_activity > before
    await rig.send(Shutdown("test over"))
    await eventually(lambda: not rig.actor.is_alive, TIMEOUT, "the actor ended on Shutdown")
    assert rig.actor.crash is None
    assert "actor.sock" not in socket_files(rig.run_dir)  # reply.sock is the test's own
    await rig.actor.stop()  # still fine afterwards


async def test_stop_is_idempotent_and_leaves_nothing_behind(rig):
    await rig.send(AbortRequest("a"))
    await rig.reply()
    await rig.actor.stop()
    await rig.actor.stop()
    assert not rig.actor.is_alive
    assert asyncio.all_tasks() == {asyncio.current_task()}
    assert "actor.sock" not in socket_files(rig.run_dir)
    rig.replies.close()
    assert socket_files(rig.run_dir) == []


async def test_stop_lets_the_current_handler_finish():
    finished, entered = [], asyncio.Event()

    async def slow(message: StepResult) -> None:
        entered.set()
        await asyncio.sleep(0.1)  # the behaviour under test: a handler still busy at stop()
        finished.append(message.step_id)

    _, inbox = pair = inproc_pair()
    actor = Actor("slow", inbox, {StepResult: slow})
    await actor.start()
    await send_message(pair[0], EMPTY_RESULT)
    await asyncio.wait_for(entered.wait(), TIMEOUT)
    await actor.stop(timeout=2.0)
    assert finished == [1]
    assert not actor.is_alive


async def test_stop_cancels_a_handler_that_overruns_the_timeout():
    entered = asyncio.Event()

    async def stuck(message: StepResult) -> None:
        entered.set()
        await asyncio.sleep(60)  # the behaviour under test: a handler that overruns stop()

    outbox, inbox = inproc_pair()
    actor = Actor("stuck", inbox, {StepResult: stuck})
    await actor.start()
    await send_message(outbox, EMPTY_RESULT)
    await asyncio.wait_for(entered.wait(), TIMEOUT)
    started = time.monotonic()
    await actor.stop(timeout=0.2)
    assert time.monotonic() - started < 1.0
    assert not actor.is_alive
    assert asyncio.all_tasks() == {asyncio.current_task()}


async def test_a_handler_may_stop_its_own_actor():
    outbox, inbox = inproc_pair()
    actor: Actor

    async def quit_(message: AbortRequest) -> None:
        await actor.stop()

    actor = Actor("quitter", inbox, {AbortRequest: quit_})
    await actor.start()
    await send_message(outbox, AbortRequest("bye"))
    await eventually(lambda: not actor.is_alive, TIMEOUT, "the actor stopped itself")
    assert actor.crash is None


async def test_shutdown_runs_its_handler_first():
    seen = []
    outbox, inbox = inproc_pair()
    actor = Actor("cleanup", inbox, {Shutdown: lambda m: seen.append(m.reason)})
    await actor.start()
    await send_message(outbox, Shutdown("bye"))
    await eventually(lambda: not actor.is_alive, TIMEOUT, "the actor ended on Shutdown")
    assert seen == ["bye"]


async def test_an_error_about_no_single_request_ends_the_loop():
    outbox, inbox = inproc_pair()
    _, reply_in = reply = inproc_pair()
    actor = EchoActor(inbox, reply[0])
    await actor.start()
    await send_message(outbox, BlockOp("boom", "r"))
    await eventually(lambda: not actor.is_alive, TIMEOUT, "the loop ended on the error")
    assert isinstance(actor.crash, RuntimeError) and "no single request" in str(actor.crash)
    assert actor.failed == []
    await actor.stop()
    reply_in.close()


async def test_an_actor_that_cannot_fail_requests_stops_rather_than_lose_one():
    outbox, inbox = inproc_pair()
    actor = Actor("plain", inbox, {AbortRequest: lambda m: 1 / 0})
    await actor.start()
    await send_message(outbox, AbortRequest("r"))
    await eventually(lambda: not actor.is_alive, TIMEOUT, "the actor stopped")
    assert "cannot fail request 'r'" in str(actor.crash)
    assert "ZeroDivisionError" in str(actor.crash)


async def test_actor_cannot_start_twice():
    _, inbox = inproc_pair()
    actor = Actor("once", inbox, {})
    await actor.start()
    with pytest.raises(RuntimeError, match="already started"):
        await actor.start()
    await actor.stop()


READY_DECODER = InboxDecoder([AbortRequest, WorkerReady])


async def test_await_ready_times_out_with_a_clear_error():
    _, inbox = inproc_pair()
    started = time.monotonic()
    with pytest.raises(ActorStartupError, match=r"worker 0 sent no WorkerReady within 0.3 s"):
        await await_ready(inbox, READY_DECODER, WorkerReady, 0.3, sender="worker 0")
    assert 0.3 <= time.monotonic() - started < 0.6


async def test_await_ready_returns_messages_that_came_first(ctx):
    run_dir = new_run_dir()
    try:
        address = ipc_address(run_dir, "ready")
        inbox, outbox = zmq_inbox(ctx, address), zmq_outbox(ctx, address)
        ready = WorkerReady(
            worker_id=0, num_blocks=1024, block_size=16, max_model_len=2048, vocab_size=32000
        )
        await send_message(outbox, AbortRequest("early"))
        await outbox.send(b"garbage")
        await send_message(outbox, ready)
        await send_message(outbox, AbortRequest("late"))
        got, early = await await_ready(inbox, READY_DECODER, WorkerReady, TIMEOUT)
        assert got == ready
        assert early == [AbortRequest("early")]
        late = await asyncio.wait_for(inbox.recv(), TIMEOUT)
        assert READY_DECODER.decode(late) == AbortRequest("late")  # not consumed
        outbox.close()
        inbox.close()
        assert socket_files(run_dir) == []
    finally:
        shutil.rmtree(run_dir)


async def test_await_ready_refuses_a_type_the_decoder_cannot_produce():
    _, inbox = inproc_pair()
    with pytest.raises(ValueError, match="Shutdown is not among"):
        await await_ready(inbox, READY_DECODER, Shutdown, 0.1)
