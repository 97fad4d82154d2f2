"""The simulator: the real engine core on a virtual clock. Deterministic for a
seed; on the same trace it schedules step for step what the real engine schedules on
CPU (same request ids in each step's batch, same preemptions); the cost model and the
traces behave as documented."""

from __future__ import annotations

import random

import pytest

from engine.config import SchedulerConfig
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from engine.sim.baselines.reservation import ReservationPolicy
from engine.sim.cost_model import PRESETS, StepShape, preset
from engine.sim.simulator import Simulator, SimulatorConfig
from engine.sim.trace import TraceRequest, poisson_trace

TINY = dict(skip_tokenizer_init=True, block_size=4, max_model_len=64)


def _trace(num: int, seed: int = 0) -> list[TraceRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(num):
        prompt = tuple(rng.randrange(3, 200) for _ in range(rng.randint(3, 20)))
        out.append(TraceRequest(f"q{i}", 0.0, len(prompt), rng.randint(4, 30), prompt))
    return out


def _real_batches(llm: LLM, trace: list[TraceRequest]) -> list[tuple[tuple[str, ...], int]]:
    """Each step's scheduled ids and the preemptions so far, from the real engine."""
    engine, seen = llm.engine, []
    plan = engine.core.plan

    def recording_plan(*args, **kwargs):
        step = plan(*args, **kwargs)
        if step is not None and step.scheduled_ids:  # an empty plan only tells what ended
            seen.append((step.scheduled_ids, engine.core.scheduler.num_preemptions))
        return step

    engine.core.plan = recording_plan
    for r in trace:
        params = SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0)
        engine.add_request(r.request_id, list(r.prompt_token_ids), params)
    while engine.has_unfinished_requests():
        engine.step()
    engine.check_integrity()
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("pipeline_depth", [1, 2])
def test_the_simulator_schedules_what_the_real_engine_schedules(pipeline_depth):
    trace = _trace(24)
    kwargs = dict(max_num_seqs=6, max_num_batched_tokens=32, kv_cache_memory=24 * 2048)
    with LLM("builtin:tiny", pipeline_depth=pipeline_depth, **TINY, **kwargs) as llm:
        num_blocks = llm.engine.core.blocks.num_blocks
        real = _real_batches(llm, trace)
        scheduler, caching = llm.config.scheduler, llm.config.cache.enable_prefix_caching
    config = SimulatorConfig(scheduler, num_blocks, 4, caching, pipeline_depth=pipeline_depth)
    result = Simulator(config, preset("opt-13b-a100"), record_batches=True).run(trace)
    simulated = [(s.request_ids, s.num_preemptions) for s in result.steps]
    assert real[-1][1] > 0  # the cache is small enough to preempt
    assert simulated == real
    assert all(r.finish_s is not None for r in result.requests.values())


@pytest.mark.timeout(60)
def test_a_run_is_a_function_of_its_trace():
    rng = random.Random(3)
    lengths = [(rng.randint(10, 400), rng.randint(10, 400)) for _ in range(200)]
    trace = poisson_trace(lengths, 4.0, 300, seed=5, max_len=1024)
    cost = preset("opt-13b-a100")
    config = SimulatorConfig(SchedulerConfig(64, 2048, 1024), 300, 16)
    first, second = (Simulator(config, cost, record_batches=True).run(trace) for _ in range(2))
    assert first.steps == second.steps and first.requests == second.requests
    assert first.num_preemptions > 0 and first.end_s > trace[-1].arrival_s
    for r in first.requests.values():  # nothing runs before it arrives, everything ends
        assert r.arrival_s < r.first_token_s <= r.finish_s


@pytest.mark.timeout(60)
def test_the_clock_waits_for_arrivals():
    trace = [TraceRequest("a", 0.0, 8, 4), TraceRequest("b", 100.0, 8, 4)]
    config = SimulatorConfig(SchedulerConfig(8, 64, 64), 64, 4)
    result = Simulator(config, preset("opt-13b-a100"), record_batches=True).run(trace)
    assert result.requests["a"].finish_s < 1.0
    assert [s.request_ids for s in result.steps] == [("a",)] * 4 + [("b",)] * 4
    assert result.steps[4].start_s == 100.0
    assert result.requests["b"].latency_s == pytest.approx(result.requests["a"].latency_s)


def test_the_cost_model_follows_the_paper_setups():
    opt13 = preset("opt-13b-a100")
    assert opt13.num_kv_slots == 15_700 and opt13.kv_bytes_per_token == 2 * 40 * 5120 * 2
    decode = opt13.step_seconds(StepShape(1, 0))
    assert 0.015 < decode < 0.04  # 26 GB of weights at ~1.2 TB/s, plus the overhead
    assert opt13.step_seconds(StepShape(32, 32 * 500)) > decode  # reading KV costs
    assert opt13.step_seconds(StepShape(4096, 4096)) > 10 * decode  # prefill is compute
    assert preset("opt-175b-8xa100-80gb").num_gpus == 8 and len(PRESETS) == 4
    with pytest.raises(ValueError, match="preset must be one of"):
        preset("gpt-5")


def test_calibration_recovers_overhead_and_efficiency():
    truth = preset("opt-13b-a100")
    from dataclasses import replace

    truth = replace(truth, overhead_s=0.004, efficiency=0.6)
    steps = [StepShape(8, c) for c in (0, 2_000, 8_000, 15_000)]
    fitted = preset("opt-13b-a100").calibrated([(s, truth.step_seconds(s)) for s in steps])
    assert fitted.overhead_s == pytest.approx(0.004, rel=1e-6)
    assert fitted.efficiency == pytest.approx(0.6, rel=1e-6)


def test_poisson_traces_are_seeded_and_fit_the_context():
    lengths = [(3000, 10), (100, 5000), (50, 50)]
    a, b = (poisson_trace(lengths, 2.0, 4000, seed=9, max_len=2048) for _ in range(2))
    assert a == b and a != poisson_trace(lengths, 2.0, 4000, seed=10, max_len=2048)
    gaps = [y.arrival_s - x.arrival_s for x, y in zip(a, a[1:], strict=False)]
    assert sum(gaps) / len(gaps) == pytest.approx(0.5, rel=0.1)
    assert all(r.prompt_len + r.output_len <= 2048 for r in a)
    with pytest.raises(ValueError, match="rate must be > 0"):
        poisson_trace(lengths, 0, 1)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("allocator", [None, *ReservationPolicy])
def test_every_kv_slot_is_accounted_for_in_every_system(allocator):
    """Paged and the Orca baselines run the same trace to the end; at every step each
    slot is in exactly one share, so the shares sum to the cache's size."""
    rng = random.Random(11)
    lengths = [(rng.randint(10, 300), rng.randint(10, 300)) for _ in range(100)]
    trace = poisson_trace(lengths, 20.0, 150, seed=2, max_len=512)
    config = SimulatorConfig(SchedulerConfig(32, 512, 512), 200, 16, allocator=allocator)
    simulator = Simulator(config, preset("opt-13b-a100"))
    result = simulator.run(trace)
    assert all(r.finish_s is not None for r in result.requests.values())
    assert sum(result.memory_sums) == len(result.steps) * 200 * 16
    assert sum(result.mean_memory_shares().values()) == pytest.approx(1.0)
    simulator.core.check_integrity()
    if allocator is None:  # paged: only a partial last block per table is not a token
        assert result.used_by_tokens() > 0.9
    else:
        assert result.used_by_tokens() < 0.75


@pytest.mark.timeout(60)
def test_paged_batches_more_requests_than_any_baseline_under_load():
    rng = random.Random(4)
    lengths = [(rng.randint(50, 400), rng.randint(50, 400)) for _ in range(200)]
    trace = poisson_trace(lengths, 30.0, 300, seed=3, max_len=1024)
    batch = {}
    for allocator in (None, *ReservationPolicy):
        config = SimulatorConfig(SchedulerConfig(64, 1024, 1024), 300, 16, allocator=allocator)
        batch[allocator] = Simulator(config, preset("opt-13b-a100")).run(trace).mean_batch_size()
    assert batch[None] > batch[ReservationPolicy.ORACLE] > batch[ReservationPolicy.MAX]
    assert batch[ReservationPolicy.POW2] > batch[ReservationPolicy.MAX]


def test_swapping_costs_pcie_time():
    opt13 = preset("opt-13b-a100")
    plain, swapping = StepShape(8, 4000), StepShape(8, 4000, num_swapped_tokens=1000)
    extra = opt13.step_seconds(swapping) - opt13.step_seconds(plain)
    assert extra == pytest.approx(1000 * opt13.kv_bytes_per_token / opt13.pcie_bandwidth)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("allocator", [None, ReservationPolicy.ORACLE])
def test_parallel_samples_finish_together_and_paged_shares_their_prompt(allocator):
    trace = [TraceRequest(f"s{i}", i * 0.01, 200, 20, n=4) for i in range(6)]
    config = SimulatorConfig(SchedulerConfig(64, 2048, 512), 400, 16, allocator=allocator)
    simulator = Simulator(config, preset("opt-13b-a100"))
    result = simulator.run(trace)
    assert all(r.finish_s is not None for r in result.requests.values())
    assert set(result.requests) == {f"s{i}" for i in range(6)}
    if allocator is None:  # four sequences, one copy of the prompt's full blocks
        assert result.stats.mean_kv_sharing_saving > 0.3


@pytest.mark.timeout(60)
def test_without_sharing_parallel_samples_copy_their_prompt():
    trace = [TraceRequest(f"s{i}", i * 0.01, 200, 20, n=4) for i in range(6)]
    used = {}
    for share in (True, False):
        config = SimulatorConfig(SchedulerConfig(64, 2048, 512), 400, 16, share_blocks=share)
        simulator = Simulator(config, preset("opt-13b-a100"))
        result = simulator.run(trace)
        simulator.core.check_integrity()
        assert all(r.finish_s is not None for r in result.requests.values())
        used[share] = max(s.num_used_blocks for s in result.steps)
        saving = result.stats.mean_kv_sharing_saving
        assert saving > 0.3 if share else saving == 0
    assert used[False] > 2 * used[True]
