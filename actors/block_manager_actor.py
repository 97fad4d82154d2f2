"""The block manager actor: one BlockManager behind an inbox.

One `ApplyBlockOps` per step carries all of that step's block traffic (the scheduler's
replica's changes, in order), and one `BlockOpsApplied` answers it: never a round trip
per request. It shares the scheduler's process through the in-process transport.
"""

from __future__ import annotations

from actors.actor import Actor, send_message
from actors.transport import Inbox, Outbox
from engine.kv.block_manager import BlockManager
from engine.messages import ApplyBlockOps


class BlockManagerActor(Actor):
    """Answers each ApplyBlockOps with the BlockManager's BlockOpsApplied on `reply_to`."""

    def __init__(self, manager: BlockManager, inbox: Inbox, reply_to: Outbox) -> None:
        super().__init__("block_manager", inbox, {ApplyBlockOps: self.on_ops}, [reply_to])
        self.manager = manager
        self.reply_to = reply_to

    async def on_ops(self, message: ApplyBlockOps) -> None:
        await send_message(self.reply_to, self.manager.apply(message))
