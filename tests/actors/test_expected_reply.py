"""The actor base's expected answer (`Actor.expect`): handled by the loop as it arrives,
before an inbox frame that waits beside it, then `after_message`; an overdue one ends
the loop with its timeout error even while inbox frames keep coming; stop() with an
answer outstanding ends cleanly (in-process and over ipc)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import pytest
import zmq.asyncio

from actors.actor import Actor, send_message
from actors.pending_reply import PendingReply
from actors.transport import (
    Inbox,
    Outbox,
    inproc_pair,
    ipc_address,
    new_run_dir,
    zmq_inbox,
    zmq_outbox,
)
from engine.codec import InboxDecoder
from engine.messages import AbortRequest, BlockOpsApplied

TIMEOUT = 5.0


class Overdue(RuntimeError):
    """The asker's answer did not come in time."""


class Asker(Actor):
    """On AbortRequest("ask") expects one answer on `answers`; echoes every AbortRequest
    (after registering the expectation); logs what it handled, in order."""

    def __init__(self, inbox: Inbox, echo: Outbox, answers: Inbox, reply_timeout: float):
        super().__init__("asker", inbox, {AbortRequest: self.on_abort}, [echo], [answers])
        self.echo, self.answers, self.reply_timeout = echo, answers, reply_timeout
        self.log: list[str] = []
        self.ended = asyncio.Event()  # the loop is over

    async def on_abort(self, message: AbortRequest) -> None:
        self.log.append(message.request_id)
        if message.request_id == "ask":
            timed_out = lambda: Overdue(f"no answer in {self.reply_timeout:g} s")  # noqa: E731
            self.expect(PendingReply(self.answers, self.reply_timeout, timed_out), self.on_answer)
        await send_message(self.echo, message)

    async def run(self) -> None:
        try:
            await super().run()
        finally:
            self.ended.set()

    def on_answer(self, frame: Any) -> None:
        answer = InboxDecoder([BlockOpsApplied]).decode(frame)
        self.log.append(f"answer {answer.exchange_id}")

    async def after_message(self) -> None:
        self.log.append("after")


@dataclass
class Rig:
    actor: Asker
    to_actor: Outbox
    to_answers: Outbox
    echoes: Inbox

    async def send(self, request_id: str) -> None:
        await send_message(self.to_actor, AbortRequest(request_id))

    async def echo(self) -> str:
        async with asyncio.timeout(TIMEOUT):
            return InboxDecoder([AbortRequest]).decode(await self.echoes.recv()).request_id


@pytest.fixture
async def make_rig() -> AsyncIterator:
    ctx = zmq.asyncio.Context()
    made: list[tuple[Rig, str | None, list]] = []

    async def make(kind: str, reply_timeout: float = TIMEOUT) -> tuple[Rig, str | None]:
        run_dir = new_run_dir() if kind == "ipc" else None

        def pair(name: str):
            if run_dir is None:
                return inproc_pair()
            address = ipc_address(run_dir, name)
            return zmq_outbox(ctx, address), zmq_inbox(ctx, address)

        (to_actor, inbox), (echo, echoes), (to_answers, answers) = map(
            pair, ("actor", "echo", "answers")
        )
        actor = Asker(inbox, echo, answers, reply_timeout)
        await actor.start()
        rig = Rig(actor, to_actor, to_answers, echoes)
        made.append((rig, run_dir, [to_actor, to_answers, echoes]))
        return rig, run_dir

    yield make
    for rig, run_dir, ends in made:
        await rig.actor.stop(timeout=1.0)
        for end in ends:
            end.close()
        if run_dir is not None:
            shutil.rmtree(run_dir)
    ctx.destroy(linger=0)


async def test_the_answer_is_handled_when_it_arrives_before_a_waiting_frame(make_rig):
    rig, _ = await make_rig("inproc")
    await rig.send("ask")
    assert await rig.echo() == "ask"  # the loop now waits for the inbox and the answer
    await rig.send("later")  # both arrive while the loop waits: the answer goes first
    await send_message(rig.to_answers, BlockOpsApplied(1, (), 0, 0))
    assert await rig.echo() == "later"
    assert rig.actor.log == ["ask", "after", "answer 1", "after", "later", "after"]
    assert not rig.actor.expects_reply and rig.actor.is_alive


async def test_an_overdue_answer_ends_the_loop_while_frames_keep_coming(make_rig):
    reply_timeout = 0.3
    rig, _ = await make_rig("inproc", reply_timeout)
    await rig.send("ask")
    assert await rig.echo() == "ask"
    start = time.monotonic()  # after the actor's deadline was set
    ended = asyncio.ensure_future(rig.actor.ended.wait())
    handled = 0
    async with asyncio.timeout(TIMEOUT):
        while not ended.done():  # the inbox never idles until the loop ends
            await rig.send(f"busy{handled}")
            echo = asyncio.ensure_future(rig.echo())
            await asyncio.wait({echo, ended}, return_when=asyncio.FIRST_COMPLETED)
            if echo.done():
                handled += 1
            else:
                echo.cancel()
    assert isinstance(rig.actor.crash, Overdue)
    assert handled > 0 and rig.actor.log[-2:] == [f"busy{handled - 1}", "after"]
    assert time.monotonic() - start < reply_timeout + 1.0


@pytest.mark.parametrize("kind", ["inproc", "ipc"])
async def test_stop_with_an_answer_outstanding_ends_cleanly(make_rig, kind):
    rig, run_dir = await make_rig(kind)
    await rig.send("ask")
    assert await rig.echo() == "ask"
    assert rig.actor.expects_reply
    async with asyncio.timeout(TIMEOUT):
        await rig.actor.stop(timeout=TIMEOUT)
    assert not rig.actor.is_alive and rig.actor.crash is None
    if run_dir is not None:  # its inbox and answer inbox removed their socket files
        assert sorted(os.listdir(run_dir)) == ["echo.sock"]
