"""The small doors: API keys from a file and the environment (never on the command line),
checked in constant time; a WebSocket that does not authenticate in time is closed; a
session belongs to the key that opened it (or, without keys, to its connection, and
closes with it) and is bounded in number and characters, system text included."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path

import httpx
import pytest
import websockets

from tests.eventually import eventually
from tests.web.conftest import start_server, stop_server
from web.api_keys import ApiKeys
from web.client import AsyncClient, AuthenticationError

FILE_KEY, ENV_KEY = "key-from-a-file", "key-from-the-environment"
MAX_CHARS = 200


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "keys.txt"
    key_file.write_text(f"# one key per line\n{FILE_KEY}\n")
    server = start_server(
        extra=[
            "--api-key-file",
            str(key_file),
            "--ws-auth-timeout",
            "1",
            "--session-max-chars",
            str(MAX_CHARS),
        ],
        env={"PAGEDSERVE_API_KEY": ENV_KEY},
    )
    server = dataclasses.replace(server, api_key=FILE_KEY)  # for /metrics
    yield server
    stop_server(server)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_api_keys_come_from_a_file_and_the_environment_not_the_command_line(keyed):
    body = {"prompt": "hi", "max_tokens": 2}
    for key in (FILE_KEY, ENV_KEY):
        r = httpx.post(f"{keyed.http}/v1/completions", json=body, headers=bearer(key))
        assert r.status_code == 200, r.text
    for headers in ({}, bearer("wrong"), bearer(FILE_KEY + "x"), bearer(FILE_KEY[:-1])):
        r = httpx.post(f"{keyed.http}/v1/completions", json=body, headers=headers)
        assert r.status_code == 401
    cmdline = Path(f"/proc/{keyed.process.proc.pid}/cmdline").read_bytes()
    assert FILE_KEY.encode() not in cmdline and ENV_KEY.encode() not in cmdline


def test_api_keys_match_exactly_and_only_strings():
    keys = ApiKeys(frozenset({"abc", "xyz"}))
    assert keys.matches("abc") and keys.matches("xyz")
    assert not any(keys.matches(c) for c in ("ab", "abcd", "", None, 123, ["abc"], "a\ud800"))
    assert not ApiKeys() and len(keys) == 2
    assert ApiKeys.fingerprint("abc") != "abc" and len(ApiKeys.fingerprint("abc")) == 16
    with pytest.raises(ValueError, match="whitespace"):
        ApiKeys(frozenset({" padded "}))


async def test_a_websocket_that_does_not_authenticate_in_time_is_closed(keyed):
    async with websockets.connect(f"{keyed.ws}/v1/stream") as ws:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 5)  # we say nothing
    assert closed.value.rcvd.code == 1008 and "timeout" in closed.value.rcvd.reason
    await eventually(lambda: keyed.metric("pagedserve_num_ws_connections") == 0, 5)


async def events(ws, n: int) -> list[dict]:
    return [json.loads(await asyncio.wait_for(ws.recv(), 30)) for _ in range(n)]


async def open_socket(server, key: str | None = None):
    ws = await websockets.connect(f"{server.ws}/v1/stream")
    if key is not None:
        await ws.send(json.dumps({"type": "auth", "token": key}))
    return ws


async def test_a_session_cannot_be_used_from_another_key(keyed):
    mine = await open_socket(keyed, FILE_KEY)
    theirs = await open_socket(keyed, ENV_KEY)
    await mine.send(json.dumps({"type": "session.open", "system": "Be brief."}))
    (opened,) = await events(mine, 1)
    sid = opened["session_id"]
    turn = {"type": "generate", "id": "t", "session_id": sid, "message": "hi"}
    await theirs.send(json.dumps({**turn, "params": {"max_tokens": 2}}))
    (refused,) = await events(theirs, 1)
    assert refused["type"] == "error" and refused["code"] == "not_found"
    await theirs.send(json.dumps({"type": "session.open", "session_id": sid}))  # not by id
    (refused,) = await events(theirs, 1)
    assert refused["code"] == "not_found"
    await theirs.send(json.dumps({"type": "session.close", "session_id": sid}))  # a no-op
    await mine.send(json.dumps({**turn, "params": {"max_tokens": 2}}))
    assert (await events(mine, 2))[-1]["type"] in ("done", "delta")
    await mine.close()  # with a key, the session outlives the socket (a reconnect)
    again = await open_socket(keyed, FILE_KEY)
    await again.send(json.dumps({"type": "session.open", "session_id": sid}))
    (reopened,) = await events(again, 1)
    assert reopened["session_id"] == sid and len(reopened["messages"]) >= 1
    await again.send(json.dumps({"type": "session.close", "session_id": sid}))
    await again.close()
    await theirs.close()
    await eventually(lambda: keyed.metric("pagedserve_num_sessions") == 0, 5)


async def test_system_text_counts_toward_the_session_bound(keyed):
    ws = await open_socket(keyed, FILE_KEY)
    await ws.send(json.dumps({"type": "session.open", "system": "s" * (MAX_CHARS + 1)}))
    (refused,) = await events(ws, 1)
    assert refused["type"] == "error" and refused["param"] == "system"
    assert f"at most {MAX_CHARS}" in refused["message"]
    await ws.close()
    assert keyed.metric("pagedserve_num_sessions") == 0


async def test_without_keys_sessions_close_with_their_connection_and_are_bounded(
    builtin_server,
):
    ws = await open_socket(builtin_server)
    for _ in range(64):
        await ws.send(json.dumps({"type": "session.open"}))
    opened = await events(ws, 64)
    assert all(e["type"] == "session" for e in opened)
    await ws.send(json.dumps({"type": "session.open"}))
    (refused,) = await events(ws, 1)
    assert refused["type"] == "error" and "64 open sessions" in refused["message"]
    other = await open_socket(builtin_server)  # another connection: not its sessions
    sid = opened[0]["session_id"]
    await other.send(json.dumps({"type": "session.open", "session_id": sid}))
    assert (await events(other, 1))[0]["code"] == "not_found"
    assert builtin_server.metric("pagedserve_num_sessions") == 64
    await ws.close()
    await other.close()
    await eventually(lambda: builtin_server.metric("pagedserve_num_sessions") == 0, 5)


async def test_the_sdk_raises_authentication_error_for_a_wrong_key(keyed):
    with pytest.raises(AuthenticationError, match="invalid or missing API key"):
        async with AsyncClient(keyed.ws, api_key="wrong"):
            pass
    async with AsyncClient(keyed.ws, api_key=ENV_KEY) as client:
        assert len((await client.complete("hi", max_tokens=2, ignore_eos=True)).token_ids) == 2
