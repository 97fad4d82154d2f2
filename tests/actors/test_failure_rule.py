"""The failure rule end to end on a real AsyncEngine (worker process, built-in model): an
exception anywhere on a request's way ends THAT request with a clear error within a
second, releases everything it held, and leaves the others running; an exception tied to
no request brings the engine down cleanly, every open request told."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import pytest_asyncio

from actors.async_engine import AsyncEngine
from engine.engine_args import EngineArgs
from engine.messages import ErrorKind, OutputDelta
from engine.sampling_params import SamplingParams
from engine.worker.builtin_model import builtin_model_dir
from tests.eventually import eventually

ARGS = dict(kv_cache_memory=8 << 20, max_num_seqs=16, block_size=4)
LONG = SamplingParams(max_tokens=400, ignore_eos=True)
SHORT = SamplingParams(max_tokens=6, ignore_eos=True)
pytestmark = pytest.mark.asyncio(loop_scope="module")  # the engine's actors live on it


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine():
    engine = await AsyncEngine.start(EngineArgs(model=str(builtin_model_dir()), **ARGS))
    yield engine
    await engine.shutdown()


async def final(engine: AsyncEngine, prompt, params, rid: str) -> tuple[OutputDelta, float]:
    """The request's last output and how long the request took."""
    start, last = time.monotonic(), None
    async for out in engine.generate(prompt, params, rid):
        last = out
    return last, time.monotonic() - start


def nothing_held(engine: AsyncEngine) -> bool:
    stats = engine.stats()
    processor = engine.graph.tokenizer.processor
    return (
        stats.num_free_blocks == stats.num_blocks
        and stats.num_running == stats.num_waiting == 0
        and not processor.states
        and not processor.sequences
        and not processor.clients
        and not engine.graph.scheduler.core.scheduler.requests
        and not engine._streams
    )


async def fails_alone(engine: AsyncEngine, faulty, rid: str = "faulty") -> OutputDelta:
    """Runs `faulty` beside a long healthy request; the faulty one must end with an
    engine error within 1 s, the healthy one must finish, and nothing stays held."""
    healthy = asyncio.create_task(final(engine, "a healthy neighbour", LONG, "healthy"))
    await eventually(lambda: "healthy" in engine._streams, 5, "the healthy neighbour's stream")
    out, took = await asyncio.wait_for(final(engine, *faulty, rid), 10)
    assert out.finish_reason == "error" and out.index == -1, out
    assert took < 1.0, f"the failure took {took:.2f} s to reach the client"
    neighbour, _ = await asyncio.wait_for(healthy, 60)
    assert neighbour.finish_reason == "length" and neighbour.num_output_tokens == 400
    await eventually(lambda: nothing_held(engine), 2.0, "every block and state released")
    engine.graph.block_manager.manager.check_integrity()
    return out


async def test_a_value_the_codec_cannot_carry_fails_only_its_request(engine):
    # What the 2**70 seed did before validation caught it: a message about the request
    # that cannot be encoded between actors. Forced in past SamplingParams' checks.
    params = SamplingParams(max_tokens=4)
    object.__setattr__(params, "seed", 2**70)
    out = await fails_alone(engine, ("seed past the wire", params))
    assert out.error_kind is ErrorKind.ENGINE and "int" in out.error


def inject(monkeypatch, obj, name: str, fault, *, after: bool = False) -> None:
    """Wraps `obj.name`: raises what `fault(arg)` returns (None: no fault), before the
    original runs or, with `after`, once it has run (a change half made)."""
    original = getattr(obj, name)

    def faulty(*args):
        result = original(*args) if after else None
        if (error := fault(*args)) is not None:
            raise error
        return result if after else original(*args)

    monkeypatch.setattr(obj, name, faulty)


def when(request_id: str, error: Exception):
    """A fault for the message (or delta) of `request_id`."""
    return lambda message, *_: error if message.request_id == request_id else None


async def test_an_exception_in_the_tokenizer_fails_only_its_request(engine, monkeypatch):
    fault = when("faulty", RuntimeError("tokenizer fault injected"))
    inject(monkeypatch, engine.graph.tokenizer.processor, "prepare", fault)
    out = await fails_alone(engine, ("hello", SHORT))
    assert "tokenizer fault injected" in out.error


async def test_an_exception_while_detokenizing_fails_only_its_request(engine, monkeypatch):
    processor = engine.graph.tokenizer.processor

    def third_token(delta):
        state = processor.states.get(delta.request_id)
        late = delta.request_id == "faulty" and state.num_output_tokens >= 2
        return UnicodeError("detokenizer fault injected") if late else None

    inject(monkeypatch, processor, "on_token_delta", third_token)
    out = await fails_alone(engine, ("hello", LONG))
    assert "detokenizer fault injected" in out.error


async def test_an_exception_in_the_scheduler_fails_only_its_request(engine, monkeypatch):
    fault = when("faulty", KeyError("scheduler fault injected"))
    # after: the request holds a place in the scheduler when the handler raises
    inject(monkeypatch, engine.graph.scheduler.core, "add_request", fault, after=True)
    out = await fails_alone(engine, ("hello", LONG))
    assert "scheduler fault injected" in out.error


async def test_n_sequences_fail_together(engine, monkeypatch):
    fault = when("faulty#1", RuntimeError("one sequence failed"))
    inject(monkeypatch, engine.graph.tokenizer.processor, "on_token_delta", fault)
    out = await fails_alone(engine, ("hello", dataclasses.replace(LONG, n=3)))
    assert "one sequence failed" in out.error


async def test_a_block_manager_fault_brings_the_engine_down_cleanly():
    engine = await AsyncEngine.start(EngineArgs(model=str(builtin_model_dir()), **ARGS))
    try:
        running = [
            asyncio.create_task(final(engine, f"prompt {i}", LONG, f"r{i}")) for i in range(3)
        ]
        await eventually(lambda: engine.stats().num_running == 3, 10, "3 requests running")

        def broken(message):
            raise RuntimeError("block manager fault injected")

        manager = engine.graph.block_manager  # the next exchange (a block boundary) raises
        manager.handlers = {t: broken for t in manager.handlers}
        start = time.monotonic()
        outs = [out for out, _ in await asyncio.wait_for(asyncio.gather(*running), 5)]
        assert time.monotonic() - start < 1.0
        for out in outs:
            assert out.finish_reason == "error" and "block manager fault injected" in out.error
        assert not engine.is_healthy and "block_manager" in engine.error
        with pytest.raises(RuntimeError, match="not healthy"):
            await anext(engine.generate("after", SHORT, "after"))
    finally:
        await engine.shutdown()
