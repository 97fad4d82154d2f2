"""The block manager actor: one BlockManager behind an inbox.

One `ReserveBlocks` per step carries all of that step's block traffic (frees first, then
reservations in order), and one `BlocksReserved` answers it: never a round trip per
request. It shares the scheduler's process through the in-process transport.
"""

from __future__ import annotations

from actors.actor import Actor, send_message
from actors.transport import Inbox, Outbox
from engine.block_manager import BlockManager
from engine.messages import ReserveBlocks


class BlockManagerActor(Actor):
    """Answers each ReserveBlocks with the BlockManager's BlocksReserved on `reply_to`."""

    def __init__(self, manager: BlockManager, inbox: Inbox, reply_to: Outbox) -> None:
        super().__init__("block_manager", inbox, {ReserveBlocks: self.on_reserve}, [reply_to])
        self.manager = manager
        self.reply_to = reply_to

    async def on_reserve(self, message: ReserveBlocks) -> None:
        await send_message(self.reply_to, self.manager.reserve(message))
