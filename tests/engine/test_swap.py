"""Preemption by swapping: under a tiny KV budget, swap and recompute both give the
outputs of an unconstrained run, and swapped blocks never exceed the CPU swap space."""

from __future__ import annotations

import random

import pytest

from engine import LLM, EngineArgs, SamplingParams
from engine.block_manager import BlockManager
from engine.engine_core import EngineCore
from engine.messages import AddRequest
from engine.worker import build_worker
from tests.engine.test_engine_core import run_pipelined
from tests.engine.tiny_models import VOCAB, kv_memory, save_hf_model

BS = 4
MAX_LEN = 40


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-swap")
    save_hf_model("llama", directory)
    return str(directory)


def engine_kwargs(model_dir: str, num_blocks: int, swap_blocks: int = 0, **overrides) -> dict:
    per_block = kv_memory(model_dir, 1, BS)
    kw = dict(
        skip_tokenizer_init=True,
        block_size=BS,
        max_model_len=MAX_LEN,
        kv_cache_memory=per_block * num_blocks,
        enable_prefix_caching=False,
        seed=0,
    )
    if swap_blocks:
        kw |= dict(swap_space=per_block * swap_blocks / 1024**3, preemption_mode="swap")
    return kw | overrides


def workload(seed: int = 0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(VOCAB) for _ in range(rng.randint(3, 14))] for _ in range(10)]
    params = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=rng.randint(8, 20), ignore_eos=True)
        for i in range(10)
    ]
    return prompts, params


def outputs(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("swap_blocks", [64, 3])  # room for victims; too little: recompute
def test_swap_and_recompute_match_an_unconstrained_run(model_dir, swap_blocks):
    prompts, params = workload()
    plenty = outputs(LLM(model_dir, **engine_kwargs(model_dir, 400)), prompts, params)
    recompute = LLM(model_dir, **engine_kwargs(model_dir, 12))
    assert outputs(recompute, prompts, params) == plenty
    assert recompute.stats().num_preemptions > 0 and recompute.stats().num_swaps == 0
    swap = LLM(model_dir, **engine_kwargs(model_dir, 12, swap_blocks))
    engine = swap.engine
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    done, peak = {}, 0
    kv = engine.scheduler.kv_cache
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step()}
        peak = max(peak, kv.num_swapped_blocks)
        engine.scheduler.check_integrity()
    assert [done[f"r{i}"] for i in range(10)] == plenty
    stats = swap.stats()
    assert stats.num_swaps > 0
    assert 0 < peak <= kv.cpu_pool.num_blocks == swap_blocks
    if swap_blocks == 3:  # some victims did not fit the swap space and were recomputed
        assert stats.num_preemptions > stats.num_swaps
    assert kv.num_free_blocks == kv.num_blocks and kv.num_swapped_blocks == 0


@pytest.mark.parametrize("depth", [1, 2])
def test_swap_one_step_ahead_matches_offline(model_dir, depth):
    prompts, params = workload(1)
    plenty = outputs(LLM(model_dir, **engine_kwargs(model_dir, 400)), prompts, params)
    kw = engine_kwargs(model_dir, 12, 64)
    args = EngineArgs(model=model_dir, **kw)
    config = args.build()
    worker, ready = build_worker(args)
    assert ready.num_cpu_blocks == 64
    core = EngineCore(
        config.scheduler, ready.num_blocks, BS, frozenset(), False, ready.num_cpu_blocks, "swap"
    )
    blocks = BlockManager(ready.num_blocks, BS, False, 0, ready.num_cpu_blocks)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(AddRequest(f"r{i}", tuple(p), sp, 0.0))
    got, _ = run_pipelined(core, blocks, worker, depth)
    assert [got[f"r{i}"] for i in range(10)] == plenty
    assert core.scheduler.num_swaps > 0
    core.scheduler.check_integrity()
    blocks.check_integrity()
    assert blocks.kv_cache.num_swapped_blocks == 0


def test_swap_needs_swap_space():
    from engine.config import CacheConfig

    with pytest.raises(ValueError, match="swap_space > 0"):
        CacheConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode"):
        CacheConfig(preemption_mode="pause")
