"""Recurrent (linear-attention) KV cache groups: a state per sequence, kept in the page of
the block holding its last computed token, over the hybrid allocator's one pool."""

from __future__ import annotations

import pytest

from engine.kv.hybrid_kv_cache_manager import NULL_BLOCK, HybridKVCacheManager
from engine.kv.kv_cache_groups import RECURRENT_WINDOW, KVCacheGroupKind, KVCacheLayout
from tests.engine.test_hybrid_kv_cache import random_walk

RECURRENT, FULL = KVCacheGroupKind.RECURRENT, KVCacheGroupKind.FULL_ATTENTION


def qwen3_5_like(num_layers: int = 8) -> KVCacheLayout:
    """Three linear-attention layers to one full-attention layer."""
    recurrent = [i for i in range(num_layers) if i % 4 != 3]
    return KVCacheLayout.from_windows([None] * num_layers, recurrent)


def two_groups() -> KVCacheLayout:
    """A linear-attention layer (group 0), then a full-attention one (group 1)."""
    return KVCacheLayout.from_windows([None, None], [0])


def test_linear_attention_layers_make_recurrent_groups_of_the_full_groups_size():
    layout = KVCacheLayout.from_windows([None] * 48, [i for i in range(48) if i % 4 != 3])
    assert [g.kind for g in layout.groups].count(RECURRENT) == 3
    assert [g.kind for g in layout.groups].count(FULL) == 1
    assert layout.layers_per_group == 12 and layout.padding_share == 0
    assert layout.recurrent_layers == frozenset(i for i in range(48) if i % 4 != 3)
    assert all(g.window == RECURRENT_WINDOW for g in layout.groups if g.kind is RECURRENT)
    assert layout.is_hybrid


def test_a_recurrent_group_keeps_only_the_last_computed_tokens_block_on():
    kv = HybridKVCacheManager(40, 4, layout=two_groups())
    kv.grow("a", 10)  # a 10-token chunk
    computed = 10
    for _ in range(30):  # decode
        kv.slide("a", computed)
        kv.grow("a", computed + 1)
        recurrent, full = kv.group_tables("a")
        live = [i for i, b in enumerate(recurrent) if b != NULL_BLOCK]
        assert live == list(range((computed - 1) // 4, len(recurrent)))  # read, write
        assert NULL_BLOCK not in full
        computed += 1
        kv.check_integrity({"a": computed})
    assert kv.blocks_for(41, num_computed=40) == 11 + 2  # full: 11; recurrent: read 9, write 10
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks


def test_a_prefix_hit_needs_only_the_recurrent_groups_last_hit_block():
    kv = HybridKVCacheManager(40, 4, layout=two_groups(), enable_prefix_caching=True)
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks
    kv.grow("a", 30)
    kv.cache_computed("a", lambda s, e: prompt[s:e], 30)
    kv.slide("a", 30)  # the recurrent group lets blocks 0..6 go (cached, free)
    kv.free("a")
    hit = kv.match_prefix("b", prompt + [1, 2])
    assert hit == 28
    recurrent, full = kv.group_tables("b")
    assert NULL_BLOCK not in full and len(full) == 7
    assert recurrent[:6] == [NULL_BLOCK] * 6 and recurrent[6] != NULL_BLOCK  # state at 28
    kv.check_integrity({"b": 28})


def test_a_query_can_be_recomputed_only_from_a_block_boundary():
    """The page of a block holds the state after its last computed token: a follower
    that recomputes the prompt's last token from a shared table must start a block."""
    kv = HybridKVCacheManager(30, 4, layout=two_groups())
    kv.grow("a", 9)
    assert kv.sees_context("a", 8) and kv.sees_context("a", 4) and kv.sees_context("a", 0)
    assert not kv.sees_context("a", 7) and not kv.sees_context("a", 5)


def test_copy_on_write_gives_a_fork_its_own_copy_of_a_shared_state_page():
    kv = HybridKVCacheManager(30, 4, layout=two_groups())
    kv.grow("a", 6)
    kv.fork("a", "b")
    copies = kv.copy_on_write("b", 6)  # the next write: block 1, both groups
    assert len(copies) == 2
    assert kv.group_tables("a")[0][1] != kv.group_tables("b")[0][1]
    kv.check_integrity({"a": 6, "b": 6})


@pytest.mark.parametrize("seed", range(4))
def test_random_walks_with_recurrent_groups_keep_every_page_accounted_for(seed):
    random_walk(seed, qwen3_5_like(8))
    layout = KVCacheLayout.from_windows([6, 6, None, None, 6, None], [0, 3])
    assert {g.kind for g in layout.groups} == {RECURRENT, FULL, KVCacheGroupKind.SLIDING_WINDOW}
    random_walk(seed, layout)
