"""Block sharing without a model: fork, copy-on-write, the prefix cache and its LRU
eviction, swapping, and a property-based run of random operations that checks integrity
AND that every sequence still reads its own tokens from its blocks (or its swap blocks)."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.kv.block_pool import BlockPool
from engine.kv.kv_cache_manager import KVCacheManager

BS = 4


def test_fork_shares_every_block_and_free_returns_them_after_the_last_owner() -> None:
    kv = KVCacheManager(8, BS)
    kv.grow("a", 10)
    table = kv.fork("a", "b")
    assert table == kv.block_table("a") and all(kv.pool.ref_count(b) == 2 for b in table)
    kv.check_integrity({"a": 10, "b": 10})
    kv.free("a")
    assert kv.num_free_blocks == 5
    kv.free("b")
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_copy_on_write_copies_only_the_shared_blocks_a_step_writes() -> None:
    kv = KVCacheManager(8, BS)
    kv.grow("a", 10)  # blocks 0,1 full, block 2 half full
    kv.fork("a", "b")
    parent = list(kv.block_table("a"))
    copies = kv.copy_on_write("b", 10)
    assert copies is not None and len(copies) == 1
    (src, dst) = copies[0]
    assert src == parent[2] and kv.block_table("b") == [*parent[:2], dst]
    assert kv.pool.ref_count(src) == 1 and kv.pool.ref_count(parent[0]) == 2
    assert kv.copy_on_write("b", 10) == []  # private now
    assert kv.copy_on_write("a", 10) == []  # the last owner writes in place
    kv.check_integrity({"a": 10, "b": 10})


def test_copy_on_write_is_all_or_nothing() -> None:
    kv = KVCacheManager(3, BS)
    kv.grow("a", 8)
    kv.fork("a", "b")
    assert kv.copy_on_write("b", 0) is None  # needs 2 copies, 1 block free
    assert kv.block_table("b") == kv.block_table("a")
    kv.check_integrity({"a": 8, "b": 8})


def prompt(n: int, start: int = 100) -> list[int]:
    return list(range(start, start + n))


def slicer(tokens: list[int]):
    return lambda start, end: tokens[start:end]


def compute(kv: KVCacheManager, seq: str, tokens: list[int]) -> int:
    """What the scheduler does for a new sequence: match, grow, compute, register."""
    hit = kv.match_prefix(seq, tokens)
    assert kv.grow(seq, len(tokens)) is not None
    kv.cache_computed(seq, slicer(tokens), len(tokens))
    return hit


def test_prefix_hit_reuses_full_blocks_but_never_the_last_tokens_block() -> None:
    kv = KVCacheManager(16, BS, enable_prefix_caching=True)
    tokens = prompt(10)
    assert compute(kv, "a", tokens) == 0
    assert compute(kv, "b", tokens) == 8  # two full blocks; the 3rd holds the last token
    assert kv.block_table("b")[:2] == kv.block_table("a")[:2]
    assert kv.block_table("b")[2] != kv.block_table("a")[2]
    assert compute(kv, "c", prompt(8)) == 4  # exactly two blocks: the second is recomputed
    assert compute(kv, "d", prompt(10, start=7)) == 0  # other tokens
    kv.check_integrity({"a": 10, "b": 10, "c": 8, "d": 10})


def test_freed_prefix_stays_cached_until_evicted_least_recently_used_first() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    compute(kv, "old", prompt(9, start=0))  # 2 cached full blocks + 1
    compute(kv, "new", prompt(9, start=50))
    kv.free("old")
    kv.free("new")
    assert kv.num_free_blocks == 8 and kv.pool.num_cached == 4
    kv.grow("x", 4 * 5)  # the 4 empty blocks first, then the LRU cached one: old's tail
    assert kv.pool.num_evictions == 1
    assert kv.match_prefix("probe-old", prompt(9, start=0)) == 4  # old's first block
    assert kv.match_prefix("probe-new", prompt(9, start=50)) == 8  # freed later: intact
    kv.check_integrity({"x": 20})


def test_a_second_chat_turn_reuses_the_prompt_and_the_reply() -> None:
    kv = KVCacheManager(32, BS, enable_prefix_caching=True)
    turn1 = prompt(11)
    compute(kv, "t1", turn1)
    reply = [7, 8, 9, 10, 11, 12]
    tokens = turn1 + reply
    for n in range(len(turn1) + 1, len(tokens)):  # decode: the last reply token is never fed
        assert kv.grow("t1", n) is not None
        kv.cache_computed("t1", slicer(tokens), n)
    kv.free("t1")
    turn2 = tokens + [40, 41, 42]
    hit = compute(kv, "t2", turn2)
    assert hit == 16  # every full block of turn 1's prompt and reply
    kv.check_integrity({"t2": len(turn2)})


def test_reset_prefix_cache_forgets_everything() -> None:
    kv = KVCacheManager(8, BS, enable_prefix_caching=True)
    compute(kv, "a", prompt(9))
    assert kv.reset_prefix_cache() == 2
    assert compute(kv, "b", prompt(9)) == 0
    kv.check_integrity({"a": 9, "b": 9})


def test_caching_off_never_hits() -> None:
    kv = KVCacheManager(8, BS)
    compute(kv, "a", prompt(9))
    assert compute(kv, "b", prompt(9)) == 0 and kv.pool.num_cached == 0


def test_pool_refuses_impossible_operations() -> None:
    pool = BlockPool(2)
    [b] = pool.allocate(1)
    with pytest.raises(ValueError, match="no cached prefix"):
        pool.touch([b])
    pool.free([b])
    with pytest.raises(ValueError, match="cannot be cached"):
        pool.cache(b, 123)


class SharingMachine(RuleBasedStateMachine):
    """Random fork / append / free / copy-on-write / prefix-hit sequences on a small
    pool. Besides integrity, a model of the physical blocks' contents checks that every
    sequence reads back exactly its own computed tokens: sharing never lets one sequence
    see another's writes."""

    @initialize(num_blocks=st.integers(4, 24), caching=st.booleans(), cpu_blocks=st.integers(0, 12))
    def setup(self, num_blocks: int, caching: bool, cpu_blocks: int) -> None:
        self.kv = KVCacheManager(
            num_blocks, BS, enable_prefix_caching=caching, num_cpu_blocks=cpu_blocks
        )
        self.content: dict[int, list[int | None]] = {}  # block id -> its token slots
        self.cpu_content: dict[int, list[int | None]] = {}  # CPU swap block -> slots
        self.tokens: dict[str, list[int]] = {}  # seq -> computed tokens (on the device)
        self.swapped: dict[str, list[int]] = {}  # seq -> computed tokens (swapped out)
        self.next_id = 0

    def _write(self, seq: str, tokens: list[int], start: int) -> None:
        table = self.kv.block_table(seq)
        for p in range(start, len(tokens)):
            block = self.content.setdefault(table[p // BS], [None] * BS)
            block[p % BS] = tokens[p]

    def _new_seq(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    @rule(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=14))
    def add(self, tokens: list[int]) -> None:
        seq = self._new_seq()
        hit = self.kv.match_prefix(seq, tokens)
        if self.kv.grow(seq, len(tokens)) is None:
            self.kv.free(seq)  # undo the hits, as the scheduler does
            return
        for p in range(hit):  # a hit must already hold these tokens
            assert self.content[self.kv.block_table(seq)[p // BS]][p % BS] == tokens[p]
        self._write(seq, tokens, hit)
        self.kv.cache_computed(seq, slicer(tokens), len(tokens))
        self.tokens[seq] = list(tokens)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), min_size=1, max_size=6))
    def append(self, data, extra: list[int]) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        start = len(self.tokens[seq])
        copies = self.kv.copy_on_write(seq, start)
        if copies is None:
            return
        for src, dst in copies:
            self.content[dst] = list(self.content[src])
        if self.kv.grow(seq, start + len(extra)) is None:
            return  # the private copies stay: still a consistent state
        tokens = self.tokens[seq] + extra
        self._write(seq, tokens, start)
        self.kv.cache_computed(seq, slicer(tokens), len(tokens))
        self.tokens[seq] = tokens

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_seq()
        self.kv.fork(parent, child)
        self.tokens[child] = list(self.tokens[parent])

    @precondition(lambda self: self.tokens or self.swapped)
    @rule(data=st.data())
    def free(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens | self.swapped)))
        self.kv.free(seq)
        self.tokens.pop(seq, None)
        self.swapped.pop(seq, None)

    @rule()
    def reset(self) -> None:
        self.kv.reset_prefix_cache()

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def swap_out(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        copies = self.kv.swap_out(seq)
        if copies is None:
            return
        for device, cpu in copies:
            self.cpu_content[cpu] = list(self.content[device])
        self.swapped[seq] = self.tokens.pop(seq)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data) -> None:
        seq = data.draw(st.sampled_from(sorted(self.swapped)))
        copies = self.kv.swap_in(seq)
        if copies is None:
            return
        for cpu, device in copies:
            self.content[device] = list(self.cpu_content[cpu])
        self.tokens[seq] = self.swapped.pop(seq)

    @invariant()
    def integrity(self) -> None:
        if not hasattr(self, "kv"):
            return
        self.kv.check_integrity({s: len(t) for s, t in self.tokens.items()})
        for seq, tokens in self.tokens.items():
            table = self.kv.block_table(seq)
            read = [self.content[table[p // BS]][p % BS] for p in range(len(tokens))]
            assert read == tokens, f"{seq} reads {read}, wrote {tokens}"
        for seq, tokens in self.swapped.items():
            cpu = self.kv.swapped_table(seq)
            read = [self.cpu_content[cpu[p // BS]][p % BS] for p in range(len(tokens))]
            assert read == tokens, f"swapped {seq} holds {read}, wrote {tokens}"
        assert self.kv.num_swapped_blocks <= (
            self.kv.cpu_pool.num_blocks if self.kv.cpu_pool else 0
        )


SharingMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
test_random_sharing_operations_keep_integrity = SharingMachine.TestCase
