"""The scheduler actor: one EngineCore, keeping the workers' plan queue full.

After every message (`after_message`) it tops the pipeline up: while fewer than
`pipeline_depth` plans are in flight and the core has work, it plans a step, sends that
step's block traffic to the block manager (one ApplyBlockOps) and, without waiting for
the answer, sends the plan to every worker. Depth 2 is scheduling one step ahead (plan
N+1 goes out before result N is back); depth 1 is the synchronous mode, kept so the two
can be compared. Frees of requests that ended go out before the actor waits again, so
an aborted request's blocks are free within the step.

The block exchange is an audit, not a question: the core's ledger has already decided
every block id the plan carries, and the block manager's BlockOpsApplied (on a reply
inbox of its own) only confirms them. So the answer is checked when it arrives, like a
result, and never sits between planning and the workers.
"""

from __future__ import annotations

import logging
from functools import partial

from actors.actor import Actor, send_message
from actors.pending_reply import PendingReply
from actors.transport import Inbox, Outbox
from engine.codec import InboxDecoder
from engine.core.engine_core import EngineCore
from engine.messages import (
    INBOXES,
    AbortRequest,
    AddRequest,
    PrepareGrammar,
    RequestFailed,
    StepResult,
)

logger = logging.getLogger(__name__)


class BlockManagerTimeout(RuntimeError):
    """The block manager did not answer an exchange in time (it is gone or stuck)."""


class SchedulerActor(Actor):
    """Plans steps, sends them to the workers, turns results into TokenDeltas.

    Block exchanges: at most one is open. Its answer is handled as it arrives (the
    actor's loop waits for it beside the inbox, `Actor.expect`), or, when the next
    exchange is due before it came, that exchange first waits for it (`Actor.settle`):
    the ledger and the block manager never see interleaved traffic, and no traffic is
    held back. An answer that disagrees with the ledger or names an op the block manager
    could not apply raises `BlockLedgerError`; none within `reply_timeout` seconds of its
    exchange raises `BlockManagerTimeout`. Both stop the actor (a diverged or silent block
    manager is about every request). A request whose AddRequest or AbortRequest handling
    raised, or that a worker could not run (`StepResult.failed`), is ended in the core
    (its blocks freed) and reported to the tokenizer (`RequestFailed`). Planning and
    results are about every request at once: an exception there stops the actor (the
    engine then fails every request).
    """

    def __init__(
        self,
        core: EngineCore,
        inbox: Inbox,
        workers: list[Outbox],
        tokenizer: Outbox,
        block_manager: Outbox,
        block_replies: Inbox,
        pipeline_depth: int = 2,
        reply_timeout: float = 10.0,
    ) -> None:
        if pipeline_depth not in (1, 2):
            raise ValueError(
                f"pipeline_depth must be 1 (sync) or 2 (one step ahead), got {pipeline_depth}"
            )
        handlers = {
            AddRequest: self.on_add,
            PrepareGrammar: self.on_prepare_grammar,
            AbortRequest: self.on_abort,
            StepResult: self.on_result,
        }
        outboxes = [*workers, tokenizer, block_manager]
        super().__init__("scheduler", inbox, handlers, outboxes, [block_replies])
        self.core = core
        self.workers = workers
        self.tokenizer = tokenizer
        self.block_manager = block_manager
        self.block_replies = block_replies
        self.reply_decoder = InboxDecoder(INBOXES["block_replies"])
        self.pipeline_depth = pipeline_depth
        self.reply_timeout = reply_timeout
        self.in_flight = 0
        self.num_steps = 0
        self.num_exchanges = 0  # answered and checked
        self.worker_busy_seconds = 0.0  # summed over results (worker 0's view of a step)

    async def on_add(self, add: AddRequest) -> None:
        self.core.add_request(add)

    async def on_prepare_grammar(self, prepare: PrepareGrammar) -> None:
        self.core.prepare_grammar(prepare)

    async def on_abort(self, abort: AbortRequest) -> None:
        self.core.abort(abort.request_id)

    async def fail_request(self, request_id: str, error: str, message: object) -> None:
        """Ends the request in the core and tells the tokenizer, which tells its client."""
        request_id = self.core.fail(request_id) or request_id
        await send_message(self.tokenizer, RequestFailed(request_id, error))

    async def after_message(self) -> None:
        await self._fill_pipeline()

    async def on_result(self, result: StepResult) -> None:
        self.in_flight -= 1
        self.worker_busy_seconds += result.busy_seconds
        if result.error is not None:
            logger.error(
                "step %d failed on worker %d: %s", result.step_id, result.worker_id, result.error
            )
        deltas = self.core.on_result(result)
        if deltas.request_ids or deltas.ranked:
            await send_message(self.tokenizer, deltas)
        for failed in result.failed:
            logger.warning(
                "worker %d could not run %s: %s", result.worker_id, failed.request_id, failed.error
            )
            self.num_errors += 1
            await self.fail_request(failed.request_id, failed.error, result)

    async def _fill_pipeline(self) -> None:
        while self.in_flight < self.pipeline_depth:
            output = self.core.schedule()
            if output is None:
                break
            await self._send_block_traffic()
            plan = self.core.build_plan(output)
            for worker in self.workers:
                await send_message(worker, plan)
            self.in_flight += 1
            self.num_steps += 1
        await self._send_block_traffic()  # frees of requests that ended, if no step took them

    async def _send_block_traffic(self) -> None:
        """Sends the ops since the last exchange, if any, and expects the answer; the
        open exchange's answer first, if it is not in yet."""
        if not self.core.has_block_traffic:
            return
        await self.settle()
        traffic = self.core.block_traffic()
        await send_message(self.block_manager, traffic)
        timed_out = partial(
            BlockManagerTimeout,
            f"no answer to block exchange {traffic.exchange_id} in {self.reply_timeout:g} s",
        )
        reply = PendingReply(self.block_replies, self.reply_timeout, timed_out)
        self.expect(reply, self._on_block_ops_applied)

    def _on_block_ops_applied(self, frame: object) -> None:
        self.core.on_block_ops_applied(self.reply_decoder.decode(frame))
        self.num_exchanges += 1
