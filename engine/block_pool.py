"""The pool of physical KV blocks: a free list and a reference count per block."""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when an allocation asks for more blocks than are free."""


class BlockPool:
    """Hands out block ids and takes them back.

    A block is free (ref count 0, on the free list) or owned (ref count >= 1, held by
    that many block tables). Freed blocks go to the back of the free list, so recently
    freed blocks are reused last.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        """Takes `n` free blocks (all or none), each with ref count 1."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def fork(self, block_ids: list[int]) -> None:
        """One more owner for each block (sharing)."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} is free and cannot be shared")
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """One owner fewer for each block; blocks nobody owns return to the free list."""
        for b in block_ids:
            if self._ref_counts[b] < 1:
                raise ValueError(f"block {b} is already free (double free)")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def check_integrity(self, owners: dict[int, int]) -> None:
        """`owners[block_id]` = how many block tables hold it. Raises AssertionError if off."""
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for b in range(self.num_blocks):
            expected = owners.get(b, 0)
            assert self._ref_counts[b] == expected, (
                f"block {b}: ref count {self._ref_counts[b]}, held by {expected} block tables"
            )
            assert (b in free) == (expected == 0), f"block {b}: free={b in free}, owners={expected}"
        assert len(free) + len(owners) == self.num_blocks, "free + owned != total"
