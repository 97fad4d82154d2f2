"""Hostile requests do not hold up the others: one with 80,000 stop strings (0.87 MB),
one that announces a 200 MiB body, and a megabyte of prompt are each refused by name,
and a stream running beside them is not slowed beyond 10% (the stop list once slowed one
21x, the megabyte prompt blocked the event loop for about a second)."""

from __future__ import annotations

import asyncio
import json
import socket
import statistics
import time

import httpx
import pytest
import websockets

STREAM = {"max_tokens": 1500, "ignore_eos": True}
STOPS = json.dumps({"prompt": "x", "stop": ["stop-word"] * 80_000}).encode()
PROMPT = json.dumps({"prompt": "word " * 200_000}).encode()


async def stream_seconds(server, streaming: asyncio.Event | None = None) -> float:
    """Seconds from the first to the last token of a 1,500-token WebSocket stream;
    `streaming` is set at its first token."""
    async with websockets.connect(f"{server.ws}/v1/stream") as ws:
        message = {"type": "generate", "id": "s", "prompt": "Once", "params": STREAM}
        await ws.send(json.dumps(message))
        first = last = None
        async with asyncio.timeout(60):
            while (event := json.loads(await ws.recv()))["type"] != "done":
                last = time.monotonic()
                first = first or last
                if streaming is not None:
                    streaming.set()
        assert event["finish_reason"] == "length"
    return last - first


def huge_body_head(port: int) -> str:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 209715200\r\n\r\n{"
        )
        return read_reply(sock)


async def hostile(server) -> None:
    """The three hostile requests at once; each refused by name, fast."""
    async with httpx.AsyncClient(timeout=30) as client:
        url = f"{server.http}/v1/completions"
        stops, prompt, head = await asyncio.gather(
            client.post(url, content=STOPS),
            client.post(url, content=PROMPT),
            asyncio.to_thread(huge_body_head, server.port),
        )
    assert stops.status_code == 400 and stops.json()["error"]["param"] == "stop"
    assert prompt.status_code == 400 and prompt.json()["error"]["param"] == "prompt"
    assert head.startswith("HTTP/1.1 400") and "limit" in head
    for answer in (stops, prompt):
        assert answer.elapsed.total_seconds() < 0.5


@pytest.mark.timeout(300)
async def test_refusing_hostile_requests_does_not_slow_a_concurrent_stream(builtin_server):
    await stream_seconds(builtin_server)  # warm-up
    ratios = []
    alone = await stream_seconds(builtin_server)
    for _ in range(5):  # each stream beside hostile requests against those alone around it
        streaming = asyncio.Event()
        stream = asyncio.create_task(stream_seconds(builtin_server, streaming))
        await asyncio.wait_for(streaming.wait(), 30)
        await hostile(builtin_server)
        beside = await asyncio.wait_for(stream, 90)
        after = await stream_seconds(builtin_server)
        ratios.append(beside / ((alone + after) / 2))
        alone = after
    ratio = statistics.median(ratios)
    assert ratio < 1.10, f"streams took {ratio:.2f}x as long beside hostile requests"


def read_reply(sock: socket.socket) -> str:
    """The server's whole answer (it closes the connection after it)."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data.decode("latin-1")
