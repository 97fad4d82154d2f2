"""A buddy allocator over block ids: contiguous runs of power-of-two blocks."""

from __future__ import annotations

import bisect
import heapq


def ceil_log2(n: int) -> int:
    """The smallest k with 2**k >= n, for n >= 1."""
    return (n - 1).bit_length()


class BuddyAllocator:
    """Hands out contiguous runs of block ids in [0, num_blocks), each 2**k blocks long.

    `num_blocks` is covered by maximal power-of-two roots laid out largest first (100
    blocks: 64 at 0, 32 at 64, 4 at 96), so every run starts at a multiple of its size
    and its buddy is `start ^ size`; runs never merge across roots.

    - `allocate(n)`: the start of a free run of 2**ceil(log2 n) blocks, or None when no
      free run is that large, even if the free blocks add up to more (external
      fragmentation). It takes the smallest free run that fits (lowest address first)
      and splits it, keeping the lower half: deterministic.
    - `free(start)`: the run goes back and merges with its buddy while the buddy is free.

    Each operation does O(log num_blocks) splits or merges, each one heap operation.
    `check_integrity()` holds after every operation: runs tile the blocks without
    overlap, free + allocated == total, and no two free buddies are left unmerged.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._root_starts: list[int] = []
        self._root_orders: list[int] = []
        start = 0
        for order in reversed(range(num_blocks.bit_length())):
            if num_blocks >> order & 1:
                self._root_starts.append(start)
                self._root_orders.append(order)
                start += 1 << order
        self._max_order = self._root_orders[0]
        # free runs per order: a set (membership, O(1) removal) and a min-heap (lowest
        # address first; entries whose run left the set are skipped when popped)
        self._free: list[set[int]] = [set() for _ in range(self._max_order + 1)]
        self._heaps: list[list[int]] = [[] for _ in range(self._max_order + 1)]
        self._allocated: dict[int, int] = {}  # start -> order
        self.num_free = num_blocks
        for start, order in zip(self._root_starts, self._root_orders, strict=True):
            self._push(start, order)

    # -- the protocol ----------------------------------------------------------------
    def allocate(self, n: int) -> int | None:
        """Start block of a free run of 2**ceil(log2 n) blocks, or None (nothing changed)."""
        if n < 1:
            raise ValueError(f"allocate needs n >= 1 blocks, got {n}")
        want = ceil_log2(n)
        order = next((k for k in range(want, self._max_order + 1) if self._free[k]), None)
        if order is None:
            return None
        start = self._pop(order)
        while order > want:  # split, keeping the lower half
            order -= 1
            self._push(start + (1 << order), order)
        self._allocated[start] = want
        self.num_free -= 1 << want
        return start

    def free(self, start: int) -> None:
        """Returns the run starting at `start`, merging it with its free buddies."""
        order = self._allocated.pop(start, None)
        if order is None:
            raise ValueError(f"block {start} does not start an allocated run")
        self.num_free += 1 << order
        root_order = self._root_order(start)
        while order < root_order:
            buddy = start ^ (1 << order)
            if buddy not in self._free[order]:
                break
            self._free[order].discard(buddy)  # its heap entry goes stale
            start = min(start, buddy)
            order += 1
        self._push(start, order)

    # -- what it holds -----------------------------------------------------------------
    @property
    def num_allocated(self) -> int:
        return self.num_blocks - self.num_free

    def run_size(self, start: int) -> int:
        """Blocks in the allocated run starting at `start`."""
        order = self._allocated.get(start)
        if order is None:
            raise ValueError(f"block {start} does not start an allocated run")
        return 1 << order

    def free_runs(self) -> list[tuple[int, int]]:
        """(start, size) of every free run, lowest address first."""
        return sorted((s, 1 << k) for k, runs in enumerate(self._free) for s in runs)

    def allocated_runs(self) -> list[tuple[int, int]]:
        """(start, size) of every allocated run, lowest address first."""
        return sorted((s, 1 << k) for s, k in self._allocated.items())

    def check_integrity(self) -> None:
        """Free and allocated runs tile [0, num_blocks) exactly, each aligned inside one
        root; free counts agree; no free run's buddy is free. AssertionError if not."""
        runs = [(s, n, True) for s, n in self.free_runs()]
        runs += [(s, n, False) for s, n in self.allocated_runs()]
        runs.sort()
        end = 0
        for start, size, _ in runs:
            assert start == end, f"run at {start} overlaps or leaves a gap after {end}"
            assert start % size == 0, f"run at {start} of {size} blocks is not aligned"
            root = bisect.bisect_right(self._root_starts, start) - 1
            root_end = self._root_starts[root] + (1 << self._root_orders[root])
            assert start + size <= root_end, f"run at {start} crosses its root"
            end = start + size
        assert end == self.num_blocks, f"runs cover {end} of {self.num_blocks} blocks"
        free = sum(size for _, size, is_free in runs if is_free)
        assert free == self.num_free, f"{free} blocks in free runs, num_free={self.num_free}"
        for k, starts in enumerate(self._free):
            assert set(self._heaps[k]) >= starts, f"order {k}: a free run is not in its heap"
            for s in starts:
                if k < self._root_order(s):
                    assert s ^ (1 << k) not in starts, f"free buddies {s} and {s ^ (1 << k)}"

    # -- internals -----------------------------------------------------------------------
    def _push(self, start: int, order: int) -> None:
        heap, live = self._heaps[order], self._free[order]
        live.add(start)
        if len(heap) > 2 * len(live) + 16:  # mostly stale entries: rebuild (amortized O(1))
            heap[:] = sorted(live)
        else:
            heapq.heappush(heap, start)

    def _pop(self, order: int) -> int:
        heap, live = self._heaps[order], self._free[order]
        while True:
            start = heapq.heappop(heap)
            if start in live:
                live.remove(start)
                return start

    def _root_order(self, start: int) -> int:
        return self._root_orders[bisect.bisect_right(self._root_starts, start) - 1]
