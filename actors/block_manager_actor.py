"""The block manager actor: one KVCacheManager behind an inbox.

One `ReserveBlocks` per step carries all of that step's block traffic (frees first, then
reservations in order), and one `BlocksReserved` answers it: never a round trip per
request. It can share the scheduler's process through the in-process transport.
"""

from __future__ import annotations

from actors.actor import Actor, send_message
from actors.transport import Inbox, Outbox
from engine.kv_cache_manager import KVCacheManager
from engine.messages import BlockGrant, BlocksReserved, ReserveBlocks


class BlockManagerActor(Actor):
    """Owns the block tables; answers each ReserveBlocks on `reply_to`.

    A reservation that does not fit is refused whole (its table unchanged) and later
    ones are still tried, so the scheduler learns exactly which sequences to preempt.
    """

    def __init__(self, kv_cache: KVCacheManager, inbox: Inbox, reply_to: Outbox) -> None:
        super().__init__("block_manager", inbox, {ReserveBlocks: self.on_reserve}, [reply_to])
        self.kv_cache = kv_cache
        self.reply_to = reply_to

    async def on_reserve(self, message: ReserveBlocks) -> None:
        await send_message(self.reply_to, self.reserve(message))

    def reserve(self, message: ReserveBlocks) -> BlocksReserved:
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
