"""The engine's supervisor against a real server: a frozen worker (SIGSTOP) is noticed
within --worker-timeout, its requests fail with a clear error and /health says so; when
it wakes the server serves again with nothing left held. --request-timeout ends a request
that runs too long (HTTP 504, WebSocket `timeout` error) and counts it."""

from __future__ import annotations

import asyncio
import contextlib
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

LONG = {"max_tokens": 1900, "ignore_eos": True}


def health(server) -> int:
    return httpx.get(f"{server.http}/health", timeout=5).status_code


async def test_a_frozen_worker_fails_its_requests_and_the_engine_recovers_when_it_wakes():
    server = start_server(extra=["--worker-timeout", "1"])
    (worker,) = workers_of(server.process.proc.pid)
    try:
        async with websockets.connect(f"{server.ws}/v1/stream") as ws:
            message = {"type": "generate", "id": "long", "prompt": "Once", "params": LONG}
            await ws.send(json.dumps(message))
            assert json.loads(await asyncio.wait_for(ws.recv(), 30))["type"] == "delta"
            os.kill(worker, signal.SIGSTOP)
            stopped = time.monotonic()
            async with asyncio.timeout(10):
                while (event := json.loads(await ws.recv()))["type"] == "delta":
                    pass
            noticed = time.monotonic() - stopped
        assert event["type"] == "error" and event["id"] == "long", event
        assert "heartbeat" in event["message"]
        assert noticed < 3.0, f"a 1 s worker timeout took {noticed:.1f} s to notice"
        assert health(server) == 503
        refused = httpx.post(f"{server.http}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and "heartbeat" in refused.json()["error"]["message"]
        await asyncio.sleep(2)  # the behaviour under test: frozen for well past the timeout
        os.kill(worker, signal.SIGCONT)
        await eventually(lambda: health(server) == 200, 5, "healthy again after SIGCONT")
        ok = httpx.post(f"{server.http}/v1/completions", json={"prompt": "x", "max_tokens": 3})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        await eventually(lambda: server.metric("pagedserve_kv_blocks_used") == 0, 5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
        stop_server(server)


@pytest.fixture(scope="module")
def timed_server():
    # A quarter second: the built-in model's longest request (LONG) takes about 1.2 s
    # here, a 2-token one a few milliseconds.
    server = start_server(extra=["--request-timeout", "0.25"])
    yield server
    stop_server(server)


async def test_the_request_timeout_ends_a_request_that_runs_too_long(timed_server):
    server = timed_server
    start = time.monotonic()
    plain = httpx.post(f"{server.http}/v1/completions", json={"prompt": "Once", **LONG}, timeout=30)
    assert plain.status_code == 504 and plain.json()["error"]["code"] == "timeout"
    assert "request timeout of 0.25 s" in plain.json()["error"]["message"]
    assert time.monotonic() - start < 3.0
    async with websockets.connect(f"{server.ws}/v1/stream") as ws:
        message = {"type": "generate", "id": "w", "prompt": "Once", "params": LONG}
        await ws.send(json.dumps(message))
        async with asyncio.timeout(10):
            while (event := json.loads(await ws.recv()))["type"] == "delta":
                pass
    assert event["type"] == "error" and event["code"] == "timeout"
    short = httpx.post(f"{server.http}/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert short.status_code == 200  # quick requests are untouched
    assert server.metric("pagedserve_num_timed_out_requests_total") == 2
    assert server.metric("pagedserve_num_requests_over_deadline") == 0
    await eventually(lambda: server.metric("pagedserve_kv_blocks_used") == 0, 5)
