"""uvicorn's Server with a graceful shutdown that drains the app first.

On SIGINT/SIGTERM uvicorn would fail every WebSocket at once (close 1012) and cut the
HTTP streams still running after its own timeout. `DrainingServer` first stops
listening, then runs the app's `Server.drain()` (in-flight requests finish within the
grace period or are aborted, every stream ends with its final event, WebSockets close
with 1001), and only then uvicorn's shutdown, whose lifespan stops the engine and its
worker. A second Ctrl-C skips what is left of the drain. After a graceful shutdown the
process exits 0 (uvicorn would re-raise the signal).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Iterator

import uvicorn
from starlette.applications import Starlette

logger = logging.getLogger(__name__)


class DrainingServer(uvicorn.Server):
    """A uvicorn.Server for an app built by `web.app.create_app`."""

    def __init__(self, config: uvicorn.Config, app: Starlette) -> None:
        super().__init__(config)
        self.app = app

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """SIGINT/SIGTERM start the shutdown (uvicorn's `handle_exit`); the previous
        handlers come back afterwards, and the signal is not raised again."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in signals}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()  # no new connections while draining
        app_server = getattr(self.app.state, "server", None)
        if app_server is not None:
            await self._drain(app_server)
        await super().shutdown(sockets)

    async def _drain(self, app_server) -> None:
        drain = asyncio.create_task(app_server.drain())
        while not drain.done() and not self.force_exit:
            await asyncio.wait({drain}, timeout=0.1)
        if not drain.done():
            logger.warning("forced exit: the drain was cut short")
            drain.cancel()
        try:
            await drain
        except asyncio.CancelledError:
            pass
        except Exception:  # noqa: BLE001 - shutdown goes on whatever the drain hit
            logger.exception("drain failed")
