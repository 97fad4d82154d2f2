"""The scheduler's BlockLedger (a logging replica) against the block manager."""

from __future__ import annotations

import random

import pytest

from engine.config import SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.kv.block_ledger import BlockLedger, BlockLedgerError
from engine.kv.block_manager import BlockManager
from engine.kv.kv_cache_manager import KVCacheManager
from engine.messages import BlockOpsApplied
from engine.sampling_params import SamplingParams
from tests.engine.hand_sampled import advance


def _exchange(ledger: BlockLedger, manager: BlockManager) -> int:
    """One exchange if there is traffic; returns how many messages went out (0 or 1)."""
    if not ledger.has_traffic:
        return 0
    ledger.apply(manager.apply(ledger.take_traffic()))
    return 1


def test_the_replica_knows_block_ids_at_once_and_the_manager_agrees():
    ledger, manager = BlockLedger(8, 4), BlockManager(8, 4)
    assert ledger.grow("a", 6) == [0, 1] and ledger.grow("b", 3) == [2]
    assert ledger.block_table("a") == [0, 1] and ledger.num_free_blocks == 5
    traffic = ledger.take_traffic()
    assert [(op.kind, op.seq_id, op.num) for op in traffic.ops] == [
        ("grow", "a", 6),
        ("grow", "b", 3),
    ]
    ledger.apply(manager.apply(traffic))
    assert manager.kv_cache.block_table("a") == [0, 1]
    assert manager.kv_cache.block_table("b") == [2]
    # Growing within a block needs no traffic at all.
    assert ledger.grow("a", 8) == [0, 1] and not ledger.has_traffic


def test_every_change_of_one_step_travels_in_order_in_one_message():
    ledger, manager = BlockLedger(6, 4, enable_prefix_caching=True), None
    manager = BlockManager(6, 4, enable_prefix_caching=True)
    tokens = list(range(9))
    ledger.grow("a", 9)
    ledger.cache_computed("a", lambda i, j: tokens[i:j], 9)
    ledger.fork("a", "b")
    assert ledger.copy_on_write("b", 9) is not None
    assert ledger.match_prefix("c", tokens) == 8
    ledger.free("a")
    traffic = ledger.take_traffic()
    assert [op.kind for op in traffic.ops] == ["grow", "cache", "fork", "cow", "match", "free"]
    ledger.apply(manager.apply(traffic))
    for seq in ("b", "c"):
        assert manager.kv_cache.block_table(seq) == ledger.block_table(seq)
    manager.check_integrity()
    ledger.check_integrity()


def test_disagreement_with_the_block_manager_is_an_error():
    ledger = BlockLedger(4, 4)
    ledger.grow("a", 4)
    exchange = ledger.take_traffic().exchange_id
    with pytest.raises(BlockLedgerError, match="has ids \\[1\\], 3 free"):
        ledger.apply(BlockOpsApplied(exchange, (1,), 3, 0))
    ledger.grow("b", 4)
    exchange = ledger.take_traffic().exchange_id
    with pytest.raises(BlockLedgerError, match="no room"):
        ledger.apply(BlockOpsApplied(exchange, (), 2, 0, "op grow 'b': no room"))
    with pytest.raises(BlockLedgerError, match="unexpected answer"):
        ledger.apply(BlockOpsApplied(99, (), 2, 0))


def test_a_diverged_block_manager_names_the_op_it_could_not_apply():
    ledger, manager = BlockLedger(4, 4), BlockManager(4, 4)
    manager.kv_cache.grow("intruder", 16)  # the manager's tables differ from the replica's
    ledger.grow("a", 4)
    reply = manager.apply(ledger.take_traffic())
    assert reply.error is not None and "grow 'a'" in reply.error
    with pytest.raises(BlockLedgerError, match="grow 'a'"):
        ledger.apply(reply)


def _request(i: int, rng: random.Random) -> Request:
    prompt = [rng.randrange(2) for _ in range(rng.randint(1, 40))]  # prefixes repeat
    return Request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(1, 20)), i)


def _twin(request: Request) -> Request:
    r = request
    return Request(r.request_id, list(r.prompt_token_ids), r.params, r.arrival_index)


def _table(ledger: BlockLedger, item) -> tuple[int, ...]:
    return tuple(ledger.block_table(item.request.request_id))


def _plan(sched: Scheduler):
    plan = sched.schedule()
    advance(sched, plan)
    return plan


def _rows(plan) -> list[tuple]:
    return [
        (s.request.request_id, s.num_computed_tokens, s.num_scheduled_tokens, tuple(s.block_table))
        for s in plan.scheduled
    ]


def _sample(sched: Scheduler, plan, tokens: list[int]) -> None:
    for item in plan.scheduled:
        if item.samples:
            item.request.output_token_ids.append(tokens.pop())
            if item.request.num_output_tokens >= item.request.params.max_tokens:
                sched.finish_request(item.request.request_id, RequestStatus.FINISHED_LENGTH)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_scheduler_on_a_ledger_plans_exactly_as_on_local_tables(seed, caching):
    """Twin schedulers get the same adds, aborts and sampled tokens; one owns its blocks,
    the other plans on a ledger and exchanges with a block manager once per step. Their
    plans, block ids and prefix hits included, and preemptions must be identical."""
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    num_blocks = 64 // block_size + 1 + rng.randint(0, 20) // block_size  # tight: preempts
    config = SchedulerConfig(rng.randint(4, 12), rng.randint(8, 80), 64)
    local = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching))
    ledger = BlockLedger(num_blocks, block_size, enable_prefix_caching=caching)
    manager = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
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
        tokens = [rng.randrange(3) for _ in range(config.max_num_seqs + 1)]
        a, b = _plan(local), _plan(remote)
        exchanges += _exchange(ledger, manager)
        steps += 1
        plan_a = [
            (
                s.request.request_id,
                s.num_computed_tokens,
                s.num_scheduled_tokens,
                tuple(s.block_table),
            )
            for s in a.scheduled
        ]
        plan_b = [
            (
                s.request.request_id,
                s.num_computed_tokens,
                s.num_scheduled_tokens,
                tuple(s.block_table),
            )
            for s in b.scheduled
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
    assert (local.prefix_stats.hit_tokens > 0) == caching
    assert local.prefix_stats == remote.prefix_stats
