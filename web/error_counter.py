"""Counting every HTTP error answer, whichever route or middleware gave it.

HTTP refusals are answered in many places (the API key check, body reading, parsing,
admission, the engine's own validation, a stream that fails midway); rather than a
counting call beside each, this middleware watches what goes out: every answer in
OpenAI's error shape is one count of its `code`. WebSocket `error` events are counted
by the connection's sender (`StreamConnection._send`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SSE_ERROR = b'data: {"error": '  # how web.openai_format.sse writes an error event
MAX_ERROR_BODY = 1 << 16  # error bodies are small (messages are cut to 2,000 chars)


class ErrorAnswerCounter:
    """Calls `count(code)` once per HTTP error answer: a 4xx/5xx response whose JSON
    body is `{"error": {"code": ...}}`, or an SSE `data: {"error": ...}` event in a
    stream that had started fine. Other responses pass untouched (a body is only read
    when the status is 4xx/5xx, an event only when it starts like an error)."""

    def __init__(self, app: ASGIApp, count: Callable[[Scope, str], None]) -> None:
        self.app, self.count = app, count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status, body = 0, bytearray()

        async def watch(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                chunk = message.get("body", b"")
                if status >= 400 and len(body) + len(chunk) <= MAX_ERROR_BODY:
                    body.extend(chunk)
                    if not message.get("more_body", False):
                        self._count(scope, bytes(body))
                elif status < 400 and chunk.startswith(SSE_ERROR):
                    self._count(scope, chunk[len(b"data: ") :])
            await send(message)

        await self.app(scope, receive, watch)

    def _count(self, scope: Scope, raw: bytes) -> None:
        code = error_code(raw)
        if code is not None:
            self.count(scope, code)


def error_code(raw: bytes) -> str | None:
    """The `error.code` of an OpenAI-shaped error body, None for anything else."""
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None
