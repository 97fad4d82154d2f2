"""Step plans carry diffs only: what a worker has not been told, once."""

from __future__ import annotations

from engine import SamplingParams
from engine.core.scheduler_output import SchedulerOutput
from engine.core.step_plan_builder import StepPlanBuilder


def test_step_plans_carry_only_what_changed():
    from engine.core.request import Request
    from engine.core.scheduler_output import ScheduledRequest

    r = Request("a", [1, 2, 3, 4, 5], SamplingParams(), 0)
    builder = StepPlanBuilder()
    first = builder.build(SchedulerOutput(1, (ScheduledRequest(r, 0, 5, (7, 8)),), ()))
    assert [n.block_ids for n in first.new_requests] == [(7, 8)] and not first.cached_requests
    second = builder.build(SchedulerOutput(2, (ScheduledRequest(r, 5, 1, (7, 8)),), ()))
    assert not second.new_requests and not second.cached_requests  # nothing new to say
    assert (second.scheduled_ids, second.num_scheduled_tokens) == (("a",), (1,))
    third = builder.build(SchedulerOutput(3, (ScheduledRequest(r, 8, 1, (7, 8, 9)),), ()))
    assert third.cached_requests[0].new_block_ids == (9,)
    r.num_preemptions += 1  # preempted and re-admitted with fresh blocks
    fourth = builder.build(SchedulerOutput(4, (ScheduledRequest(r, 0, 9, (2, 3, 4)),), ()))
    c = fourth.cached_requests[0]
    assert c.resumed_from_preemption and c.new_block_ids == (2, 3, 4)
    assert c.num_computed_tokens == 0
    fifth = builder.build(SchedulerOutput(5, (), ()), finished_ids=["a"])
    assert fifth.finished_ids == ("a",)
    sixth = builder.build(SchedulerOutput(6, (ScheduledRequest(r, 0, 1, (5,)),), ()))
    assert [n.request_id for n in sixth.new_requests] == ["a"]  # forgotten once finished
