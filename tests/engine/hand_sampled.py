"""Test helpers: a scheduler driven by hand, the test appending the tokens it samples."""

from __future__ import annotations

from engine.core.scheduler import Scheduler
from engine.core.scheduler_output import SchedulerOutput


def advance(sched: Scheduler, plan: SchedulerOutput) -> None:
    """`sched.advance(plan)` without the placeholders the engine core resolves later: the
    plan's tokens are computed, and the test appends each sampled token itself."""
    sched.advance(plan)
    for item in plan.scheduled:
        request = item.request
        if request.num_pending_outputs:
            del request.output_token_ids[-request.num_pending_outputs :]
            request.num_pending_outputs = 0
