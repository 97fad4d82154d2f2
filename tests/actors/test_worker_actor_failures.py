"""A request the worker cannot run, across the actors (the engine's graph of scheduler
and block manager, and a worker, over in-process transports): the scheduler hears it in
StepResult.failed, frees its blocks and reports RequestFailed to the tokenizer; the
other requests finish; the worker forgets it once told it finished. A failure tied to
no request stops the worker actor."""

from __future__ import annotations

import asyncio

from actors.actor import send_message
from actors.engine_graph import EngineGraph
from actors.transport import inproc_pair
from actors.worker_actor import WorkerActor
from engine.codec import InboxDecoder
from engine.config import SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.kv.block_ledger import BlockLedger
from engine.kv.block_manager import BlockManager
from engine.messages import INBOXES, AddRequest, RequestFailed, TokenDeltas
from engine.sampling_params import SamplingParams
from engine.worker.worker import NullWorker
from tests.eventually import eventually

NUM_BLOCKS, BLOCK_SIZE = 64, 4


class FaultyWorker(NullWorker):
    """Cannot take request "bad" in (its diff raises)."""

    def _add(self, new):
        if new.request_id == "bad":
            raise MemoryError("no room for this one")
        super()._add(new)


async def test_a_request_the_worker_cannot_run_fails_alone_and_frees_its_blocks():
    core = EngineCore(SchedulerConfig(8, 64, 256), BlockLedger(NUM_BLOCKS, BLOCK_SIZE), frozenset())
    to_sched, sched_inbox = inproc_pair()
    to_worker, worker_inbox = inproc_pair()
    worker = FaultyWorker()
    manager = BlockManager(NUM_BLOCKS, BLOCK_SIZE)
    graph = EngineGraph(core, manager, sched_inbox, [to_worker])
    worker_actor = WorkerActor(worker, worker_inbox, to_sched)
    await worker_actor.start()
    await graph.start()
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    for rid in ("a", "bad", "b"):
        await send_message(to_sched, AddRequest(rid, (1, 2, 3, 4, 5), params, 0.0))
    decoder, ended, failed = InboxDecoder(INBOXES["tokenizer"]), set(), {}
    async with asyncio.timeout(10):
        while ended | set(failed) != {"a", "bad", "b"}:
            message = decoder.decode(await graph.tokenizer_inbox.recv())
            if isinstance(message, RequestFailed):
                failed[message.request_id] = message.error
            else:
                assert isinstance(message, TokenDeltas)
                ended |= {f.request_id for f in message.finished}
    assert set(failed) == {"bad"} and "no room for this one" in failed["bad"]
    assert ended == {"a", "b"}
    scheduler = graph.scheduler
    await eventually(lambda: scheduler.in_flight == 0 and not core.has_unfinished)
    await eventually(lambda: manager.num_free_blocks == NUM_BLOCKS, what="blocks back")
    core.scheduler.check_integrity()
    manager.check_integrity()
    assert worker.failed == set() and not worker.requests  # told it finished: forgotten
    assert all(a.is_alive for a in (*graph.actors, worker_actor)) and scheduler.num_errors == 1
    await graph.stop()
    await worker_actor.stop()
