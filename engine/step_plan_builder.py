"""Scheduler side of the worker protocol: plans become StepPlans that carry diffs only."""

from __future__ import annotations

from collections.abc import Iterable

from engine.messages import CachedRequestData, NewRequestData, StepPlan
from engine.scheduler_output import SchedulerOutput


class StepPlanBuilder:
    """Remembers what the workers have been told about each request.

    A request the workers have not seen goes out in full (prompt, params, blocks); after
    that a diff goes out only when it got new blocks (those ids and its computed-token
    count). A preempted request comes back with its whole new block table and
    `resumed_from_preemption`. Finished ids are forgotten here and passed on so workers
    drop their state too.
    """

    def __init__(self) -> None:
        self._sent: dict[str, tuple[int, int]] = {}  # request_id -> (blocks sent, preemptions)

    def build(self, plan: SchedulerOutput, finished_ids: Iterable[str] = ()) -> StepPlan:
        finished = tuple(finished_ids)
        for request_id in finished:
            self._sent.pop(request_id, None)
        new, cached, ids, counts = [], [], [], []
        sent = self._sent
        for r, computed, n, table in plan.scheduled:
            request_id = r.request_id
            ids.append(request_id)
            counts.append(n)
            seen = sent.get(request_id)
            if seen is None:
                new.append(
                    NewRequestData(
                        request_id, tuple(r.prompt_token_ids), r.params, tuple(table), computed
                    )
                )
            elif seen[0] == len(table) and seen[1] == r.num_preemptions:
                continue  # nothing new to say; the worker counts its computed tokens
            else:
                resumed = seen[1] != r.num_preemptions
                start = 0 if resumed else seen[0]
                cached.append(
                    CachedRequestData(request_id, tuple(table[start:]), computed, resumed)
                )
            sent[request_id] = (len(table), r.num_preemptions)
        copies = plan.block_copies
        return StepPlan(
            plan.step_id,
            tuple(new),
            tuple(cached),
            tuple(ids),
            tuple(counts),
            finished,
            tuple(src for src, _ in copies),
            tuple(dst for _, dst in copies),
            tuple(src for src, _ in plan.swap_out),
            tuple(dst for _, dst in plan.swap_out),
            tuple(src for src, _ in plan.swap_in),
            tuple(dst for _, dst in plan.swap_in),
        )
