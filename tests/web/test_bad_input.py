"""Bad input gets the right status or close code and a message naming the problem; the
server keeps serving others throughout."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets

from tests.web.conftest import start_server, stop_server

KEY = "secret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def server():
    s = start_server(
        api_key=KEY,
        extra=["--max-queued-requests", "2", "--max-message-bytes", "65536"],
    )
    yield s
    stop_server(s)


def post(server, path: str, body, headers=AUTH) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return httpx.post(f"{server.http}{path}", content=content, headers=headers, timeout=30)


HTTP_CASES = [
    # (name, path, body, status, words the message must contain)
    ("invalid json", "/v1/completions", b"{not json", 400, "JSON"),
    ("wrong type", "/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("unknown field", "/v1/completions", {"prompt": "x", "bogus": 1}, 400, "bogus"),
    (
        "negative max_tokens",
        "/v1/completions",
        {"prompt": "x", "max_tokens": -1},
        400,
        "max_tokens",
    ),
    (
        "temperature < 0",
        "/v1/completions",
        {"prompt": "x", "temperature": -0.5},
        400,
        "temperature",
    ),
    ("top_p > 1", "/v1/completions", {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n = 0", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n must"),
    ("best_of < n", "/v1/completions", {"prompt": "x", "n": 3, "best_of": 2}, 400, "best_of"),
    (
        "best_of > n streamed",
        "/v1/completions",
        {"prompt": "x", "best_of": 2, "stream": True},
        400,
        "cannot be streamed",
    ),
    ("prompt over the context", "/v1/completions", {"prompt": "ab" * 1500}, 400, "max_model_len"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("non-UTF-8 bytes", "/v1/completions", b'{"prompt": "\xff\xfe"}', 400, "UTF-8"),
    ("oversize body", "/v1/completions", {"prompt": "x" * 70000}, 400, "limit"),
    ("unknown model", "/v1/completions", {"prompt": "x", "model": "gpt-9"}, 404, "gpt-9"),
]


@pytest.mark.parametrize("case", HTTP_CASES, ids=[c[0] for c in HTTP_CASES])
def test_http_bad_input(server, case) -> None:
    _, path, body, status, words = case
    r = post(server, path, body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words in error["message"], error
    ok = post(server, "/v1/completions", {"prompt": "still there?", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_http_wrong_api_key(server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = post(server, "/v1/completions", {"prompt": "x"}, headers)
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(f"{server.http}/health").status_code == 200  # /health stays open
    assert httpx.get(f"{server.http}/metrics").status_code == 401


async def test_http_flood_beyond_queue_limit(server) -> None:
    body = json.dumps({"prompt": "flood", "max_tokens": 4}).encode()
    async with httpx.AsyncClient(headers=AUTH, timeout=60) as client:
        replies = await asyncio.gather(
            *(client.post(f"{server.http}/v1/completions", content=body) for _ in range(40))
        )
    codes = [r.status_code for r in replies]
    assert 503 in codes and 200 in codes, codes
    refused = next(r for r in replies if r.status_code == 503)
    assert refused.headers["retry-after"] and "overloaded" in refused.json()["error"]["message"]


async def ws_events(server, frames, n_events: int, headers=AUTH) -> list[dict]:
    async with websockets.connect(f"{server.ws}/v1/stream", additional_headers=headers) as ws:
        for f in frames:
            await ws.send(f if isinstance(f, str | bytes) else json.dumps(f))
        return [json.loads(await asyncio.wait_for(ws.recv(), 30)) for _ in range(n_events)]


WS_CASES = [
    ("invalid json", "{oops", "JSON"),
    ("unknown type", {"type": "fly"}, "unknown message type"),
    ("no id", {"type": "generate", "prompt": "x"}, "id must"),
    ("wrong type", {"type": "generate", "id": "a", "prompt": 5}, "prompt must"),
    ("unknown field", {"type": "generate", "id": "a", "prompt": "x", "colour": 1}, "colour"),
    (
        "unknown param",
        {"type": "generate", "id": "a", "prompt": "x", "params": {"tempo": 1}},
        "tempo",
    ),
    (
        "negative max_tokens",
        {"type": "generate", "id": "a", "prompt": "x", "params": {"max_tokens": -3}},
        "max_tokens",
    ),
    (
        "temperature < 0",
        {"type": "generate", "id": "a", "prompt": "x", "params": {"temperature": -1}},
        "temperature",
    ),
    ("top_p > 1", {"type": "generate", "id": "a", "prompt": "x", "params": {"top_p": 2}}, "top_p"),
    (
        "prompt over the context",
        {"type": "generate", "id": "a", "prompt": "ab" * 1500},
        "max_model_len",
    ),
    ("empty messages", {"type": "generate", "id": "a", "messages": []}, "messages"),
    ("non-UTF-8 bytes", b"\x93\xff\xfe", "msgpack"),
]


@pytest.mark.parametrize("case", WS_CASES, ids=[c[0] for c in WS_CASES])
async def test_ws_bad_input(server, case) -> None:
    _, frame, words = case
    good = {"type": "generate", "id": "ok", "prompt": "hi", "params": {"max_tokens": 2}}
    events = await ws_events(server, [frame, good], 1)
    assert events[0]["type"] == "error" and words in events[0]["message"], events
    assert events[0]["code"] == "invalid_request"
    rest = await ws_events(server, [good], 2)  # the same server still serves
    assert rest[-1]["type"] == "done" or rest[0]["type"] == "delta"


async def test_ws_oversize_frame_closes_1009(server) -> None:
    async with websockets.connect(f"{server.ws}/v1/stream", additional_headers=AUTH) as ws:
        await ws.send(json.dumps({"type": "generate", "id": "big", "prompt": "x" * 100_000}))
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd.code == 1009


async def test_ws_wrong_api_key_closes_1008(server) -> None:
    for headers, first in (
        ({"Authorization": "Bearer nope"}, {"type": "ping"}),
        ({}, {"type": "auth", "token": "nope"}),
    ):
        async with websockets.connect(f"{server.ws}/v1/stream", additional_headers=headers) as ws:
            await ws.send(json.dumps(first))
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await asyncio.wait_for(ws.recv(), 10)
        assert closed.value.rcvd.code == 1008
    # a key in the first message works
    events = await ws_events(server, [{"type": "auth", "token": KEY}, {"type": "ping"}], 1, {})
    assert events == [{"type": "pong"}]


async def test_ws_flood_beyond_queue_limit(server) -> None:
    frames = [
        {"type": "generate", "id": f"f{i}", "prompt": "flood", "params": {"max_tokens": 2}}
        for i in range(30)
    ]
    async with websockets.connect(f"{server.ws}/v1/stream", additional_headers=AUTH) as ws:
        for f in frames:
            await ws.send(json.dumps(f))
        finals = {}
        while len(finals) < 30:
            e = json.loads(await asyncio.wait_for(ws.recv(), 30))
            if e["type"] in ("done", "error"):
                finals[e["id"]] = e
    codes = {e.get("code", e["type"]) for e in finals.values()}
    assert "overloaded" in codes and "done" in codes, codes
