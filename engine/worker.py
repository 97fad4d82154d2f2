"""Worker side of the protocol: cached per-request state + a ModelRunner."""

from __future__ import annotations

import itertools

from engine.config import EngineArgs
from engine.messages import SampledToken, StepPlan, StepResult, WorkerReady
from engine.model_runner import ModelRunner
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest, SchedulerOutput


class Worker:
    """Applies each StepPlan's diffs to its cached requests and runs the step.

    The worker keeps every running request's token ids, including the tokens it sampled
    itself, so a plan never carries sampled tokens back. Contract: a request id is new in
    exactly one plan, cached afterwards, and dropped when it appears in `finished_ids`.
    """

    def __init__(self, runner: ModelRunner, worker_id: int = 0) -> None:
        self.runner = runner
        self.worker_id = worker_id
        self.requests: dict[str, Request] = {}
        self.block_tables: dict[str, list[int]] = {}
        self._arrivals = itertools.count()

    def execute(self, plan: StepPlan) -> StepResult:
        self._apply(plan)
        if not plan.scheduled:  # a plan may only carry finished ids
            return StepResult(plan.step_id, self.worker_id, (), None)
        scheduled = tuple(
            ScheduledRequest(
                self.requests[s.request_id],
                self.requests[s.request_id].num_computed_tokens,
                s.num_tokens,
                tuple(self.block_tables[s.request_id]),
            )
            for s in plan.scheduled
        )
        result = self.runner.execute(SchedulerOutput(plan.step_id, scheduled, ()))
        for item in scheduled:
            item.request.num_computed_tokens += item.num_scheduled_tokens
        sampled = []
        for request_id, token in result.sampled.items():
            self.requests[request_id].output_token_ids.append(token)
            sampled.append(SampledToken(request_id, token))
        return StepResult(plan.step_id, self.worker_id, tuple(sampled), None)

    def _apply(self, plan: StepPlan) -> None:
        for request_id in plan.finished_ids:
            self.requests.pop(request_id, None)
            self.block_tables.pop(request_id, None)
        eos = self.runner.model_config.eos_token_ids
        for new in plan.new_requests:
            request = Request(
                new.request_id,
                None,
                list(new.prompt_token_ids),
                new.params,
                next(self._arrivals),
                eos_token_ids=eos,
                status=RequestStatus.RUNNING,
            )
            request.num_computed_tokens = new.num_computed_tokens
            self.requests[new.request_id] = request
            self.block_tables[new.request_id] = list(new.block_ids)
        for cached in plan.cached_requests:
            table = self.block_tables[cached.request_id]
            if cached.resumed_from_preemption:
                table.clear()
            table.extend(cached.new_block_ids)
            self.requests[cached.request_id].num_computed_tokens = cached.num_computed_tokens


def build_worker(args: EngineArgs, worker_id: int = 0) -> tuple[Worker, WorkerReady]:
    """Loads the model, sizes and allocates the KV cache; returns the ready message."""
    config = args.build()
    runner = ModelRunner(
        config.model,
        config.cache,
        config.device,
        config.scheduler.max_num_batched_tokens,
        config.scheduler.max_num_seqs,
    )
    num_blocks = runner.num_blocks()
    runner.initialize_cache(num_blocks)
    ready = WorkerReady(
        worker_id,
        num_blocks,
        config.cache.block_size,
        config.model.max_model_len,
        config.model.vocab_size,
    )
    return Worker(runner, worker_id), ready
