"""`pagedserve serve --data-parallel-size 2`: two engine replicas (two worker processes)
behind one server; chats, /health, /metrics and /v1/info work as with one; a replica
count out of range is refused by name."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from tests.web.conftest import start_server, stop_server
from web.cli import main

MODEL = "pagedserve-builtin-tiny"


@pytest.fixture(scope="module")
def dp_server():
    server = start_server(extra=["--data-parallel-size", "2"])
    yield server
    stop_server(server)


def worker_processes(pid: int) -> list[int]:
    """The child processes of `pid` that run `actors.worker_actor`."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    cmdlines = {c: Path(f"/proc/{c}/cmdline").read_bytes() for c in children}
    return [int(c) for c, cmd in cmdlines.items() if b"actors.worker_actor" in cmd]


async def chat(client: httpx.AsyncClient, messages: list[dict]) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0}
    r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


@pytest.mark.timeout(180)
def test_two_replicas_serve_chats_behind_one_server(dp_server):
    assert len(worker_processes(dp_server.process.proc.pid)) == 2
    assert httpx.get(f"{dp_server.http}/health").json() == {"status": "ok"}
    assert httpx.get(f"{dp_server.http}/v1/info").json()["data_parallel_size"] == 2

    async def two_turns(client: httpx.AsyncClient, c: int) -> None:
        messages = [{"role": "user", "content": f"chat {c}: " + "tell me about the sea. " * 4}]
        reply = await chat(client, messages)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
        await chat(client, messages)

    async def main_() -> None:
        async with httpx.AsyncClient(base_url=dp_server.http, timeout=60) as client:
            await asyncio.gather(*(two_turns(client, c) for c in range(4)))

    asyncio.run(main_())
    assert dp_server.metric("pagedserve_prefix_cache_hit_tokens_total") > 0
    assert dp_server.metric("pagedserve_kv_blocks_total") > 0
    assert dp_server.metric("pagedserve_num_requests_running") == 0
    assert httpx.get(f"{dp_server.http}/health").status_code == 200


def running(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


@pytest.mark.timeout(120)
def test_stopping_the_server_stops_every_replica(dp_server):
    """Runs after the test above (same server): SIGTERM leaves no worker running."""
    workers = worker_processes(dp_server.process.proc.pid)
    assert len(workers) == 2 and all(running(w) for w in workers)
    stop_server(dp_server)
    assert dp_server.process.proc.returncode == 0
    assert not any(running(w) for w in workers)


@pytest.mark.parametrize("bad", ["0", "17", "two"])
def test_a_replica_count_out_of_range_is_refused_by_name(bad, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", "builtin:tiny", "--data-parallel-size", bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "--data-parallel-size" in err and "must be an integer from 1 to 16" in err
