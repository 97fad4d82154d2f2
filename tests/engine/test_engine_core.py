"""EngineCore planning one step ahead of results gives the offline engine's outputs."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.core.engine_core import EngineCore
from engine.engine_args import EngineArgs
from engine.kv.block_ledger import BlockLedger
from engine.kv.block_manager import BlockManager
from engine.messages import AddRequest
from engine.wiring import EngineParts
from engine.worker.kv_cache import block_bytes
from tests.engine.pipelined import add_all, run_pipelined, served_parts
from tests.engine.tiny_models import SMALL_ENGINE, VOCAB, random_prompts, save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-core")
    save_hf_model("llama", directory)
    return str(directory)


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("kv_blocks", [None, 19])
def test_one_step_ahead_matches_offline(model_dir, depth, kv_blocks):
    kwargs = {**SMALL_ENGINE, "seed": 0, "max_num_batched_tokens": 24}
    offline = LLM(model_dir, **kwargs)
    if kv_blocks:
        kwargs["kv_cache_memory"] = block_bytes(offline.config.model, 4) * kv_blocks
        offline = LLM(model_dir, **kwargs)
    rng = random.Random(11)
    prompts = random_prompts(rng, 16)
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 1.0]),
            seed=i,
            max_tokens=rng.randint(1, 30),
            ignore_eos=True,
            stop_token_ids=[rng.randrange(VOCAB) for _ in range(8)],
        )
        for i in range(16)
    ]
    expected = offline.generate(prompts, params, use_tqdm=False)

    parts, worker = served_parts(EngineArgs(model=model_dir, **kwargs))
    core, blocks = parts.core, parts.block_manager
    num_blocks = blocks.num_blocks
    add_all(core, prompts, params)
    outputs, discarded = run_pipelined(parts, worker, depth)

    assert [outputs[f"r{i}"] for i in range(16)] == [o.outputs[0].token_ids for o in expected]
    stopped_early = sum(o.outputs[0].finish_reason == "stop" for o in expected)
    assert stopped_early > 0  # the stop-token path is exercised
    if depth == 1:
        assert discarded == 0
    else:
        # Plans really ran ahead (some early stops were found a step late), and each such
        # stop cost at most one thrown-away token.
        assert 0 < discarded <= stopped_early
    core.scheduler.check_integrity()
    blocks.check_integrity()
    assert blocks.num_free_blocks == num_blocks == core.blocks.num_free_blocks
    assert not worker.requests
    if kv_blocks:
        assert core.scheduler.num_preemptions > 0


def test_null_worker_drives_the_core_without_a_model():
    """The control-plane benchmark's worker: same plan protocol, a fixed token, no model."""
    from engine.config import SchedulerConfig
    from engine.worker.worker import NullWorker

    core = EngineCore(SchedulerConfig(8, 64, 128), BlockLedger(64, 4), frozenset())
    blocks, worker = BlockManager(64, 4), NullWorker(token_id=7)
    parts = EngineParts(core, None, blocks)
    lengths = [1, 5, 12, 30]
    for i, n in enumerate(lengths):
        core.add_request(AddRequest(f"n{i}", (1, 2, 3), SamplingParams(max_tokens=n), 0.0))
    outputs, discarded = run_pipelined(parts, worker, depth=2)
    assert [outputs[f"n{i}"] for i in range(4)] == [[7] * n for n in lengths]
    assert discarded == 0  # length limits are known at plan time: nothing runs past them
    blocks.check_integrity()
    assert blocks.num_free_blocks == 64 and not worker.requests


@pytest.mark.parametrize("depth", [1, 2])
def test_prefix_caching_one_step_ahead_matches_offline_without_it(model_dir, depth):
    """Waves of requests sharing prefixes, then next chat turns built from the first
    wave's outputs: the core (caching on, blocks registered when their tokens resolve)
    gives the offline engine's tokens (caching off) and really hits the cache."""
    kwargs = {**SMALL_ENGINE, "seed": 0, "max_num_batched_tokens": 24}
    offline = LLM(model_dir, **kwargs, enable_prefix_caching=False)
    parts, worker = served_parts(EngineArgs(model=model_dir, **kwargs, enable_prefix_caching=True))
    core, blocks = parts.core, parts.block_manager
    rng = random.Random(12)
    system = [rng.randrange(VOCAB) for _ in range(13)]
    wave = [system + p for p in random_prompts(rng, 6, max_len=9)]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    turns = [wave, wave]  # the second wave hits the first wave's blocks
    hits = []
    for turn, prompts in enumerate(turns):
        hits.append(core.scheduler.prefix_stats.hit_tokens)
        expected = offline.generate(prompts, params, use_tqdm=False)
        add_all(core, prompts, [params] * len(prompts), prefix=f"t{turn}-")
        outputs, _ = run_pipelined(parts, worker, depth)
        got = [outputs[f"t{turn}-{i}"] for i in range(len(prompts))]
        assert got == [o.outputs[0].token_ids for o in expected]
        if turn == 0:  # next chat turns: prompt + reply + a new message
            turns.append([p + o + [7, 8, 9] for p, o in zip(prompts, got, strict=True)])
            computed = [len(p) + len(o) - 1 for p, o in zip(prompts, got, strict=True)]
    hits.append(core.scheduler.prefix_stats.hit_tokens)
    assert hits[1] > 0  # later requests of the first wave share its system prompt
    assert hits[2] - hits[1] == sum((len(p) - 1) // 4 * 4 for p in wave)  # the same again
    # a next turn reuses every full block of the previous prompt and its reply
    assert hits[3] - hits[2] == sum(n // 4 * 4 for n in computed)
    core.scheduler.check_integrity()
    blocks.check_integrity()
    assert blocks.num_free_blocks == blocks.num_blocks
