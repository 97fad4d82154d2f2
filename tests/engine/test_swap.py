"""Preemption by swapping: under a tiny KV budget, swap and recompute both give the
outputs of an unconstrained run, and swapped blocks never exceed the CPU swap space."""

from __future__ import annotations

import random

import pytest

from engine import LLM, EngineArgs, SamplingParams
from tests.engine.pipelined import add_all, run_pipelined, served_parts
from tests.engine.pipelined import swap_engine_kwargs as engine_kwargs
from tests.engine.tiny_models import VOCAB, save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-swap")
    save_hf_model("llama", directory)
    return str(directory)


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
    kv = engine.core.scheduler.kv_cache
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step()}
        peak = max(peak, kv.num_swapped_blocks)
        engine.check_integrity()
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
    parts, worker = served_parts(EngineArgs(model=model_dir, **engine_kwargs(model_dir, 12, 64)))
    core, blocks = parts.core, parts.block_manager
    assert blocks.kv_cache.cpu_pool.num_blocks == 64
    add_all(core, prompts, params)
    got, _ = run_pipelined(parts, worker, depth)
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
