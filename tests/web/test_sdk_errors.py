"""The SDK's error types, retries, timeouts and call ids, against a scripted server
(tests/web/sdk_stub.py): every failure is a PagedServeError of the right kind, never a
bare TimeoutError, ConnectionClosed or KeyError."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.web.sdk_stub import StubServer, answer_control, finish, send
from web.client import (
    AsyncClient,
    AuthenticationError,
    ConnectionLostError,
    EngineError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    PagedServeError,
    RequestTimeout,
    RetryPolicy,
    ServerError,
)
from web.launch import free_port

pytestmark = pytest.mark.timeout(30)
FAST = RetryPolicy(max_retries=2, base_delay_s=0.01, max_delay_s=0.05)


def refusing(code: str, times: int, **extra):
    """A script that refuses the first `times` generate frames with `code`."""

    async def script(stub, ws, frame):
        if await answer_control(ws, frame):
            return
        if frame["type"] == "generate":
            if len(stub.of_type("generate")) <= times:
                await send(ws, type="error", id=frame["id"], code=code, message=code, **extra)
            else:
                await finish(ws, frame["id"])

    return script


def silent():
    """A script that answers each connection's first ping (so a client connects),
    nothing else."""
    connected = set()

    async def script(stub, ws, frame) -> None:
        if frame["type"] == "ping" and ws not in connected:
            connected.add(ws)
            await answer_control(ws, frame)

    return script


async def test_overload_before_the_first_token_is_retried_with_backoff() -> None:
    async with StubServer(refusing("overloaded", 2)) as stub:
        async with AsyncClient(stub.url, retry=FAST) as client:
            result = await client.complete("hi")
        assert result.text == "ok"
        ids = [f["id"] for f in stub.of_type("generate")]
        assert len(ids) == 3 and len(set(ids)) == 3  # each attempt under an id of its own


@pytest.mark.parametrize("code", ["overloaded", "too_many_requests", "unavailable"])
async def test_overload_past_max_retries_raises_overloaded(code: str) -> None:
    async with StubServer(refusing(code, 99)) as stub:
        async with AsyncClient(stub.url, retry=FAST) as client:
            with pytest.raises(OverloadedError, match="after 2 retries") as raised:
                await client.complete("hi")
            assert raised.value.code == code
        assert len(stub.of_type("generate")) == 3
    async with StubServer(refusing(code, 99)) as stub:
        async with AsyncClient(stub.url, max_retries=0) as client:
            with pytest.raises(OverloadedError):
                await client.complete("hi")
        assert len(stub.of_type("generate")) == 1


async def test_a_request_that_produced_tokens_is_not_retried() -> None:
    async def script(stub, ws, frame):
        if not await answer_control(ws, frame) and frame["type"] == "generate":
            await send(ws, type="delta", id=frame["id"], text="a", token_ids=[1])
            await send(ws, type="error", id=frame["id"], code="overloaded", message="busy")

    async with StubServer(script) as stub:
        async with AsyncClient(stub.url, retry=FAST) as client:
            stream = client.stream("hi")
            assert (await anext(stream)).text == "a"
            with pytest.raises(OverloadedError):
                await anext(stream)
        assert len(stub.of_type("generate")) == 1


async def test_retries_stop_when_the_timeout_leaves_no_time_for_the_backoff() -> None:
    slow = RetryPolicy(max_retries=5, base_delay_s=10.0, max_delay_s=10.0)
    async with StubServer(refusing("overloaded", 99)) as stub:
        async with AsyncClient(stub.url, retry=slow) as client:
            started = time.monotonic()
            with pytest.raises(OverloadedError):
                await client.complete("hi", timeout=2.0)
            assert time.monotonic() - started < 2.0
        assert len(stub.of_type("generate")) == 1


def test_backoff_is_capped_exponential_with_jitter() -> None:
    policy = RetryPolicy(max_retries=5, base_delay_s=0.5, max_delay_s=8.0)
    for attempt, full in [(0, 0.5), (1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (9, 8.0)]:
        delays = [policy.delay(attempt) for _ in range(50)]
        assert all(0.75 * full <= d <= full for d in delays), (attempt, delays)
        assert len(set(delays)) > 1  # jittered
    with pytest.raises(InvalidRequestError):
        RetryPolicy(max_retries=-1)
    with pytest.raises(InvalidRequestError) as raised:
        AsyncClient(timeout=0)
    assert raised.value.param == "timeout"


@pytest.mark.parametrize(
    ("code", "error"),
    [
        ("invalid_request", InvalidRequestError),
        ("not_found", NotFoundError),
        ("engine_error", ServerError),
        ("timeout", RequestTimeout),
        ("shutting_down", OverloadedError),
        ("something_new", ServerError),
    ],
)
async def test_server_error_codes_raise_their_types(code: str, error: type) -> None:
    async with StubServer(refusing(code, 99, param="temperature")) as stub:
        async with AsyncClient(stub.url, max_retries=0) as client:
            with pytest.raises(error) as raised:
                await client.complete("hi")
    assert raised.value.code == code and raised.value.param == "temperature"
    assert raised.value.request_id == stub.of_type("generate")[0]["id"]
    assert isinstance(raised.value, PagedServeError)
    assert EngineError is ServerError


async def test_a_silent_server_times_out_with_request_timeout_and_is_told_to_cancel() -> None:
    async with StubServer(silent()) as stub:
        async with AsyncClient(stub.url) as client:
            with pytest.raises(RequestTimeout, match="pong"):
                await client.ping(timeout=0.2)
            with pytest.raises(RequestTimeout, match="cancelled on the server") as raised:
                await client.complete("hi", timeout=0.2)
            assert isinstance(raised.value, TimeoutError)  # `except TimeoutError` still works
            rid = stub.of_type("generate")[0]["id"]
            await stub.wait_for(lambda: {"type": "cancel", "id": rid} in stub.frames)
        async with AsyncClient(stub.url, timeout=0.2) as client:  # the client-wide default
            with pytest.raises(RequestTimeout):
                async for _ in client.stream("hi"):
                    pass


async def test_a_rejected_key_raises_authentication_error() -> None:
    async def script(stub, ws, frame):
        await ws.close(1008, "invalid or missing API key")

    async with StubServer(script) as stub:
        with pytest.raises(AuthenticationError, match="invalid or missing API key"):
            async with AsyncClient(stub.url, api_key="wrong"):
                pass


async def test_no_server_raises_connection_lost() -> None:
    with pytest.raises(ConnectionLostError, match="cannot connect"):
        async with AsyncClient(f"ws://127.0.0.1:{free_port()}"):
            pass


async def test_a_closed_client_and_a_garbled_frame_raise_sdk_errors() -> None:
    async def script(stub, ws, frame):
        if frame["type"] == "ping" and len(stub.of_type("ping")) == 2:
            await ws.send("this is not JSON")
        else:
            await answer_control(ws, frame)

    async with StubServer(script) as stub:
        client = AsyncClient(stub.url)
        async with client:
            with pytest.raises(ServerError, match="bad frame"):
                await client.ping()
        with pytest.raises(ConnectionLostError, match="closed"):
            await client.complete("hi")


async def test_replies_are_matched_to_calls_by_id_whatever_their_order() -> None:
    held: list = []

    async def script(stub, ws, frame):
        if frame["type"] == "ping" and len(stub.of_type("ping")) == 1:
            await answer_control(ws, frame)  # connect()
        elif frame["type"] == "ping":
            held.append(frame)
            if len(held) == 3:  # answer the three in reverse order
                for f in reversed(held):
                    await answer_control(ws, f)

    async with StubServer(script) as stub:
        async with AsyncClient(stub.url) as client:
            await asyncio.gather(*(client.ping(timeout=5) for _ in range(3)))
        assert len({f["id"] for f in held}) == 3


async def test_a_server_without_call_ids_still_answers() -> None:
    async def script(stub, ws, frame):  # a server from before call ids
        if frame["type"] == "ping":
            await send(ws, type="pong")
        elif frame["type"] == "session.open":
            await send(ws, type="session", session_id="old", messages=[])
        elif frame["type"] == "generate":
            await finish(ws, frame["id"])

    async with StubServer(script) as stub:
        async with AsyncClient(stub.url) as client:
            await client.ping()
            chat = client.chat_session()
            assert (await chat.send("hi").collect()).text == "ok"
            assert chat.session_id == "old"


async def test_sends_racing_on_a_new_session_open_it_once_and_a_failed_open_ends_the_turn() -> None:
    async def script(stub, ws, frame):
        if frame["type"] == "session.open" and frame.get("system") == "refuse me":
            await send(
                ws,
                type="error",
                id=frame["id"],
                code="invalid_request",
                message="system is too long",
                param="system",
            )
        elif not await answer_control(ws, frame) and frame["type"] == "generate":
            await finish(ws, frame["id"])

    async with StubServer(script) as stub:
        async with AsyncClient(stub.url) as client:
            chat = client.chat_session(system="hi")
            results = await asyncio.gather(*(chat.send(f"m{i}").collect() for i in range(3)))
            assert [r.text for r in results] == ["ok"] * 3
            assert len(stub.of_type("session.open")) == 1
            assert {f["session_id"] for f in stub.of_type("generate")} == {"s1"}
            stream = client.chat_session(system="refuse me").send("hello")
            with pytest.raises(InvalidRequestError) as raised:
                await anext(stream)
            assert raised.value.param == "system"
            with pytest.raises(StopAsyncIteration):  # it has ended
                await anext(stream)
