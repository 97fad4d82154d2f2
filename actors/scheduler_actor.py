"""The scheduler actor: one EngineCore, keeping the workers' plan queue full.

After every message it tops the pipeline up: while fewer than `pipeline_depth` plans are
in flight and the core has work, it sends the next plan to every worker. Depth 2 is
scheduling one step ahead (plan N+1 goes out before result N is back); depth 1 is the
synchronous mode, kept so the two can be compared.
"""

from __future__ import annotations

import logging

from actors.actor import Actor, send_message
from actors.transport import Inbox, Outbox
from engine.engine_core import EngineCore
from engine.messages import AbortRequest, AddRequest, StepResult

logger = logging.getLogger(__name__)


class SchedulerActor(Actor):
    """Plans steps, sends them to the workers, turns results into TokenDeltas."""

    def __init__(
        self,
        core: EngineCore,
        inbox: Inbox,
        workers: list[Outbox],
        tokenizer: Outbox,
        pipeline_depth: int = 2,
    ) -> None:
        if pipeline_depth not in (1, 2):
            raise ValueError(
                f"pipeline_depth must be 1 (sync) or 2 (one step ahead), got {pipeline_depth}"
            )
        handlers = {
            AddRequest: self.on_add,
            AbortRequest: self.on_abort,
            StepResult: self.on_result,
        }
        super().__init__("scheduler", inbox, handlers, [*workers, tokenizer])
        self.core = core
        self.workers = workers
        self.tokenizer = tokenizer
        self.pipeline_depth = pipeline_depth
        self.in_flight = 0
        self.num_steps = 0

    async def on_add(self, add: AddRequest) -> None:
        self.core.add_request(add)
        await self._fill_pipeline()

    async def on_abort(self, abort: AbortRequest) -> None:
        self.core.abort(abort.request_id)
        await self._fill_pipeline()

    async def on_result(self, result: StepResult) -> None:
        self.in_flight -= 1
        if result.error is not None:
            logger.error(
                "step %d failed on worker %d: %s", result.step_id, result.worker_id, result.error
            )
        deltas = self.core.on_result(result)
        if deltas.deltas:
            await send_message(self.tokenizer, deltas)
        await self._fill_pipeline()

    async def _fill_pipeline(self) -> None:
        while self.in_flight < self.pipeline_depth:
            plan = self.core.plan()
            if plan is None:
                return
            for worker in self.workers:
                await send_message(worker, plan)
            self.in_flight += 1
            self.num_steps += 1
