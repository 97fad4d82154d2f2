"""The block manager actor's engine object: the authoritative block tables."""

from __future__ import annotations

from engine.kv_cache_manager import KVCacheManager
from engine.messages import BlockGrant, BlocksReserved, ReserveBlocks


class BlockManager:
    """Applies one step's block traffic at a time and says what it granted.

    Contract of `reserve(message)`: the message's frees run first, then its reservations
    in order. A reservation that does not fit is refused whole (that table unchanged) and
    later ones are still tried, so the sender learns exactly which sequences missed out.
    The answer carries the new block ids per granted sequence, in table order, and the
    free block count after the whole exchange.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.kv_cache = KVCacheManager(num_blocks, block_size)
        self.num_exchanges = 0

    @property
    def num_blocks(self) -> int:
        return self.kv_cache.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.kv_cache.num_free_blocks

    def reserve(self, message: ReserveBlocks) -> BlocksReserved:
        self.num_exchanges += 1
        for seq_id in message.free_seq_ids:
            self.kv_cache.free(seq_id)
        grants, refused = [], []
        for r in message.reservations:
            before = len(self.kv_cache.block_table(r.seq_id))
            if self.kv_cache.allocate_slots(r.seq_id, r.num_tokens):
                new = self.kv_cache.block_table(r.seq_id)[before:]
                if new:
                    grants.append(BlockGrant(r.seq_id, tuple(new)))
            else:
                refused.append(r.seq_id)
        return BlocksReserved(
            message.step_id, tuple(grants), tuple(refused), self.kv_cache.num_free_blocks
        )

    def check_integrity(self) -> None:
        """Every block is free or held by exactly as many tables as its ref count says."""
        self.kv_cache.check_integrity()
