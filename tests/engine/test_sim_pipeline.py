"""Pipeline parallelism in simulation (engine/sim/pipeline.py): the bubble formula's
limits, one stage equal to the cost model's step, hops costing their bytes over the
bandwidth, steady-state decode with micro-batches in flight, and a cross-host
tensor-parallel ring losing to stages joined by the same slow link."""

from __future__ import annotations

import dataclasses

import pytest

from engine.sim.cost_model import StepShape, preset
from engine.sim.disaggregation import TransferLink
from engine.sim.pipeline import (
    FREE_LINK,
    H100_80GB,
    LLAMA_70B,
    LLAMA_405B,
    ParallelLayout,
    Pipeline,
    bubble_fraction,
    decode_idle_fraction,
    decode_rate,
    kv_slots,
    ring_allreduce_seconds,
)

COST = preset("opt-66b-4xa100")  # 64 layers, hidden 9216
DECODE = StepShape(num_tokens=64, num_context_tokens=64 * 512)
NVLINK = TransferLink(bandwidth=450e9, latency_s=1e-6)
ETHERNET = TransferLink(bandwidth=100e9 / 8, latency_s=20e-6)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stages", [1, 2, 4, 8])
def test_the_bubble_is_most_of_the_pass_with_one_micro_batch_and_vanishes_with_many(stages):
    assert bubble_fraction(stages, 1) == pytest.approx((stages - 1) / stages)
    assert bubble_fraction(stages, 10**6) < 1e-5
    assert bubble_fraction(stages, 4) == pytest.approx((stages - 1) / (4 + stages - 1))
    assert decode_idle_fraction(stages, stages) == 0.0
    assert decode_idle_fraction(stages, 1) == pytest.approx((stages - 1) / stages)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stages, micro_batches", [(2, 1), (4, 2), (4, 8), (8, 4)])
def test_the_schedule_has_the_classic_bubble_with_even_stages_and_free_hops(stages, micro_batches):
    pipeline = Pipeline(COST, stages)
    schedule = pipeline.schedule(DECODE, micro_batches)
    stage_s = COST.step_seconds(StepShape(64 // micro_batches, 64 * 512 // micro_batches))
    expected = (micro_batches + stages - 1) * stage_s / stages
    assert schedule.makespan_s == pytest.approx(expected)
    assert schedule.bubble == pytest.approx(bubble_fraction(stages, micro_batches))


@pytest.mark.timeout(10)
def test_one_stage_is_the_single_device_cost():
    pipeline = Pipeline(COST, 1, ETHERNET)  # no boundary: the link is never used
    rate = pipeline.decode(DECODE, 1)
    assert rate.tpot_s == COST.step_seconds(DECODE)
    assert rate.tokens_per_s == pytest.approx(64 / COST.step_seconds(DECODE))
    assert rate.busy == pytest.approx(1.0)
    assert pipeline.schedule(DECODE, 1).makespan_s == COST.step_seconds(DECODE)
    assert pipeline.hop_seconds(64) == 0.0


@pytest.mark.timeout(10)
def test_a_hop_costs_its_hidden_states_bytes_over_the_bandwidth():
    slow = TransferLink(bandwidth=1e9, latency_s=1e-4)
    pipeline = Pipeline(COST, 2, slow, activation_bytes=2)
    assert pipeline.hop_seconds(64) == pytest.approx(1e-4 + 64 * 9216 * 2 / 1e9)
    assert pipeline.hop_seconds(128) - 1e-4 == pytest.approx(2 * (pipeline.hop_seconds(64) - 1e-4))
    half = Pipeline(COST, 2, dataclasses.replace(slow, bandwidth=0.5e9))
    assert half.hop_seconds(64) - 1e-4 == pytest.approx(2 * (pipeline.hop_seconds(64) - 1e-4))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("stages", [2, 4])
def test_each_token_pays_its_hops_on_top_of_the_stages(stages):
    link = TransferLink(bandwidth=10e9, latency_s=50e-6)
    free, linked = Pipeline(COST, stages), Pipeline(COST, stages, link)
    hop = linked.hop_seconds(64)
    extra = linked.decode(DECODE, 1).tpot_s - free.decode(DECODE, 1).tpot_s
    assert extra == pytest.approx((stages - 1) * hop + link.latency_s)  # + the ids' return


@pytest.mark.timeout(10)
def test_micro_batches_in_flight_keep_every_stage_busy_from_one_per_stage():
    pipeline = Pipeline(COST, 4)
    assert pipeline.decode(DECODE, 1).busy == pytest.approx(0.25)
    assert pipeline.decode(DECODE, 2).busy == pytest.approx(0.5)
    assert pipeline.decode(DECODE, 4).busy == pytest.approx(1.0)
    assert pipeline.decode(DECODE, 8).busy == pytest.approx(1.0)
    # four micro-batches read each stage's weights four times: slower per micro-batch,
    # yet all four stages work at once
    one, four = pipeline.decode(DECODE, 1), pipeline.decode(DECODE, 4)
    assert four.tokens_per_s > one.tokens_per_s
    # past one per stage, more micro-batches only add weight reads
    assert pipeline.decode(DECODE, 8).tokens_per_s < four.tokens_per_s


@pytest.mark.timeout(10)
def test_uneven_stages_run_at_the_slowest_stages_pace():
    even, uneven = Pipeline(COST, 2), Pipeline(COST, 2, layers=(24, 40))
    assert uneven.stage_seconds(DECODE) == pytest.approx(
        tuple(COST.step_seconds(DECODE) * n / 64 for n in (24, 40))
    )
    assert uneven.decode(DECODE, 2).tpot_s > even.decode(DECODE, 2).tpot_s
    assert uneven.schedule(DECODE, 2).bubble > even.schedule(DECODE, 2).bubble


@pytest.mark.timeout(10)
def test_wrong_counts_are_refused_by_name():
    with pytest.raises(ValueError, match="sum to 63"):
        Pipeline(COST, 2, layers=(23, 40))
    with pytest.raises(ValueError, match="needs 2 counts"):
        Pipeline(COST, 2, layers=(64,))
    with pytest.raises(ValueError, match="at most as many micro-batches as tokens"):
        Pipeline(COST, 2).decode(StepShape(4, 400), 8)
    with pytest.raises(ValueError, match=">= 1"):
        bubble_fraction(0, 1)


@pytest.mark.timeout(10)
def test_a_ring_pays_two_latencies_and_two_shares_per_other_rank():
    assert ring_allreduce_seconds(ETHERNET, 1, 1e6) == 0.0
    expected = 2 * 7 * 20e-6 + 2 * 7 / 8 * 1e6 / ETHERNET.bandwidth
    assert ring_allreduce_seconds(ETHERNET, 8, 1e6) == pytest.approx(expected)
    assert ring_allreduce_seconds(FREE_LINK, 8, 1e6) == 0.0


@pytest.mark.timeout(10)
def test_across_slow_hosts_stages_beat_a_tensor_parallel_ring():
    pp = ParallelLayout(8, 2, 2, tp_link=NVLINK, pp_link=ETHERNET)
    tp = ParallelLayout(16, tp_link=ETHERNET)
    fast_tp = ParallelLayout(16, tp_link=NVLINK)  # as if all 16 shared one NVLink domain
    rates = {
        n: decode_rate(LLAMA_70B, H100_80GB, lay, 64, 1024)
        for n, lay in dict(pp=pp, tp=tp, fast_tp=fast_tp).items()
    }
    assert rates["pp"].tokens_per_s > 5 * rates["tp"].tokens_per_s
    assert rates["fast_tp"].tpot_s < rates["pp"].tpot_s


@pytest.mark.timeout(10)
def test_one_device_is_the_yardstick_and_memory_is_counted():
    one = decode_rate(LLAMA_70B, H100_80GB, ParallelLayout(1), 32, 1024)
    eight = decode_rate(LLAMA_70B, H100_80GB, ParallelLayout(8, tp_link=NVLINK), 32, 1024)
    assert 1 < eight.tokens_per_s / one.tokens_per_s < 8
    assert kv_slots(LLAMA_70B, H100_80GB, ParallelLayout(1)) == 0  # 141 GB of weights
    assert kv_slots(LLAMA_405B, H100_80GB, ParallelLayout(8)) == 0  # 812 GB of weights
    assert kv_slots(LLAMA_405B, H100_80GB, ParallelLayout(8, 2)) > 256 * 1024
