"""bench/simulate.py's capacity search and the simulator's workloads."""

from __future__ import annotations

import pytest

from bench.sim_workloads import (
    CHAT_WINDOW,
    PREFIX_LENS,
    make_trace,
    scaled_to_means,
    workload_lengths,
)
from bench.simulate import capacity_search, refine, sustained_rate
from tests.conftest import shared_path


def _system(capacity: float):
    """A fake system whose latency is flat until `capacity` req/s and explodes after."""
    runs = []

    def run(rate: float) -> dict:
        runs.append(rate)
        latency = 0.03 if rate <= capacity else 0.03 * 10 ** (rate - capacity)
        return {"system": "s", "rate": rate, "mean_normalized_latency_s": latency}

    return run, runs


def test_the_capacity_search_brackets_then_bisects():
    run, runs = _system(5.3)
    points = capacity_search(run, 0.2, 1.0, bisections=4)
    assert runs[:4] == [1.0, 2.0, 4.0, 8.0]  # doubling until over the SLO
    assert len(runs) == 8
    assert 5.3 <= sustained_rate(points, "s", 0.2) <= 6.5


def test_the_capacity_search_halves_from_a_start_over_the_slo():
    run, runs = _system(1.1)
    points = capacity_search(run, 0.2, 8.0, bisections=2)
    assert runs[:4] == [8.0, 4.0, 2.0, 1.0]
    assert 1.1 <= sustained_rate(points, "s", 0.2) < 2.0


def test_refine_adds_nothing_without_a_bracket():
    run, runs = _system(100.0)
    assert refine([run(1.0), run(2.0)], 0.2, 3, run) == []
    assert runs == [1.0, 2.0]


@pytest.mark.timeout(60)
def test_workload_traces():
    shared_path("data")
    prefix = make_trace("prefix-5shot", workload_lengths("prefix-5shot"), 2.0, 10.0)
    ids = [r.token_ids() for r in prefix]
    assert len(prefix) == 20 and all(r.prompt_len > PREFIX_LENS["prefix-5shot"] for r in prefix)
    assert len({p[:341] for p in ids}) == 1 and len({p[341:] for p in ids}) > 1
    chat = workload_lengths("chatbot")
    assert max(p for p, _ in chat) == CHAT_WINDOW and max(o for _, o in chat) <= CHAT_WINDOW
    beams = make_trace("alpaca", workload_lengths("alpaca"), 2.0, 5.0, beam_width=3)
    assert all(r.use_beam_search and r.n == 3 for r in beams)
    with pytest.raises(ValueError, match="workload must be one of"):
        workload_lengths("wmt16")


def test_lengths_scale_to_the_means_asked_for():
    scaled = scaled_to_means([(10, 100), (30, 300), (1, 1)], (20.0, 50.0))
    assert sum(p for p, _ in scaled) / 3 == pytest.approx(20.0, abs=0.5)
    assert sum(o for _, o in scaled) / 3 == pytest.approx(50.0, abs=0.5)
    assert min(min(pair) for pair in scaled) >= 1
