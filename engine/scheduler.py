"""The scheduler: one rule, computed tokens catch up with known tokens."""

from __future__ import annotations

import bisect
from collections import deque

from engine.config import SchedulerConfig
from engine.kv_cache_manager import KVCacheManager
from engine.policies import LatestArrivalFirst, PreemptionPolicy
from engine.request import Request, RequestStatus
from engine.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.stop_checker import max_num_tokens


class Scheduler:
    """Plans each step under a token budget and a sequence cap, FCFS.

    Running requests are served first, in arrival order; then waiting requests are
    admitted in order until the budget, the sequence cap or the free blocks run out
    (the first that does not fit blocks the rest, so preempted requests, which wait at
    the front, are re-admitted before anything new). When a running request cannot get
    its blocks, the preemption policy picks a victim whose blocks are all freed; it is
    recomputed later from its known tokens.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        preemption: PreemptionPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.preemption = preemption or LatestArrivalFirst()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival_index
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._step_id = 0

    # -- queue ---------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        request.max_num_tokens = max_num_tokens(
            request.params, request.num_prompt_tokens, self.config.max_model_len
        )
        self.waiting.append(request)
        self.requests[request.request_id] = request

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Ends a request (stop, length, abort, error) and frees its blocks at once."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv_cache.free(request_id)
        return request

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # -- planning ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[str] = []
        for request in list(self.running):
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_tokens = len(request.prompt_token_ids) + len(request.output_token_ids)
            if num_tokens >= request.max_num_tokens:
                continue  # at its length limit: it only awaits its last result
            n = min(num_tokens - request.num_computed_tokens, budget)
            item = self._schedule_running(request, n, preempted)
            if item is not None:
                scheduled.append(item)
                budget -= n
        if not preempted:
            scheduled += self._admit_waiting(budget)
        self._step_id += 1
        return SchedulerOutput(self._step_id, tuple(scheduled), tuple(preempted))

    def _schedule_running(
        self, request: Request, n: int, preempted: list[str]
    ) -> ScheduledRequest | None:
        """`n` more tokens for `request`, preempting (maybe itself) until its blocks fit."""
        while not self.kv_cache.allocate_slots(request.request_id, request.num_computed_tokens + n):
            victim = self.preemption.choose_victim(self.running)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return None
        return self._plan(request, n)

    def _admit_waiting(self, budget: int) -> list[ScheduledRequest]:
        admitted = []
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if self._at_limit(request):
                break  # its pending result will finish it; FCFS keeps the rest waiting
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self.kv_cache.allocate_slots(request.request_id, n):
                break
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=lambda r: r.arrival_index)
            admitted.append(self._plan(request, n))
            budget -= n
        return admitted

    def _at_limit(self, request: Request) -> bool:
        """Known tokens (sampled or still pending) already reach the length limit:
        computing more would only make a token that is thrown away."""
        return request.num_tokens >= request.max_num_tokens

    def _plan(self, request: Request, n: int) -> ScheduledRequest:
        table = self.kv_cache.block_table(request.request_id)
        return ScheduledRequest(request, request.num_computed_tokens, n, table)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv_cache.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- results -------------------------------------------------------------------
    def advance(self, plan: SchedulerOutput, placeholder: int | None = None) -> None:
        """Marks the plan's tokens as computed (once the step ran, or at once when planning
        ahead: then every row that samples also gets `placeholder` as its next output,
        for the result to fill in)."""
        running = RequestStatus.RUNNING
        for request, computed, n, _ in plan.scheduled:
            if request.status == running:
                request.num_computed_tokens += n
            if placeholder is None:
                continue
            if computed + n == len(request.prompt_token_ids) + len(request.output_token_ids):
                request.output_token_ids.append(placeholder)
                request.num_pending_outputs += 1

    def check_integrity(self) -> None:
        """Blocks are consistent with every running request's computed tokens."""
        stored = {r.request_id: r.num_computed_tokens for r in self.running}
        self.kv_cache.check_integrity(stored)
        for r in self.waiting:
            assert not self.kv_cache.block_table(r.request_id), f"{r.request_id} waits with blocks"
