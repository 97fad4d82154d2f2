"""The Orca baselines: reservation sizes, contiguous regions placed by a buddy allocator,
where the memory goes, and the Scheduler driving them."""

import random

import pytest

from engine.config import SchedulerConfig
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from engine.sampling_params import SamplingParams
from engine.sim.baselines.contiguous_kv_cache import ContiguousKVCacheManager
from engine.sim.baselines.reservation import ReservationPolicy, reservation_tokens
from engine.sim.memory_shares import KVMemoryShares
from tests.engine.hand_sampled import advance

MAX, POW2, ORACLE = ReservationPolicy.MAX, ReservationPolicy.POW2, ReservationPolicy.ORACLE


def make_kv(policy, num_blocks=16, block_size=4, max_model_len=64) -> ContiguousKVCacheManager:
    return ContiguousKVCacheManager(num_blocks, block_size, policy, max_model_len)


# -- reservation sizes ------------------------------------------------------------------
@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("policy", "prompt_len", "output_len", "max_model_len", "expected"),
    [
        (MAX, 10, 25, 2048, 2048),
        (POW2, 10, 25, 2048, 10 + 32),  # the paper's example: 25 outputs reserve 32
        (POW2, 10, 32, 2048, 10 + 32),
        (POW2, 10, 33, 2048, 10 + 64),
        (POW2, 10, 1, 2048, 11),
        (POW2, 100, 100, 200, 200),  # 100 + 128, capped at max_model_len
        (ORACLE, 10, 25, 2048, 35),
        (ORACLE, 100, 150, 200, 200),
    ],
)
def test_reservation_tokens(policy, prompt_len, output_len, max_model_len, expected):
    assert reservation_tokens(policy, prompt_len, output_len, max_model_len) == expected


@pytest.mark.timeout(10)
def test_reservation_policy_names_and_bad_lengths():
    assert [p.value for p in ReservationPolicy] == [
        "contiguous-max",
        "contiguous-pow2",
        "contiguous-oracle",
    ]
    assert ReservationPolicy("contiguous-pow2") is POW2
    with pytest.raises(ValueError, match="max_model_len"):
        reservation_tokens(ORACLE, 64, 1, 64)
    with pytest.raises(ValueError, match="output_len=0"):
        reservation_tokens(POW2, 8, 0, 64)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("policy", "run_blocks"), [(MAX, 16), (POW2, 4), (ORACLE, 2)])
def test_first_grow_reserves_the_region_later_grows_only_lengthen_the_table(policy, run_blocks):
    kv = make_kv(policy)  # 16 blocks of 4 slots, max_model_len 64
    kv.expect("a", 5, 3)  # MAX: 64 tokens; POW2: 5 + 4 = 9 -> 3 blocks; ORACLE: 8 -> 2
    assert kv.grow("a", 0) == [] and kv.num_free_blocks == 16  # nothing to hold yet
    assert kv.grow("a", 5) == [0, 1]
    assert kv.num_free_blocks == 16 - run_blocks
    assert kv.grow("a", 8) == [0, 1]
    assert kv.num_free_blocks == 16 - run_blocks  # within the reservation: no allocation
    assert kv.grow("a", kv.reservation("a") + 1) is None
    assert kv.block_table("a") == [0, 1]
    kv.check_integrity({"a": 8})
    kv.free("a")
    assert kv.block_table("a") == [] and kv.num_free_blocks == 16
    assert kv.grow("a", 2) == [0]  # still expected: a preempted request grows again
    with pytest.raises(ValueError, match=r"grow\('b'\): call expect"):
        kv.grow("b", 2)
    kv.check_integrity({"a": 2})


@pytest.mark.timeout(10)
def test_no_free_run_large_enough_is_none_and_changes_nothing():
    kv = make_kv(ORACLE)  # 16 blocks
    for i in range(16):
        kv.expect(f"s{i}", 3, 1)  # 4 tokens: one block each
        assert kv.grow(f"s{i}", 3) == [i]
    for i in range(0, 16, 2):
        kv.free(f"s{i}")
    kv.expect("big", 5, 3)  # 2 blocks: 8 are free, no two adjacent buddies
    assert kv.num_free_blocks == 8
    assert kv.grow("big", 5) is None
    assert kv.num_free_blocks == 8 and kv.block_table("big") == []
    kv.check_integrity()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("policy", list(ReservationPolicy))
def test_random_workload_regions_never_overlap_and_shares_add_up(policy):
    rng = random.Random(7)
    kv = make_kv(policy, num_blocks=100, block_size=4, max_model_len=48)
    total = 100 * 4
    tokens: dict[str, int] = {}
    for step in range(2000):
        if tokens and rng.random() < 0.3:
            seq = rng.choice(sorted(tokens))
            del tokens[seq]
            kv.free(seq)
        elif tokens and rng.random() < 0.5:
            seq = rng.choice(sorted(tokens))
            n = min(tokens[seq] + rng.randint(1, 8), kv.reservation(seq))
            assert kv.grow(seq, n) is not None
            tokens[seq] = n
        else:
            seq = f"s{step}"
            prompt_len = rng.randint(1, 30)
            kv.expect(seq, prompt_len, rng.randint(1, 47 - prompt_len + 1))
            if kv.grow(seq, prompt_len) is not None:
                tokens[seq] = prompt_len
        held = [b for seq in tokens for b in kv.block_table(seq)]
        assert len(held) == len(set(held)), f"step {step}: two tables share a block"
        kv.check_integrity(tokens)
        shares = kv.memory_shares()
        assert shares.total == total
        assert shares.token == sum(tokens.values())
        assert shares.free == kv.num_free_blocks * 4
        assert sum(shares.fractions().values()) == pytest.approx(1.0)
    assert kv.num_table_blocks() == sum(kv.blocks_for(n) for n in tokens.values())


@pytest.mark.timeout(10)
def test_memory_shares_by_hand():
    kv = make_kv(POW2)  # 16 blocks of 4 slots = 64 slots
    kv.expect("a", 5, 3)  # reserves 5 + 4 = 9 tokens -> 3 blocks -> a run of 4
    kv.grow("a", 6)
    kv.expect("b", 2, 1)  # reserves 2 + 1 = 3 tokens -> 1 block -> a run of 1
    kv.grow("b", 2)
    shares = kv.memory_shares()
    # a: 6 tokens; 2 more to come (needs 8); 1 reserved beyond need; 16 - 9 = 7 rounding
    # b: 2 tokens; 1 more to come; no over-reservation; 4 - 3 = 1 rounding
    assert shares == KVMemoryShares(token=8, reserved=3, internal=1, external=8, free=44)
    assert shares.total == 64 and shares.allocated == 20
    assert shares.used_by_tokens == pytest.approx(8 / 20)
    assert shares.fractions() == pytest.approx(
        {"token": 8 / 64, "reserved": 3 / 64, "internal": 1 / 64, "external": 8 / 64,
         "free": 44 / 64}
    )  # fmt: skip
    assert kv.num_allocated_slots() == 20
    kv.free("a")
    kv.free("b")
    assert kv.memory_shares() == KVMemoryShares(0, 0, 0, 0, 64)
    assert kv.memory_shares().used_by_tokens == 0.0


@pytest.mark.timeout(10)
def test_fork_copies_every_block_the_child_holds():
    kv = make_kv(ORACLE)
    kv.expect("p", 6, 4)  # 10 tokens -> 3 blocks -> a run of 4 at 0
    assert kv.grow("p", 6) == [0, 1]
    kv.expect("c", 6, 4)
    assert kv.fork("p", "c", 6) == [4, 5]  # its own region
    kv.check_integrity({"p": 6, "c": 6})
    assert kv.copy_on_write("c", 5) == [(0, 4), (1, 5)]  # all of them, not just from 5 on
    assert kv.copy_on_write("c", 5) == []  # nothing shared afterwards
    assert kv.block_table("p") == [0, 1]
    # a child without its own lengths inherits its parent's; fork(num_tokens=0): all
    assert kv.fork("p", "d") == [8, 9]
    assert kv.reservation("d") == kv.reservation("p")
    assert kv.copy_on_write("d", 0) == [(0, 8), (1, 9)]
    with pytest.raises(ValueError, match="already has a block table"):
        kv.fork("p", "d")
    kv.check_integrity({"p": 6, "c": 6, "d": 6})


@pytest.mark.timeout(10)
def test_fork_without_a_free_run_waits_for_copy_on_write():
    kv = make_kv(ORACLE, num_blocks=8)
    kv.expect("p", 6, 2)  # 8 tokens -> a run of 2 at 0
    kv.grow("p", 6)
    kv.expect("y", 6, 10)  # 16 tokens -> a run of 4 at 4
    kv.grow("y", 6)
    kv.expect("z", 6, 2)
    kv.grow("z", 6)  # a run of 2 at 2: nothing left
    assert kv.fork("p", "c") == []
    assert kv.copy_on_write("c", 5) is None
    kv.check_integrity()
    kv.free("z")
    assert kv.copy_on_write("c", 5) == [(0, 2), (1, 3)]
    kv.check_integrity({"p": 6, "c": 6})


@pytest.mark.timeout(10)
def test_swap_and_prefix_caching_are_refused_by_name():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        ContiguousKVCacheManager(16, 4, ORACLE, 64, enable_prefix_caching=True)
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        ContiguousKVCacheManager(16, 4, ORACLE, 64, num_cpu_blocks=8)
    kv = make_kv(ORACLE)
    kv.expect("a", 4, 4)
    kv.grow("a", 4)
    with pytest.raises(ValueError, match="preemption_mode='recompute'"):
        kv.swap_out("a")
    with pytest.raises(ValueError, match="preemption_mode='recompute'"):
        kv.swap_in("a")
    assert not kv.enable_prefix_caching
    assert kv.match_prefix("a", [1, 2, 3, 4]) == 0
    assert kv.reset_prefix_cache() == 0
    assert kv.num_swapped_blocks == 0 and kv.swapped_table("a") == []


# -- the Scheduler driving it -------------------------------------------------------------
def make_request(i: int, prompt_len: int, max_tokens: int) -> Request:
    return Request(f"r{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), i)


def make_scheduler(kv: ContiguousKVCacheManager, budget: int = 64) -> Scheduler:
    return Scheduler(SchedulerConfig(8, budget, kv.max_model_len), kv)


def run_to_completion(sched: Scheduler, max_steps: int = 200) -> list[int]:
    """Steps until every request finished, sampling a token wherever a plan samples;
    returns the number of running requests at each step."""
    kv, rng, running = sched.kv_cache, random.Random(0), []
    for _ in range(max_steps):
        if not sched.has_unfinished:
            return running
        plan = sched.schedule()
        advance(sched, plan)
        for item in plan.scheduled:
            if item.samples:
                item.request.output_token_ids.append(rng.randrange(100))
                if item.request.num_output_tokens >= item.request.params.max_tokens:
                    sched.finish_request(item.request.request_id, RequestStatus.FINISHED_LENGTH)
        running.append(len(sched.running))
        sched.check_integrity()
        assert kv.memory_shares().total == kv.num_blocks * kv.block_size
    raise AssertionError(f"unfinished after {max_steps} steps")


@pytest.mark.timeout(30)
@pytest.mark.parametrize(("policy", "most_running"), [(MAX, 1), (POW2, 4), (ORACLE, 4)])
def test_scheduler_admits_as_many_as_reservations_fit(policy, most_running):
    kv = make_kv(policy)  # 16 blocks of 4 slots; MAX reserves all 64 for one request
    sched = make_scheduler(kv)
    requests = [make_request(i, 6, 4) for i in range(4)]  # POW2/ORACLE: 10 tokens, run of 4
    for r in requests:
        kv.expect(r.request_id, r.num_prompt_tokens, r.params.max_tokens)
        sched.add_request(r)
    running = run_to_completion(sched)
    assert max(running) == most_running
    assert sched.num_preemptions == 0  # reservations cover every token: nobody grows out
    assert all(r.num_output_tokens == 4 for r in requests)
    assert kv.num_free_blocks == 16


@pytest.mark.timeout(30)
def test_scheduler_preempts_a_request_that_outgrows_its_reservation():
    kv = make_kv(ORACLE)
    sched = make_scheduler(kv)
    r0, r1 = make_request(0, 6, 4), make_request(1, 6, 4)
    kv.expect("r0", 6, 2)  # expects 2 outputs, will produce 4: its 8 slots run out
    kv.expect("r1", 6, 4)
    sched.add_request(r0)
    sched.add_request(r1)
    rng = random.Random(1)
    plan = sched.schedule()
    while not plan.preempted_ids:
        advance(sched, plan)
        for item in plan.scheduled:
            if item.samples:
                item.request.output_token_ids.append(rng.randrange(100))
        sched.check_integrity()
        plan = sched.schedule()
    assert plan.preempted_ids == ("r1", "r0")  # latest arrival first, then itself
    assert r0.num_tokens == 9 and kv.block_table("r0") == []
    assert [r.request_id for r in sched.waiting] == ["r0", "r1"]
    advance(sched, plan)
    kv.expect("r0", 6, 4)  # the longer length: recomputed into a larger region
    run_to_completion(sched)
    assert (r0.num_preemptions, r1.num_preemptions) == (1, 1)
    assert r0.num_output_tokens == 4 and r1.num_output_tokens == 4
    assert kv.num_free_blocks == 16
