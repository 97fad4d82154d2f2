"""The scheduler's lookahead slots under random accept/reject patterns.

A worker without a model proposes a random number of drafts (up to the row's lookahead
and its table's room) and accepts a random leading run of them; the engine core plans
on a block ledger whose every exchange a block manager replays, in step and one step
ahead, with prefix caching, n=2 forks, length limits, aborts and preemption by
recompute or swap. After every result: the core's integrity check (each running table
holds exactly its computed tokens plus the slots its steps in flight reserved), the two
replicas' tables equal, no block owned twice; each request's tokens are exactly what
the worker sampled for it; at the end every block is free.
"""

from __future__ import annotations

import random
from collections import deque

import pytest

from engine.config import PreemptionMode, SchedulerConfig
from engine.core.stop_checker import max_num_tokens
from engine.kv.block_ledger import BlockLedger
from engine.kv.block_manager import BlockManager
from engine.messages import AddRequest
from engine.sampling_params import SamplingParams
from engine.speculative_config import SpeculativeConfig
from engine.wiring import build_core
from engine.worker.model_output import ModelOutput, Verified
from engine.worker.worker import Worker

pytestmark = pytest.mark.timeout(120)

BLOCK, NUM_BLOCKS, MAX_LEN, K = 4, 24, 48, 3


class RandomDrafter(Worker):
    """A worker without a model: drafts of random length, a random run accepted, random
    tokens; it records every token it emitted per request (the truth to compare)."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__(None, proposer=self)
        self.rng = rng
        self.emitted: dict[str, list[int]] = {}

    def _propose_all(self, rows: list[tuple[str, int]]) -> None:
        for request_id, k in rows:
            request = self.requests[request_id]
            slots = len(self.block_tables[request_id]) * BLOCK
            limit = max_num_tokens(request.params, request.num_prompt_tokens, MAX_LEN)
            room = min(slots - request.num_tokens, limit - request.num_tokens - 1, k)
            if room > 0:
                count = self.rng.randint(0, room)
                request.draft_token_ids = [self.rng.randrange(50) for _ in range(count)]

    def _run(self, step):
        sampled, verified = {}, {}
        for s in step.scheduled:
            request = s.request
            if not s.samples:
                continue
            drafts = request.draft_token_ids
            slots = len(self.block_tables[request.request_id]) * BLOCK
            assert s.num_computed_tokens + s.num_scheduled_tokens <= slots  # room to write
            rid = request.request_id
            sampled[rid] = self.rng.randrange(50)
            if drafts:
                accepted = drafts[: self.rng.randint(0, len(drafts))]
                verified[rid] = Verified(len(drafts), accepted)
                self.emitted.setdefault(rid, []).extend(accepted)
            self.emitted.setdefault(rid, []).append(sampled[rid])
        return ModelOutput(sampled, verified=verified)

    def after_step(self, request) -> None:
        pass


def run(seed: int, depth: int, mode: PreemptionMode, caching: bool) -> None:
    rng = random.Random(seed)
    tables = dict(
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK,
        enable_prefix_caching=caching,
        num_cpu_blocks=64 if mode is PreemptionMode.SWAP else 0,
    )
    ledger, manager = BlockLedger(**tables), BlockManager(**tables)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=24, max_model_len=MAX_LEN)
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": K})
    core = build_core(config, ledger, preemption_mode=mode, speculative=spec)
    worker = RandomDrafter(rng)
    shared = [rng.randrange(50) for _ in range(9)]
    for i in range(14):
        prompt = (shared if i % 2 else [])[: rng.randint(0, 9)]
        prompt = prompt + [rng.randrange(50) for _ in range(rng.randint(1, 14))]
        params = SamplingParams(
            temperature=0, max_tokens=rng.randint(1, 30), ignore_eos=True, n=2 if i % 5 == 0 else 1
        )
        core.add_request(AddRequest(f"r{i}", tuple(prompt), params, 0.0))
    outputs: dict[str, list[int]] = {}
    in_flight: deque = deque()
    aborted: set[str] = set()
    while core.has_unfinished or in_flight:
        plan = core.plan(manager.apply) if len(in_flight) < depth else None
        if plan is not None:
            in_flight.append(worker.execute(plan))
            continue
        deltas = core.on_result(in_flight.popleft())
        for d in deltas.deltas():
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
        if rng.random() < 0.02 and core.scheduler.running:
            victim = rng.choice(core.scheduler.running).request_id
            core.abort(victim)
            aborted.add(victim)
        traffic = core.block_traffic()  # the trims (and frees) this result made
        if traffic is not None:
            core.on_block_ops_applied(manager.apply(traffic))
        core.check_integrity()
        manager.check_integrity()
        for r in core.scheduler.running:
            assert manager.kv_cache.block_table(r.request_id) == ledger.block_table(r.request_id)
    flush = core.plan(manager.apply)
    if flush is not None:
        worker.execute(flush)
    stats = core.stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_draft_tokens > stats.spec_decode_num_accepted_tokens
    for rid, tokens in outputs.items():
        if rid not in aborted:  # the worker emitted these, then maybe more past a limit
            assert worker.emitted[rid][: len(tokens)] == tokens
    ledger.check_integrity()
    manager.check_integrity()
    assert ledger.num_free_blocks == NUM_BLOCKS and manager.num_free_blocks == NUM_BLOCKS
    assert ledger.num_swapped_blocks == 0
    assert all(r.status.is_finished for r in core.scheduler.requests.values())
    assert not core.scheduler._lookahead_steps
    return stats


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.SWAP])
def test_random_accept_patterns_keep_the_blocks_exact(seed, depth, mode):
    stats = run(seed, depth, mode, caching=seed % 2 == 0)
    assert stats.num_preemptions > 0  # the cache is tight
    assert (stats.num_swaps > 0) == (mode is PreemptionMode.SWAP)


def test_draft_slots_never_preempt_a_sequence():
    """Two prompts of 6 tokens fill a cache of 4 blocks of 4: their decoding steps fit,
    the 3 draft slots each would want do not, so they decode without drafts and nobody
    is preempted for them."""
    from engine.kv.kv_cache_manager import KVCacheManager
    from engine.worker.worker import NullWorker

    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=16)
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 3})
    core = build_core(config, KVCacheManager(4, BLOCK), speculative=spec)
    for i in range(2):
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        core.add_request(AddRequest(f"r{i}", tuple(range(6)), params, 0.0))
    worker = NullWorker()
    while core.has_unfinished:
        plan = core.plan()
        core.on_result(worker.execute(plan))
        core.check_integrity()
    stats = core.stats()
    assert stats.num_preemptions == 0 and stats.num_steps == 2  # prefill, then one decode
