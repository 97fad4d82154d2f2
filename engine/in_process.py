"""The served engine's pieces, called directly: what the offline `LLM` runs.

`InProcessEngine` is the served request path without the actors: the same
`TextProcessor` admits each request and detokenizes its tokens, the same `EngineCore`
plans steps (up to `pipeline_depth` ahead, as the scheduler actor does) and turns
results into token deltas, and the same `Worker` applies each `StepPlan` and runs the
model. No sockets, no event loop, no extra process: each call returns when it is done.
"""

from __future__ import annotations

import time
from collections import deque

from engine.core.stats import EngineStats
from engine.errors import describe
from engine.messages import (
    GenerateRequest,
    OutputDelta,
    StepPlan,
    StepResult,
    TokenDeltas,
)
from engine.output_assembler import OutputAssembler
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.wiring import EngineParts
from engine.worker.worker import Worker

CLIENT_ID = "in-process"
Prompt = str | list[int]


class InProcessEngine:
    """`add_request` (raises ValueError before anything is queued), then `step()` until
    `has_unfinished_requests()` is False; each step returns the requests it finished.

    Depth 1 delivers each step's result before planning the next; depth 2 plans step
    N+1 before result N is delivered (the served default, so both paths can be compared
    token for token; in one thread it only costs the tokens planned past a stop)."""

    def __init__(self, parts: EngineParts, worker: Worker, pipeline_depth: int = 1) -> None:
        if pipeline_depth not in (1, 2):
            raise ValueError(
                f"pipeline_depth must be 1 (sync) or 2 (one step ahead), got {pipeline_depth}"
            )
        self.core, self.processor = parts.core, parts.processor
        self.tokenizer = parts.processor.tokenizer
        self.worker = worker
        self.pipeline_depth = pipeline_depth
        self.outputs = OutputAssembler()
        self._in_flight: deque[StepResult] = deque()

    # -- requests ------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: Prompt, params: SamplingParams) -> None:
        keep_logprobs = not _ranked_without_logprobs(params)
        if not keep_logprobs:  # best_of ranks its sequences by their sampled logprobs
            params = params.with_updates(logprobs=0)  # (their sums go out, not the rows)
        request = GenerateRequest.of(request_id, CLIENT_ID, prompt, params)
        add = self.processor.admit(request, time.time())
        prompt_ids = list(add.prompt_token_ids)
        self.outputs.open(request_id, request.prompt, prompt_ids, params, keep_logprobs)
        self.core.add_request(add)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Ends the request; its output so far, every open sequence "abort" (None:
        not in flight)."""
        self.processor.drop(request_id)
        self.core.abort(request_id)
        return self.outputs.add(OutputDelta.aborted(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished or bool(self._in_flight)

    # -- the loop ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Plans until `pipeline_depth` steps are in flight, then delivers the oldest
        result; returns the requests that finished with it."""
        while len(self._in_flight) < self.pipeline_depth:
            plan = self.core.plan()
            if plan is None:
                break
            self._note_scheduled(plan)
            self._in_flight.append(self.worker.execute(plan))
        if not self._in_flight:
            if self.core.has_unfinished:
                raise RuntimeError(f"no step can run: {self.core.stats()}")
            return []
        return self._deliver(self._in_flight.popleft())

    def flush(self) -> None:
        """Once nothing is left: tells the worker to drop the requests that ended."""
        plan = None if self._in_flight else self.core.plan()
        if plan is not None:
            self.worker.execute(plan)

    def _note_scheduled(self, plan: StepPlan) -> None:
        for new in plan.new_requests:
            self.outputs.scheduled(self.processor.request_of(new.request_id))

    def _deliver(self, result: StepResult) -> list[RequestOutput]:
        deltas = self.core.on_result(result)
        finished = [self._fail(f.request_id, f.error) for f in result.failed]
        for out in self._text(deltas):
            done = self.outputs.add(out)
            if done is not None:
                finished.append(done)
        return [out for out in finished if out is not None]

    def _text(self, message: TokenDeltas) -> list[OutputDelta]:
        """The tokenizer actor's work: each delta's text, stop strings ending sequences
        (aborted in the core at once), ranked outputs decoded whole."""
        outs: list[OutputDelta] = []
        for delta in message.deltas():
            try:
                new, abort = self.processor.on_token_delta(delta)
            except Exception as exc:  # noqa: BLE001 - the failure rule: this request only
                outs.append(self._failed(self.processor.request_of(delta.request_id), exc))
                continue
            if abort is not None:
                self.core.abort(abort.request_id)
            outs += new
        if message.ranked:
            self.outputs.add_scores(message.ranked)
            ranked = self.processor.on_ranked(message.ranked, message.prompt_logprobs)
            outs += [out for _, out in ranked]
        return outs

    def _failed(self, request_id: str, exc: Exception) -> OutputDelta:
        self.processor.drop(request_id)
        self.core.fail(request_id)
        return OutputDelta.failed(request_id, describe(exc))

    def _fail(self, request_id: str, error: str) -> RequestOutput | None:
        """A request the worker could not run ends with its error."""
        request_id = self.core.fail(request_id) or self.processor.request_of(request_id)
        self.processor.drop(request_id)
        return self.outputs.add(OutputDelta.failed(request_id, error))

    # -- engine-wide ---------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self.core.stats()

    def reset_prefix_cache(self) -> int:
        """Forgets every cached prefix; returns how many cached blocks were dropped."""
        return self.core.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.core.check_integrity()


def _ranked_without_logprobs(params: SamplingParams) -> bool:
    sampled_ranked = params.num_sequences > params.n and not params.use_beam_search
    return sampled_ranked and params.logprobs is None
