"""The block manager actor over the in-process transport: one exchange per step."""

from __future__ import annotations

import asyncio

from actors.actor import send_message
from actors.block_manager_actor import BlockManagerActor
from actors.transport import inproc_pair
from engine.codec import InboxDecoder
from engine.kv.block_manager import BlockManager
from engine.messages import INBOXES, ApplyBlockOps, BlockOp, BlockOpsApplied, Shutdown


async def _exchange(outbox, inbox, decoder, message) -> BlockOpsApplied:
    await send_message(outbox, message)
    return decoder.decode(await asyncio.wait_for(inbox.recv(), timeout=5))


async def test_one_exchange_per_step_replays_the_ops_in_order():
    to_bm, bm_inbox = inproc_pair()
    reply_out, reply_in = inproc_pair()
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    kv = manager.kv_cache
    actor = BlockManagerActor(manager, bm_inbox, reply_out)
    await actor.start()
    decoder = InboxDecoder(INBOXES["block_replies"])

    ops = (BlockOp("grow", "a", 6), BlockOp("grow", "c", 4), BlockOp("cache", "a", 0, hashes=(7,)))
    first = await _exchange(to_bm, reply_in, decoder, ApplyBlockOps(1, ops))
    assert first == BlockOpsApplied(1, (0, 1, 2), 1, 1)

    # Frees run where they stand: the freed blocks serve the next op; a prefix hit
    # revives the cached block.
    ops = (BlockOp("free", "a"), BlockOp("match", "b", hashes=(7,)), BlockOp("grow", "b", 12))
    second = await _exchange(to_bm, reply_in, decoder, ApplyBlockOps(2, ops))
    assert second.block_ids == (0, 3, 1) and second.error is None  # empty blocks FIFO
    kv.check_integrity({"b": 12, "c": 4})

    # An op that does not fit is named, not applied.
    third = await _exchange(to_bm, reply_in, decoder, ApplyBlockOps(3, (BlockOp("grow", "d", 8),)))
    assert third.error is not None and "grow 'd'" in third.error

    # A garbage frame is dropped; the actor keeps serving.
    await to_bm.send(b"\x93garbage")
    ops = (BlockOp("free", "b"), BlockOp("free", "c"))
    fourth = await _exchange(to_bm, reply_in, decoder, ApplyBlockOps(4, ops))
    assert fourth.num_free_blocks == 4 and actor.num_dropped == 1
    kv.check_integrity({})

    await send_message(to_bm, Shutdown("test"))
    await actor.stop()
    assert not actor.is_alive and actor.crash is None
