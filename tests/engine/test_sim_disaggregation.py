"""Prefill/decode disaggregation in simulation (engine/sim/disaggregation.py): a decode
engine computes no prompt token, a transfer adds its bytes over the link's bandwidth to
every TTFT, and with long prompts arriving while others decode, separating the phases
keeps decode steps short (TPOT) where colocated engines stall them."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import SchedulerConfig
from engine.sim.cost_model import preset
from engine.sim.disaggregation import (
    Slo,
    TransferLink,
    colocated,
    disaggregated,
    goodput,
    tpot,
    ttft,
)
from engine.sim.simulator import Simulator, SimulatorConfig
from engine.sim.trace import TraceRequest, poisson_trace

pytestmark = pytest.mark.timeout(120)

COST = preset("llama-13b-a100")
CONFIG = SimulatorConfig(
    SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=4096),
    num_blocks=COST.num_blocks(16),
)
FAST = TransferLink(bandwidth=1e15)


def test_a_decode_engine_computes_no_prompt_token():
    trace = [TraceRequest(f"r{i}", 0.01 * i, 1000, 8) for i in range(4)]
    decode = dataclasses.replace(CONFIG, prompts_arrive_computed=True)
    result = Simulator(decode, COST).run(trace)
    assert sum(s.num_tokens for s in result.steps) == 4 * 8 - 4  # outputs after the first
    full = Simulator(CONFIG, COST).run(trace)
    assert sum(s.num_tokens for s in full.steps) == 4 * 1000 + 4 * 8 - 4


def test_a_transfer_adds_its_bytes_over_the_bandwidth_to_the_ttft():
    trace = [TraceRequest("r0", 0.0, 2000, 4)]
    link = TransferLink(bandwidth=1e9, latency_s=0.001)
    fast = disaggregated(trace, CONFIG, COST, 1, 1, FAST)[0]
    slow = disaggregated(trace, CONFIG, COST, 1, 1, link)[0]
    expected = 0.001 + 2000 * COST.kv_bytes_per_token / 1e9
    assert ttft(slow) - ttft(fast) == pytest.approx(expected, rel=1e-6)
    assert tpot(slow) == pytest.approx(tpot(fast))


def test_separate_phases_keep_decode_steps_short_under_long_prompts():
    lengths = [(1800, 200), (60, 300), (40, 300)]
    trace = poisson_trace(lengths, rate=6.0, num_requests=120, seed=1)
    together = colocated(trace, CONFIG, COST, 2)
    apart = disaggregated(trace, CONFIG, COST, 1, 1, TransferLink(bandwidth=50e9))
    assert len(together) == len(apart) == len(trace)
    slo = Slo(ttft_s=2.0, tpot_s=0.030)
    g_together, g_apart = goodput(together, slo, 20.0), goodput(apart, slo, 20.0)
    assert g_apart["p90_tpot_s"] < g_together["p90_tpot_s"]
    assert 0 <= g_apart["slo_attainment"] <= 1 and g_apart["goodput_rps"] >= 0
