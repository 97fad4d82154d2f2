"""The per-connection event buffer: deltas coalesce for a slow reader; a client that
leaves too many other events unread is disconnected with a clean close code while the
server goes on."""

from __future__ import annotations

import asyncio
import json

from starlette.datastructures import Headers

from web.api_keys import ApiKeys
from web.event_buffer import MAX_CONTROL_EVENTS, EventBuffer
from web.sessions import SessionStore
from web.ws_connection import SLOW_READER_CLOSE, StreamConnection, StreamLimits


def delta(rid: str, text: str, ids: list[int]) -> dict:
    return {"type": "delta", "id": rid, "text": text, "token_ids": ids}


def test_a_requests_unsent_deltas_merge_in_order() -> None:
    buf = EventBuffer()
    assert buf.push(delta("a", "He", [1]))
    assert buf.push(delta("b", "X", [9]))
    assert buf.push(delta("a", "llo", [2, 3]))
    assert buf.push({"type": "done", "id": "a"})
    assert buf.push(delta("a", "!", [4]))  # after the done: must not merge before it
    events = [buf.pop() for _ in range(4)]
    assert events == [
        delta("a", "Hello", [1, 2, 3]),
        delta("b", "X", [9]),
        {"type": "done", "id": "a"},
        delta("a", "!", [4]),
    ]
    assert buf.pop() is None and not buf.ready.is_set()


def test_buffer_refuses_once_control_events_pile_up() -> None:
    buf = EventBuffer()
    for i in range(MAX_CONTROL_EVENTS):
        assert buf.push({"type": "pong"})
        assert buf.push(delta("a", "x", [i]))  # deltas keep merging into one
    assert len(buf.events) == MAX_CONTROL_EVENTS + 1
    assert not buf.push({"type": "pong"})
    assert buf.overflowed
    assert not buf.push(delta("b", "y", [1]))  # nothing more once overflowed


class StalledSocket:
    """A WebSocket whose client sends frames but stops reading after `reads` events."""

    def __init__(self, frames: list[str], reads: int) -> None:
        self.frames = [{"type": "websocket.receive", "text": f} for f in frames]
        self.reads = reads
        self.sent: list[dict] = []
        self.closed: tuple[int, str] | None = None
        self.closed_event = asyncio.Event()
        self.headers = Headers()  # no Authorization header
        self.client = None  # no peer address

    async def accept(self) -> None:
        pass

    async def receive(self) -> dict:
        if self.frames:
            return self.frames.pop(0)
        await self.closed_event.wait()  # the client stays connected until closed
        return {"type": "websocket.disconnect", "code": self.closed[0]}

    async def send_text(self, text: str) -> None:
        if len(self.sent) >= self.reads:
            await asyncio.Event().wait()  # the client's receive buffer is full
        self.sent.append(json.loads(text))

    async def close(self, code: int = 1000, reason: str = "") -> None:
        self.closed = (code, reason)
        self.closed_event.set()


async def test_a_client_that_stops_reading_is_closed_with_4008() -> None:
    pings = [json.dumps({"type": "ping"})] * (MAX_CONTROL_EVENTS + 50)
    ws = StalledSocket(pings, reads=10)
    conn = StreamConnection(
        ws, None, SessionStore(60.0, 1000), StreamLimits(), ApiKeys(), binary=False
    )
    await asyncio.wait_for(conn.serve(), 5)
    assert ws.closed is not None
    code, reason = ws.closed
    assert code == SLOW_READER_CLOSE
    assert "unread" in reason
    assert ws.sent == [{"type": "pong"}] * 10
