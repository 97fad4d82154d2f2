"""Block pool and block tables without a model: allocation, sharing, integrity."""

import random

import pytest

from engine.kv.block_pool import BlockPool, NoFreeBlocksError
from engine.kv.kv_cache_manager import KVCacheManager


def test_allocate_and_free_round_trip():
    pool = BlockPool(8)
    blocks = pool.allocate(5)
    assert len(set(blocks)) == 5 and pool.num_free == 3
    pool.check_integrity({b: 1 for b in blocks})
    pool.free(blocks)
    assert pool.num_free == 8
    pool.check_integrity({})


def test_allocation_is_all_or_nothing():
    pool = BlockPool(4)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(2)
    assert pool.num_free == 1


def test_shared_block_returns_to_pool_after_last_owner():
    pool = BlockPool(4)
    [b] = pool.allocate(1)
    pool.fork([b])
    assert pool.ref_count(b) == 2
    pool.free([b])
    assert pool.num_free == 3 and pool.ref_count(b) == 1
    pool.free([b])
    assert pool.num_free == 4


def test_double_free_and_forking_a_free_block_are_errors():
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    with pytest.raises(ValueError, match="is free"):
        pool.fork([b])


def test_integrity_check_catches_a_leak():
    pool = BlockPool(3)
    pool.allocate(1)
    with pytest.raises(AssertionError):
        pool.check_integrity({})


def test_tables_grow_on_demand_and_waste_stays_below_one_block():
    rng = random.Random(0)
    for block_size in (1, 4, 16, 32):
        kv = KVCacheManager(num_blocks=4096, block_size=block_size)
        tokens: dict[str, int] = {}
        for step in range(300):
            seq = f"s{rng.randrange(20)}"
            grow = rng.randint(1, 40)
            assert kv.grow(seq, tokens.get(seq, 0) + grow) is not None
            tokens[seq] = tokens.get(seq, 0) + grow
            if rng.random() < 0.1:
                kv.free(seq)
                tokens.pop(seq)
            kv.check_integrity(tokens)
            for s, n in tokens.items():
                waste = len(kv.block_table(s)) * block_size - n
                assert 0 <= waste < block_size, (step, s, waste)


def test_failed_allocation_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.grow("a", 8) == [0, 1]
    assert kv.grow("b", 8) is None
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    kv.check_integrity({"a": 8})
