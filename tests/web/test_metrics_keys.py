"""/metrics exports every EngineStats field: one stats source, the same keys as
`LLM.stats()` and `AsyncEngine.stats()`; totals typed as counters, levels as gauges."""

from __future__ import annotations

import dataclasses

from engine.core.stats import EngineStats
from web.metrics import (
    ENGINE_COUNTERS,
    ENGINE_GAUGES,
    VLLM_COUNTERS,
    VLLM_GAUGES,
    accepted_per_position,
)

PROPERTIES = {"prefix_cache_hit_rate", "kv_cache_usage", "spec_decode_acceptance_rate"}
# exported by a family of its own, one sample per position
PER_POSITION = {"spec_decode_num_accepted_tokens_per_pos"}


def fields_of(*tables) -> set[str]:
    return {field for table in tables for _, field in table.values()}


def test_every_engine_stats_field_has_a_metric():
    names = {"attention_backend", "kv_cache_dtype", "quantization"}  # names, not numbers
    fields = {f.name for f in dataclasses.fields(EngineStats)} - names - PER_POSITION
    exported = fields_of(ENGINE_GAUGES, ENGINE_COUNTERS)
    assert fields <= exported
    assert exported - fields <= PROPERTIES
    assert not set(ENGINE_GAUGES) & set(ENGINE_COUNTERS)


def test_vllm_names_read_the_same_stats():
    fields = {f.name for f in dataclasses.fields(EngineStats)} | PROPERTIES
    assert fields_of(VLLM_GAUGES, VLLM_COUNTERS) <= fields
    # totals since start are counters in both vocabularies
    assert fields_of(VLLM_COUNTERS) <= fields_of(ENGINE_COUNTERS)
    assert not fields_of(VLLM_GAUGES) & fields_of(ENGINE_COUNTERS)


def test_accepted_drafts_per_position_are_labelled_samples():
    stats = EngineStats(0, 0, 0, 0.0, 0.0, 0, 0, 0, 0)
    stats = dataclasses.replace(stats, spec_decode_num_accepted_tokens_per_pos=(7, 3, 1))
    metric = accepted_per_position(stats, "m")
    assert metric.name == "vllm:spec_decode_num_accepted_tokens_per_pos"
    values = {s.labels["position"]: s.value for s in metric.samples if s.name.endswith("_total")}
    assert values == {"0": 7.0, "1": 3.0, "2": 1.0}
