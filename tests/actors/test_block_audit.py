"""The scheduler's block exchange as an asynchronous audit: the plan goes to the workers
before the block manager answers, the answer is checked when it arrives (a wrong or
failing one stops the scheduler, a missing one too, by its deadline), and one exchange
is open at a time.

The test plays the block manager (answering with a real BlockManager, or wrongly, or not
at all) and the worker; every message the scheduler sends and every answer the test
gives is written, in order, to one log."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from actors.actor import send_message
from actors.scheduler_actor import BlockManagerTimeout, SchedulerActor
from actors.transport import Inbox, Outbox, inproc_pair
from engine.config import SchedulerConfig
from engine.core.engine_core import EngineCore
from engine.kv.block_ledger import BlockLedger, BlockLedgerError
from engine.kv.block_manager import BlockManager
from engine.messages import AddRequest, ApplyBlockOps, BlockOpsApplied, StepPlan
from engine.sampling_params import SamplingParams
from tests.eventually import eventually

TIMEOUT = 5.0
NUM_BLOCKS, BLOCK_SIZE = 8, 4


class LoggedOutbox(Outbox):
    """An in-process outbox that writes each message it sends to a shared log first."""

    carries_messages = True

    def __init__(self, log: list[Any], outbox: Outbox) -> None:
        self.log, self.outbox = log, outbox

    async def send(self, message: Any) -> None:
        self.log.append(message)
        await self.outbox.send(message)

    def close(self) -> None:
        self.outbox.close()


@dataclass
class Rig:
    """A scheduler on a block ledger; the test holds the block manager's and the
    worker's ends."""

    scheduler: SchedulerActor
    to_scheduler: Outbox
    to_replies: Outbox
    blocks_inbox: Inbox
    worker_inbox: Inbox
    log: list[Any]
    manager: BlockManager = field(
        default_factory=lambda: BlockManager(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE)
    )

    async def add(self, request_id: str, prompt: tuple[int, ...], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        await send_message(self.to_scheduler, AddRequest(request_id, prompt, params, 0.0))

    async def traffic(self) -> ApplyBlockOps:
        async with asyncio.timeout(TIMEOUT):
            return await self.blocks_inbox.recv()

    async def plan(self) -> StepPlan:
        async with asyncio.timeout(TIMEOUT):
            return await self.worker_inbox.recv()

    async def answer(self, traffic: ApplyBlockOps) -> None:
        """The block manager's true answer."""
        await send_message(self.to_replies, self.manager.apply(traffic))

    def kinds(self) -> list[str]:
        """The log as 'ops 1', 'plan 1', 'answer 1', ..."""
        return [_kind(m) for m in self.log]


def _kind(message: Any) -> str:
    if isinstance(message, ApplyBlockOps):
        return f"ops {message.exchange_id}"
    if isinstance(message, BlockOpsApplied):
        return f"answer {message.exchange_id}"
    if isinstance(message, StepPlan):
        return f"plan {message.step_id}"
    return type(message).__name__


@pytest.fixture
async def make_rig() -> AsyncIterator:
    started: list[SchedulerActor] = []

    async def make(depth: int = 2, reply_timeout: float = 10.0) -> Rig:
        log: list[Any] = []
        core = EngineCore(
            SchedulerConfig(4, 32, 64), BlockLedger(NUM_BLOCKS, BLOCK_SIZE), frozenset()
        )
        to_scheduler, scheduler_inbox = inproc_pair()
        to_worker, worker_inbox = inproc_pair()
        to_tokenizer, _tokenizer_inbox = inproc_pair()
        to_blocks, blocks_inbox = inproc_pair()
        to_replies, replies_inbox = inproc_pair()
        scheduler = SchedulerActor(
            core,
            scheduler_inbox,
            [LoggedOutbox(log, to_worker)],
            to_tokenizer,
            LoggedOutbox(log, to_blocks),
            replies_inbox,
            pipeline_depth=depth,
            reply_timeout=reply_timeout,
        )
        await scheduler.start()
        started.append(scheduler)
        replies = LoggedOutbox(log, to_replies)
        return Rig(scheduler, to_scheduler, replies, blocks_inbox, worker_inbox, log)

    yield make
    for scheduler in started:
        await scheduler.stop(timeout=1.0)


async def test_the_plan_reaches_the_workers_before_the_block_manager_answers(make_rig):
    rig = await make_rig(depth=1)
    await rig.add("r", (1, 2, 3), max_tokens=2)
    traffic = await rig.traffic()
    plan = await rig.plan()  # nobody has answered the exchange yet
    assert plan.new_requests[0].block_ids == (0,)  # the ledger's own id, no answer needed
    assert rig.scheduler.expects_reply and rig.scheduler.num_exchanges == 0
    await rig.answer(traffic)
    await eventually(lambda: rig.scheduler.num_exchanges == 1, TIMEOUT, "the answer checked")
    assert not rig.scheduler.expects_reply and rig.scheduler.is_alive
    assert rig.kinds() == ["ops 1", "plan 1", "answer 1"]


async def test_at_most_one_exchange_is_open_the_next_waits_for_its_answer(make_rig):
    rig = await make_rig(depth=2)
    # Step 1 fills block 0 with the prompt; step 2 (planned one step ahead) needs block 1.
    await rig.add("r", (1, 2, 3, 4), max_tokens=3)
    first = await rig.traffic()
    await rig.plan()
    # Step 2 is planned and its traffic logged, but neither goes out before answer 1.
    core = rig.scheduler.core
    assert core.num_steps == 2 and core.has_block_traffic and rig.scheduler.num_steps == 1
    await rig.answer(first)
    second = await rig.traffic()
    plan = await rig.plan()
    assert plan.cached_requests[0].new_block_ids == (1,)
    await rig.answer(second)
    await eventually(lambda: rig.scheduler.num_exchanges == 2, TIMEOUT, "both answers checked")
    assert rig.kinds() == ["ops 1", "plan 1", "answer 1", "ops 2", "plan 2", "answer 2"]
    assert rig.scheduler.is_alive and rig.scheduler.crash is None
    rig.manager.check_integrity()


@pytest.mark.parametrize(
    ("wrong", "says"),
    [
        (lambda ok: BlockOpsApplied(ok.exchange_id, (5,), *_counts(ok)), "has ids \\[5\\]"),
        (
            lambda ok: BlockOpsApplied(ok.exchange_id, (), *_counts(ok), "op grow 'r': no room"),
            "no room",
        ),
        (
            lambda ok: BlockOpsApplied(7, ok.block_ids, *_counts(ok)),
            "unexpected answer to exchange 7",
        ),
    ],
    ids=["wrong ids", "op failed", "wrong exchange"],
)
async def test_a_wrong_answer_stops_the_scheduler_when_it_arrives(make_rig, wrong, says):
    rig = await make_rig(depth=1)
    await rig.add("r", (1, 2, 3), max_tokens=2)
    traffic = await rig.traffic()
    await rig.plan()
    # Only the answer arrives: nothing else wakes the scheduler to look at it.
    await send_message(rig.to_replies, wrong(rig.manager.apply(traffic)))
    await eventually(lambda: not rig.scheduler.is_alive, TIMEOUT, "the scheduler stopped")
    assert isinstance(rig.scheduler.crash, BlockLedgerError)
    assert re.search(says, str(rig.scheduler.crash))


def _counts(ok: BlockOpsApplied) -> tuple[int, int]:
    return ok.num_free_blocks, ok.num_cached_blocks


@pytest.mark.parametrize(
    ("prompt", "sent"),
    [
        ((1, 2, 3), ["ops 1", "plan 1", "plan 2"]),  # step 2 needs no block: idle after it
        ((1, 2, 3, 4), ["ops 1", "plan 1"]),  # step 2 needs one: it waits for answer 1
    ],
    ids=["by its deadline while idle", "while the next exchange waits"],
)
async def test_a_silent_block_manager_is_caught_within_the_timeout(make_rig, prompt, sent):
    reply_timeout = 0.3
    rig = await make_rig(depth=2, reply_timeout=reply_timeout)
    start = time.monotonic()
    await rig.add("r", prompt, max_tokens=3)
    await rig.traffic()  # never answered
    await eventually(lambda: not rig.scheduler.is_alive, TIMEOUT, "the scheduler stopped")
    assert time.monotonic() - start < reply_timeout + 1.0
    assert isinstance(rig.scheduler.crash, BlockManagerTimeout)
    assert "no answer to block exchange 1 in 0.3 s" in str(rig.scheduler.crash)
    assert rig.kinds() == sent
