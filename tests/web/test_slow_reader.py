"""A WebSocket client that stops reading while its request streams is closed with 4008
within a bound, even once the server's socket buffer toward it is full: when a keepalive
ping goes unanswered, or when it leaves too many events unread. Its request ends, the
close frame waits behind the events it had not read, and other clients are served on.

The server runs in this process: uvicorn with the server's WebSocket protocol and the
real StreamConnection, over a stub that streams big deltas, on a listening socket whose
connections get a small send buffer; the slow client is a raw socket with a small
receive buffer that reads nothing until it looks for the close."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from types import SimpleNamespace

import pytest
import uvicorn
import websockets
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from websockets.client import ClientProtocol
from websockets.frames import Close, Frame, Opcode
from websockets.http11 import Response
from websockets.uri import parse_uri

from web.api_keys import ApiKeys
from web.client_concurrency import ClientConcurrency
from web.event_buffer import MAX_CONTROL_EVENTS
from web.sessions import SessionStore
from web.ws_connection import SLOW_READER_CLOSE, StreamConnection, StreamLimits
from web.ws_protocol import SlowReaderClosingProtocol

pytestmark = pytest.mark.timeout(60)
CHUNK = "x" * 16_384  # characters per delta: a few fill the small buffers below
CHUNKS = 64
GENERATE = {"type": "generate", "id": "r", "prompt": "hi", "params": {"max_tokens": 8}}


class StreamingStub:
    """Stands in for the Generator: a request streams CHUNKS deltas of CHUNK (`streamed`
    is set after the last), then stays open until it is cancelled (`ended`). `gone`
    is set once a connection's handler has returned (stub_app)."""

    def __init__(self) -> None:
        self.metrics = SimpleNamespace(refused=lambda code: None)
        self.concurrency = ClientConcurrency()
        self.streamed = asyncio.Event()
        self.ended = asyncio.Event()
        self.gone = asyncio.Event()

    async def stream(self, prompt, params, request_id, timing):
        try:
            for _ in range(CHUNKS):
                yield SimpleNamespace(text=CHUNK, token_ids=[1], logprobs=None,
                                      finish_reason=None, num_prompt_tokens=1,
                                      num_output_tokens=1)  # fmt: skip
                await asyncio.sleep(0)  # the writer's turn
            self.streamed.set()
            await asyncio.Event().wait()  # open until the connection goes
        finally:
            self.ended.set()


def stub_app(stub: StreamingStub) -> Starlette:
    async def stream(ws) -> None:
        sessions = SessionStore(60.0, 1000)
        try:
            await StreamConnection(ws, stub, sessions, StreamLimits(), ApiKeys(), False).serve()
        finally:
            stub.gone.set()

    return Starlette(routes=[WebSocketRoute("/v1/stream", stream)])


@contextlib.asynccontextmanager
async def serving(app: Starlette, **ws_options) -> AsyncIterator[int]:
    """uvicorn in this loop with the server's WebSocket protocol; yields its port. Its
    connections inherit a small send buffer (no autotuning) from the listening socket."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 16_384)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    config = uvicorn.Config(app, ws=SlowReaderClosingProtocol, lifespan="off",
                            log_config=None, timeout_graceful_shutdown=5,
                            **ws_options)  # fmt: skip
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[listener]))
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 15)
        listener.close()


class SilentClient:
    """A WebSocket client on a raw socket with a small receive buffer: it completes the
    handshake and sends frames, and reads nothing more (not even a ping) until
    `close_received()`."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.setblocking(False)
        self.protocol: ClientProtocol | None = None
        self.response: Response | None = None
        self.frames: list[Frame] = []

    @classmethod
    async def connect(cls, port: int) -> SilentClient:
        client, loop = cls(), asyncio.get_running_loop()
        await loop.sock_connect(client.sock, ("127.0.0.1", port))
        uri = parse_uri(f"ws://127.0.0.1:{port}/v1/stream")
        client.protocol = ClientProtocol(uri, max_size=None)
        client.protocol.send_request(client.protocol.connect())
        await client._flush()
        while client.response is None:
            assert await client._receive(), "closed during the handshake"
        assert client.response.status_code == 101, client.response
        return client

    async def send(self, message: dict) -> None:
        self.protocol.send_text(json.dumps(message).encode())
        await self._flush()

    async def close_received(self) -> Close:
        """Reads everything the server sent, up to its close frame."""
        while self.protocol.close_rcvd is None:
            if not await self._receive():
                break
        assert self.protocol.close_rcvd is not None, "closed without a close frame"
        return self.protocol.close_rcvd

    def texts(self) -> list[dict]:
        return [json.loads(f.data) for f in self.frames if f.opcode is Opcode.TEXT]

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(self.sock, b"".join(self.protocol.data_to_send()))

    async def _receive(self) -> bool:
        """Reads what has come; False once the server has closed the socket."""
        try:
            data = await asyncio.get_running_loop().sock_recv(self.sock, 1 << 16)
        except ConnectionResetError:
            data = b""
        if not data:
            return False
        self.protocol.receive_data(data)
        for event in self.protocol.events_received():
            if isinstance(event, Frame):
                self.frames.append(event)
            else:
                self.response = event
        return True


async def test_a_client_that_never_reads_its_stream_gets_4008_and_others_go_on() -> None:
    stub = StreamingStub()
    async with serving(stub_app(stub), ws_ping_interval=0.5, ws_ping_timeout=1.0) as port:
        silent = await SilentClient.connect(port)
        await silent.send(GENERATE)
        async with websockets.connect(f"ws://127.0.0.1:{port}/v1/stream") as reader:
            await asyncio.wait_for(stub.streamed.wait(), 10)  # its buffers are full
            await asyncio.wait_for(stub.ended.wait(), 10)  # the server gave up on it
            await asyncio.wait_for(stub.gone.wait(), 10)  # before it read anything
            await reader.send(json.dumps({"type": "ping"}))  # a reading client: served
            assert json.loads(await asyncio.wait_for(reader.recv(), 10)) == {"type": "pong"}
        close = await asyncio.wait_for(silent.close_received(), 10)
        silent.sock.close()
    assert close.code == SLOW_READER_CLOSE and "stopped reading" in close.reason
    deltas = silent.texts()
    assert deltas and all(e["type"] == "delta" and e["id"] == "r" for e in deltas)


async def test_a_client_that_leaves_too_many_events_unread_gets_4008_past_a_full_buffer():
    stub = StreamingStub()
    async with serving(stub_app(stub), ws_ping_interval=None) as port:  # no keepalive
        silent = await SilentClient.connect(port)
        await silent.send(GENERATE)
        await asyncio.wait_for(stub.streamed.wait(), 10)  # its buffers are full
        for _ in range(MAX_CONTROL_EVENTS + 10):  # pongs pile up behind the deltas
            await silent.send({"type": "ping"})
        await asyncio.wait_for(stub.ended.wait(), 10)
        await asyncio.wait_for(stub.gone.wait(), 10)  # closed before it read anything
        close = await asyncio.wait_for(silent.close_received(), 10)
        silent.sock.close()
    assert close.code == SLOW_READER_CLOSE and "unread" in close.reason
    assert silent.texts() and silent.texts()[0]["type"] == "delta"
