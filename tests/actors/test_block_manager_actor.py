"""The block manager actor over the in-process transport: one exchange per step."""

from __future__ import annotations

import asyncio

from actors.actor import send_message
from actors.block_manager_actor import BlockManagerActor
from actors.codec import InboxDecoder
from actors.transport import inproc_pair
from engine.block_manager import BlockManager
from engine.messages import (
    INBOXES,
    BlockGrant,
    BlockReservation,
    BlocksReserved,
    ReserveBlocks,
    Shutdown,
)


async def _exchange(outbox, inbox, decoder, message) -> BlocksReserved:
    await send_message(outbox, message)
    return decoder.decode(await asyncio.wait_for(inbox.recv(), timeout=5))


async def test_one_exchange_per_step_grants_refuses_and_frees():
    to_bm, bm_inbox = inproc_pair()
    reply_out, reply_in = inproc_pair()
    manager = BlockManager(num_blocks=4, block_size=4)
    kv = manager.kv_cache
    actor = BlockManagerActor(manager, bm_inbox, reply_out)
    await actor.start()
    decoder = InboxDecoder(INBOXES["block_replies"])

    first = await _exchange(
        to_bm,
        reply_in,
        decoder,
        ReserveBlocks(
            1, (), (BlockReservation("a", 6), BlockReservation("b", 12), BlockReservation("c", 4))
        ),
    )
    assert first.grants == (BlockGrant("a", (0, 1)), BlockGrant("c", (2,)))
    assert first.refused_seq_ids == ("b",) and first.num_free_blocks == 1
    assert kv.block_table("b") == []

    # Frees come first, so the same message can reuse the freed blocks.
    second = await _exchange(
        to_bm,
        reply_in,
        decoder,
        ReserveBlocks(2, ("a",), (BlockReservation("b", 12), BlockReservation("c", 5))),
    )
    assert [g.seq_id for g in second.grants] == ["b"] and second.refused_seq_ids == ("c",)
    kv.check_integrity({"b": 12, "c": 4})

    # A garbage frame is dropped; the actor keeps serving.
    await to_bm.send(b"\x93garbage")
    third = await _exchange(to_bm, reply_in, decoder, ReserveBlocks(3, ("b", "c"), ()))
    assert third.num_free_blocks == 4 and actor.num_dropped == 1
    kv.check_integrity({})

    await send_message(to_bm, Shutdown("test"))
    await actor.stop()
    assert not actor.is_alive and actor.crash is None
