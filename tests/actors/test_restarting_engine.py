"""A dead or stalled worker comes back: its requests fail fast, new ones are refused as
unavailable while a fresh engine starts, then served; with no restarts left the engine
stays down as before. Data-parallel: a dead replica is skipped, the set serves on."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from actors.async_engine import Supervision
from actors.engine_status import EngineStatus
from actors.replica_set import ReplicaSet
from actors.restarting_engine import RestartingEngine, RestartPolicy
from engine.engine_args import EngineArgs
from engine.sampling_params import SamplingParams
from engine.worker.builtin_model import builtin_model_dir
from tests.eventually import eventually

ARGS = dict(kv_cache_memory=8 << 20, max_num_seqs=32, block_size=4)
LONG = SamplingParams(max_tokens=2000, temperature=0, ignore_eos=True)
SHORT = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
FAST = RestartPolicy(max_restarts=2, backoff_s=0.05)


def engine_args() -> EngineArgs:
    return EngineArgs(model=str(builtin_model_dir()), **ARGS)


async def finish(engine, prompt: str, params: SamplingParams, rid: str) -> str | None:
    """The request's last finish reason ("error" for a request-wide failure)."""
    reason = None
    async for out in engine.generate(prompt, params, rid):
        reason = out.finish_reason or reason
    return reason


async def started(engine, prompt: str, rid: str) -> asyncio.Task:
    """A long request, once it has produced a token."""
    first = asyncio.Event()

    async def run() -> str | None:
        reason = None
        async for out in engine.generate(prompt, LONG, rid):
            first.set()
            reason = out.finish_reason or reason
        return reason

    task = asyncio.create_task(run())
    await asyncio.wait_for(first.wait(), 30)
    return task


def test_policy_backs_off_and_refuses_negative_counts() -> None:
    policy = RestartPolicy(backoff_s=0.5, max_backoff_s=3.0)
    assert [policy.backoff(k) for k in (1, 2, 3, 4)] == [0.5, 1.0, 2.0, 3.0]
    with pytest.raises(ValueError, match="max_worker_restarts must be >= 0"):
        RestartPolicy(max_restarts=-1)


@pytest.mark.timeout(120)
async def test_a_killed_worker_is_replaced_and_new_requests_are_served() -> None:
    engine = await RestartingEngine.start(engine_args(), FAST)
    try:
        first = engine.engine
        in_flight = await started(engine, "hello", "in-flight")
        os.kill(first.launch.process.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        assert await asyncio.wait_for(in_flight, 5) == "error"
        assert time.monotonic() - killed_at < 1.5
        await eventually(lambda: engine.status is EngineStatus.RESTARTING, 5, "restarting")
        with pytest.raises(RuntimeError, match="restarting"):
            await finish(engine, "hi", SHORT, "during")
        with pytest.raises(RuntimeError, match="restarting"):
            await engine.count_prompt_tokens([{"role": "user", "content": "hi"}])
        await eventually(lambda: engine.status is EngineStatus.OK, 60, "back")
        assert engine.engine is not first and engine.num_restarts == 1
        assert engine.watch_stats().num_restarts == 1
        assert await finish(engine, "hi", SHORT, "after") == "length"
        assert first.launch.process.poll() is not None
    finally:
        await engine.shutdown()
    assert engine.engine.launch.process.poll() is not None


@pytest.mark.timeout(120)
async def test_no_restarts_keeps_the_engine_down() -> None:
    engine = await RestartingEngine.start(engine_args(), RestartPolicy(max_restarts=0))
    try:
        os.kill(engine.engine.launch.process.pid, signal.SIGKILL)
        await eventually(lambda: engine.engine.ended.is_set(), 10, "the engine down")
        assert engine.status is EngineStatus.UNHEALTHY and engine.num_restarts == 0
        assert "exited" in engine.error
    finally:
        await engine.shutdown()


@pytest.mark.timeout(120)
async def test_a_stalled_worker_is_stopped_and_replaced() -> None:
    policy = RestartPolicy(max_restarts=1, backoff_s=0.05, stall_restart_s=1.0)
    supervision = Supervision(worker_timeout_s=0.5)
    engine = await RestartingEngine.start(engine_args(), policy, supervision=supervision)
    try:
        stalled = engine.engine.launch.process
        stalled.send_signal(signal.SIGSTOP)
        await eventually(lambda: engine.num_restarts == 1, 60, "a replacement")
        assert stalled.poll() is not None  # killed, not left stopped
        assert await finish(engine, "hi", SHORT, "after-stall") == "length"
    finally:
        await engine.shutdown()


@pytest.mark.timeout(180)
async def test_a_dead_replica_is_skipped_then_comes_back() -> None:
    replicas = await ReplicaSet.start(engine_args(), 2, restart=FAST)
    try:
        dead = replicas.replicas[1].engine.launch.process
        os.kill(dead.pid, signal.SIGKILL)
        await eventually(lambda: replicas.status is EngineStatus.DEGRADED, 10, "degraded")
        assert replicas.is_healthy and replicas.error is None
        reasons = await asyncio.gather(
            *(finish(replicas, f"chat {i}", SHORT, f"while-down-{i}") for i in range(6))
        )
        assert reasons == ["length"] * 6  # every one served by replica 0
        assert replicas.stats().num_blocks == replicas.replicas[0].stats().num_blocks
        await eventually(lambda: replicas.status is EngineStatus.OK, 60, "replica 1 back")
        assert replicas.watch_stats().num_restarts == 1
        served = set()
        for i in range(4):
            rid = f"after-{i}"
            async for _ in replicas.generate(f"independent {i}", SHORT, rid):
                served.add(replicas.replica_of(rid))
        assert 1 in served  # replica 1 takes traffic again (it is the least used now)
    finally:
        await replicas.shutdown()
