"""Closing streams mid-generation aborts their requests: no blocks stay in use."""

from __future__ import annotations

import asyncio
import functools
import json

import httpx
import websockets

from tests.eventually import eventually

N = 50
LONG = {"max_tokens": 1500, "ignore_eos": True}


async def ws_stream_then_close(server, i: int) -> None:
    ws = await websockets.connect(f"{server.ws}/v1/stream")
    await ws.send(json.dumps({"type": "generate", "id": f"d{i}", "prompt": "Hi", "params": LONG}))
    async with asyncio.timeout(30):
        while json.loads(await ws.recv())["type"] != "delta":
            pass
    await ws.close()


async def sse_stream_then_close(client: httpx.AsyncClient, server, i: int) -> None:
    body = {"prompt": f"Hi {i}", "stream": True, **LONG}
    async with client.stream("POST", f"{server.http}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                break  # leaving the block closes the connection mid-stream


async def blocks_free_within(server, seconds: float) -> None:
    used = functools.partial(server.metric, "pagedserve_kv_blocks_used")
    await eventually(lambda: used() == 0, seconds, lambda: f"{used()} blocks still in use")


async def test_closing_50_websockets_and_50_sse_streams_frees_all_blocks(builtin_server):
    await asyncio.gather(*(ws_stream_then_close(builtin_server, i) for i in range(N)))
    await blocks_free_within(builtin_server, 1.0)
    limits = httpx.Limits(max_connections=N)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        await asyncio.gather(*(sse_stream_then_close(client, builtin_server, i) for i in range(N)))
    await blocks_free_within(builtin_server, 1.0)
    # and the server still serves
    r = httpx.post(f"{builtin_server.http}/v1/completions", json={"prompt": "ok", "max_tokens": 2})
    assert r.status_code == 200
