"""Scheduler side of the worker protocol: plans become StepPlans that carry diffs only."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.core.request import Request
from engine.core.scheduler_output import SchedulerOutput
from engine.messages import CachedRequestData, NewRequestData, StepPlan
from engine.structured_outputs import StructuredOutputsParams


class StepPlanBuilder:
    """Remembers what the workers have been told about each request.

    A request the workers have not seen goes out in full (prompt, params, blocks); after
    that a diff goes out only when it got new blocks (those ids and its computed-token
    count). A preempted request comes back with its whole new block table and
    `resumed_from_preemption`. A beam whose newest token the search chose (`choose`)
    gets a diff carrying it the next time it is scheduled. Finished ids are forgotten
    here and passed on so workers drop their state too. A request admitted to load its
    prompt's KV goes out in full with the plan that admits it (`load_ids`).
    """

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request_id -> (blocks sent, preemptions)
        self._chosen: dict[str, int] = {}  # request_id -> its newest token, not yet sent
        self._grammars: list[StructuredOutputsParams] = []  # to compile, not yet sent

    def prepare_grammar(self, params: StructuredOutputsParams) -> None:
        """The next plan tells the workers to start compiling `params` (a request being
        admitted needs it: see PrepareGrammar)."""
        if params not in self._grammars:
            self._grammars.append(params)

    def choose(self, request_id: str, token_id: int) -> None:
        """`request_id`'s newest output token is `token_id`, whatever the worker sampled."""
        self._chosen[request_id] = token_id

    def build(self, plan: SchedulerOutput, finished_ids: Iterable[str] = ()) -> StepPlan:
        finished = tuple(finished_ids)
        chosen = self._chosen
        for request_id in finished:
            self._sent.pop(request_id, None)
            chosen.pop(request_id, None)
        new, cached, ids, counts, lookahead = [], [], [], [], []
        sent = self._sent
        rewritten = dict(plan.rewritten_tables) if plan.rewritten_tables else None
        for r, computed, _, table, _ in plan.loads:  # sent in full, to load into
            new.append(self._new(r, computed, table))
            sent[r.request_id] = (len(table), r.num_preemptions)
        for r, computed, n, table, k in plan.scheduled:
            request_id = r.request_id
            ids.append(request_id)
            counts.append(n)
            lookahead.append(k)
            seen = sent.get(request_id)
            if seen is None:
                new.append(self._new(r, computed, table))
                if chosen:
                    chosen.pop(request_id, None)
            elif (
                seen[0] == len(table)
                and seen[1] == r.num_preemptions
                and not (chosen and request_id in chosen)
                and not (rewritten and request_id in rewritten)
            ):
                continue  # nothing new to say; the worker counts its computed tokens
            else:
                cached.append(self._diff(r, computed, table, seen, rewritten))
            sent[request_id] = (len(table), r.num_preemptions)
        copies = plan.block_copies
        return StepPlan(
            step_id=plan.step_id,
            new_requests=tuple(new),
            cached_requests=tuple(cached),
            scheduled_ids=tuple(ids),
            num_scheduled_tokens=tuple(counts),
            finished_ids=finished,
            copy_src=tuple(src for src, _ in copies),
            copy_dst=tuple(dst for _, dst in copies),
            swap_out_src=tuple(src for src, _ in plan.swap_out),
            swap_out_dst=tuple(dst for _, dst in plan.swap_out),
            swap_in_src=tuple(src for src, _ in plan.swap_in),
            swap_in_dst=tuple(dst for _, dst in plan.swap_in),
            grammars=self._take_grammars(),
            num_lookahead_tokens=tuple(lookahead) if any(lookahead) else (),
            load_ids=tuple(s.request.request_id for s in plan.loads),
        )

    @staticmethod
    def _new(r: Request, computed: int, table: Sequence[int]) -> NewRequestData:
        known = len(r.output_token_ids) - r.num_pending_outputs
        return NewRequestData(
            request_id=r.request_id,
            prompt_token_ids=tuple(r.prompt_token_ids),
            params=r.params,
            block_ids=tuple(table),
            num_computed_tokens=computed,
            output_token_ids=tuple(r.output_token_ids[:known]),
        )

    def _take_grammars(self) -> tuple[StructuredOutputsParams, ...]:
        grammars, self._grammars = tuple(self._grammars), []
        return grammars

    def _diff(
        self,
        r: Request,
        computed: int,
        table: Sequence[int],
        seen: tuple[int, int],
        rewritten: dict[str, int] | None,
    ) -> CachedRequestData:
        """A cached request's diff: its new blocks, its whole table after a preemption,
        or its table from the first block a copy-on-write replaced; and the token a beam
        search chose for it."""
        request_id = r.request_id
        resumed = seen[1] != r.num_preemptions
        start, first = (0, -1) if resumed else (seen[0], -1)
        if not resumed and rewritten and request_id in rewritten:
            start = first = min(rewritten[request_id], seen[0])
        last = self._chosen.pop(request_id, None) if self._chosen else None
        return CachedRequestData(
            request_id=request_id,
            new_block_ids=tuple(table[start:]),
            num_computed_tokens=computed,
            resumed_from_preemption=resumed,
            last_token_id=last,
            first_block_index=first,
            num_lookahead_tokens=r.num_lookahead_tokens,
        )
