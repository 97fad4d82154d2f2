"""--http-header-timeout bounds connections that do not finish their request headers
(slowloris), and nothing else: slow bodies, long streams and WebSockets live on."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import time

import httpx
import pytest
import websockets

from tests.web.conftest import start_server, stop_server

TIMEOUT = 1.0  # --http-header-timeout
SLACK = 2.0  # a stalled connection must be closed within TIMEOUT + SLACK
SMALL = {"prompt": "hi", "max_tokens": 2}
PARTIAL = [
    b"",  # connects, sends nothing
    b"POST /v1/compl",  # part of the request line
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: appl",  # part of the headers
]


@pytest.fixture(scope="module")
def server():
    s = start_server(extra=["--http-header-timeout", str(TIMEOUT)])
    yield s
    stop_server(s)


def connect(server, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(data)
    return sock


def read_until_eof(sock: socket.socket, deadline: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open at
    `deadline` (time.monotonic())."""
    received = b""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.01))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            raise AssertionError(f"still open; received {received!r}") from None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def request(path: str, body: dict | None = None, close: bool = False) -> bytes:
    method = "GET" if body is None else "POST"
    data = b"" if body is None else json.dumps(body).encode()
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(data)}\r\n"
    if close:
        head += "Connection: close\r\n"
    return head.encode() + b"\r\n" + data


def read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length (keep-alive)."""
    sock.settimeout(10)
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"closed mid-response: {buf!r}"
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "closed mid-body"
        body += chunk
    assert len(body) == length, "more bytes than one response"
    return head + b"\r\n\r\n" + body


@pytest.mark.parametrize("data", PARTIAL, ids=["nothing", "request line", "headers"])
def test_stalled_connection_is_closed_after_the_timeout(server, data) -> None:
    start = time.monotonic()
    sock = connect(server, data)
    with sock:
        received = read_until_eof(sock, start + TIMEOUT + SLACK)
    elapsed = time.monotonic() - start
    assert elapsed >= TIMEOUT * 0.9, f"closed after {elapsed:.2f} s, before the timeout"
    if data:
        assert received.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), received
    else:
        assert received == b"", "an idle connection is closed without a response"


def test_trickled_headers_do_not_extend_the_deadline(server) -> None:
    start = time.monotonic()
    head = request("/health")
    with connect(server) as sock:
        for i in range(len(head) - 2):  # the blank line that ends the headers never comes
            readable, _, _ = select.select([sock], [], [], 0.1)  # one byte per 0.1 s
            if readable:
                break
            try:
                sock.sendall(head[i : i + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
        received = read_until_eof(sock, start + TIMEOUT + SLACK)
    elapsed = time.monotonic() - start
    assert TIMEOUT * 0.9 <= elapsed <= TIMEOUT + SLACK, elapsed
    assert received.startswith(b"HTTP/1.1 408"), received


def test_25_stalled_connections_do_not_stop_others_and_all_close(server) -> None:
    start = time.monotonic()
    stalled = [connect(server, PARTIAL[i % len(PARTIAL)]) for i in range(25)]
    try:
        r = httpx.post(f"{server.http}/v1/completions", json=SMALL, timeout=10)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert time.monotonic() - start < TIMEOUT, "the request waited for the stalled ones"
        for sock in stalled:
            read_until_eof(sock, start + TIMEOUT + SLACK)
    finally:
        for sock in stalled:
            sock.close()
    r = httpx.post(f"{server.http}/v1/completions", json=SMALL, timeout=10)
    assert r.status_code == 200, r.text


def test_slow_body_after_complete_headers_is_not_cut(server) -> None:
    data = request("/v1/completions", SMALL, close=True)
    head_len = data.index(b"\r\n\r\n") + 4
    with connect(server, data[:head_len]) as sock:
        time.sleep(TIMEOUT + 0.5)  # the behaviour under test: a body slower than the timeout
        sock.sendall(data[head_len:])
        response = read_until_eof(sock, time.monotonic() + 10)
    assert response.startswith(b"HTTP/1.1 200 OK\r\n"), response[:200]
    assert b'"finish_reason":"length"' in response


def test_stream_longer_than_the_timeout_is_not_cut(server) -> None:
    body = {"prompt": "hi", "max_tokens": 2000, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{server.http}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        events = [next(line for line in lines if line.startswith("data: "))]
        time.sleep(TIMEOUT + 0.5)  # the behaviour under test: a stream outlasting the timeout
        events += [line for line in lines if line.startswith("data: ")]
    elapsed = time.monotonic() - start
    # an SSE event can hold more than one token (bytes held back until they decode), so
    # events are not counted
    assert elapsed > TIMEOUT + 0.5
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][6:])["choices"][0]["finish_reason"] == "length"


async def test_websocket_idle_longer_than_the_timeout_stays_open(server) -> None:
    async with websockets.connect(f"{server.ws}/v1/stream", open_timeout=10) as ws:
        await asyncio.sleep(TIMEOUT + 0.5)  # the behaviour under test: idle past the timeout
        latency = await asyncio.wait_for(await ws.ping(), 5)
        assert latency >= 0


def test_keep_alive_connection_serves_again_then_closes_when_idle(server) -> None:
    with connect(server) as sock:
        sock.sendall(request("/health"))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        time.sleep(TIMEOUT / 4)  # the behaviour under test: idle, but within the timeout
        sock.sendall(request("/v1/completions", SMALL))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        done = time.monotonic()
        received = read_until_eof(sock, done + TIMEOUT + SLACK)
        assert received == b"", "an idle keep-alive connection closes without a response"
        assert time.monotonic() - done >= TIMEOUT * 0.9


def test_keep_alive_deadline_runs_from_the_previous_response(server) -> None:
    with connect(server) as sock:
        sock.sendall(request("/health"))
        assert read_response(sock).startswith(b"HTTP/1.1 200")
        done = time.monotonic()
        sock.sendall(b"GET /hea")  # uvicorn's keep-alive timer stops at this byte
        received = read_until_eof(sock, done + TIMEOUT + SLACK)
    assert received.startswith(b"HTTP/1.1 408"), received


def test_client_pool_survives_idle_closes(server) -> None:
    with httpx.Client(timeout=10) as client:
        r = client.post(f"{server.http}/v1/completions", json=SMALL)
        assert r.status_code == 200, r.text
        time.sleep(TIMEOUT + 0.5)  # the behaviour under test: the server closes it meanwhile
        r = client.post(f"{server.http}/v1/completions", json=SMALL)
        assert r.status_code == 200, r.text
