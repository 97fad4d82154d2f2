"""The hybrid allocator: KV cache groups by layer kind over one pool, sliding windows
letting go of what leaves them, every primitive applied to every group."""

from __future__ import annotations

import random

import pytest

from engine.kv.block_count import cdiv
from engine.kv.hybrid_kv_cache_manager import NULL_BLOCK, HybridKVCacheManager
from engine.kv.kv_cache_groups import MAX_GROUPS, KVCacheGroupKind, KVCacheLayout

FULL, SLIDING = KVCacheGroupKind.FULL_ATTENTION, KVCacheGroupKind.SLIDING_WINDOW


def gpt_oss_like(num_layers: int = 4, window: int = 8) -> KVCacheLayout:
    return KVCacheLayout.from_windows([window if i % 2 == 0 else None for i in range(num_layers)])


def test_alternating_layers_make_two_equal_groups():
    layout = gpt_oss_like(24, 128)
    assert [(g.kind, g.layers[:2], g.sliding_window) for g in layout.groups] == [
        (SLIDING, (0, 2), 128),
        (FULL, (1, 3), None),
    ]
    assert layout.layers_per_group == 12 and layout.padding_share == 0
    assert layout.place(5) == (1, 2) and layout.place(4) == (0, 2)


def test_five_local_to_one_global_pads_only_a_local_group():
    windows = [None if i % 6 == 5 else 1024 for i in range(62)]  # Gemma-3-27B's pattern
    layout = KVCacheLayout.from_windows(windows)
    assert layout.layers_per_group == 5  # divides the global layers: they need no padding
    assert [len(g.layers) for g in layout.groups] == [5] * 10 + [2, 5, 5]
    assert sum(g.kind is FULL for g in layout.groups) == 2
    assert layout.padding_share == pytest.approx(1 - 62 / 65)  # vLLM's 7 groups of 10: 70
    assert sorted(i for g in layout.groups for i in g.layers) == list(range(62))


def test_the_chunk_size_keeps_groups_few():
    layout = KVCacheLayout.from_windows([None, 8] * 20 + [8])  # 20 full, 21 windowed
    assert layout.num_groups <= MAX_GROUPS
    full = [g for g in layout.groups if g.kind is FULL]
    assert all(len(g.layers) == layout.layers_per_group for g in full)


@pytest.mark.parametrize("windows", [[None] * 3, [16] * 3])
def test_one_kind_is_one_group(windows):
    layout = KVCacheLayout.from_windows(windows)
    assert layout.num_groups == 1 and layout.layers_per_group == 3
    assert layout.is_hybrid == (windows[0] is not None)


def test_a_window_group_frees_what_leaves_the_window_and_never_holds_more():
    kv = HybridKVCacheManager(40, 4, layout=gpt_oss_like(window=8))
    window_blocks = cdiv(8, 4) + 1
    computed = 0
    kv.grow("a", 30)  # a 30-token prefill in one chunk: every slot of the chunk is needed
    computed = 30
    for _ in range(40):  # decode
        kv.slide("a", computed)
        kv.grow("a", computed + 1)
        sliding, full = kv.group_tables("a")
        live = [b for b in sliding if b != NULL_BLOCK]
        assert len(live) <= window_blocks
        assert len(full) == cdiv(computed + 1, 4) and NULL_BLOCK not in full
        computed += 1
        kv.check_integrity({"a": computed})
    kv.free("a")
    assert kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()


def test_a_long_chunked_prefill_never_allocates_what_the_window_has_left():
    kv = HybridKVCacheManager(64, 4, layout=KVCacheLayout.from_windows([8, 8]))
    computed = 0
    while computed < 100:
        kv.slide("a", computed)
        kv.grow("a", computed + 10)  # 10-token chunks
        (table,) = kv.group_tables("a")
        live = sum(b != NULL_BLOCK for b in table)
        assert live == kv.blocks_for(computed + 10, computed) <= cdiv(8 - 1 + 10, 4) + 1
        computed += 10
    kv.free("a")
    kv.check_integrity()


def test_grow_is_all_or_nothing_across_groups():
    kv = HybridKVCacheManager(5, 4, layout=gpt_oss_like())
    assert kv.grow("a", 8) is not None  # two blocks per group
    assert kv.grow("b", 8) is None  # needs 4, 1 free
    assert kv.group_tables("b") == ([], []) and kv.num_free_blocks == 1
    kv.check_integrity({"a": 8})


def test_fork_and_copy_on_write_cover_every_group():
    kv = HybridKVCacheManager(30, 4, layout=gpt_oss_like(window=8))
    kv.grow("p", 10)
    kv.fork("p", "c")
    assert kv.group_tables("c") == kv.group_tables("p")
    copies = kv.copy_on_write("c", 8)  # the last block of each group
    assert len(copies) == 2
    assert [t[-1] for t in kv.group_tables("c")] == [dst for _, dst in copies]
    assert [t[:-1] for t in kv.group_tables("c")] == [t[:-1] for t in kv.group_tables("p")]
    kv.check_integrity({"p": 10, "c": 10})


def test_swap_out_and_in_move_every_groups_live_blocks():
    kv = HybridKVCacheManager(30, 4, layout=gpt_oss_like(window=8), num_cpu_blocks=20)
    kv.grow("a", 20)
    kv.slide("a", 20)  # the window group keeps blocks 3 and 4
    before = kv.group_tables("a")
    copies = kv.swap_out("a")
    assert len(copies) == 2 + 5 and kv.num_free_blocks == kv.num_blocks
    kv.check_integrity()
    back = kv.swap_in("a")
    after = kv.group_tables("a")
    assert [[b == NULL_BLOCK for b in t] for t in after] == [
        [b == NULL_BLOCK for b in t] for t in before
    ]
    assert [cpu for _, cpu in copies] == [cpu for cpu, _ in back]
    assert kv.num_swapped_blocks == 0
    kv.check_integrity({"a": 20})


def test_a_prefix_hit_needs_only_the_window_of_a_sliding_group():
    kv = HybridKVCacheManager(40, 4, layout=gpt_oss_like(window=8), enable_prefix_caching=True)
    prompt = list(range(100, 130))  # 30 tokens: 7 full blocks
    kv.grow("a", 30)
    kv.cache_computed("a", lambda s, e: prompt[s:e], 30)
    kv.slide("a", 30)  # the window group lets blocks 0..4 go (still cached, free)
    kv.free("a")
    hit = kv.match_prefix("b", prompt + [1, 2])  # 32 tokens: blocks 0..6 may hit
    assert hit == 28
    sliding, full = kv.group_tables("b")
    assert len(full) == 7 and NULL_BLOCK not in full
    first = (28 - 8 + 1) // 4  # the block of the first key position 28 sees
    assert sliding[:first] == [NULL_BLOCK] * first and NULL_BLOCK not in sliding[first:]
    kv.check_integrity({"b": 28})


def test_a_prefix_hit_is_cut_where_the_window_group_lost_its_blocks():
    kv = HybridKVCacheManager(12, 4, layout=gpt_oss_like(window=8), enable_prefix_caching=True)
    prompt = list(range(28))
    kv.grow("a", 28)
    kv.cache_computed("a", lambda s, e: prompt[s:e], 28)
    kv.slide("a", 28)
    kv.free("a")
    kv.grow("x", 4 * 4)  # 8 blocks: evicts the window group's freed (cached) blocks first
    assert kv.match_prefix("b", prompt + [0]) < 28
    kv.check_integrity()


def random_walk(seed: int, layout: KVCacheLayout) -> None:
    """Random grows (chunks and decodes), slides, trims, forks, copies, swaps and frees;
    the invariants hold after every operation."""
    rng = random.Random(seed)
    bs = 4
    kv = HybridKVCacheManager(60, bs, layout=layout, enable_prefix_caching=True, num_cpu_blocks=30)
    windows = [g.sliding_window for g in layout.groups if g.sliding_window]
    computed: dict[str, int] = {}
    swapped: dict[str, int] = {}
    tokens: dict[str, list[int]] = {}
    prompts = [[rng.randrange(5) for _ in range(40)] + [7] * 100 for _ in range(3)]
    for step in range(300):
        op = rng.random()
        seq = f"s{rng.randrange(8)}"
        if seq not in computed and seq not in swapped:
            prompt = tokens[seq] = rng.choice(prompts)
            hit = kv.match_prefix(seq, prompt[: rng.randint(1, 40)])
            if kv.grow(seq, hit + rng.randint(1, 12)) is not None:
                computed[seq] = hit
            else:
                kv.free(seq)
        elif seq in swapped:
            if kv.swap_in(seq) is not None:
                computed[seq] = swapped.pop(seq)
        elif op < 0.5:  # the step computed what was scheduled; schedule more
            n = len(kv.group_tables(seq)[0]) * bs
            done = rng.randint(computed[seq], n)
            kv.cache_computed(seq, lambda s, e, t=tokens[seq]: t[s:e], done)
            computed[seq] = done
            kv.slide(seq, done)
            kv.grow(seq, done + rng.choice([1, 1, 1, 7]))
        elif op < 0.55:  # drafts rejected: back to between the computed and held tokens
            held = len(kv.group_tables(seq)[0]) * bs
            kv.trim(seq, rng.randint(computed[seq], held))
        elif op < 0.6:
            child = f"c{step}"
            kv.fork(seq, child)
            computed[child], tokens[child] = computed[seq], tokens[seq]
            kv.copy_on_write(child, computed[child])
        elif op < 0.7 and kv.swap_out(seq) is not None:
            swapped[seq] = computed.pop(seq)
        elif op < 0.85:
            kv.free(seq)
            computed.pop(seq)
        kv.check_integrity()
        assert kv.num_free_blocks + kv.num_used_blocks == kv.num_blocks
        for s, done in computed.items():
            for group, table in zip(layout.groups, kv.group_tables(s), strict=True):
                if group.sliding_window and done >= group.sliding_window:
                    live = sum(b != NULL_BLOCK for b in table[: cdiv(done, bs)])
                    assert live <= cdiv(max(windows), bs) + 1
    for s in [*computed, *swapped]:
        kv.free(s)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.num_swapped_blocks == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_keep_every_page_accounted_for(seed):
    random_walk(seed, gpt_oss_like(window=8))
    random_walk(seed, KVCacheLayout.from_windows([None if i % 3 == 2 else 6 for i in range(6)]))


def test_a_table_sees_a_query_context_only_while_its_window_blocks_live():
    kv = HybridKVCacheManager(30, 4, layout=gpt_oss_like(window=8))
    kv.grow("a", 20)
    assert kv.sees_context("a", 19) and kv.sees_context("a", 3)
    kv.slide("a", 20)  # keeps what the query at 20 sees: positions 13.. (blocks 3, 4)
    assert kv.sees_context("a", 19)  # from position 12: block 3
    assert not kv.sees_context("a", 18)  # it would read position 11, in freed block 2
    full = HybridKVCacheManager(30, 4, layout=KVCacheLayout.from_windows([None, None]))
    assert full.sees_context("a", 0)


def test_static_partitioning_strands_the_window_groups_share():
    from engine.sim.baselines.static_partition_kv_cache import StaticPartitionKVCacheManager

    layout = gpt_oss_like(window=8)
    shared = HybridKVCacheManager(20, 4, layout=layout)
    static = StaticPartitionKVCacheManager(20, 4, layout=layout)  # 10 pages per group
    for kv in (shared, static):
        computed = 0
        while kv.grow("a", computed + 4) is not None:  # decode-like growth, window slides
            computed += 4
            kv.slide("a", computed)
        kv.check_integrity()
    shared_len = len(shared.group_tables("a")[1]) * 4
    static_len = len(static.group_tables("a")[1]) * 4
    assert static_len == 40  # the full group's 10 pages; the window group's sit idle
    assert shared_len > static_len  # the window group's freed pages served the full group
    static.free("a")
    assert static.pool.used == [0, 0] and static.num_free_blocks == static.num_blocks
