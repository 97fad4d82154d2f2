"""EngineStats.merged: one snapshot of data-parallel replicas (counts summed, ratios
weighted by what they are ratios of)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from engine.core.stats import _RATIO_WEIGHTS, EngineStats


def snapshot(**kw) -> EngineStats:
    base = dict(
        num_blocks=100,
        num_used_blocks=0,
        num_free_blocks=100,
        kv_slot_utilization=1.0,
        mean_kv_slot_utilization=1.0,
        num_preemptions=0,
        num_steps=0,
        num_running=0,
        num_waiting=0,
        attention_backend="native",
    )
    return EngineStats(**(base | kw))


def test_counts_add_up_and_derived_rates_follow_the_sums():
    a = snapshot(
        num_used_blocks=30,
        num_free_blocks=70,
        num_running=3,
        num_waiting=1,
        prefix_cache_queried_tokens=100,
        prefix_cache_hit_tokens=90,
        num_steps=10,
    )
    b = snapshot(
        num_blocks=300,
        num_used_blocks=10,
        num_free_blocks=290,
        num_running=1,
        prefix_cache_queried_tokens=300,
        prefix_cache_hit_tokens=10,
        num_steps=30,
        num_preemptions=2,
        num_swapped=1,
    )
    m = EngineStats.merged([a, b])
    assert (m.num_blocks, m.num_used_blocks, m.num_free_blocks) == (400, 40, 360)
    assert (m.num_running, m.num_waiting, m.num_steps) == (4, 1, 40)
    assert (m.num_preemptions, m.num_swapped) == (2, 1)
    assert m.kv_cache_usage == pytest.approx(0.1)
    assert m.prefix_cache_hit_rate == pytest.approx(100 / 400)
    assert m.attention_backend == "native"


def test_ratios_are_weighted_by_what_they_are_ratios_of():
    a = snapshot(
        num_used_blocks=30,
        kv_slot_utilization=0.5,
        num_steps=10,
        mean_kv_slot_utilization=0.9,
        kv_sharing_saving=0.2,
    )
    b = snapshot(
        num_used_blocks=10,
        kv_slot_utilization=1.0,
        num_steps=30,
        mean_kv_slot_utilization=0.5,
        kv_sharing_saving=0.6,
    )
    m = EngineStats.merged([a, b])
    assert m.kv_slot_utilization == pytest.approx((0.5 * 30 + 1.0 * 10) / 40)
    assert m.mean_kv_slot_utilization == pytest.approx((0.9 * 10 + 0.5 * 30) / 40)
    assert m.kv_sharing_saving == pytest.approx((0.2 * 30 + 0.6 * 10) / 40)
    idle = EngineStats.merged([snapshot(), snapshot(kv_slot_utilization=0.5)])
    assert idle.kv_slot_utilization == pytest.approx(0.75)  # nothing in use: plain mean


def test_every_ratio_field_has_a_weight_and_backends_are_listed_once():
    floats = {f.name for f in fields(EngineStats) if f.type == "float"}
    assert floats == set(_RATIO_WEIGHTS)
    mixed = EngineStats.merged([snapshot(), snapshot(attention_backend="sdpa"), snapshot()])
    assert mixed.attention_backend == "native,sdpa"
    assert EngineStats.merged([snapshot(num_steps=3)]) == snapshot(num_steps=3)
