"""AsyncEngine end to end: worker process, scheduler and tokenizer actors, streaming."""

from __future__ import annotations

import asyncio
import os
import random

import pytest

from actors.async_engine import AsyncEngine
from engine import LLM, SamplingParams
from engine.config import EngineArgs
from tests.conftest import shared_path


async def _run(engine, prompt, params, rid):
    text, tokens, last = "", [], None
    async for out in engine.generate(prompt, params, rid):
        text += out.text
        tokens += out.token_ids
        last = out
    return text, tokens, last


async def test_streams_equal_offline_outputs_on_a_tiny_random_model(tmp_path):
    """The same check without ../shared: a random model beside an in-test tokenizer."""
    from tests.engine.test_detokenizer import sentencepiece_like
    from tests.engine.tiny_models import save_hf_model

    tokenizer = sentencepiece_like()
    save_hf_model("llama", tmp_path, vocab_size=tokenizer.vocab_size)
    tokenizer.hf_tokenizer.save_pretrained(tmp_path)
    kwargs = dict(kv_cache_memory=1 << 20, max_model_len=96, block_size=4)
    rng = random.Random(8)
    prompts = [rng.choice(["hello there", "once upon", "a cafe", "tea time"]) for _ in range(16)]
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            seed=i,
            ignore_eos=True,
            max_tokens=rng.randint(1, 20),
        )
        for i in range(16)
    ]
    expected = LLM(str(tmp_path), **kwargs).generate(prompts, params, use_tqdm=False)
    engine = await AsyncEngine.start(EngineArgs(model=str(tmp_path), **kwargs))
    try:
        results = await asyncio.gather(
            *(
                _run(engine, p, sp, f"t{i}")
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            )
        )
        for (text, tokens, _), exp in zip(results, expected, strict=True):
            assert tokens == exp.outputs[0].token_ids and text == exp.outputs[0].text
    finally:
        await engine.shutdown()


@pytest.mark.shared
@pytest.mark.parametrize("depth", [1, 2])
async def test_streams_equal_offline_outputs(depth):
    model = str(shared_path("models", "stories260K"))
    kwargs = dict(kv_cache_memory=16 << 20, max_num_batched_tokens=256)
    rng = random.Random(4)
    starts = ["Once upon a time", "The little dog", "Lily and Ben", "One day", "The sun"]
    prompts = [rng.choice(starts) for _ in range(64)]
    params = [
        SamplingParams(temperature=rng.choice([0.0, 0.9]), seed=i, max_tokens=rng.randint(5, 40))
        for i in range(64)
    ]
    expected = LLM(model, **kwargs).generate(prompts, params, use_tqdm=False)

    engine = await AsyncEngine.start(EngineArgs(model=model, **kwargs), pipeline_depth=depth)
    try:
        results = await asyncio.gather(
            *(
                _run(engine, p, sp, f"r{i}")
                for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
            )
        )
        for (text, tokens, last), exp in zip(results, expected, strict=True):
            assert tokens == exp.outputs[0].token_ids
            assert text == exp.outputs[0].text
            assert last.finish_reason == exp.outputs[0].finish_reason
            assert last.num_output_tokens == len(tokens)
        bad = await _run(engine, "hi", SamplingParams(logit_bias={10**6: 1.0}), "bad")
        assert bad[2].finish_reason == "error" and "logit_bias" in bad[2].error
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    finally:
        run_dir = engine._run_dir
        await engine.shutdown()
    assert engine._worker.poll() is not None  # no orphan process
    assert not os.path.exists(run_dir)  # no stale ipc files


@pytest.mark.shared
async def test_killed_worker_ends_every_request_with_an_error_and_shuts_down():
    import signal
    import time

    model = str(shared_path("models", "stories260K"))
    engine = await AsyncEngine.start(EngineArgs(model=model, kv_cache_memory=16 << 20))
    run_dir = engine._run_dir
    params = SamplingParams(max_tokens=500, ignore_eos=True)
    first_token = asyncio.Event()

    async def consume(rid):
        last = None
        async for out in engine.generate("Once upon a time", params, rid):
            first_token.set()
            last = out
        return last

    tasks = [asyncio.create_task(consume(f"k{i}")) for i in range(8)]
    await asyncio.wait_for(first_token.wait(), timeout=60)
    engine._worker.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    finals = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert time.monotonic() - killed_at < 5
    assert all(f.finish_reason == "error" and "exited" in f.error for f in finals)
    assert not engine.is_healthy
    with pytest.raises(RuntimeError, match="not healthy"):
        async for _ in engine.generate("again", params, "late"):
            pass
    await engine.shutdown()  # idempotent after the watchdog's own shutdown
    assert engine._worker.poll() is not None
    for _ in range(50):
        if not os.path.exists(run_dir):
            break
        await asyncio.sleep(0.05)
    assert not os.path.exists(run_dir)


@pytest.mark.shared
async def test_500_requests_with_random_aborts_leave_every_block_free():
    model = str(shared_path("models", "stories260K"))
    engine = await AsyncEngine.start(
        EngineArgs(model=model, kv_cache_memory=8 << 20, max_num_seqs=64)
    )
    rng = random.Random(9)

    async def client(i):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 30))
        mode = rng.choice(["finish", "break", "abort"])
        stop_after = rng.randint(0, 5)
        await asyncio.sleep(rng.random() * 0.5)
        n, last = 0, None
        async for out in engine.generate("Once upon a time", params, f"a{i}"):
            n, last = n + 1, out
            if mode == "break" and n > stop_after:
                break  # leaving the stream aborts the request
            if mode == "abort" and n > stop_after:
                await engine.abort(f"a{i}")
        return mode, last

    try:
        results = await asyncio.wait_for(
            asyncio.gather(*(client(i) for i in range(500))), timeout=240
        )
        finished = [last for mode, last in results if mode == "finish"]
        assert all(last.finish_reason in ("stop", "length") for last in finished)
        aborted = [last for mode, last in results if mode == "abort"]
        assert all(last.finish_reason in ("stop", "length", "abort") for last in aborted)
        assert any(last.finish_reason == "abort" for last in aborted)
        for _ in range(200):  # let the last aborts and results reach the scheduler
            stats = engine.stats()
            if stats.num_running == stats.num_waiting == 0 and engine.scheduler.in_flight == 0:
                break
            await asyncio.sleep(0.02)
        engine.scheduler.core.scheduler.check_integrity()
        engine.block_manager.manager.check_integrity()  # the block manager's own tables
        assert stats.num_free_blocks == stats.num_blocks
        assert engine.is_healthy
    finally:
        await engine.shutdown()
