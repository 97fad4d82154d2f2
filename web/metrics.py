"""Prometheus metrics of one server (its own registry: no process-wide globals)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from actors.async_engine import EngineStatsSnapshot

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """Counters and latency histograms observed by the web layer, plus engine gauges
    read from `stats()` at scrape time. `render()` is the /metrics body."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(
        self,
        stats: Callable[[], EngineStatsSnapshot],
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

        gauges = {
            "pagedserve_num_requests_running": ("Requests running", lambda s: s.num_running),
            "pagedserve_num_requests_waiting": (
                "Requests waiting in the scheduler",
                lambda s: s.num_waiting,
            ),
            "pagedserve_kv_blocks_used": (
                "KV cache blocks in use",
                lambda s: s.num_blocks - s.num_free_blocks,
            ),
            "pagedserve_kv_blocks_total": ("KV cache blocks", lambda s: s.num_blocks),
            "pagedserve_num_preemptions": ("Preemptions so far", lambda s: s.num_preemptions),
            "pagedserve_kv_blocks_cached": (
                "Blocks holding a cached prefix (owned or free)",
                lambda s: s.num_cached_blocks,
            ),
            "pagedserve_prefix_cache_hit_rate": (
                "Prompt tokens found in the prefix cache / prompt tokens looked up",
                lambda s: s.prefix_cache_hit_rate,
            ),
            "pagedserve_prefix_cache_queried_tokens": (
                "Prompt tokens looked up in the prefix cache so far",
                lambda s: s.prefix_cache_queried_tokens,
            ),
            "pagedserve_prefix_cache_hit_tokens": (
                "Prompt tokens found in the prefix cache so far (not computed)",
                lambda s: s.prefix_cache_hit_tokens,
            ),
            "pagedserve_prefix_cache_evictions": (
                "Cached blocks evicted so far",
                lambda s: s.num_cache_evictions,
            ),
            "pagedserve_num_requests_over_deadline": (
                "Open requests older than --request-timeout (the watchdog ends them; "
                "above 0 for long means requests are stuck)",
                lambda s: s.num_over_deadline,
            ),
            "pagedserve_num_timed_out_requests": (
                "Requests ended by --request-timeout so far",
                lambda s: s.num_timed_out,
            ),
            "pagedserve_oldest_request_age_seconds": (
                "Age of the oldest open request",
                lambda s: s.oldest_request_s,
            ),
            "pagedserve_worker_silence_seconds": (
                "Seconds since the worker's last heartbeat",
                lambda s: s.worker_silent_s,
            ),
        }
        for name, (doc, read) in gauges.items():
            Gauge(name, doc, registry=r).set_function(lambda read=read: read(stats()))
        for name, (doc, read) in web_gauges.items():
            Gauge(name, doc, registry=r).set_function(read)

    def render(self) -> bytes:
        return generate_latest(self.registry)
