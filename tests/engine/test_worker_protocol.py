"""Scheduler plans sent as diff-only StepPlans to a Worker with its own model runner
give exactly the offline engine's outputs (chunked prefill and preemption included)."""

from __future__ import annotations

import random

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineArgs
from engine.kv_cache import block_bytes
from engine.llm_engine import LLMEngine
from engine.model_runner import StepResult as RunnerResult
from engine.scheduler_output import SchedulerOutput
from engine.step_plan_builder import StepPlanBuilder
from engine.worker import Worker, build_worker
from tests.engine.tiny_models import SMALL_ENGINE, random_prompts, save_hf_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama-worker")
    save_hf_model("llama", directory)
    return str(directory)


def _drive(engine: LLMEngine, worker: Worker) -> dict[str, list[int]]:
    """The engine's scheduler plans; the worker executes from StepPlans alone."""
    builder, finished_ids, outputs = StepPlanBuilder(), [], {}
    while engine.has_unfinished_requests():
        plan = engine.scheduler.schedule()
        message = worker.execute(builder.build(plan, finished_ids))
        sampled = dict(zip(message.sampled_ids, message.sampled_token_ids, strict=True))
        done = engine._update(plan, RunnerResult(sampled, None, (), {}))
        finished_ids = [o.request_id for o in done]
        outputs.update({o.request_id: o.outputs[0].token_ids for o in done})
    flush = worker.execute(builder.build(SchedulerOutput(-1, (), ()), finished_ids))
    assert flush.sampled_ids == ()
    return outputs


@pytest.mark.parametrize("setting", ["plain", "chunked", "preemption"])
def test_worker_fed_by_step_plans_matches_the_offline_engine(model_dir, setting):
    kwargs = {**SMALL_ENGINE, "seed": 0}
    if setting == "chunked":
        kwargs["max_num_batched_tokens"] = 7
    if setting == "preemption":
        probe = LLM(model_dir, **kwargs)
        kwargs["kv_cache_memory"] = block_bytes(probe.engine.config.model, 4) * (64 // 4 + 3)
    rng = random.Random(5)
    prompts = random_prompts(rng, 12)
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.9]),
            seed=i,
            max_tokens=rng.randint(1, 25),
            ignore_eos=True,
        )
        for i in range(len(prompts))
    ]
    expected_llm = LLM(model_dir, **kwargs)
    expected = expected_llm.generate(prompts, params, use_tqdm=False)

    args = EngineArgs(model=model_dir, **kwargs)
    engine = LLMEngine(args.build())
    worker, ready = build_worker(args)
    assert ready.num_blocks == engine.scheduler.kv_cache.num_blocks
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"offline-{i}", p, sp)
    got = _drive(engine, worker)
    assert [got[f"offline-{i}"] for i in range(len(prompts))] == [
        o.outputs[0].token_ids for o in expected
    ]
    if setting == "preemption":
        assert engine.stats().num_preemptions > 0
    assert not worker.requests  # every finished request was dropped on the worker too


def test_step_plans_carry_only_what_changed():
    from engine.request import Request
    from engine.scheduler_output import ScheduledRequest

    r = Request("a", None, [1, 2, 3, 4, 5], SamplingParams(), 0)
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
