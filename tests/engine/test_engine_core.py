"""EngineCore planning one step ahead of results gives the offline engine's outputs."""

from __future__ import annotations

import random
from collections import deque

import pytest

from engine import LLM, SamplingParams
from engine.block_manager import BlockManager
from engine.config import EngineArgs
from engine.engine_core import EngineCore
from engine.kv_cache import block_bytes
from engine.messages import AddRequest
from engine.worker import Worker, build_worker
from tests.engine.tiny_models import SMALL_ENGINE, VOCAB, random_prompts, save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-core")
    save_hf_model("llama", directory)
    return str(directory)


def run_pipelined(
    core: EngineCore, blocks: BlockManager, worker: Worker, depth: int, ranked: dict | None = None
) -> tuple[dict, int]:
    """Up to `depth` plans in flight; results delivered oldest first. Returns outputs and
    the number of tokens the worker computed that were thrown away; beam searches' whole
    outputs go to `ranked` (request id -> RankedSequences, best first)."""
    in_flight: deque = deque()
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    discarded = 0
    while core.has_unfinished or in_flight:
        plan = core.plan(blocks.apply) if len(in_flight) < depth else None
        if plan is not None:
            in_flight.append(worker.execute(plan))
            continue
        result = in_flight.popleft()
        deltas = core.on_result(result)
        for seq in deltas.ranked:
            ranked.setdefault(seq.request_id, []).append(seq)
        delivered = set(deltas.request_ids)
        discarded += sum(1 for s in result.sampled_ids if s not in delivered)
        for d in deltas.deltas():
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finish_reason:
                finish[d.request_id] = d.finish_reason
    flush = core.plan(blocks.apply)
    if flush is not None:
        worker.execute(flush)
    return outputs, discarded


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("kv_blocks", [None, 19])
def test_one_step_ahead_matches_offline(model_dir, depth, kv_blocks):
    kwargs = {**SMALL_ENGINE, "seed": 0, "max_num_batched_tokens": 24}
    offline = LLM(model_dir, **kwargs)
    if kv_blocks:
        kwargs["kv_cache_memory"] = block_bytes(offline.engine.config.model, 4) * kv_blocks
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

    args = EngineArgs(model=model_dir, **kwargs)
    config = args.build()
    worker, ready = build_worker(args)
    num_blocks = ready.num_blocks
    core = EngineCore(config.scheduler, num_blocks, 4, config.model.eos_token_ids)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        core.add_request(AddRequest(f"r{i}", tuple(p), sp, 0.0))
    blocks = BlockManager(num_blocks, 4)
    outputs, discarded = run_pipelined(core, blocks, worker, depth)

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
    from engine.worker import NullWorker

    core = EngineCore(
        SchedulerConfig(8, 64, 128), num_blocks=64, block_size=4, eos_token_ids=frozenset()
    )
    blocks, worker = BlockManager(64, 4), NullWorker(token_id=7)
    lengths = [1, 5, 12, 30]
    for i, n in enumerate(lengths):
        core.add_request(AddRequest(f"n{i}", (1, 2, 3), SamplingParams(max_tokens=n), 0.0))
    outputs, discarded = run_pipelined(core, blocks, worker, depth=2)
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
    args = EngineArgs(model=model_dir, **kwargs)
    config = args.build()
    worker, ready = build_worker(args)
    core = EngineCore(config.scheduler, ready.num_blocks, 4, frozenset(), True)
    blocks = BlockManager(ready.num_blocks, 4, True)
    rng = random.Random(12)
    system = [rng.randrange(VOCAB) for _ in range(13)]
    wave = [system + p for p in random_prompts(rng, 6, max_len=9)]
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    turns = [wave, wave]  # the second wave hits the first wave's blocks
    hits = []
    for turn, prompts in enumerate(turns):
        hits.append(core.scheduler.prefix_stats.hit_tokens)
        expected = offline.generate(prompts, params, use_tqdm=False)
        for i, p in enumerate(prompts):
            core.add_request(AddRequest(f"t{turn}-{i}", tuple(p), params, 0.0))
        outputs, _ = run_pipelined(core, blocks, worker, depth)
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
    assert blocks.num_free_blocks == ready.num_blocks
