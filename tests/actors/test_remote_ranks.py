"""Ranks on other hosts, on this host's loopback: the head serves the store and rank
0; `pagedserve worker --head tcp://127.0.0.1:PORT --rank 1` joins it with the cluster
secret. Outputs match one device; a worker without the secret is refused; forged,
tampered and unsealed frames are refused and logged while the group keeps serving;
losing the remote rank fails every request within 10 s. The two-host version, in
network namespaces, is tests/actors/test_two_hosts.py."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from actors.async_engine import AsyncEngine, Supervision
from actors.head_record import RUN_KEY, channel
from actors.remote_rank import _head_gone
from actors.worker_launch import WorkerLaunch
from engine.engine_args import EngineArgs
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.actors.forged_frames import forgeries, push
from tests.actors.open_streams import streams_under_way, tokens_of
from tests.eventually import eventually
from web.launch import REPO, free_port

SECRET = b"remote-ranks-test-secret-0123456789"
KWARGS = dict(skip_tokenizer_init=True, block_size=4, kv_cache_memory=1 << 20, max_model_len=64)
PROMPTS = [[5, 9, 14, 22, 31, 7, 3, 12], [2, 8, 19]]
PARAMS = [
    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=10, n=2, temperature=0.8, seed=3, ignore_eos=True),
]


def _worker(port: int, log: Path, secret: bytes = SECRET, rank: int = 1) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), PAGEDSERVE_CLUSTER_SECRET=secret.decode())
    cmd = [sys.executable, "-m", "web.cli", "worker", "--head", f"tcp://127.0.0.1:{port}"]
    with open(log, "wb") as out:
        return subprocess.Popen(
            [*cmd, "--rank", str(rank), "--join-timeout", "60"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def _args(port: int) -> EngineArgs:
    return EngineArgs(
        model="builtin:tiny",
        tensor_parallel_size=2,
        distributed_address=f"127.0.0.1:{port}",
        **KWARGS,
    )


async def _start(port: int, worker_log: Path, supervision=None):
    args = _args(port)
    launch = WorkerLaunch.start(args, local_ranks=1, secret=SECRET)
    worker = _worker(port, worker_log)
    try:
        engine = await AsyncEngine.start(args, launch=launch, supervision=supervision)
    except BaseException:
        worker.kill()
        worker.wait()
        raise
    return engine, worker


async def _generate_all(engine: AsyncEngine, tag: str) -> list[list[list[int]]]:
    runs = (
        tokens_of(engine, p, sp, f"{tag}{i}")
        for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS, strict=True))
    )
    return await asyncio.wait_for(asyncio.gather(*runs), timeout=60)


def _one_device() -> list[list[list[int]]]:
    with LLM("builtin:tiny", **KWARGS) as llm:
        outputs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    return [[list(c.token_ids) for c in out.outputs] for out in outputs]


@pytest.mark.timeout(180)
async def test_a_remote_rank_serves_like_one_device_and_refuses_forged_frames(tmp_path, caplog):
    expected = _one_device()
    port = free_port()
    engine, worker = await _start(port, tmp_path / "worker.log")
    head = engine.launch.head
    try:
        assert await _generate_all(engine, "a") == expected
        caplog.set_level(logging.WARNING, logger="actors.frame_auth")
        plans = head.plan_addresses()[1]
        push(plans, forgeries(SECRET, channel(head.run_id, "plan-1")))
        heartbeats = head.monitors[0].endpoint.replace("0.0.0.0", "127.0.0.1")
        push(heartbeats, forgeries(SECRET, channel(head.run_id, "heartbeat-1")))
        await eventually(lambda: head.monitors[0].num_refused == 3, 10, "heartbeats refused")
        assert await _generate_all(engine, "b") == expected  # the group keeps serving
        assert engine.is_healthy
        assert "refused a frame" in caplog.text and "bad tag" in caplog.text
        await eventually(
            lambda: (tmp_path / "worker.log").read_text().count("refused a frame") >= 1,
            10,
            "the worker logs the forged plans",
        )
        assert SECRET.decode() not in (tmp_path / "worker.log").read_text()
        assert SECRET.decode() not in caplog.text
    finally:
        await engine.shutdown()
    assert worker.wait(20) == 0  # the head's Shutdown reached it
    assert all(p.poll() is not None for p in engine.launch.processes)


@pytest.mark.timeout(120)
async def test_a_worker_without_the_secret_is_refused(tmp_path):
    port = free_port()
    launch = WorkerLaunch.start(_args(port), local_ranks=1, secret=SECRET)
    try:
        stranger = _worker(port, tmp_path / "stranger.log", secret=b"not-the-secret-" * 3)
        assert stranger.wait(60) == 2
        log = (tmp_path / "stranger.log").read_text()
        assert "join record was refused" in log and "bad tag" in log
        wrong_rank = _worker(port, tmp_path / "rank0.log", rank=0)
        assert wrong_rank.wait(60) == 2
        assert "--rank must be in [1, 2)" in (tmp_path / "rank0.log").read_text()
    finally:
        launch.abandon()


@pytest.mark.timeout(120)
async def test_losing_the_remote_rank_fails_every_request_within_ten_seconds(tmp_path):
    engine, worker = await _start(
        free_port(), tmp_path / "worker.log", Supervision(worker_timeout_s=5.0)
    )
    tasks = await streams_under_way(engine, [f"k{i}" for i in range(3)])
    worker.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    finals = await asyncio.wait_for(asyncio.gather(*tasks), timeout=10)
    assert time.monotonic() - killed_at < 10
    assert all(f.finish_reason == "error" for f in finals)
    assert not engine.is_healthy
    await engine.shutdown()
    worker.wait()
    await eventually(
        lambda: all(p.poll() is not None for p in engine.launch.processes), 10, "ranks gone"
    )


@pytest.mark.timeout(120)
async def test_the_remote_rank_exits_when_the_head_is_gone(tmp_path):
    """A head that dies without a Shutdown: the remote rank does not linger, whether a
    collective with rank 0 fails first or its look at the head's store does."""
    engine, worker = await _start(free_port(), tmp_path / "worker.log")
    assert await _generate_all(engine, "c")
    engine.launch.abandon()  # the local rank killed, the store stopped, no Shutdown sent
    assert worker.wait(20) == 1
    log = (tmp_path / "worker.log").read_text()
    # the store look's own words, or gloo's for a collective whose peer is gone (two
    # wordings, by which side of the socket notices first)
    gone = ("the head at 127.0.0.1", "Connection reset by peer", "remote worker crashing")
    assert any(words in log for words in gone), log[-2000:]
    await engine.shutdown()


@pytest.mark.timeout(60)
async def test_an_idle_rank_sees_the_head_go():
    port = free_port()
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, timedelta(seconds=5), wait_for_workers=False
    )
    store.set(RUN_KEY, b"run-1")
    gone = _head_gone("127.0.0.1", port, "run-1")
    assert await gone() is None
    store.set(RUN_KEY, b"run-2")
    assert await gone() == f"the head at 127.0.0.1:{port} started another run"
    del store
    assert await gone() == f"the head at 127.0.0.1:{port} is gone"


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("argv", "env", "message"),
    [
        (["serve", "-tp", "2", "--local-ranks", "3"], {}, "--local-ranks must be in [1, 2]"),
        (["serve", "-tp", "2", "--local-ranks", "1"], {}, "need --distributed-address HOST:PORT"),
        (
            ["serve", "-tp", "2", "--local-ranks", "1", "--distributed-address", "127.0.0.1:9"],
            {},
            "need the cluster secret: set PAGEDSERVE_CLUSTER_SECRET",
        ),
        (["serve", "--cluster-secret-file", "/x"], {}, "--cluster-secret-file is for ranks on"),
        (["worker", "--head", "tcp://127.0.0.1:9", "--rank", "1"], {}, "needs the cluster secret"),
        (
            ["worker", "--head", "127.0.0.1", "--rank", "1"],
            {"PAGEDSERVE_CLUSTER_SECRET": SECRET.decode()},
            "--head must be HOST:PORT",
        ),
    ],
)
def test_the_command_line_refuses_what_cannot_work(argv, env, message, capsys, monkeypatch):
    from web.cli import main

    monkeypatch.delenv("PAGEDSERVE_CLUSTER_SECRET", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if argv[0] == "serve":
        argv = [*argv, "--model", "builtin:tiny"]
    assert main(argv) == 2
    assert message in capsys.readouterr().err
