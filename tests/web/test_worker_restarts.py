"""A server whose worker is killed comes back by itself: the requests in flight fail
within a second, the server says `restarting` (a session turn gets 503 `unavailable`,
which the SDK retries) and serves again once the new worker is up. With two replicas,
the dead one is skipped at once: /health stays 200 (`degraded`) and no new request
fails, and it takes traffic again after its restart."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
import websockets

from tests.eventually import eventually
from tests.web.conftest import start_server, stop_server
from tests.web.processes import workers_of
from web.client import AsyncClient
from web.client_connection import RetryPolicy

pytestmark = pytest.mark.timeout(300)
LONG = {"max_tokens": 1900, "ignore_eos": True}
KEY = "restart-test-key"  # sessions belong to a key: a second socket can use one


def metrics(server) -> str:
    return httpx.get(f"{server.http}/metrics", timeout=10, headers=auth(server)).text


def auth(server) -> dict[str, str]:
    return {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}


def health(server) -> httpx.Response:
    return httpx.get(f"{server.http}/health", timeout=5)


async def open_stream(server, rid: str):
    """A WebSocket with a long request streaming on it (after its first delta)."""
    auth = {"Authorization": f"Bearer {KEY}"}
    ws = await websockets.connect(f"{server.ws}/v1/stream", additional_headers=auth)
    await ws.send(json.dumps({"type": "generate", "id": rid, "prompt": "Once", "params": LONG}))
    assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "delta"
    return ws


async def final_event(ws) -> dict:
    async with asyncio.timeout(10):
        while (event := json.loads(await ws.recv()))["type"] == "delta":
            pass
    return event


async def test_a_killed_worker_is_replaced_while_the_server_stays_up() -> None:
    server = start_server(api_key=KEY)
    try:
        (worker,) = workers_of(server.process.proc.pid)
        ws = await open_stream(server, "in-flight")
        retry = RetryPolicy(max_retries=60)
        async with AsyncClient(server.ws, api_key=KEY, retry=retry) as client:
            chat = client.chat_session()
            assert (await chat.send("hi", max_tokens=2).collect()).finish_reason == "length"
            os.kill(worker, signal.SIGKILL)
            killed = time.monotonic()
            event = await final_event(ws)
            assert event["type"] == "error" and event["id"] == "in-flight", event
            assert time.monotonic() - killed < 1.0
            await eventually(lambda: health(server).json()["status"] == "restarting", 5)
            assert health(server).status_code == 503
            turn = {"type": "generate", "id": "turn", "session_id": chat.session_id}
            await ws.send(json.dumps({**turn, "message": "again", "params": {"max_tokens": 2}}))
            refused = await final_event(ws)
            assert refused["type"] == "error" and refused["code"] == "unavailable", refused
            retried = await chat.send("and again", max_tokens=2).collect()  # retries until up
            assert retried.finish_reason == "length"
        assert time.monotonic() - killed < 30 + 10
        assert health(server).json() == {"status": "ok"}
        (new_worker,) = workers_of(server.process.proc.pid)
        assert new_worker != worker
        assert server.metric("pagedserve_num_worker_restarts_total") == 1
        await ws.close()
    finally:
        stop_server(server)


async def test_a_dead_replica_is_routed_around_and_comes_back() -> None:
    server = start_server(extra=["--data-parallel-size", "2"])
    try:
        workers = workers_of(server.process.proc.pid)
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        await eventually(lambda: health(server).json()["status"] != "ok", 5, "the death seen")
        answer = health(server)
        assert answer.status_code == 200 and answer.json()["status"] in ("degraded", "ok")
        async with httpx.AsyncClient(base_url=server.http, timeout=60) as client:
            body = {"prompt": "Hello", "max_tokens": 2}
            results = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(12))
            )
        assert [r.status_code for r in results] == [200] * 12
        await eventually(lambda: health(server).json() == {"status": "ok"}, 60, "replica back")
        assert 'pagedserve_replica_healthy{replica="1"} 1.0' in metrics(server)
        assert len(workers_of(server.process.proc.pid)) == 2
    finally:
        stop_server(server)
