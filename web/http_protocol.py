"""uvicorn's h11 protocol with a deadline for request headers (slowloris).

uvicorn (0.54, h11) arms no timer on a new connection, and its keep-alive timer is
cancelled by the first byte of the next request: a client that sends a partial request
line or trickles header bytes holds its connection for as long as it likes."""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)


class HeaderTimeoutH11Protocol(H11Protocol):
    """H11Protocol that closes a connection whose request headers are not complete
    `header_timeout` seconds after it opened or after its previous response completed.

    The timer runs exactly while h11 waits for a request (their_state IDLE): it is
    cancelled once a request's headers are parsed, so slow bodies, long handlers,
    streaming responses and WebSockets are never cut by it. On expiry, a connection that
    sent part of a request gets `408 Request Timeout` (Connection: close); one that sent
    nothing is closed silently, as uvicorn's keep-alive timeout does (an unsolicited 408
    on an idle keep-alive connection could be read as the reply to a request in flight).
    An idle keep-alive connection therefore lasts min(timeout_keep_alive, header_timeout).
    Build it with `factory(header_timeout)` for `uvicorn.Config(http=...)`."""

    def __init__(self, *args: Any, header_timeout: float = 10.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_timeout = header_timeout
        self._header_timer: asyncio.TimerHandle | None = None

    @classmethod
    def factory(cls, header_timeout: float) -> Callable[..., HeaderTimeoutH11Protocol]:
        """What uvicorn calls with config=, server_state=, app_state=, _loop=."""
        return functools.partial(cls, header_timeout=header_timeout)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._update_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        self._update_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update_header_timer()

    def _update_header_timer(self) -> None:
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._cancel_header_timer()
        elif self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        received = len(self.conn.trailing_data[0])
        level = logging.INFO if received else logging.DEBUG
        logger.log(
            level,
            "%s: no complete request headers within %g s (%d bytes received): closing",
            "{}:{}".format(*self.client) if self.client else "client",
            self.header_timeout,
            received,
        )
        if received:
            headers = [(b"content-length", b"0"), (b"connection", b"close")]
            response = h11.Response(status_code=408, headers=headers, reason=b"Request Timeout")
            self.transport.write(self.conn.send(response) + self.conn.send(h11.EndOfMessage()))
        self.conn.send(h11.ConnectionClosed())
        self.transport.close()
