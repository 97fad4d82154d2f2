"""Prefix hashes: the identity of a full block's KV, chained from the block before it.

Two blocks hold the same KV exactly when they hold the same tokens at the same
positions after the same earlier tokens, under the same model; so a block's hash covers
its own token ids, its parent's hash (which covers everything before it) and an
`extra_key` for whatever else changes the KV (model, revision, dtype). The hash of
a tuple of ints is the same in every process (no hash randomization for ints), which
the block manager actor's replica relies on. It is 64 bits: two different prefixes
collide with odds about n^2 / 2^65 for n cached blocks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

BlockHash = int
TokenSlice = Callable[[int, int], Sequence[int]]  # (start, end) -> those token ids


def chain_hashes(
    parent: BlockHash | None,
    tokens: TokenSlice,
    first: int,
    end: int,
    block_size: int,
    extra_key: int,
) -> list[BlockHash]:
    """The hashes of blocks first..end-1, chained on from `parent` (the hash of block
    first-1, None for the first block): hash((parent, block's token ids, extra_key))."""
    new = []
    for i in range(first, end):
        parent = hash((parent, tuple(tokens(i * block_size, (i + 1) * block_size)), extra_key))
        new.append(parent)
    return new
