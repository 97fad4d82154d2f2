"""The pool of physical KV blocks: ref counts, a free queue and the prefix cache index."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from engine.kv.prefix_hash import BlockHash


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Hands out block ids and takes them back; remembers which hold a cached prefix.

    A block is owned (ref count >= 1: held by that many block tables) or free (ref count
    0). A full block whose KV is computed may be registered under its prefix hash
    (`cache`); it stays findable (`lookup`) after it is freed, so a later prefix hit
    revives it (`touch`) instead of computing it again. Free blocks wait in two queues:
    empty ones first-in first-out (recently freed blocks are reused last), and cached
    ones least recently freed first. `allocate` takes empty blocks before it evicts a
    cached one, and evicts the least recently used; every operation is O(1) per block.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._empty: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # eviction order
        self._ref_counts = [0] * num_blocks
        self._hash_of: list[BlockHash | None] = [None] * num_blocks
        self._cached: dict[BlockHash, int] = {}  # prefix hash -> block id
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take (cached free blocks included)."""
        return len(self._empty) + len(self._cached_free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Takes `n` free blocks (all or none), each with ref count 1 and no hash."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"asked for {n} blocks, {self.num_free} free")
        blocks = []
        for _ in range(n):
            queue = self._empty if self._empty else self._cached_free
            blocks.append(queue.popitem(last=False)[0])
        for b in blocks:
            self._ref_counts[b] = 1
            h = self._hash_of[b]
            if h is not None:  # evict the prefix it held
                del self._cached[h]
                self._hash_of[b] = None
                self.num_evictions += 1
        return blocks

    def fork(self, block_ids: Iterable[int]) -> None:
        """One more owner for each owned block (sharing)."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def touch(self, block_ids: Iterable[int]) -> None:
        """One more owner for each cached block, reviving the free ones (prefix hits)."""
        for b in block_ids:
            if self._hash_of[b] is None:
                raise ValueError(f"block {b} holds no cached prefix")
            if self._ref_counts[b] == 0:
                del self._cached_free[b]
            self._ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """One owner fewer for each block, in the given order; a block nobody owns joins
        the back of its free queue (a cached one is evicted after those freed before)."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} is already free (double free)")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                queue = self._empty if self._hash_of[b] is None else self._cached_free
                queue[b] = None

    # -- the prefix cache -------------------------------------------------------------
    def cache(self, block_id: int, block_hash: BlockHash) -> bool:
        """Registers an owned, full, computed block under its prefix hash; False when
        another block already holds that prefix (this one stays unregistered)."""
        if self._ref_counts[block_id] < 1:
            raise ValueError(f"block {block_id} is free and cannot be cached")
        if block_hash in self._cached or self._hash_of[block_id] is not None:
            return False
        self._cached[block_hash] = block_id
        self._hash_of[block_id] = block_hash
        return True

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix (owned blocks keep their KV, unfindable); returns
        how many were dropped."""
        dropped = len(self._cached)
        for b in self._cached.values():
            self._hash_of[b] = None
        self._empty.update(self._cached_free)
        self._cached_free.clear()
        self._cached.clear()
        return dropped

    def check_integrity(self, owners: dict[int, int]) -> None:
        """`owners[block_id]` = how many block tables hold it. Every block is free,
        free-and-cached, or referenced exactly as often as tables hold it; the prefix
        index and the per-block hashes agree. Raises AssertionError if not."""
        free = self._empty.keys() | self._cached_free.keys()
        assert len(free) == self.num_free, "a block is in both free queues"
        for b in range(self.num_blocks):
            expected = owners.get(b, 0)
            assert self._ref_counts[b] == expected, (
                f"block {b}: ref count {self._ref_counts[b]}, held by {expected} block tables"
            )
            assert (b in free) == (expected == 0), f"block {b}: free={b in free}, owners={expected}"
            h = self._hash_of[b]
            assert b not in self._cached_free or h is not None, f"block {b}: cached, no hash"
            assert h is None or self._cached.get(h) == b, f"block {b}: hash {h} not indexed"
        assert len(free) + len(owners) == self.num_blocks, "free + owned != total"
        for h, b in self._cached.items():
            assert self._hash_of[b] == h, f"index: {h} -> block {b}, which holds {self._hash_of[b]}"
