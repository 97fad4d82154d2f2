"""uvicorn's WebSocket protocol with the close a client that stopped reading is promised:
4008 (SLOW_READER_CLOSE, web/ws_connection.py), within a bound.

uvicorn (0.54, websockets' sans-I/O protocol, its default) ended such a client
otherwise, two ways:
- every ASGI send, the close included, first waits until the transport's write buffer
  drains below its low-water mark. A client that stopped reading never drains it, so
  the app's own 4008 close waited for ever;
- its keepalive (a ping every `ws_ping_interval` seconds, 20 by default) closes a
  connection whose pong does not come within `ws_ping_timeout` seconds (20) with 1011
  ("internal error") and does not tell the app, whose requests went on. A peer answers a
  ping only after reading every frame sent before it, so an unanswered ping is how a
  client that stopped reading shows, above all when its events fit in the socket
  buffers and no send of the app's ever blocks.
"""

from __future__ import annotations

import logging

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from web.ws_connection import SLOW_READER_CLOSE

logger = logging.getLogger(__name__)


class SlowReaderClosingProtocol(WebSocketsSansIOProtocol):
    """WebSocketsSansIOProtocol whose closes reach a client that stopped reading.

    - The app's `websocket.close` is written at once, even past the write buffer's
      high-water mark: its frame queues behind the unread events, so the client finds it
      when (if) it reads them; the transport then closes as uvicorn's does.
    - A keepalive ping unanswered for `ws_ping_timeout` seconds closes the connection
      with SLOW_READER_CLOSE, and the app gets its `websocket.disconnect` at once (its
      requests are aborted, its buffered events dropped), not when the socket goes.
    So a client that stops reading gets 4008 within `ws_ping_interval + ws_ping_timeout`
    seconds (40 by default), sooner when it leaves MAX_CONTROL_EVENTS events unread.
    Other connections are untouched. Use it as `uvicorn.Config(ws=SlowReaderClosingProtocol)`."""

    async def send(self, message) -> None:
        if message["type"] == "websocket.close" and self.handshake_complete:
            self.writable.set()  # a close never waits for a buffer that may never drain
        await super().send(message)

    def keepalive_timeout(self) -> None:
        self.pong_timer = None
        self.pending_ping_payload = None
        if self.close_sent or self.transport.is_closing():
            return
        reason = f"client stopped reading: no pong within {self.ping_timeout:g} s"
        client = "{}:{}".format(*self.client) if self.client else "client"
        logger.warning("%s: %s; closing with %d", client, reason, SLOW_READER_CLOSE)
        disconnect = {"type": "websocket.disconnect", "code": SLOW_READER_CLOSE, "reason": reason}
        self.queue.put_nowait(disconnect)
        self.conn.fail(SLOW_READER_CLOSE, reason)
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.transport.close()
