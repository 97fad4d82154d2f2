"""Graceful shutdown under load: SIGTERM, or a terminal's Ctrl-C (SIGINT to the whole
process group), lets in-flight requests finish within the grace period, aborts the rest
with a final event on every stream, closes WebSockets with 1001, and leaves no worker
process behind."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import time
from pathlib import Path

import httpx
import pytest
import websockets

from tests.eventually import eventually
from tests.web.processes import alive, children_of, workers_of
from web.launch import ServerProcess

GRACE_S = 0.5
LONG = {"max_tokens": 1900, "ignore_eos": True}  # far longer than the grace period
SHORT = {"max_tokens": 12, "ignore_eos": True}  # finishes within it


class WsClient:
    """One raw WebSocket connection that records every event and its close code."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.events: list[dict] = []
        self.first_delta: dict[str, asyncio.Event] = {}

    async def generate(self, rid: str, params: dict) -> None:
        self.first_delta[rid] = asyncio.Event()
        message = {"type": "generate", "id": rid, "prompt": "Once", "params": params}
        await self.ws.send(json.dumps(message))

    async def read_until_closed(self) -> int:
        try:
            async for frame in self.ws:
                event = json.loads(frame)
                self.events.append(event)
                if event["type"] == "delta":
                    self.first_delta[event["id"]].set()
        except websockets.ConnectionClosed:
            pass
        return self.ws.close_code

    def done(self, rid: str) -> dict:
        (event,) = [e for e in self.events if e["type"] == "done" and e["id"] == rid]
        return event


async def sse_stream(client: httpx.AsyncClient, url: str, started: asyncio.Event) -> list[str]:
    body = {"prompt": "Once", "stream": True, **LONG}
    lines = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                started.set()
    return lines


async def plain_request(client: httpx.AsyncClient, url: str) -> httpx.Response:
    return await client.post(f"{url}/v1/completions", json={"prompt": "Once", **LONG})


async def load_then_signal(server: ServerProcess, send_signal):
    """Two WebSockets and two SSE streams mid-generation, a plain (non-streaming) HTTP
    request, plus a short request; then the signal. Returns the WebSocket clients, their
    close codes, the SSE data lines and the plain request's response."""
    clients = [WsClient(await websockets.connect(f"ws://127.0.0.1:{server.port}/v1/stream"))]
    clients.append(WsClient(await websockets.connect(f"ws://127.0.0.1:{server.port}/v1/stream")))
    readers = [asyncio.create_task(c.read_until_closed()) for c in clients]
    for i, c in enumerate(clients):
        await c.generate(f"long{i}", LONG)
    async with httpx.AsyncClient(timeout=60) as http:
        started = [asyncio.Event() for _ in range(2)]
        sse = [asyncio.create_task(sse_stream(http, server.url, s)) for s in started]
        plain = asyncio.create_task(plain_request(http, server.url))
        for c in clients:
            await asyncio.wait_for(c.first_delta[f"long{clients.index(c)}"].wait(), 30)
        for s in started:
            await asyncio.wait_for(s.wait(), 30)
        await clients[0].generate("short", SHORT)
        await asyncio.wait_for(clients[0].first_delta["short"].wait(), 30)
        send_signal()
        codes = await asyncio.wait_for(asyncio.gather(*readers), 30)
        sse_lines = await asyncio.wait_for(asyncio.gather(*sse), 30)
        plain_response = await asyncio.wait_for(plain, 30)
    return clients, codes, sse_lines, plain_response


@pytest.mark.parametrize("how", ["sigterm", "ctrl-c"])
async def test_graceful_shutdown_under_load(how: str) -> None:
    server = ServerProcess(
        ["--model", "builtin:tiny", "--shutdown-grace", str(GRACE_S), "--max-num-seqs", "16"],
        env={"OMP_NUM_THREADS": "1"},
        own_group=True,
    )
    server.start(timeout=120)
    try:
        workers = children_of(server.proc.pid)
        assert workers, "the server has no worker process"

        def send_signal() -> None:
            if how == "sigterm":
                server.proc.send_signal(signal.SIGTERM)
            else:  # what a terminal does on Ctrl-C: SIGINT to the foreground group
                os.killpg(server.proc.pid, signal.SIGINT)

        start = time.monotonic()
        clients, codes, sse_lines, plain = await load_then_signal(server, send_signal)
        rc = await asyncio.to_thread(server.proc.wait, 30)
        took = time.monotonic() - start
    finally:
        server.stop()

    # the request that could finish within the grace period did
    assert clients[0].done("short")["finish_reason"] == "length"
    assert clients[0].done("short")["usage"]["completion_tokens"] == SHORT["max_tokens"]
    # the others were aborted, each stream still ending with its final event
    for i, c in enumerate(clients):
        assert c.done(f"long{i}")["finish_reason"] == "abort"
        assert c.events[-1]["type"] == "done"
    assert codes == [1001, 1001]  # going away
    for lines in sse_lines:
        assert lines[-1] == "[DONE]"
        finals = [json.loads(x)["choices"][0]["finish_reason"] for x in lines[:-1]]
        assert finals[-1] == "abort" and all(f is None for f in finals[:-1])
    # the plain request is told it was cut short, not handed a 200 that looks finished
    assert plain.status_code == 503, plain.text
    error = plain.json()["error"]
    assert error["code"] == "shutting_down" and "before it finished" in error["message"]
    assert rc == 0
    assert took < GRACE_S + 15
    await eventually(lambda: not any(map(alive, workers)), 5, "every worker gone with the server")


async def test_worker_exits_when_the_server_process_is_killed() -> None:
    server = ServerProcess(
        ["--model", "builtin:tiny"], env={"OMP_NUM_THREADS": "1"}, own_group=True
    )
    server.start(timeout=120)
    workers = workers_of(server.proc.pid)
    children = children_of(server.proc.pid)  # the workers and the template renderers
    assert workers and len(children) > len(workers)
    run_dirs = {Path(a.split("://", 1)[1]).parent for a in ipc_addresses(workers)}
    try:
        server.proc.kill()  # no graceful shutdown: the worker is orphaned
        server.proc.wait(10)
        await eventually(lambda: not any(map(alive, children)), 5, "the orphans' exit")
        assert all(d.is_dir() for d in run_dirs)  # the killed server could not remove it
        following = ServerProcess(["--model", "builtin:tiny"], env={"OMP_NUM_THREADS": "1"})
        following.start(timeout=120)  # the next server removes what the dead one left
        following.stop()
        assert not any(d.exists() for d in run_dirs)
    finally:
        for run_dir in run_dirs:
            shutil.rmtree(run_dir, ignore_errors=True)


def ipc_addresses(pids: list[int]) -> list[str]:
    args = [a for pid in pids for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")]
    return [a.decode() for a in args if a.startswith(b"ipc://")]
