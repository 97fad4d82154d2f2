"""The block manager actor's engine object: the authoritative block tables."""

from __future__ import annotations

from typing import Unpack

from engine.kv.block_ops import BlockOpError, apply_op
from engine.kv.hybrid_kv_cache_manager import HybridKVCacheManager
from engine.kv.kv_cache_groups import KVCacheLayout
from engine.kv.kv_cache_manager import KVCacheManager, TableOptions
from engine.messages import ApplyBlockOps, BlockOpsApplied


class BlockManager:
    """Replays each exchange's block ops, in order, on its own tables.

    Contract of `apply(message)`: every op runs in order; the answer lists the block ids
    the ops put into tables (engine/kv/block_ops.py says which), and the free and cached
    block counts after the exchange. An op that does not fit stops the exchange and is
    named in `error` (the scheduler's replica has diverged: a bug, never load).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        layout: KVCacheLayout | None = None,
        **options: Unpack[TableOptions],
    ) -> None:
        """`layout`: the model's KV cache groups; a hybrid one (`is_hybrid`) gets the
        hybrid allocator's tables, else the paged tables."""
        self.kv_cache = block_tables_for(num_blocks, block_size, layout, **options)
        self.num_exchanges = 0

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    def apply(self, message: ApplyBlockOps) -> BlockOpsApplied:
        self.num_exchanges += 1
        block_ids: list[int] = []
        error = None
        for op in message.ops:
            try:
                block_ids += apply_op(self.kv_cache, op)
            except BlockOpError as exc:
                error = f"op {op.kind} {op.seq_id!r}: {exc}"
                break
        kv = self.kv_cache
        return BlockOpsApplied(
            message.exchange_id, tuple(block_ids), kv.num_free_blocks, kv.num_cached_blocks, error
        )

    def check_integrity(self) -> None:
        """Every block is free, cached, or held by exactly as many tables as its ref
        count says."""
        self.kv_cache.check_integrity()


def block_tables_for(
    num_blocks: int,
    block_size: int,
    layout: KVCacheLayout | None,
    **options: Unpack[TableOptions],
) -> KVCacheManager:
    """The paged tables for a model with one full-attention group, the hybrid
    allocator's for any other `layout`."""
    if layout is not None and layout.is_hybrid:
        return HybridKVCacheManager(num_blocks, block_size, layout=layout, **options)
    return KVCacheManager(num_blocks, block_size, **options)
