"""Data parallelism's overhead: a ReplicaSet of 2 vs two separate AsyncEngines.

    from bench.scaling_dp import run_dp
    run_dp("builtin:tiny", num_requests=64, max_tokens=32)

(a) one `ReplicaSet` of two replicas is sent every request at once (distinct prompts,
    so the router splits them by load); (b) two separate `AsyncEngine`s are each sent
    half of the same requests at once, both running together. Every request decodes
    exactly `max_tokens` tokens (greedy, EOS ignored). The figure is output tokens per
    second from the first request sent to the last one finished; the target is (a)
    within 10% of (b) (`ratio` = a / b >= 0.9). Each system is warmed up (one short
    request per engine) before it is timed, and the two run one after the other, with
    the same worker placement (`launch_replicas`: on CUDA, one GPU per engine; on CPU,
    half the cores' threads each). (c) For the record, DP = 1: one engine given every
    request, its worker on every core (`one_engine_tok_s`).
"""

from __future__ import annotations

import asyncio
import os
import platform
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from actors.async_engine import AsyncEngine  # noqa: E402
from actors.replica_launch import launch_replicas  # noqa: E402
from actors.replica_set import ReplicaSet  # noqa: E402
from engine.engine_args import EngineArgs  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

NUM_REPLICAS = 2
WARM_UP = [1, 2, 3]  # token ids: every model reads them


def run_dp(
    model: str, num_requests: int, max_tokens: int, engine_kwargs: dict | None = None
) -> dict:
    """Output tokens/s of (a) a ReplicaSet of 2 and (b) two separate AsyncEngines given
    half the requests each, and their ratio a / b (see the module doc).
    `engine_kwargs`: more EngineArgs (kv_cache_memory, max_num_seqs, ...)."""
    if num_requests < NUM_REPLICAS or max_tokens < 1:
        raise ValueError(f"need num_requests >= {NUM_REPLICAS} and max_tokens >= 1")
    args = EngineArgs(model=model, **(engine_kwargs or {}))
    prompts = _prompts(num_requests, args.skip_tokenizer_init)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    one_engine = asyncio.run(_one_engine(args, prompts, params))
    replica_set = asyncio.run(_replica_set(args, prompts, params))
    separate = asyncio.run(_separate(args, prompts, params))
    return {
        "model": model,
        "num_requests": num_requests,
        "max_tokens": max_tokens,
        "one_engine_tok_s": one_engine,
        "replica_set_tok_s": replica_set,
        "separate_engines_tok_s": separate,
        "ratio": replica_set / separate,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
    }


def _prompts(num_requests: int, token_ids: bool) -> list[str] | list[list[int]]:
    """Distinct prompts (no shared prefix for the router to follow): texts, or 32 token
    ids each for a model without a tokenizer."""
    if token_ids:
        return [[10 + (i * 7 + j * 13) % 1000 for j in range(32)] for i in range(num_requests)]
    return [f"request {i}: a short story about the number {i}." for i in range(num_requests)]


async def _one_engine(args: EngineArgs, prompts: list, params: SamplingParams) -> float:
    """DP = 1, for the record: one engine, its worker on every core, every request."""
    engine = await AsyncEngine.start(args)
    try:
        await _tokens(engine, WARM_UP, params)
        return await _throughput([(engine, prompts)], params)
    finally:
        await engine.shutdown()


async def _replica_set(args: EngineArgs, prompts: list[str], params: SamplingParams) -> float:
    config = await asyncio.to_thread(args.build)
    replicas = await ReplicaSet.start(args, NUM_REPLICAS, config=config)
    try:
        await asyncio.gather(*(_tokens(r, WARM_UP, params) for r in replicas.replicas))
        return await _throughput([(replicas, prompts)], params)
    finally:
        await replicas.shutdown()


async def _separate(args: EngineArgs, prompts: list[str], params: SamplingParams) -> float:
    config = await asyncio.to_thread(args.build)
    launches = launch_replicas(args, NUM_REPLICAS, config.device.device)
    starts = [AsyncEngine.start(args, config=config, launch=launch) for launch in launches]
    engines = await asyncio.gather(*starts, return_exceptions=True)
    try:
        failed = [e for e in engines if isinstance(e, BaseException)]
        if failed:
            raise failed[0]
        await asyncio.gather(*(_tokens(e, WARM_UP, params) for e in engines))
        halves = [(e, prompts[i::NUM_REPLICAS]) for i, e in enumerate(engines)]
        return await _throughput(halves, params)
    finally:
        running = [e for e in engines if isinstance(e, AsyncEngine)]
        await asyncio.gather(*(e.shutdown() for e in running))
        for launch in launches:
            launch.abandon()


async def _throughput(work: list[tuple[object, list[str]]], params: SamplingParams) -> float:
    """Output tokens per second of every (engine, prompts) pair's prompts, all at once."""
    start = time.perf_counter()
    counts = await asyncio.gather(
        *(_tokens(engine, prompt, params) for engine, prompts in work for prompt in prompts)
    )
    return sum(counts) / (time.perf_counter() - start)


async def _tokens(engine, prompt: str, params: SamplingParams) -> int:
    """The output tokens of one request."""
    count = 0
    async for out in engine.generate(prompt, params):
        count += len(out.token_ids)
    return count
