"""/metrics exports every EngineStats field: one stats source, the same keys as
`LLM.stats()` and `AsyncEngine.stats()`."""

from __future__ import annotations

import dataclasses

from engine.core.stats import EngineStats
from web.metrics import ENGINE_GAUGES


def test_every_engine_stats_field_has_a_gauge():
    fields = {f.name for f in dataclasses.fields(EngineStats)} - {"attention_backend"}  # a name
    exported = {field for _, field in ENGINE_GAUGES.values()}
    assert fields <= exported
    assert exported - fields <= {"prefix_cache_hit_rate"}  # a property of the same stats
