"""`trim`: a table shrinks back to its accepted tokens once verification rejected the
drafts whose slots a step reserved (speculative decoding's lookahead).

Property test: random walks of speculative steps (grow by k lookahead slots, trim to
the accepted tokens plus one), forks sharing blocks, prefix caching of the accepted
tokens, swaps and frees, on the scheduler's `BlockLedger` with every exchange replayed
by a `BlockManager`: the two agree after every step, no block leaks or is owned twice,
each table is exactly as long as its tokens need, and everything is free at the end."""

from __future__ import annotations

import random

import pytest

from engine.kv.block_ledger import BlockLedger
from engine.kv.block_manager import BlockManager
from engine.kv.kv_cache_manager import KVCacheManager

pytestmark = pytest.mark.timeout(60)

BLOCK = 4


def test_trim_frees_the_tail_blocks_and_keeps_the_accepted_ones() -> None:
    kv = KVCacheManager(8, BLOCK)
    assert kv.grow("a", 5) == [0, 1]
    assert kv.grow("a", 5 + 6) == [0, 1, 2]  # 6 lookahead slots: one block more
    assert kv.trim("a", 7) == 1  # one draft accepted, plus the bonus token: 7 tokens
    assert kv.block_table("a") == [0, 1] and kv.num_free_blocks == 6
    kv.check_integrity({"a": 7})
    assert kv.trim("a", 7) == 0 and kv.trim("missing", 3) == 0


def test_trim_gives_back_shared_blocks_only_as_owners_drop() -> None:
    kv = KVCacheManager(8, BLOCK)
    kv.grow("a", 12)
    kv.fork("a", "b")
    assert kv.trim("b", 4) == 2  # b's references to blocks 1 and 2 dropped
    assert kv.num_free_blocks == 5  # a still holds all three
    kv.check_integrity({"a": 12, "b": 4})
    kv.free("a")
    kv.free("b")
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_trim_forgets_prefix_hashes_past_the_kept_blocks() -> None:
    kv = KVCacheManager(8, BLOCK, enable_prefix_caching=True)
    tokens = list(range(12))
    kv.grow("a", 12)
    kv.cache_computed("a", lambda i, j: tokens[i:j], 12)
    kv.trim("a", 6)
    kv.check_integrity({"a": 6})
    kv.grow("a", 12)  # the same positions grown again get fresh blocks
    kv.cache_computed("a", lambda i, j: tokens[i:j], 12)
    kv.check_integrity({"a": 12})


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("caching", [False, True])
def test_random_speculative_walks_keep_both_replicas_exact(seed: int, caching: bool) -> None:
    rng = random.Random(seed)
    options = {"enable_prefix_caching": caching, "num_cpu_blocks": 16}
    ledger, manager = BlockLedger(24, BLOCK, **options), BlockManager(24, BLOCK, **options)
    tokens: dict[str, list[int]] = {}  # live sequences' accepted tokens
    swapped: set[str] = set()
    for step in range(250):
        _random_change(rng, ledger, tokens, swapped, step)
        if ledger.has_traffic:
            ledger.apply(manager.apply(ledger.take_traffic()))
        live = {s: len(t) for s, t in tokens.items() if s not in swapped}
        ledger.check_integrity(live)
        manager.check_integrity()
        for seq in live:
            assert manager.kv_cache.block_table(seq) == ledger.block_table(seq)
    for seq in list(tokens):
        ledger.free(seq)
    ledger.apply(manager.apply(ledger.take_traffic()))
    ledger.check_integrity()
    manager.check_integrity()
    assert ledger.num_free_blocks == 24  # cached blocks count as free (evictable)
    assert ledger.num_swapped_blocks == 0


def _random_change(rng, ledger: BlockLedger, tokens: dict, swapped: set, step: int) -> None:
    live = [s for s in tokens if s not in swapped]
    action = rng.random()
    if action < 0.15 or not live:
        seq = f"s{step}"
        prompt = [rng.randrange(6) for _ in range(rng.randrange(1, 14))]
        if ledger.enable_prefix_caching:
            ledger.match_prefix(seq, prompt)  # the table starts with its cached blocks
        if ledger.grow(seq, len(prompt)) is not None:
            tokens[seq] = prompt
            _cache(ledger, seq, prompt)
        else:
            ledger.free(seq)
    elif action < 0.65:
        _speculative_step(rng, ledger, rng.choice(live), tokens)
    elif action < 0.72:
        parent = rng.choice(live)
        child = f"f{step}"
        ledger.fork(parent, child)
        tokens[child] = list(tokens[parent])
    elif action < 0.8 and ledger.cpu_pool is not None:
        seq = rng.choice(live)
        if ledger.swap_out(seq) is not None:
            swapped.add(seq)
    elif action < 0.88 and swapped:
        seq = rng.choice(sorted(swapped))
        if ledger.swap_in(seq) is not None:
            swapped.discard(seq)
    else:
        seq = rng.choice(live)
        ledger.free(seq)
        del tokens[seq]


def _speculative_step(rng, ledger: BlockLedger, seq: str, tokens: dict) -> None:
    """k lookahead slots reserved (copy-on-write for shared blocks they write), then
    trimmed to the accepted drafts plus the bonus token."""
    n, k = len(tokens[seq]), rng.randrange(1, 7)
    if ledger.grow(seq, n + k) is None or ledger.copy_on_write(seq, n) is None:
        ledger.trim(seq, n)  # no room this step: back to the accepted tokens
        return
    accepted = rng.randrange(0, k + 1)
    tokens[seq] += [rng.randrange(6) for _ in range(min(accepted + 1, k))]
    ledger.trim(seq, len(tokens[seq]))
    _cache(ledger, seq, tokens[seq])


def _cache(ledger: BlockLedger, seq: str, seq_tokens: list[int]) -> None:
    if ledger.enable_prefix_caching:
        ledger.cache_computed(seq, lambda i, j: seq_tokens[i:j], len(seq_tokens))
