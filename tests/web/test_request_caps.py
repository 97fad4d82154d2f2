"""Bounds on one client's work: --max-tokens-per-request refuses a request whose
max_tokens times its sequences is past the cap (400 naming the fields), and
--max-concurrent-per-key refuses a client's request past its number open at once (429,
a WebSocket `error` event) until one ends; other keys are not held up."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
import websockets
from starlette.datastructures import Address

from tests.web.conftest import start_server, stop_server
from web.api_keys import ApiKeys
from web.cli import main
from web.client_concurrency import Client, ClientConcurrency, ClientKind
from web.errors import ApiError
from web.server_config import ServerConfig

pytestmark = pytest.mark.timeout(120)
KEY_A, KEY_B = "key-a", "key-b"
CAP = 4096  # output tokens per request
HELD = {"max_tokens": 2000, "ignore_eos": True}  # seconds of decoding on builtin:tiny


@pytest.fixture(scope="module")
def capped():
    server = start_server(
        api_key=KEY_A,
        extra=["--api-key", KEY_B, "--max-concurrent-per-key", "1"]
        + ["--max-tokens-per-request", str(CAP)],
    )
    yield server
    stop_server(server)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def complete(server, key: str, **body) -> httpx.Response:
    body = {"prompt": "hi", "max_tokens": 2} | body
    return httpx.post(f"{server.http}/v1/completions", json=body, headers=bearer(key), timeout=60)


async def next_event(ws) -> dict:
    return json.loads(await asyncio.wait_for(ws.recv(), 30))


async def open_socket(server, key: str):
    ws = await websockets.connect(f"{server.ws}/v1/stream")
    await ws.send(json.dumps({"type": "auth", "token": key}))
    return ws


def test_a_request_past_the_output_cap_is_refused_naming_n_and_max_tokens(capped):
    refused = complete(capped, KEY_B, n=3, max_tokens=2000)
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]
    assert error["param"] == "n" and error["code"] == "invalid_request"
    assert error["message"].startswith("n × max_tokens = 3 × 2,000 = 6,000 output tokens")
    assert f"--max-tokens-per-request) of {CAP:,}" in error["message"]
    assert complete(capped, KEY_B, n=2, max_tokens=2).status_code == 200  # its slot was freed


async def test_a_key_at_its_cap_gets_429_until_its_request_ends(capped):
    held = await open_socket(capped, KEY_A)
    await held.send(json.dumps({"type": "generate", "id": "long", "prompt": "hi", "params": HELD}))
    assert (await next_event(held))["type"] == "delta"  # running now, for some seconds
    refused = await asyncio.to_thread(complete, capped, KEY_A)
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "1"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error" and error["code"] == "too_many_requests"
    assert "this API key already has 1 request open" in error["message"]
    assert "--max-concurrent-per-key 1" in error["message"]
    other = await open_socket(capped, KEY_A)  # another socket, the same key
    await other.send(json.dumps({"type": "generate", "id": "second", "prompt": "hi"}))
    event = await next_event(other)
    assert event["type"] == "error" and event["id"] == "second"
    assert event["code"] == "too_many_requests"
    assert (await asyncio.to_thread(complete, capped, KEY_B)).status_code == 200  # not held up
    await held.send(json.dumps({"type": "cancel", "id": "long"}))
    while (event := await next_event(held))["type"] != "done":
        assert event["type"] == "delta"
    assert event["finish_reason"] == "abort"  # it was still running when refused others
    assert (await asyncio.to_thread(complete, capped, KEY_A)).status_code == 200
    await other.send(json.dumps({"type": "generate", "id": "third", "prompt": "hi"}))
    while (event := await next_event(other))["type"] == "delta":
        pass
    assert event["type"] == "done" and event["id"] == "third"
    await held.close()
    await other.close()


def test_a_finished_stream_frees_its_slot(capped):
    with httpx.stream(
        "POST",
        f"{capped.http}/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True},
        headers=bearer(KEY_B),
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200
        data = [line for line in streamed.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        last = json.loads(data[-2].removeprefix("data: "))["choices"][0]
        assert last["finish_reason"] in ("stop", "length")
    assert complete(capped, KEY_B).status_code == 200


def test_the_count_is_per_client_and_ends_with_release():
    cap = ClientConcurrency(2)
    a = Client.of_key(KEY_A)
    b = Client.of_address(Address("10.0.0.2", 5000))
    cap.acquire(a)
    cap.acquire(a)
    with pytest.raises(ApiError) as refused:
        cap.acquire(a)
    assert refused.value.status == 429 and refused.value.code == "too_many_requests"
    assert "this API key already has 2 requests open" in refused.value.message
    cap.acquire(b)  # another client: its own count
    cap.release(a)
    cap.acquire(a)
    for client in (a, a, b):
        cap.release(client)
    assert cap.open == {}
    uncapped = ClientConcurrency()
    for _ in range(1000):
        uncapped.acquire(a)
    assert uncapped.open == {}


def test_a_client_is_its_key_with_keys_else_its_address():
    keys = ApiKeys(frozenset({KEY_A}))
    address = Address("10.0.0.1", 1234)
    keyed = Client.of_http(keys, [f"Bearer {KEY_A}"], address)
    assert keyed == Client(ClientKind.API_KEY, ApiKeys.fingerprint(KEY_A))
    assert KEY_A not in keyed.name
    assert Client.of_http(ApiKeys(), [f"Bearer {KEY_A}"], address) == Client(
        ClientKind.ADDRESS, "10.0.0.1"
    )
    assert Client.of_http(ApiKeys(), [], None).name == "unknown"


@pytest.mark.parametrize("flag", ["--max-concurrent-per-key", "--max-tokens-per-request"])
@pytest.mark.parametrize("bad", ["0", "-3", "many"])
def test_the_caps_are_positive_integers(flag, bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "builtin:tiny", flag, bad])
    assert exit_.value.code == 2
    assert flag in capsys.readouterr().err


def test_the_server_config_checks_its_cap():
    assert ServerConfig("m").max_concurrent_per_key is None
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="max_concurrent_per_key must be an int >= 1"):
            ServerConfig("m", max_concurrent_per_key=bad)
