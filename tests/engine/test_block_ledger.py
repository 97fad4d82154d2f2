"""The scheduler's BlockLedger against the block manager it mirrors."""

from __future__ import annotations

import random

import pytest

from engine.block_ledger import PENDING_BLOCK, BlockLedger, BlockLedgerError
from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.messages import BlockGrant, BlocksReserved
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler


def _exchange(ledger: BlockLedger, manager: BlockManager) -> int:
    """One exchange if there is traffic; returns how many messages went out (0 or 1)."""
    if not ledger.has_traffic:
        return 0
    ledger.apply(manager.reserve(ledger.take_traffic()))
    return 1


def test_new_blocks_are_pending_until_the_answer_names_them():
    ledger, manager = BlockLedger(8, 4), BlockManager(8, 4)
    assert ledger.allocate_slots("a", 6) and ledger.allocate_slots("b", 3)
    assert ledger.block_table("a") == [PENDING_BLOCK] * 2 and ledger.num_free_blocks == 5
    traffic = ledger.take_traffic()
    assert traffic.free_seq_ids == ()
    assert [(r.seq_id, r.num_tokens) for r in traffic.reservations] == [("a", 6), ("b", 3)]
    ledger.apply(manager.reserve(traffic))
    assert ledger.block_table("a") == manager.kv_cache.block_table("a") == [0, 1]
    assert ledger.block_table("b") == [2]
    # Growing within a block needs no traffic at all.
    assert ledger.allocate_slots("a", 8) and not ledger.has_traffic


def test_frees_and_reservations_of_one_step_travel_in_one_message():
    ledger, manager = BlockLedger(4, 4), BlockManager(4, 4)
    ledger.allocate_slots("a", 8)
    ledger.allocate_slots("b", 8)
    _exchange(ledger, manager)
    assert not ledger.allocate_slots("c", 4)  # full: refused locally, nothing sent
    ledger.free("a")
    assert ledger.allocate_slots("c", 4)
    ledger.allocate_slots("d", 1)
    ledger.free("d")  # reserved and freed before any exchange: never sent
    traffic = ledger.take_traffic()
    assert traffic.free_seq_ids == ("a",)
    assert [r.seq_id for r in traffic.reservations] == ["c"]
    ledger.apply(manager.reserve(traffic))
    assert ledger.block_table("c") == manager.kv_cache.block_table("c")
    manager.check_integrity()
    ledger.check_integrity({"b": 8, "c": 4})


def test_disagreement_with_the_block_manager_is_an_error():
    ledger = BlockLedger(4, 4)
    ledger.allocate_slots("a", 4)
    step = ledger.take_traffic().step_id
    with pytest.raises(BlockLedgerError, match="refused"):
        ledger.apply(BlocksReserved(step, (), ("a",), 4))
    with pytest.raises(BlockLedgerError, match="awaits 1"):
        ledger.apply(BlocksReserved(step, (BlockGrant("a", (0, 1)),), (), 2))
    with pytest.raises(BlockLedgerError, match="2 free blocks, the ledger counts 3"):
        ledger.apply(BlocksReserved(step, (BlockGrant("a", (0,)),), (), 2))


def _request(i: int, rng: random.Random) -> Request:
    prompt = [1] * rng.randint(1, 40)
    return Request(f"r{i}", None, prompt, SamplingParams(max_tokens=rng.randint(1, 20)), i)


def _twin(request: Request) -> Request:
    r = request
    return Request(r.request_id, None, list(r.prompt_token_ids), r.params, r.arrival_index)


def _table(ledger: BlockLedger, item) -> tuple[int, ...]:
    return tuple(ledger.block_table(item.request.request_id))


def _plan(sched: Scheduler):
    plan = sched.schedule()
    sched.advance(plan)
    return plan


def _sample(sched: Scheduler, plan, tokens: list[int]) -> None:
    for item in plan.scheduled:
        if item.samples:
            item.request.output_token_ids.append(tokens.pop())
            if item.request.num_output_tokens >= item.request.params.max_tokens:
                sched.finish_request(item.request.request_id, RequestStatus.FINISHED_LENGTH)


@pytest.mark.parametrize("seed", range(4))
def test_scheduler_on_a_ledger_plans_exactly_as_on_local_tables(seed):
    """Twin schedulers get the same adds, aborts and sampled tokens; one owns its blocks,
    the other plans on a ledger and exchanges with a block manager once per step. Their
    plans, block ids included, and preemptions must be identical."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    num_blocks = 64 // block_size + 1 + rng.randint(0, 20) // block_size  # tight: preempts
    config = SchedulerConfig(rng.randint(4, 12), rng.randint(8, 80), 64)
    local = Scheduler(config, KVCacheManager(num_blocks, block_size))
    ledger, manager = BlockLedger(num_blocks, block_size), BlockManager(num_blocks, block_size)
    remote = Scheduler(config, ledger)
    next_id, exchanges, steps = 0, 0, 0
    for _ in range(300):
        if rng.random() < 0.3:
            request = _request(next_id, rng)
            local.add_request(request)
            remote.add_request(_twin(request))
            next_id += 1
        if local.requests and rng.random() < 0.08:
            rid = rng.choice(sorted(local.requests))
            local.finish_request(rid, RequestStatus.FINISHED_ABORTED)
            remote.finish_request(rid, RequestStatus.FINISHED_ABORTED)
        tokens = [rng.randrange(100) for _ in range(config.max_num_seqs + 1)]
        a, b = _plan(local), _plan(remote)
        exchanges += _exchange(ledger, manager)
        steps += 1
        tables_b = [tuple(ledger.block_table(s.request.request_id)) for s in b.scheduled]
        plan_a = [
            (s.request.request_id, s.num_scheduled_tokens, tuple(s.block_table))
            for s in a.scheduled
        ]
        plan_b = [
            (s.request.request_id, s.num_scheduled_tokens, t)
            for s, t in zip(b.scheduled, tables_b, strict=True)
        ]
        assert plan_a == plan_b
        assert local.num_preemptions == remote.num_preemptions
        _sample(local, a, list(tokens))
        _sample(remote, b, list(tokens))
        exchanges += _exchange(ledger, manager)  # frees of finished requests
        remote.check_integrity()
        manager.check_integrity()
        assert manager.num_free_blocks == ledger.num_free_blocks == local.kv_cache.num_free_blocks
    assert exchanges <= 2 * steps
    assert local.num_preemptions > 0  # the preemption path was exercised
