"""AsyncEngine end to end: worker process, scheduler and tokenizer actors, streaming."""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass, field

import pytest

from actors.async_engine import AsyncEngine
from engine import LLM, SamplingParams
from engine.engine_args import EngineArgs
from tests.conftest import shared_path
from tests.eventually import eventually

START_TEXTS = ["Once upon a time", "The little dog", "Lily and Ben", "One day", "The sun"]


@dataclass(frozen=True)
class ServedModel:
    path: str
    kwargs: dict


@pytest.fixture(scope="module", params=["stories260K", "tiny"])
def served(request, tmp_path_factory) -> ServedModel:
    """The real stories260K from ../shared (skipped when absent), and always a tiny random
    Llama beside an in-test tokenizer, so every test here runs on a bare checkout too."""
    if request.param == "stories260K":
        model = str(shared_path("models", "stories260K"))
        return ServedModel(model, dict(kv_cache_memory=16 << 20, max_num_batched_tokens=256))
    from tests.engine.tiny_models import save_hf_model
    from tests.engine.tiny_tokenizers import sentencepiece_like

    directory = tmp_path_factory.mktemp("tiny-served")
    tokenizer = sentencepiece_like()
    save_hf_model("llama", directory, vocab_size=tokenizer.vocab_size)
    tokenizer.hf_tokenizer.save_pretrained(directory)
    return ServedModel(str(directory), dict(kv_cache_memory=2 << 20, block_size=4))


@dataclass
class Streamed:
    text: str = ""
    tokens: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list = field(default_factory=list)
    last: object = None


async def _run(engine, prompt, params, rid) -> Streamed:
    got = Streamed()
    async for out in engine.generate(prompt, params, rid):
        got.text += out.text
        got.tokens += out.token_ids
        got.logprobs += out.logprobs or []
        got.prompt_logprobs += out.prompt_logprobs or []
        got.last = out
    return got


def _same_rows(rows, expected: list[dict]) -> None:
    """Wire rows (chosen first, then tops) against LLM's Logprob dicts, in order."""
    assert len(rows) == len(expected)
    for row, exp in zip(rows, expected, strict=True):
        assert [c.token_id for c in row] == list(exp)
        for c in row:
            want = exp[c.token_id]
            assert (c.rank, c.decoded_token) == (want.rank, want.decoded_token)
            assert c.logprob == pytest.approx(want.logprob, abs=1e-4)


@pytest.mark.parametrize("depth", [1, 2])
async def test_streams_equal_offline_outputs(served, depth):
    """64 mixed requests (greedy and seeded, some with logprobs and prompt logprobs)
    stream exactly what the offline LLM returns, one step ahead and synchronously."""
    rng = random.Random(4)
    prompts = [rng.choice(START_TEXTS) for _ in range(64)]
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.9]),
            seed=i,
            max_tokens=rng.randint(5, 40),
            logprobs=rng.choice([None, None, 0, 2]),
            prompt_logprobs=rng.choice([None, None, None, 1]),
        )
        for i in range(64)
    ]
    expected = LLM(served.path, **served.kwargs).generate(prompts, params, use_tqdm=False)

    args = EngineArgs(model=served.path, **served.kwargs)
    engine = await AsyncEngine.start(args, pipeline_depth=depth)
    try:
        results = await asyncio.wait_for(
            asyncio.gather(
                *(
                    _run(engine, p, sp, f"r{i}")
                    for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
                )
            ),
            timeout=240,
        )
        for got, exp, sp in zip(results, expected, params, strict=True):
            assert got.tokens == exp.outputs[0].token_ids
            assert got.text == exp.outputs[0].text
            assert got.last.finish_reason == exp.outputs[0].finish_reason
            assert got.last.num_output_tokens == len(got.tokens)
            if sp.logprobs is not None:
                _same_rows(got.logprobs, exp.outputs[0].logprobs)
            else:
                assert got.logprobs == []
            if sp.prompt_logprobs is not None:
                _same_rows(got.prompt_logprobs, exp.prompt_logprobs[1:])
        assert any(sp.logprobs is not None for sp in params) and any(
            sp.prompt_logprobs for sp in params
        )
        bad_params = SamplingParams(logit_bias={10**6: 1.0})
        bad = await asyncio.wait_for(_run(engine, "hi", bad_params, "bad"), timeout=60)
        assert bad.last.finish_reason == "error" and "logit_bias" in bad.last.error
        stats = engine.stats()
        assert stats.num_running == 0 and stats.num_free_blocks == stats.num_blocks
    finally:
        run_dir = engine.launch.run_dir
        await engine.shutdown()
    assert engine.launch.process.poll() is not None  # no orphan process
    assert not os.path.exists(run_dir)  # no stale ipc files


async def test_killed_worker_ends_every_request_with_an_error_and_shuts_down(served):
    import signal
    import time

    engine = await AsyncEngine.start(EngineArgs(model=served.path, **served.kwargs))
    run_dir = engine.launch.run_dir
    params = SamplingParams(max_tokens=80, ignore_eos=True)
    first_token = asyncio.Event()

    async def consume(rid):
        last = None
        async for out in engine.generate("Once upon a time", params, rid):
            first_token.set()
            last = out
        return last

    tasks = [asyncio.create_task(consume(f"k{i}")) for i in range(8)]
    await asyncio.wait_for(first_token.wait(), timeout=60)
    engine.launch.process.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    finals = await asyncio.wait_for(asyncio.gather(*tasks), timeout=5)
    assert time.monotonic() - killed_at < 5
    assert all(f.finish_reason == "error" and "exited" in f.error for f in finals)
    assert not engine.is_healthy
    with pytest.raises(RuntimeError, match="not healthy"):
        async for _ in engine.generate("again", params, "late"):
            pass
    await engine.shutdown()  # idempotent after the watchdog's own shutdown
    assert engine.launch.process.poll() is not None
    await eventually(lambda: not os.path.exists(run_dir), 5, f"{run_dir} removed")


async def test_500_requests_with_random_aborts_leave_every_block_free(served):
    kwargs = {**served.kwargs, "max_num_seqs": 64}
    engine = await AsyncEngine.start(EngineArgs(model=served.path, **kwargs))
    rng = random.Random(9)

    async def client(i):
        params = SamplingParams(temperature=0.8, seed=i, max_tokens=rng.randint(1, 30))
        mode = rng.choice(["finish", "break", "abort"])
        stop_after = rng.randint(0, 5)
        await asyncio.sleep(rng.random() * 0.5)  # the behaviour under test: staggered arrivals
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

        def idle() -> bool:  # the last aborts and results have reached the scheduler
            stats = engine.stats()
            return stats.num_running == stats.num_waiting == engine.graph.scheduler.in_flight == 0

        await eventually(idle, 10, "nothing running, waiting or in flight")
        stats = engine.stats()
        engine.graph.scheduler.core.scheduler.check_integrity()
        engine.graph.block_manager.manager.check_integrity()  # the block manager's own tables
        assert stats.num_free_blocks == stats.num_blocks
        assert engine.is_healthy
    finally:
        await engine.shutdown()


async def test_n_sequences_stream_by_index_like_the_offline_engine(served):
    """n > 1 served as one sequence group: each sequence streams under its index, with
    the offline engine's tokens and text; a stop string ends only its own sequence;
    best_of > n returns the offline engine's n best, a beam search its n best beams
    (whole, with the prompt's logprobs on the first)."""
    beams = SamplingParams(
        use_beam_search=True, n=2, best_of=3, temperature=0, max_tokens=14, prompt_logprobs=1
    )
    params = [
        SamplingParams(n=3, temperature=0.9, seed=11, max_tokens=24),
        SamplingParams(n=2, temperature=0.0, max_tokens=12),
        SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=30, stop=["e"]),
        SamplingParams(n=2, best_of=4, temperature=1.0, seed=2, max_tokens=16),  # ranked
        beams,
    ]
    prompts = ["Once upon a time", "The little dog", "Lily and Ben", "One day", "The sun"]
    expected = LLM(served.path, **served.kwargs).generate(prompts, params, use_tqdm=False)
    engine = await AsyncEngine.start(EngineArgs(model=served.path, **served.kwargs))
    try:
        prompt_rows: dict[str, list] = {}

        async def run(prompt, sp, rid):
            tokens: dict[int, list[int]] = {}
            text: dict[int, str] = {}
            finish: dict[int, str] = {}
            async for out in engine.generate(prompt, sp, rid):
                tokens.setdefault(out.index, []).extend(out.token_ids)
                text[out.index] = text.get(out.index, "") + out.text
                prompt_rows.setdefault(rid, []).extend(out.prompt_logprobs or ())
                if out.finish_reason:
                    finish[out.index] = out.finish_reason
            return tokens, text, finish

        runs = (run(p, sp, f"g{i}") for i, (p, sp) in enumerate(zip(prompts, params, strict=True)))
        results = await asyncio.wait_for(asyncio.gather(*runs), timeout=240)
        for (tokens, text, finish), exp, sp in zip(results, expected, params, strict=True):
            assert sorted(tokens) == list(range(sp.n))
            for c in exp.outputs:
                assert tokens[c.index] == c.token_ids
                assert text[c.index] == c.text
                assert finish[c.index] == c.finish_reason
        beam_prompt = expected[4].prompt_token_ids
        assert [row[0].token_id for row in prompt_rows["g4"]] == beam_prompt[1:]
        # aborting a beam search mid-way (nothing has streamed yet) ends it at once
        searching = asyncio.create_task(
            run(
                "Once",
                SamplingParams(use_beam_search=True, n=4, max_tokens=100, temperature=0),
                "bs",
            )
        )
        await eventually(lambda: "bs" in engine._streams, 5, "the beam search's stream open")
        await engine.abort("bs")
        tokens, _, finish = await asyncio.wait_for(searching, timeout=30)
        assert finish == {-1: "abort"} and not any(tokens.values())
        # leaving a stream early aborts every sequence; all blocks come back
        stream = engine.generate(
            "Once", SamplingParams(n=4, seed=1, max_tokens=200, ignore_eos=True), "early"
        )
        await asyncio.wait_for(anext(stream), timeout=60)
        await stream.aclose()

        def all_free() -> bool:
            stats = engine.stats()
            return stats.num_free_blocks == stats.num_blocks and not stats.num_running

        await eventually(all_free, 5, "every block free and nothing running")
    finally:
        await engine.shutdown()


async def test_a_worker_that_cannot_load_fails_the_start_at_once(tmp_path):
    """The worker process exits (a model whose config loads but whose weights are
    missing): start() says so at once instead of waiting out its ready timeout, and
    leaves no process or run dir."""
    import time

    from actors.actor import ActorStartupError
    from actors.worker_launch import WorkerLaunch
    from tests.engine.tiny_models import save_hf_model

    save_hf_model("llama", tmp_path)
    for weights in tmp_path.glob("*.safetensors"):
        weights.unlink()
    args = EngineArgs(model=str(tmp_path), skip_tokenizer_init=True)
    launch = WorkerLaunch.start(args)
    started = time.monotonic()
    with pytest.raises(ActorStartupError, match="exited with code"):
        await AsyncEngine.start(args, ready_timeout=120, launch=launch)
    assert time.monotonic() - started < 60
    assert launch.process.poll() is not None and not os.path.exists(launch.run_dir)


@pytest.mark.timeout(120)
async def test_a_config_that_cannot_load_fails_the_start_with_its_error(tmp_path):
    """Both processes read the config; this one's error, which names the problem, is
    the one raised (not the worker's exit), and nothing is left behind."""
    import json

    from actors.worker_launch import WorkerLaunch

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NopeForCausalLM"]}))
    args = EngineArgs(model=str(tmp_path))
    launch = WorkerLaunch.start(args)
    with pytest.raises(ValueError, match="model_type"):
        await AsyncEngine.start(args, ready_timeout=120, launch=launch)
    assert launch.process.poll() is not None and not os.path.exists(launch.run_dir)


@pytest.mark.timeout(240)
async def test_an_engine_adopts_a_worker_launched_before_it(served):
    """A worker launched first (its model loading while the caller starts up) is adopted
    with the config the caller built: the engine serves, and shutdown leaves nothing. A
    launch for other arguments is refused and cleaned up."""
    from actors.worker_launch import WorkerLaunch

    args = EngineArgs(model=served.path, **served.kwargs)
    launch = WorkerLaunch.start(args)
    engine = await AsyncEngine.start(args, config=args.build(), launch=launch)
    try:
        params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
        got = await asyncio.wait_for(_run(engine, "Once upon", params, "early"), timeout=60)
        assert len(got.tokens) == 4 and got.last.finish_reason == "length"
    finally:
        await engine.shutdown()
    assert launch.process.poll() == 0 and not os.path.exists(launch.run_dir)
    other = WorkerLaunch.start(EngineArgs(model=served.path, **served.kwargs, seed=7))
    with pytest.raises(ValueError, match="other engine arguments"):
        await AsyncEngine.start(args, launch=other)
    assert other.process.poll() is not None and not os.path.exists(other.run_dir)
