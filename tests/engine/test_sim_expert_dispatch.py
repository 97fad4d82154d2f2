"""Expert parallelism's all-to-all against tensor parallelism's all-reduce in
simulation (engine/sim/expert_dispatch.py): the bytes each moves, the busiest rank's
load against a sampled router, the crossover's direction, and load imbalance raising
EP's time."""

from __future__ import annotations

import random
import statistics

import pytest

from engine.sim.disaggregation import TransferLink
from engine.sim.expert_dispatch import (
    DEEPSEEK_V3,
    MIXTRAL_8X7B,
    MoeLayout,
    MoeShape,
    Routing,
    all_to_all_seconds,
    crossover_tokens,
    dispatch_bytes,
    ep_step,
    ep_winning_range,
    tp_step,
)
from engine.sim.pipeline import FREE_LINK, H100_80GB, ring_allreduce_seconds

BANDWIDTH_ONLY = TransferLink(bandwidth=50e9)
LINK = TransferLink(bandwidth=50e9, latency_s=5e-6)
NVLINK = TransferLink(bandwidth=450e9, latency_s=1e-6)
SMALL = MoeShape(
    "small", hidden_size=1024, intermediate_size=512, num_experts=16, top_k=2, num_moe_layers=4
)


def _layout(ranks: int, link: TransferLink = LINK) -> MoeLayout:
    return MoeLayout(ranks, link, H100_80GB)


@pytest.mark.timeout(10)
def test_an_all_to_all_sends_all_but_its_own_share():
    assert all_to_all_seconds(BANDWIDTH_ONLY, 8, 8e6) == pytest.approx(7 / 8 * 8e6 / 50e9)
    assert all_to_all_seconds(LINK, 8, 0) == pytest.approx(7 * 5e-6)
    assert all_to_all_seconds(LINK, 1, 8e6) == 0.0


@pytest.mark.timeout(10)
def test_dispatch_moves_each_tokens_top_k_copies_and_tp_reduces_each_token_once():
    tokens, ranks = 1 << 16, 8
    per_rank = dispatch_bytes(SMALL, Routing.uniform(16), tokens, ranks)
    mean = tokens * SMALL.top_k / ranks * SMALL.hidden_size * SMALL.activation_bytes
    assert mean <= per_rank < 1.02 * mean  # the busiest rank, barely above the mean
    ep = ep_step(SMALL, _layout(ranks, BANDWIDTH_ONLY), Routing.uniform(16), tokens)
    assert ep.comm_s == pytest.approx(SMALL.num_moe_layers * 2 * 7 / 8 * per_rank / 50e9)
    tp = tp_step(SMALL, _layout(ranks, BANDWIDTH_ONLY), Routing.uniform(16), tokens)
    reduced = tokens * SMALL.hidden_size * SMALL.activation_bytes
    assert tp.comm_s == pytest.approx(SMALL.num_moe_layers * 2 * 7 / 8 * reduced / 50e9)
    # top_k / E of TP's bytes: 2 / 8
    assert ep.comm_s / tp.comm_s == pytest.approx(SMALL.top_k / ranks, rel=0.02)


@pytest.mark.timeout(10)
def test_two_all_to_alls_pay_the_rings_latencies():
    ep = ep_step(SMALL, _layout(8), Routing.uniform(16), 1)
    tp = tp_step(SMALL, _layout(8), Routing.uniform(16), 1)
    latencies = SMALL.num_moe_layers * 2 * 7 * LINK.latency_s
    assert ep.comm_s - latencies < 1e-6 and tp.comm_s - latencies < 1e-6
    assert tp.comm_s == pytest.approx(
        SMALL.num_moe_layers * ring_allreduce_seconds(LINK, 8, 1024 * 2)
    )


def _sampled_max_load(num_experts, top_k, ranks, tokens, trials=300, seed=3) -> float:
    rng, per_rank, maxima = random.Random(seed), num_experts // ranks, []
    for _ in range(trials):
        loads = [0] * ranks
        for _ in range(tokens):
            for expert in rng.sample(range(num_experts), top_k):
                loads[expert // per_rank] += 1
        maxima.append(max(loads))
    return statistics.mean(maxima)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "num_experts, top_k, ranks, tokens", [(8, 2, 8, 2), (8, 2, 4, 16), (64, 8, 16, 4)]
)
def test_the_busiest_rank_matches_a_sampled_router(num_experts, top_k, ranks, tokens):
    estimate = Routing.uniform(num_experts).max_rank_load(tokens, top_k, ranks)
    sampled = _sampled_max_load(num_experts, top_k, ranks, tokens)
    assert estimate == pytest.approx(sampled, rel=0.1)
    assert estimate >= tokens * top_k / ranks


@pytest.mark.timeout(10)
def test_ep_moves_less_from_the_crossover_on_and_never_when_top_k_reaches_e():
    layout, routing = _layout(16), Routing.uniform(DEEPSEEK_V3.num_experts)
    crossover = crossover_tokens(DEEPSEEK_V3, layout, routing)
    assert crossover is not None and crossover > 1
    for tokens in (crossover - 1, 1):
        ep, tp = (
            ep_step(DEEPSEEK_V3, layout, routing, tokens),
            tp_step(DEEPSEEK_V3, layout, routing, tokens),
        )
        assert ep.comm_s >= tp.comm_s
    for tokens in (crossover, 4 * crossover, 4096):
        ep, tp = (
            ep_step(DEEPSEEK_V3, layout, routing, tokens),
            tp_step(DEEPSEEK_V3, layout, routing, tokens),
        )
        assert ep.comm_s < tp.comm_s
    # 8 experts a token over 8 ranks: EP moves at least TP's bytes at every size
    assert crossover_tokens(DEEPSEEK_V3, _layout(8), routing) is None
    # the crossover does not depend on the link when latencies match
    assert crossover_tokens(DEEPSEEK_V3, _layout(16, BANDWIDTH_ONLY), routing) == crossover


@pytest.mark.timeout(10)
def test_imbalance_raises_eps_time_and_not_tps():
    layout, tokens = _layout(8, NVLINK), 2048  # compute-bound: 2 x 2048 / 8 = 512 each
    uniform = Routing.uniform(8)
    skewed = Routing.from_loads([40, 10, 10, 10, 10, 10, 5, 5])
    ep_even, ep_skew = (ep_step(MIXTRAL_8X7B, layout, r, tokens) for r in (uniform, skewed))
    assert ep_skew.comm_s > ep_even.comm_s
    # 40% of the assignments on one rank (0.8 of the tokens), not 12.5%
    assert ep_skew.compute_s > 2.5 * ep_even.compute_s
    tp_even, tp_skew = (tp_step(MIXTRAL_8X7B, layout, r, tokens) for r in (uniform, skewed))
    assert tp_skew.comm_s == tp_even.comm_s and tp_skew.compute_s == tp_even.compute_s
    # every token routed to expert 0, a rank of its own: it receives as much as TP reduces
    assert crossover_tokens(MIXTRAL_8X7B, layout, Routing.from_loads([1] + [0] * 7)) is None
    zipf = Routing.zipf(8, 1.0)
    assert ep_step(MIXTRAL_8X7B, layout, zipf, tokens).total_s > ep_even.total_s


@pytest.mark.timeout(10)
def test_one_token_makes_an_ep_rank_read_a_whole_expert():
    layout = _layout(8, NVLINK)  # one Mixtral expert a rank: TP reads 2 experts / 8 each
    ep = ep_step(MIXTRAL_8X7B, layout, Routing.uniform(8), 1)
    tp = tp_step(MIXTRAL_8X7B, layout, Routing.uniform(8), 1)
    assert ep.compute_s == pytest.approx(4 * tp.compute_s)


@pytest.mark.timeout(10)
def test_with_compute_a_skewed_router_gives_the_win_back_at_large_steps():
    layout, zipf = _layout(8, NVLINK), Routing.zipf(8, 0.5)
    first, last = ep_winning_range(MIXTRAL_8X7B, layout, zipf, with_compute=True)
    assert 1 < first < last < 1 << 16
    for tokens, ep_wins in ((first - 1, False), (first, True), (last, True), (last + 1, False)):
        ep, tp = (
            ep_step(MIXTRAL_8X7B, layout, zipf, tokens),
            tp_step(MIXTRAL_8X7B, layout, zipf, tokens),
        )
        assert (ep.total_s < tp.total_s) is ep_wins
    assert crossover_tokens(MIXTRAL_8X7B, layout, zipf) < first  # it moves less sooner


@pytest.mark.timeout(10)
def test_routings_and_shapes_are_checked():
    assert Routing.zipf(16, 1.0, seed=1) == Routing.zipf(16, 1.0, seed=1)
    assert sum(Routing.zipf(16, 1.0).shares) == pytest.approx(1)
    assert Routing.from_loads([3, 1]).shares == (0.75, 0.25)
    with pytest.raises(ValueError, match="no token was routed"):
        Routing.from_loads([0, 0])
    with pytest.raises(ValueError, match="do not split over 3 ranks"):
        Routing.uniform(8).rank_shares(3)
    with pytest.raises(ValueError, match="top_k"):
        MoeShape("bad", 64, 64, num_experts=4, top_k=5, num_moe_layers=1)
    assert ring_allreduce_seconds(FREE_LINK, 4, 1e9) == 0.0
