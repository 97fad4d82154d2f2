"""The connection an SDK request rides on, as `Stream` and `ChatSession`
(web/client_stream.py) see it: `Wire` (one request on it), `RetryPolicy` (how requests
refused for overload are sent again) and `Connection` (what they need of the client).
`AsyncClient` (web/client.py) implements `Connection`; so the stream module never
imports the client, and the client imports the stream module (no import circle)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from web.client_errors import InvalidRequestError


@dataclass(frozen=True)
class RetryPolicy:
    """Requests refused for overload (`overloaded`, `too_many_requests`, `unavailable`)
    before their first token are sent again up to `max_retries` times, after
    min(max_delay_s, base_delay_s * 2**attempt) seconds less up to a quarter (jitter)."""

    max_retries: int = 2
    base_delay_s: float = 0.5
    max_delay_s: float = 8.0

    def __post_init__(self) -> None:
        if self.max_retries < 0 or self.base_delay_s < 0 or self.max_delay_s < 0:
            raise InvalidRequestError(f"retry settings must be >= 0, got {self}", param="retry")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0 for the first)."""
        backoff = min(self.max_delay_s, self.base_delay_s * 2**attempt)
        return backoff * (1 - 0.25 * random.random())


@dataclass(eq=False)
class Wire:
    """One request on the connection: its id there and the queue its events go to.
    The client keeps these, never the Stream, so a Stream nobody holds is collected."""

    request_id: str
    events: asyncio.Queue[dict[str, Any]] = field(default_factory=asyncio.Queue)


class Connection(Protocol):
    """What a stream and a chat session use of the client that owns the socket.
    Package-internal (underscored): not part of the SDK's public surface."""

    retry: RetryPolicy

    def _timeout_of(self, timeout: float | None) -> float | None:
        """A request's timeout: the client's default where `timeout` is unset."""

    def _register(self) -> Wire:
        """A fresh wire id whose events are routed to the returned `Wire`."""

    def _unregister(self, wire: Wire) -> None:
        """Stops routing `wire`'s events (the request has ended)."""

    def _abandon(self, wire: Wire) -> None:
        """A stream nobody holds any more (any thread): cancel it on the server."""

    async def _send(self, message: dict[str, Any]) -> None:
        """Sends one frame, connecting first if need be."""

    async def _send_cancel(self, request_id: str) -> None:
        """Cancels a request on the server, best effort."""

    async def _open_session(self, system: str | None) -> str:
        """Opens a server-side chat session; its id."""

    async def _call(self, message: dict[str, Any], reply: str, timeout: float) -> dict:
        """Sends a control message and returns its reply of type `reply`."""
