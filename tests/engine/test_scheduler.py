"""Scheduler scenarios without a model: a fake executor appends tokens."""

import random

from engine.config import SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.kv.kv_cache_manager import KVCacheManager
from engine.sampling_params import SamplingParams
from tests.engine.hand_sampled import advance


def make_scheduler(num_blocks=64, block_size=4, max_seqs=8, budget=32, max_len=256):
    config = SchedulerConfig(max_seqs, budget, max_len)
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def make_request(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), i)


def run_step(sched: Scheduler, rng: random.Random) -> list[str]:
    """Schedule, 'execute', append a token where the plan samples; returns finished ids."""
    plan = sched.schedule()
    assert plan.num_scheduled_tokens <= sched.config.max_num_batched_tokens
    assert len(plan.scheduled) <= sched.config.max_num_seqs
    advance(sched, plan)
    finished = []
    for item in plan.scheduled:
        assert item.num_scheduled_tokens > 0
        if item.samples:
            item.request.output_token_ids.append(rng.randrange(100))
            if item.request.num_output_tokens >= item.request.params.max_tokens:
                sched.finish_request(item.request.request_id, RequestStatus.FINISHED_LENGTH)
                finished.append(item.request.request_id)
    sched.check_integrity()
    return finished


def test_chunked_prefill_respects_token_budget_and_finishes():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request(0, 30, 3))
    steps = 0
    while sched.has_unfinished:
        run_step(sched, random.Random(0))
        steps += 1
    assert steps == 4 + 2  # 30 prompt tokens in chunks of 8 (last one samples), 2 decodes


def test_decodes_are_served_before_new_prefills():
    sched = make_scheduler(budget=10)
    sched.add_request(make_request(0, 4, 10))
    run_step(sched, random.Random(0))
    sched.add_request(make_request(1, 40, 1))
    plan = sched.schedule()
    assert [(s.request.request_id, s.num_scheduled_tokens) for s in plan.scheduled] == [
        ("r0", 1),
        ("r1", 9),
    ]


def test_preemption_takes_latest_arrival_and_blocks_new_admissions():
    # 6 blocks of 4 tokens: two requests of 8 prompt tokens fill 4 blocks and then grow.
    sched = make_scheduler(num_blocks=6, block_size=4, budget=64, max_len=24)
    for i in range(2):
        sched.add_request(make_request(i, 8, 12))
    rng = random.Random(1)
    plan = sched.schedule()
    while not plan.preempted_ids:
        advance(sched, plan)
        _sample(sched, plan, rng)
        plan = sched.schedule()
    assert plan.preempted_ids == ("r1",)  # the most recent arrival gives its blocks back
    assert [s.request.request_id for s in plan.scheduled] == ["r0"]
    advance(sched, plan)
    _sample(sched, plan, rng)
    sched.add_request(make_request(9, 2, 1))  # fits in the free block, but r1 waits first
    assert list(r.request_id for r in sched.waiting) == ["r1", "r9"]
    while sched.requests["r1"].status != RequestStatus.RUNNING:
        plan = sched.schedule()
        ids = [s.request.request_id for s in plan.scheduled]
        assert "r9" not in ids or ids.index("r1") < ids.index("r9")  # never ahead of r1
        advance(sched, plan)
        _sample(sched, plan, rng)
        sched.check_integrity()
    while sched.has_unfinished:
        plan = sched.schedule()
        advance(sched, plan)
        _sample(sched, plan, rng)
        sched.check_integrity()
    assert sched.kv_cache.num_free_blocks == 6


def _sample(sched, plan, rng):
    for item in plan.scheduled:
        if item.samples and item.request.status == RequestStatus.RUNNING:
            item.request.output_token_ids.append(rng.randrange(100))
            if item.request.num_output_tokens >= item.request.params.max_tokens:
                sched.finish_request(item.request.request_id, RequestStatus.FINISHED_LENGTH)


def test_preempted_request_recomputes_its_known_tokens():
    sched = make_scheduler(num_blocks=5, block_size=4, budget=64)
    sched.add_request(make_request(0, 8, 12))
    sched.add_request(make_request(1, 8, 12))
    rng = random.Random(2)
    while not sched.num_preemptions:
        plan = sched.schedule()
        advance(sched, plan)
        _sample(sched, plan, rng)
    victim = sched.requests["r1"]
    assert victim.status == RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    known = victim.num_tokens
    assert known > 8  # its outputs are kept and recomputed as known tokens
    while victim.status != RequestStatus.RUNNING:
        plan = sched.schedule()
        advance(sched, plan)
        _sample(sched, plan, rng)
    assert victim.num_output_tokens == known - 8 + 1  # exactly one new token once caught up


def test_random_add_finish_abort_keeps_integrity():
    rng = random.Random(1234)
    for trial in range(5):
        block_size = rng.choice([1, 4, 16])
        sched = make_scheduler(
            num_blocks=rng.randint(40, 200) // block_size + 64 // block_size + 1,
            block_size=block_size,
            max_seqs=rng.randint(1, 12),
            budget=rng.randint(8, 80),
            max_len=64,
        )
        next_id = 0
        for _ in range(400):
            if rng.random() < 0.3:
                sched.add_request(make_request(next_id, rng.randint(1, 40), rng.randint(1, 20)))
                next_id += 1
            if sched.requests and rng.random() < 0.05:
                rid = rng.choice(list(sched.requests))
                sched.finish_request(rid, RequestStatus.FINISHED_ABORTED)
                sched.check_integrity()
            run_step(sched, rng)
            for r in sched.running:
                table = sched.kv_cache.block_table(r.request_id)
                assert len(table) * block_size - r.num_computed_tokens < block_size
        while sched.has_unfinished:
            run_step(sched, rng)
        assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks, trial


def test_finished_request_frees_blocks_at_once():
    sched = make_scheduler()
    sched.add_request(make_request(0, 10, 5))
    run_step(sched, random.Random(0))
    assert sched.kv_cache.num_free_blocks < sched.kv_cache.num_blocks
    sched.finish_request("r0", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_blocks
    assert sched.finish_request("r0", RequestStatus.FINISHED_ABORTED) is None
