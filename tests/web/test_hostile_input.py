"""What a hostile client found, as regressions: every request ends with a clear answer
fast, nothing it held stays held, and the server (and the WebSocket it came on) serves
on. The seed 2**70 once hung its request in the msgpack codec; sixteen of them filled
--max-queued-requests for good."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest
import websockets

from tests.eventually import eventually
from tests.web.conftest import start_server, stop_server

QUEUE = 16
HELD = (
    "pagedserve_num_requests_queued",
    "pagedserve_num_requests_live",
    "pagedserve_num_requests_running",
    "pagedserve_num_requests_waiting",
    "pagedserve_kv_blocks_used",
    "pagedserve_num_ws_connections",
)


@pytest.fixture(scope="module")
def server():
    s = start_server(extra=["--max-queued-requests", str(QUEUE)])
    yield s
    stop_server(s)


def post(server, body: bytes | dict, path: str = "/v1/completions", **kw) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.http}{path}", content=content, timeout=10, **kw)


async def nothing_held(server) -> None:
    await eventually(
        lambda: all(server.metric(name) == 0 for name in HELD), 5, "everything released"
    )


def names(response: httpx.Response, field: str, within: float = 1.0) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and field in error["message"], error
    assert response.elapsed.total_seconds() < within


async def test_the_seed_that_hung_is_refused_at_once_and_never_fills_the_queue(server):
    big = 2**70
    for path, body in (
        ("/v1/completions", {"prompt": "x", "seed": big}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "seed": big}),
    ):
        names(post(server, body, path), "seed")
    refused = post(server, {"prompt": "x", "seed": big}).json()["error"]["message"]
    assert "[-9223372036854775808, 18446744073709551615]" in refused
    replies = await asyncio.gather(
        *(asyncio.to_thread(post, server, {"prompt": "x", "seed": big}) for _ in range(3 * QUEUE))
    )
    assert {r.status_code for r in replies} == {400}
    ok = post(server, {"prompt": "still served", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    await nothing_held(server)


async def ws_answers(server, frames: list, rids: set) -> dict:
    """Sends `frames` on one socket beside a long request; returns the final event of
    each id in `rids` (None: no id) and checks the long request still finished."""
    long = {
        "type": "generate",
        "id": "long",
        "prompt": "Hi",
        "params": {"max_tokens": 200, "ignore_eos": True},
    }
    finals: dict = {}
    async with websockets.connect(f"{server.ws}/v1/stream") as ws:
        await ws.send(json.dumps(long))
        for frame in frames:
            await ws.send(frame if isinstance(frame, str | bytes) else json.dumps(frame))
        async with asyncio.timeout(30):
            while "long" not in finals or not rids <= set(finals):
                event = json.loads(await ws.recv())
                if event["type"] in ("done", "error", "session"):
                    finals[event.get("id")] = event
    assert finals["long"]["type"] == "done" and finals["long"]["finish_reason"] == "length"
    return finals


async def test_websocket_hostile_frames_get_errors_and_the_connection_carries_on(server):
    deep = "[" * 100_000 + "]" * 100_000
    frames = [
        {"type": "generate", "id": "seed", "prompt": "x", "params": {"seed": 2**70}},
        '{"type": "generate", "id": "text", "prompt": "a\\ud800b"}',
        '{"type": "generate", "id": "x\\udc00", "prompt": "hi"}',  # the id itself
        '{"type": "generate", "id": "deep", "prompt": ' + deep + "}",
        {"type": "session.open", "session_id": {"no": "dict"}},
    ]
    start = time.monotonic()
    finals = await ws_answers(server, frames, {"seed", "text", None})
    assert finals["seed"]["param"] == "seed"
    assert finals["text"]["param"] == "prompt" and "surrogate" in finals["text"]["message"]
    assert all(finals[k]["code"] == "invalid_request" for k in ("seed", "text", None))
    assert time.monotonic() - start < 30
    await nothing_held(server)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (b'{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt holds a lone UTF-16 surrogate"),
        (b'{"prompt": "x", "\\ud800bad": 1}', "unknown field"),
        (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
        (b'{"prompt": ' + b"[" * 40 + b"]" * 40 + b"}", "prompt is nested"),
        (json.dumps({"prompt": "x", "stop": ["s"] * 80_000}).encode(), "stop must be at most"),
    ],
    ids=["surrogate prompt", "surrogate field", "deep body", "deep field", "80k stops"],
)
async def test_http_hostile_bodies_get_a_400_never_a_500(server, raw, words):
    response = post(server, raw)
    assert response.status_code == 400 and words in response.json()["error"]["message"]
    assert response.elapsed.total_seconds() < 1.0
    await nothing_held(server)


async def test_an_oversize_body_is_refused_before_it_is_read(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 209715200\r\n\r\n" + b"{" + b" " * 1000
        )  # 200 MiB promised, 1 KB sent: the answer comes without the rest
        head = read_reply(sock)
    assert head.startswith("HTTP/1.1 400") and "the limit is" in head


async def test_a_plain_request_is_aborted_when_its_client_hangs_up(server):
    body = {"prompt": "Once", "max_tokens": 1900, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=60) as client:
        request = asyncio.create_task(client.post(f"{server.http}/v1/completions", json=body))
        await eventually(lambda: server.metric("pagedserve_kv_blocks_used") > 0, 10)
        request.cancel()  # the client hangs up mid-request
        with pytest.raises(asyncio.CancelledError):
            await request
    start = time.monotonic()
    await eventually(lambda: server.metric("pagedserve_kv_blocks_used") == 0, 2, "blocks freed")
    assert time.monotonic() - start < 1.0
    await nothing_held(server)


def read_reply(sock: socket.socket) -> str:
    """The server's whole answer (it closes the connection after it)."""
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data.decode("latin-1")
