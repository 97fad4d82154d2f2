"""The Worker's failure rule, per request: a diff it cannot apply or a step whose run
raises fails exactly the requests concerned (named in StepResult.failed, forgotten, their
rows in plans already sent skipped until a plan says they finished); a failure in a step
that also moved blocks cannot be pinned on its requests and propagates."""

from __future__ import annotations

import pytest

from engine.messages import CachedRequestData, NewRequestData, StepPlan
from engine.sampling_params import SamplingParams
from engine.worker.worker import NullWorker

PARAMS = SamplingParams(max_tokens=8)


def new(rid: str, blocks: tuple[int, ...] = (0,)) -> NewRequestData:
    return NewRequestData(
        request_id=rid,
        prompt_token_ids=(1, 2, 3),
        params=PARAMS,
        block_ids=blocks,
        num_computed_tokens=0,
    )


def plan(step, new_requests=(), cached=(), scheduled=(), finished=(), copies=()) -> StepPlan:
    ids = tuple(rid for rid, _ in scheduled)
    counts = tuple(n for _, n in scheduled)
    src = tuple(s for s, _ in copies)
    dst = tuple(d for _, d in copies)
    news, finished = tuple(new_requests), tuple(finished)
    return StepPlan(
        step_id=step,
        new_requests=news,
        cached_requests=tuple(cached),
        scheduled_ids=ids,
        num_scheduled_tokens=counts,
        finished_ids=finished,
        copy_src=src,
        copy_dst=dst,
    )


def cached_diff(rid: str, new_blocks: tuple[int, ...], num_computed: int) -> CachedRequestData:
    return CachedRequestData(
        request_id=rid,
        new_block_ids=new_blocks,
        num_computed_tokens=num_computed,
        resumed_from_preemption=False,
    )


class FaultyWorker(NullWorker):
    """Its model run raises whenever request "bad" is in the step."""

    def _run(self, step):
        if any(s.request.request_id == "bad" for s in step.scheduled):
            raise RuntimeError("model run failed")
        return super()._run(step)


def test_a_diff_that_cannot_be_applied_fails_only_its_request():
    worker = NullWorker()
    first = worker.execute(plan(1, [new("a"), new("b", (1,))], scheduled=[("a", 3), ("b", 3)]))
    assert first.sampled_ids == ("a", "b") and first.failed == ()
    # "b" disagrees about its computed tokens; "ghost" was never sent: both fail alone.
    cached = [cached_diff("b", (), 99), cached_diff("ghost", (5,), 1)]
    second = worker.execute(plan(2, cached=cached, scheduled=[("a", 1), ("b", 1), ("ghost", 1)]))
    assert second.sampled_ids == ("a",)
    failed = {f.request_id: f.error for f in second.failed}
    assert set(failed) == {"b", "ghost"}
    assert "99" in failed["b"] and "ghost" in failed["ghost"]
    assert set(worker.requests) == {"a"} and worker.failed == {"b", "ghost"}
    # A plan already on its way still schedules "b": skipped, not failed twice.
    third = worker.execute(plan(3, scheduled=[("a", 1), ("b", 1)]))
    assert third.sampled_ids == ("a",) and third.failed == ()
    # Once a plan says they finished, they are forgotten for good.
    worker.execute(plan(4, finished=["b", "ghost"]))
    assert worker.failed == set()


def test_a_step_whose_run_raises_fails_the_requests_it_scheduled():
    worker = FaultyWorker()
    worker.execute(plan(1, [new("a"), new("c", (2,))], scheduled=[("a", 3), ("c", 3)]))
    result = worker.execute(plan(2, [new("bad", (1,))], scheduled=[("a", 1), ("bad", 3)]))
    assert result.sampled_ids == ()
    assert {f.request_id for f in result.failed} == {"a", "bad"}
    assert all("model run failed" in f.error for f in result.failed)
    assert set(worker.requests) == {"c"}  # not in the failed step: untouched
    after = worker.execute(plan(3, scheduled=[("a", 1), ("c", 1)]))
    assert after.sampled_ids == ("c",) and after.failed == ()


def test_a_failed_step_that_moved_blocks_is_not_pinned_on_its_requests():
    worker = FaultyWorker()
    worker.execute(plan(1, [new("a")], scheduled=[("a", 3)]))
    with pytest.raises(RuntimeError, match="model run failed"):
        worker.execute(plan(2, [new("bad", (1,))], scheduled=[("bad", 3)], copies=[(0, 3)]))
