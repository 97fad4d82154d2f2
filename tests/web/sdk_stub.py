"""A scripted stand-in for a pagedserve WebSocket (`/v1/stream`) on 127.0.0.1: each
frame a client sends is recorded and handed to a script that answers it. The SDK's
tests use it for what a real server does only under conditions hard to arrange (an
overload at the right moment, an engine error, a server that never answers)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

from websockets.asyncio.server import ServerConnection, serve

Script = Callable[["StubServer", ServerConnection, dict[str, Any]], Awaitable[None]]


class StubServer:
    """`async with StubServer(script) as stub`: `stub.url` to connect to; every frame
    received lands in `stub.frames` (and `stub.arrived` is set), then `script(stub, ws,
    frame)` answers it."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.frames: list[dict[str, Any]] = []
        self.arrived = asyncio.Event()

    async def __aenter__(self) -> StubServer:
        self._server = await serve(self._serve, "127.0.0.1", 0)
        port = next(iter(self._server.sockets)).getsockname()[1]
        self.url = f"ws://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        await self._server.wait_closed()

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [f for f in self.frames if f.get("type") == kind]

    async def wait_for(self, check: Callable[[], bool], timeout: float = 5.0) -> None:
        """Returns once `check()` holds, re-checked as each frame arrives."""
        async with asyncio.timeout(timeout):
            while not check():
                self.arrived.clear()
                await self.arrived.wait()

    async def _serve(self, ws: ServerConnection) -> None:
        async for raw in ws:
            frame = json.loads(raw)
            self.frames.append(frame)
            self.arrived.set()
            await self.script(self, ws, frame)


async def send(ws: ServerConnection, **event: Any) -> None:
    await ws.send(json.dumps(event))


async def answer_control(ws: ServerConnection, frame: dict[str, Any]) -> bool:
    """Answers ping and session.open as the server does (True if it was one)."""
    call = {"id": frame["id"]} if "id" in frame else {}
    if frame["type"] == "ping":
        await send(ws, type="pong", **call)
    elif frame["type"] == "session.open":
        await send(ws, type="session", session_id="s1", messages=[], **call)
    else:
        return False
    return True


async def finish(ws: ServerConnection, rid: str, text: str = "ok") -> None:
    """A one-delta reply that ends with finish_reason "stop"."""
    await send(ws, type="delta", id=rid, text=text, token_ids=[1])
    usage = {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    await send(ws, type="done", id=rid, finish_reason="stop", stop_reason=None, usage=usage)
