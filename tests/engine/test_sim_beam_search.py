"""Beam search and shared prefixes on the simulator (paper Fig. 14-16): the
model-free worker's offers drive the real beam search, whose beams share blocks."""

from __future__ import annotations

import pytest

from engine.config import SchedulerConfig
from engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from engine.sampling_params import SamplingParams
from engine.sim.baselines.reservation import ReservationPolicy
from engine.sim.cost_model import preset
from engine.sim.sim_worker import FIRST_OFFER_ID, SimWorker
from engine.sim.simulator import Simulator, SimulatorConfig
from engine.sim.trace import TraceRequest, with_shared_prefix
from engine.worker.worker_request import WorkerRequest

OPT13 = preset("opt-13b-a100")


def _beams(width: int, count: int = 8) -> list[TraceRequest]:
    return [
        TraceRequest(f"b{i}", i * 0.05, 40, 60, n=width, use_beam_search=True) for i in range(count)
    ]


def _run(trace, allocator=None, share=True, prefix_caching=False):
    config = SimulatorConfig(
        SchedulerConfig(128, 2048, 1024),
        600,
        16,
        enable_prefix_caching=prefix_caching,
        allocator=allocator,
        share_blocks=share,
    )
    simulator = Simulator(config, OPT13)
    result = simulator.run(trace)
    simulator.core.check_integrity()
    return result


def _step(*requests: WorkerRequest) -> SchedulerOutput:
    """A step computing each request's last prompt token (so every row samples)."""
    scheduled = tuple(ScheduledRequest(r, r.num_tokens - 1, 1, [0]) for r in requests)
    return SchedulerOutput(1, scheduled, (), (), (), ())


def test_beams_get_ranked_offers_and_other_rows_the_fixed_token():
    beam = WorkerRequest("b", [5, 6], SamplingParams(logprobs=6, temperature=0), frozenset(), [], 0)
    plain = WorkerRequest("p", [5, 6], SamplingParams(temperature=0), frozenset(), [], 0)
    worker = SimWorker(token_id=7, seed=3)
    output = worker._run(_step(beam, plain))
    assert output.sampled == {"b": FIRST_OFFER_ID, "p": 7}
    [row] = [r.rows[0] for r in worker._logprobs(output)]
    assert [o.rank for o in row] == [1, 2, 3, 4, 5, 6]
    assert [o.token_id for o in row] == list(range(FIRST_OFFER_ID, FIRST_OFFER_ID + 6))
    logprobs = [o.logprob for o in row]
    assert logprobs == sorted(logprobs, reverse=True) and logprobs[0] < 0
    again = SimWorker(token_id=7, seed=3)
    assert [r.rows for r in again._logprobs(again._run(_step(beam, plain)))] == [(row,)]


def test_sim_worker_refuses_gaps_that_are_not_positive():
    with pytest.raises(ValueError, match="top_gap and next_gap must be > 0"):
        SimWorker(top_gap=0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("width", [2, 4])
def test_every_beam_search_finishes_and_its_beams_share_blocks(width):
    result = _run(_beams(width))
    assert set(result.requests) == {f"b{i}" for i in range(8)}
    assert all(r.finish_s is not None for r in result.requests.values())
    assert all(r.first_token_s == r.finish_s for r in result.requests.values())
    assert result.stats.mean_kv_sharing_saving > 0.2


@pytest.mark.timeout(60)
def test_a_beam_search_run_is_a_function_of_its_trace():
    first, second = _run(_beams(3)), _run(_beams(3))
    assert first.steps == second.steps
    assert first.requests == second.requests


@pytest.mark.timeout(60)
def test_without_sharing_beams_hold_more_blocks():
    shared, copied = _run(_beams(4)), _run(_beams(4), share=False)
    assert copied.stats.mean_kv_sharing_saving == 0
    peak = {k: max(s.num_used_blocks for s in r.steps) for k, r in (("s", shared), ("c", copied))}
    assert peak["c"] > 1.5 * peak["s"]


@pytest.mark.timeout(60)
def test_beam_search_runs_on_the_contiguous_baseline():
    result = _run(_beams(2), allocator=ReservationPolicy.ORACLE)
    assert all(r.finish_s is not None for r in result.requests.values())
    shares = result.mean_memory_shares()
    assert sum(shares.values()) == pytest.approx(1.0)


def test_a_shared_prefix_comes_first_in_every_prompt():
    trace = [TraceRequest(f"t{i}", i, 10 + i, 5) for i in range(3)]
    prefixed = with_shared_prefix(trace, 80)
    prompts = [r.token_ids() for r in prefixed]
    assert [len(p) for p in prompts] == [r.prompt_len for r in prefixed] == [90, 91, 92]
    assert prompts[0][:80] == prompts[1][:80] == prompts[2][:80]
    assert [p[80:] for p in prompts] == [r.token_ids() for r in trace]
    with pytest.raises(ValueError, match="prefix_len must be >= 1"):
        with_shared_prefix(trace, 0)


@pytest.mark.timeout(60)
def test_prefix_caching_computes_a_shared_prefix_once():
    trace = with_shared_prefix([TraceRequest(f"t{i}", i * 0.5, 20, 10) for i in range(10)], 341)
    cached, plain = _run(trace, prefix_caching=True), _run(trace)
    assert cached.stats.prefix_cache_hit_tokens >= 9 * 336  # 21 full blocks after the first
    assert sum(s.num_tokens for s in cached.steps) < sum(s.num_tokens for s in plain.steps) / 3
