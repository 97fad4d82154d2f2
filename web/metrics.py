"""Prometheus metrics of one server (its own registry: no process-wide globals)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from actors.async_engine import WatchStats
from engine.core.stats import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """Counters and latency histograms observed by the web layer, plus gauges read at
    scrape time: every `EngineStats` field (`ENGINE_GAUGES`, the keys `LLM.stats()`
    has) and the supervisor's `WatchStats`. `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        stats: Callable[[], EngineStats],
        watch: Callable[[], WatchStats],
        web_gauges: dict[str, tuple[str, Callable[[], float]]],
    ) -> None:
        """`web_gauges`: name -> (help, read) for the web layer's own counts (queued
        requests, live requests, sessions, WebSocket connections)."""
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Time to first token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token = Histogram(
            "pagedserve_inter_token_latency_seconds",
            "Time between streamed tokens",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "End-to-end request latency",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens processed", registry=r
        )
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Tokens generated", registry=r
        )
        self.requests = Counter(
            "pagedserve_requests", "Finished requests by reason", ["finish_reason"], registry=r
        )
        self.rejected = Counter(
            "pagedserve_rejected_requests", "Requests refused, by error code", ["code"], registry=r
        )

        for name, (doc, field) in ENGINE_GAUGES.items():
            read = functools.partial(_read, stats, field)
            Gauge(name, doc, registry=r).set_function(read)
        for name, (doc, field) in WATCH_GAUGES.items():
            Gauge(name, doc, registry=r).set_function(functools.partial(_read, watch, field))
        for name, (doc, read) in web_gauges.items():
            Gauge(name, doc, registry=r).set_function(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _read(snapshot: Callable[[], Any], field: str) -> float:
    return float(getattr(snapshot(), field))


# metric name -> (help, EngineStats field or property); every field has one.
ENGINE_GAUGES: dict[str, tuple[str, str]] = {
    "pagedserve_kv_blocks_total": ("KV cache blocks", "num_blocks"),
    "pagedserve_kv_blocks_used": ("KV cache blocks in use", "num_used_blocks"),
    "pagedserve_kv_blocks_free": (
        "KV cache blocks free (cached ones nobody holds included)",
        "num_free_blocks",
    ),
    "pagedserve_kv_slot_utilization": (
        "Token slots holding real tokens / slots allocated, at the last step",
        "kv_slot_utilization",
    ),
    "pagedserve_mean_kv_slot_utilization": (
        "Token slots holding real tokens / slots allocated, over all steps",
        "mean_kv_slot_utilization",
    ),
    "pagedserve_num_preemptions": ("Preemptions so far", "num_preemptions"),
    "pagedserve_num_steps": ("Model steps planned so far", "num_steps"),
    "pagedserve_num_requests_running": ("Requests running", "num_running"),
    "pagedserve_num_requests_waiting": ("Requests waiting in the scheduler", "num_waiting"),
    "pagedserve_prefix_cache_queried_tokens": (
        "Prompt tokens looked up in the prefix cache so far",
        "prefix_cache_queried_tokens",
    ),
    "pagedserve_prefix_cache_hit_tokens": (
        "Prompt tokens found in the prefix cache so far (not computed)",
        "prefix_cache_hit_tokens",
    ),
    "pagedserve_prefix_cache_hit_rate": (
        "Prompt tokens found in the prefix cache / prompt tokens looked up",
        "prefix_cache_hit_rate",
    ),
    "pagedserve_kv_blocks_cached": (
        "Blocks holding a cached prefix (owned or free)",
        "num_cached_blocks",
    ),
    "pagedserve_prefix_cache_evictions": ("Cached blocks evicted so far", "num_cache_evictions"),
    "pagedserve_num_swaps": ("Preemptions by swapping out so far", "num_swaps"),
    "pagedserve_kv_blocks_swapped": ("CPU swap blocks in use", "num_swapped_blocks"),
    "pagedserve_kv_sharing_saving": (
        "1 - blocks owned / blocks the block tables hold, at the last step",
        "kv_sharing_saving",
    ),
    "pagedserve_mean_kv_sharing_saving": (
        "1 - blocks owned / blocks the block tables hold, over all steps",
        "mean_kv_sharing_saving",
    ),
}

WATCH_GAUGES: dict[str, tuple[str, str]] = {
    "pagedserve_num_requests_over_deadline": (
        "Open requests older than --request-timeout (the watchdog ends them; "
        "above 0 for long means requests are stuck)",
        "num_over_deadline",
    ),
    "pagedserve_num_timed_out_requests": (
        "Requests ended by --request-timeout so far",
        "num_timed_out",
    ),
    "pagedserve_oldest_request_age_seconds": (
        "Age of the oldest open request",
        "oldest_request_s",
    ),
    "pagedserve_worker_silence_seconds": (
        "Seconds since the worker's last heartbeat",
        "worker_silent_s",
    ),
}
