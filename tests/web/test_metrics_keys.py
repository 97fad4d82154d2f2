"""/metrics exports every EngineStats field: one stats source, the same keys as
`LLM.stats()` and `AsyncEngine.stats()`; totals typed as counters, levels as gauges."""

from __future__ import annotations

import dataclasses

from engine.core.stats import EngineStats
from web.metrics import ENGINE_COUNTERS, ENGINE_GAUGES, VLLM_COUNTERS, VLLM_GAUGES

PROPERTIES = {"prefix_cache_hit_rate", "kv_cache_usage"}  # derived from the same stats


def fields_of(*tables) -> set[str]:
    return {field for table in tables for _, field in table.values()}


def test_every_engine_stats_field_has_a_metric():
    names = {"attention_backend", "kv_cache_dtype", "quantization"}  # names, not numbers
    fields = {f.name for f in dataclasses.fields(EngineStats)} - names
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
