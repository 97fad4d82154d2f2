"""The buddy allocator: power-of-two runs, lowest address first, coalescing, and the
external fragmentation it leaves."""

import random

import pytest

from engine.sim.baselines.buddy_allocator import BuddyAllocator


def roots(num_blocks: int) -> list[tuple[int, int]]:
    """(start, size) of the maximal power-of-two roots covering `num_blocks`, largest first."""
    sizes = [1 << k for k in reversed(range(num_blocks.bit_length())) if num_blocks >> k & 1]
    return [(sum(sizes[:i]), size) for i, size in enumerate(sizes)]


def largest_free_run(buddy: BuddyAllocator) -> int:
    """Blocks in the largest run `allocate` can hand out now (0 when none is free)."""
    return max((size for _, size in buddy.free_runs()), default=0)


@pytest.mark.timeout(10)
def test_non_power_of_two_is_covered_by_maximal_roots():
    buddy = BuddyAllocator(100)
    assert roots(100) == [(0, 64), (64, 32), (96, 4)]
    assert buddy.free_runs() == roots(100)
    assert largest_free_run(buddy) == 64
    assert [buddy.allocate(n) for n in (64, 17, 3)] == [0, 64, 96]  # 17 -> 32, 3 -> 4
    assert buddy.num_free == 0
    assert buddy.allocate(1) is None
    buddy.check_integrity()
    for start in (64, 0, 96):
        buddy.free(start)
        buddy.check_integrity()
    assert buddy.free_runs() == roots(100)


@pytest.mark.timeout(10)
def test_runs_round_up_to_powers_of_two_and_split_lowest_address_first():
    buddy = BuddyAllocator(16)
    assert buddy.allocate(3) == 0  # 4 blocks
    assert buddy.run_size(0) == 4
    assert buddy.allocate(1) == 4
    assert buddy.allocate(1) == 5
    assert buddy.allocate(2) == 6
    assert buddy.allocate(5) == 8  # 8 blocks
    assert buddy.num_free == 0 and buddy.num_allocated == 16
    buddy.free(5)
    buddy.free(0)
    assert buddy.free_runs() == [(0, 4), (5, 1)]
    assert buddy.allocate(1) == 5  # the smallest run that fits, before splitting a larger
    buddy.check_integrity()


@pytest.mark.timeout(10)
def test_free_coalesces_buddies_up_to_the_root():
    buddy = BuddyAllocator(8)
    starts = [buddy.allocate(1) for _ in range(8)]
    assert starts == list(range(8))
    for s in (1, 2, 5, 6):
        buddy.free(s)
    assert buddy.free_runs() == [(1, 1), (2, 1), (5, 1), (6, 1)]  # no two are buddies
    buddy.free(3)  # 2+3 merge, then can't go further: 0..1 is half taken
    assert buddy.free_runs() == [(1, 1), (2, 2), (5, 1), (6, 1)]
    buddy.free(0)  # 0+1, then 0..1 + 2..3
    assert buddy.free_runs() == [(0, 4), (5, 1), (6, 1)]
    buddy.free(4)
    buddy.free(7)
    assert buddy.free_runs() == [(0, 8)]
    buddy.check_integrity()


@pytest.mark.timeout(10)
def test_enough_free_blocks_but_no_run_is_external_fragmentation():
    buddy = BuddyAllocator(16)
    for _ in range(16):
        buddy.allocate(1)
    for s in range(0, 16, 2):
        buddy.free(s)
    assert buddy.num_free == 8
    assert largest_free_run(buddy) == 1
    assert buddy.allocate(2) is None  # 8 free blocks, no two adjacent buddies
    assert buddy.num_free == 8
    buddy.free(1)  # 0 and 1 merge into a run of 2
    assert buddy.allocate(2) == 0
    buddy.check_integrity()


@pytest.mark.timeout(10)
def test_misuse_is_refused():
    buddy = BuddyAllocator(4)
    with pytest.raises(ValueError, match="n >= 1"):
        buddy.allocate(0)
    assert buddy.allocate(5) is None  # larger than any root
    start = buddy.allocate(2)
    buddy.free(start)
    with pytest.raises(ValueError, match="allocated run"):
        buddy.free(start)  # double free
    with pytest.raises(ValueError, match="allocated run"):
        buddy.free(3)
    with pytest.raises(ValueError, match="num_blocks"):
        BuddyAllocator(0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_blocks", [1, 7, 16, 100, 257, 1000])
def test_random_allocations_never_overlap_and_coalesce_back(num_blocks):
    rng = random.Random(num_blocks)
    buddy = BuddyAllocator(num_blocks)
    owner = [None] * num_blocks  # which run holds each block, checked independently
    live: dict[int, int] = {}  # start -> size
    for step in range(3000):
        if live and rng.random() < 0.45:
            start = rng.choice(sorted(live))
            size = live.pop(start)
            buddy.free(start)
            for b in range(start, start + size):
                owner[b] = None
        else:
            n = rng.randint(1, max(1, num_blocks // 4))
            size = 1 << (n - 1).bit_length()
            largest = largest_free_run(buddy)
            start = buddy.allocate(n)
            if start is None:
                assert largest < size, f"step {step}: a free run of {largest} fits {n}"
                continue
            assert buddy.run_size(start) == size
            assert start % size == 0
            for b in range(start, start + size):
                assert owner[b] is None, f"step {step}: block {b} handed out twice"
                owner[b] = start
            live[start] = size
        assert buddy.num_free == owner.count(None)
        buddy.check_integrity()
    for start in list(live):
        buddy.free(start)
    buddy.check_integrity()
    assert buddy.free_runs() == roots(num_blocks)  # one free run per root
    assert buddy.num_free == num_blocks
