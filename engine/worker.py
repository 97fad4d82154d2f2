"""Worker side of the protocol: cached per-request state + a ModelRunner."""

from __future__ import annotations

import itertools

from engine.config import EngineArgs
from engine.logprobs import Logprob, to_dicts
from engine.messages import (
    LogprobRow,
    PromptLogprobs,
    SampledToken,
    StepPlan,
    StepResult,
    TokenLogprob,
    WorkerReady,
)
from engine.model_runner import ModelRunner
from engine.model_runner import StepResult as RunnerResult
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
        rows = self._logprob_rows(result)
        sampled = []
        for request_id, token in result.sampled.items():
            self.requests[request_id].output_token_ids.append(token)
            sampled.append(SampledToken(request_id, token, rows.get(request_id)))
        prompt = tuple(self._prompt_logprobs(result))
        return StepResult(plan.step_id, self.worker_id, tuple(sampled), None, prompt)

    def _logprob_rows(self, result: RunnerResult) -> dict[str, LogprobRow]:
        """Sampled-token logprobs of the requests that asked for them."""
        if result.logprobs is None:
            return {}
        requests = [self.requests[rid] for rid in result.logprob_rows]
        tokens = [result.sampled[rid] for rid in result.logprob_rows]
        tops = [r.params.logprobs or 0 for r in requests]
        return {
            r.request_id: _wire_row(row)
            for r, row in zip(requests, to_dicts(result.logprobs, tokens, tops), strict=True)
            if r.params.logprobs is not None
        }

    def _prompt_logprobs(self, result: RunnerResult):
        for rid, (lp, targets) in result.prompt_logprobs.items():
            request = self.requests[rid]
            rows = to_dicts(lp, targets, [request.params.prompt_logprobs] * len(targets))
            request.prompt_logprobs.extend(rows)  # scored once, even if recomputed later
            yield PromptLogprobs(rid, tuple(_wire_row(r) for r in rows))

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
            if new.params.prompt_logprobs is not None:
                request.prompt_logprobs = [None]
            self.requests[new.request_id] = request
            self.block_tables[new.request_id] = list(new.block_ids)
        for cached in plan.cached_requests:
            table = self.block_tables[cached.request_id]
            if cached.resumed_from_preemption:
                table.clear()
            table.extend(cached.new_block_ids)
            self.requests[cached.request_id].num_computed_tokens = cached.num_computed_tokens


def _wire_row(row: dict[int, Logprob]) -> LogprobRow:
    return tuple(TokenLogprob(t, lp.logprob, lp.rank, None) for t, lp in row.items())


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
