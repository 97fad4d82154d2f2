"""Client WebSockets: one connection (WsConn), its pools (WsPool, CheckoutPool), and one
generate exchange on a connection (ws_run)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgpack
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed


@dataclass(frozen=True)
class Closed:
    """Put in a request's queue when its connection closed (code 1006: no close frame)."""

    code: int | None
    reason: str


ALL = object()  # subscription key of a connection whose events all go to one reader


def cancel_message(rid: str) -> dict:
    return {"type": "cancel", "id": rid}


async def quietly(awaitable: Awaitable) -> None:
    """Awaits `awaitable`, ignoring any exception (a send on a closing socket)."""
    with contextlib.suppress(Exception):
        await awaitable


class WsConn:
    """One client WebSocket; a reader task routes each event to the queue subscribed
    under its request id (a `session` event: its session id; id-less events: None), or,
    with `catch_all`, every event to the queue under ALL. When the connection closes,
    every queue (and any subscribed later) gets its Closed."""

    def __init__(self, ws, binary: bool, catch_all: bool) -> None:
        self.ws, self.binary, self.catch_all = ws, binary, catch_all
        self.queues: dict[Any, asyncio.Queue] = {}
        self.closed: Closed | None = None
        self.closed_by_us = False
        self.strays: list[dict] = []  # events nobody was waiting for
        self.reader = asyncio.create_task(self._read())

    @classmethod
    async def open(cls, url: str, binary: bool, catch_all: bool = False) -> WsConn:
        url += "?encoding=msgpack" if binary else ""
        ws = await connect(url, compression=None, max_size=None, ping_interval=None)
        return cls(ws, binary, catch_all)

    def subscribe(self, key: Any) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.queues[key] = queue
        if self.closed is not None:
            queue.put_nowait(self.closed)
        return queue

    def unsubscribe(self, key: Any) -> None:
        self.queues.pop(key, None)

    async def send(self, message: dict | str | bytes) -> None:
        if isinstance(message, dict):
            message = msgpack.packb(message) if self.binary else json.dumps(message)
        await self.ws.send(message)

    def cancel_later(self, rid: str) -> None:
        """Tells the server a request is abandoned (a client past its deadline)."""
        if self.closed is None:
            asyncio.get_running_loop().create_task(quietly(self.send(cancel_message(rid))))

    async def close(self) -> None:
        self.closed_by_us = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ws.close(), 10)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.reader, 5)

    async def _read(self) -> None:
        try:
            async for frame in self.ws:
                event = msgpack.unpackb(frame) if isinstance(frame, bytes) else json.loads(frame)
                self._route(event)
        except ConnectionClosed:
            pass
        finally:
            code = self.ws.close_code if self.ws.close_code is not None else 1006
            self.closed = Closed(code, self.ws.close_reason or "")
            for queue in self.queues.values():
                queue.put_nowait(self.closed)

    def _route(self, event: dict) -> None:
        key = ALL if self.catch_all else event.get("id")
        if key is None and event.get("type") == "session":
            key = event.get("session_id")
        queue = self.queues.get(key)
        if queue is not None:
            queue.put_nowait(event)
        elif len(self.strays) < 100:
            self.strays.append(event)


class WsPool:
    """`size` long-lived connections, handed out round-robin (many requests share one);
    a connection the server closed is replaced, and its close code counted."""

    def __init__(self, url: str, binary: bool, size: int) -> None:
        self.url, self.binary = url, binary
        self.slots: list[WsConn | None] = [None] * size
        self.locks = [asyncio.Lock() for _ in range(size)]
        self.turn = itertools.count()
        self.server_closes: collections.Counter = collections.Counter()
        self.strays: list[dict] = []

    async def get(self) -> WsConn:
        i = next(self.turn) % len(self.slots)
        async with self.locks[i]:
            conn = self.slots[i]
            if conn is None or conn.closed is not None:
                if conn is not None:
                    self._retire(conn)
                conn = self.slots[i] = await WsConn.open(self.url, self.binary)
        return conn

    def _retire(self, conn: WsConn) -> None:
        if not conn.closed_by_us:
            self.server_closes[f"{conn.closed.code} {conn.closed.reason}".strip()] += 1
        self.strays += conn.strays

    async def close(self) -> None:
        for conn in filter(None, self.slots):
            await conn.close()
            self._retire(conn)
        self.slots = [None] * len(self.slots)


class CheckoutPool:
    """Connections lent to one request at a time (malformed frames): one that answered
    as it should goes back for the next request, any other is closed."""

    def __init__(self, url: str, binary: bool) -> None:
        self.url, self.binary = url, binary
        self.idle: list[WsConn] = []
        self.reused = 0

    async def get(self) -> WsConn:
        while self.idle:
            conn = self.idle.pop()
            if conn.closed is None:
                self.reused += 1
                return conn
        return await WsConn.open(self.url, self.binary, catch_all=True)

    async def put(self, conn: WsConn, healthy: bool) -> None:
        if healthy and conn.closed is None:
            self.idle.append(conn)
        else:
            await conn.close()

    async def close(self) -> None:
        for conn in self.idle:
            await conn.close()
        self.idle = []


async def ws_run(
    conn: WsConn, message: dict, on_delta: Callable[[dict], Awaitable[None]] | None = None
) -> tuple[dict | Closed, list[dict]]:
    """Sends one generate and reads its events to the end: (done / error / Closed,
    deltas). A request cut short by the deadline is cancelled on the server."""
    rid = message["id"]
    queue = conn.subscribe(rid)
    try:
        await conn.send(message)
        deltas: list[dict] = []
        while True:
            event = await queue.get()
            if isinstance(event, Closed) or event.get("type") in ("done", "error"):
                return event, deltas
            if event.get("type") == "delta":
                deltas.append(event)
                if on_delta is not None:
                    await on_delta(event)
    except asyncio.CancelledError:
        conn.cancel_later(rid)
        raise
    finally:
        conn.unsubscribe(rid)


async def next_answer(queue: asyncio.Queue) -> dict | Closed:
    """The next event that is not a delta (or the close)."""
    while True:
        event = await queue.get()
        if isinstance(event, Closed) or event.get("type") != "delta":
            return event


def describe(event: dict | Closed) -> str:
    """One line for a terminal event or a close, as the report quotes it."""
    if isinstance(event, Closed):
        return f"connection closed {event.code} {event.reason}".strip()
    if event.get("type") == "error":
        return f"error {event.get('code')}: {event.get('message')}"
    if event.get("type") == "done":
        return f"done, finish_reason {event.get('finish_reason')}"
    return f"{event.get('type')} event"
