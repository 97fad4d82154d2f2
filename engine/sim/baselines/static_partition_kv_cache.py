"""Static partitioning: the hybrid allocator's tables, each KV cache group on its own
fixed share of the pages (the design vLLM's hybrid allocator replaced)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence

from engine.kv.block_pool import BlockPool
from engine.kv.hybrid_kv_cache_manager import NULL_BLOCK, HybridKVCacheManager
from engine.kv.kv_cache_groups import KVCacheLayout


class PartitionedPool(BlockPool):
    """A `BlockPool` whose pages are split into fixed per-group quotas: a group may
    hold at most `quotas[g]` pages, whatever the others leave free."""

    def __init__(self, num_blocks: int, quotas: Sequence[int]) -> None:
        super().__init__(num_blocks)
        self.quotas = tuple(quotas)
        self.used = [0] * len(quotas)  # pages each group owns
        self._group = [-1] * num_blocks  # the group owning each page (-1: none)

    def fits(self, groups: Iterable[int]) -> bool:
        """Whether one new page for each entry of `groups` fits every group's quota."""
        wanted = Counter(groups)
        if not self.can_allocate(sum(wanted.values())):
            return False
        return all(self.used[g] + n <= self.quotas[g] for g, n in wanted.items())

    def allocate_for(self, groups: Sequence[int]) -> list[int]:
        blocks = self.allocate(len(groups))
        for block, g in zip(blocks, groups, strict=True):
            self._group[block] = g
            self.used[g] += 1
        return blocks

    def free(self, block_ids: Iterable[int]) -> None:
        blocks = list(block_ids)
        super().free(blocks)
        for block in set(blocks):
            g = self._group[block]
            if g >= 0 and self.ref_count(block) == 0:
                self.used[g] -= 1
                self._group[block] = -1


class StaticPartitionKVCacheManager(HybridKVCacheManager):
    """`HybridKVCacheManager` whose groups do not share pages: each gets
    `num_blocks // num_groups` of them (every group has the same layers per page, so
    equal page counts are equal memory: the split by layer count). A windowed group's
    share sits mostly idle while a full-attention group runs out. No prefix caching
    (a page revived from the cache would need its old group's quota)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        layout: KVCacheLayout,
        enable_prefix_caching: bool = False,
        extra_key: int = 0,
        num_cpu_blocks: int = 0,
    ) -> None:
        if enable_prefix_caching:
            raise ValueError("StaticPartitionKVCacheManager does not support prefix caching")
        super().__init__(
            num_blocks,
            block_size,
            layout=layout,
            extra_key=extra_key,
            num_cpu_blocks=num_cpu_blocks,
        )
        quota = num_blocks // self.num_groups
        self.pool = PartitionedPool(num_blocks + 1, [quota] * self.num_groups)
        if self.pool.allocate(1) != [NULL_BLOCK]:
            raise AssertionError("the null block must be block 0")

    def _can_allocate(self, entries: Sequence[int]) -> bool:
        return self.pool.fits(e % self.num_groups for e in entries)

    def _allocate(self, entries: Sequence[int]) -> list[int]:
        return self.pool.allocate_for([e % self.num_groups for e in entries])
