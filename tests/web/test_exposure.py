"""What a probing client could make the server misread or reveal: a request with two
Authorization headers is refused (HTTP 400 naming the header, WebSocket 1008) instead
of one of them winning; a key sent in the query string never reaches the access log;
a model loaded from a local directory is served under the directory's name, and no
answer shows a path of the server's."""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from tests.eventually import eventually
from tests.web.conftest import RunningServer
from web.launch import ServerProcess

pytestmark = pytest.mark.timeout(120)
KEY = "exposure-test-key"
SECRETS = ("sk-in-the-query-1", "sk-in-the-query-2")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    from engine.worker.builtin_model import builtin_model_dir

    return builtin_model_dir()  # a local directory: served under its name


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[tuple[RunningServer, Path]]:
    """The built-in model from its directory (no --served-model-name), with a key and
    its log in a file."""
    args = ["--model", str(model_dir), "--api-key", KEY, "--max-num-seqs", "16"]
    args += ["--kv-cache-memory", str(64 << 20)]
    with tempfile.NamedTemporaryFile(prefix="pagedserve-exposure-", suffix=".log") as log:
        process = ServerProcess(args, env={"OMP_NUM_THREADS": "1"}, log=log)
        process.start(timeout=120)
        yield (
            RunningServer(process.port, model_dir.name, str(model_dir), KEY, process),
            Path(log.name),
        )
        process.stop()


def bearer(*keys: str) -> list[tuple[str, str]]:
    return [("Authorization", f"Bearer {k}") for k in keys]


def test_two_authorization_headers_are_a_400_naming_the_header(server) -> None:
    running, _ = server
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in (bearer(KEY, "wrong"), bearer("wrong", KEY), bearer(KEY, KEY)):
        for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions")):
            r = httpx.request(method, f"{running.http}{path}", json=body, headers=headers)
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["type"] == "invalid_request_error" and error["param"] == "Authorization"
            assert "2 Authorization headers" in error["message"]
    assert httpx.get(f"{running.http}/v1/models", headers=bearer(KEY)).status_code == 200


async def test_a_websocket_with_two_authorization_headers_is_closed_1008(server) -> None:
    running, _ = server
    url = f"{running.ws}/v1/stream"
    async with websockets.connect(url, additional_headers=bearer(KEY, "wrong")) as ws:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(ws.recv(), 10)
    assert closed.value.rcvd.code == 1008
    assert "2 Authorization headers" in closed.value.rcvd.reason
    async with websockets.connect(url, additional_headers=bearer(KEY)) as ws:  # one: served
        await ws.send(json.dumps({"type": "ping"}))
        assert json.loads(await asyncio.wait_for(ws.recv(), 10)) == {"type": "pong"}


async def test_query_values_never_reach_the_access_log(server) -> None:
    running, log = server
    url = f"{running.http}/v1/models?api_key={SECRETS[0]}&verbose=1"
    assert httpx.get(url, headers=bearer(KEY)).status_code == 200
    ws_url = f"{running.ws}/v1/stream?token={SECRETS[1]}"
    async with websockets.connect(ws_url, additional_headers=bearer(KEY)) as ws:
        await ws.send(json.dumps({"type": "ping"}))
        await asyncio.wait_for(ws.recv(), 10)
    logged = ('"GET /v1/models?api_key=<redacted>&verbose=<redacted> HTTP/1.1" 200',
              '"WebSocket /v1/stream?token=<redacted>"')  # fmt: skip
    await eventually(lambda: all(line in log.read_text() for line in logged), 10, log.read_text)
    assert not any(secret in log.read_text() for secret in SECRETS)


def test_a_local_model_is_served_by_its_directory_name_and_no_path_shows(server) -> None:
    running, _ = server
    name, headers = running.model, dict(bearer(KEY))
    assert name == Path(running.model_dir).name
    models = httpx.get(f"{running.http}/v1/models", headers=headers)
    assert [card["id"] for card in models.json()["data"]] == [name]
    info = httpx.get(f"{running.http}/v1/info", headers=headers)
    assert info.json()["model"] == name
    strings = [v for v in info.json().values() if isinstance(v, str)]
    assert not any(re.search(r"(^|\s)/\w", v) for v in strings), info.text
    body = {"prompt": "hi", "max_tokens": 2, "model": name}
    done = httpx.post(f"{running.http}/v1/completions", json=body, headers=headers)
    assert done.status_code == 200 and done.json()["model"] == name
    for text in (models.text, info.text, done.text):
        assert running.model_dir not in text
    by_path = httpx.post(
        f"{running.http}/v1/completions", json={**body, "model": running.model_dir}, headers=headers
    )
    assert by_path.status_code == 404 and repr(name) in by_path.json()["error"]["message"]
